"""A local group that spans daemons (`--local-group NAME`): the training processes of every daemon
of a run with the same label, on fast links (a rack, a site), as one group (DESIGN.md, "A peer is a
machine, not a process"). Each process keeps its own daemon (its shared file, lease and checkpoint);
the daemons only agree on who is in the group, in which order, and where it meets.

    store        Every daemon of the label hosts a torch.distributed TCPStore on its advertised host
                 and publishes its address in its heartbeats (the membership record's
                 dear_address). The *coordinator* is the daemon with the smallest peer ID among
                 this one and the label's peers in its table that published one; its store is the
                 group's: the daemons' beats, the epochs and the processes' Gloo rendezvous.
    beat         Every TICK s each daemon writes `d/<peer ID>` there: a count that moves, its attached
                 processes, the epoch it holds, and the epoch it needs to move past (one of its
                 processes came, went, or saw the group break).
    epoch        The coordinator lists the daemons whose beat moved within STALE s (a beat it sees
                 for the first time counts by the time it was written: one written to it while it
                 last coordinated is no news) and that have a process: itself first, then by peer
                 ID. Where the list differs from the last epoch's, or a daemon asks to move past
                 it, it writes `e/<E>` (the list) and then `epoch` = E, above every epoch any
                 daemon reported (a new coordinator goes on from the old one's numbers). A daemon
                 that took over less than STALE s ago (the last coordinator left its table) first
                 waits, within those STALE s, for every label peer in its table to beat to it: the
                 others' tables drop the last coordinator moments apart, and an epoch of the first
                 to arrive would train apart from the rest until the next phase.
    placement    Each daemon reads `epoch`. In an epoch that lists it, its first `procs` processes
                 take the ranks base .. base + procs - 1 (base: the processes of the daemons listed
                 before it) of a group of the list's total. The daemon listed first *leads*: its
                 first process is the group's leader, which hands the group's phases to it, and
                 its rounds average the group's pseudo-gradient on the WAN as one peer (weighted by
                 the group's samples). The others *follow*: at each phase's end their first process
                 hands over the parameters the leader broadcast, and they take them as θ without a
                 round (daemon/attached.py, `end_phase`).

**Lanes** (a run with `averaging.lanes` >= 2; peers/dear/delegate.py): the leading daemon asks each
other daemon of the epoch to average that daemon's lanes of the group's vector over its own link.
It writes the request into that daemon's own store (`q/<n>`, n from the counter `asks`) and waits
for the answer there (`a/<n>`); each daemon looks for requests in its store every ASK_POLL s
(`asked`) and writes its answers (`answer`).

A daemon that dies stops beating: STALE s later the coordinator lists the group without it, and the
processes, whose collectives broke at once, regroup in that epoch. A coordinator that dies leaves
the others' tables after the membership's peer TTL; the next smallest peer ID coordinates, on its
own store. The TCPStore is not authenticated: a group's daemons must trust their fast links (as
Gloo's connections do; docs/security.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from peerd.peers.averaging import RoundResult
from peerd.peers.dear.delegate import Refused, decode_request, encode_answer, encode_refusal
from peerd.peers.dear.hierarchy import lane_bounds

logger = logging.getLogger(__name__)

TICK = 0.5  # seconds between two beats (and, on the coordinator, two looks at the beats)
STALE = 4.0  # seconds a daemon's beat may stand still before the coordinator leaves it out
STORE_TIMEOUT = 2.0  # seconds one store operation (or a connection to a coordinator) may take
ASK_POLL = 0.05  # seconds between two looks for a leader's lane requests in this daemon's store


@dataclass(frozen=True, slots=True)
class Placement:
    """This daemon's place in an epoch of its spanning group."""

    epoch: int
    base: int  # rank of this daemon's first process
    procs: int  # this daemon's processes the epoch counts (its first ones)
    size: int  # processes in the group
    store: str  # "tcp://host:port": the coordinator's store, where the epoch's processes meet
    daemons: tuple[str, ...]  # peer IDs of the epoch's daemons, the leading one first

    @property
    def spans(self) -> bool:
        return len(self.daemons) > 1


def plan_epoch(beats: dict[str, dict], me: str) -> tuple[tuple[str, int], ...]:
    """The coordinator's list for a new epoch from the fresh beats: (peer ID, processes) of each
    daemon with a process, `me` first, then by peer ID. Pure."""
    listed = [(peer, int(b["procs"])) for peer, b in beats.items() if int(b["procs"]) > 0]
    return tuple(sorted(listed, key=lambda item: (item[0] != me, item[0])))


def place(listed: list[tuple[str, int]], me: str, epoch: int, store: str) -> Placement | None:
    """This daemon's Placement in the epoch that lists `listed`; None where it is not listed."""
    base = 0
    for peer, procs in listed:
        if peer == me:
            total = sum(n for _, n in listed)
            return Placement(epoch, base, procs, total, store, tuple(p for p, _ in listed))
        base += procs
    return None


class GroupSpan:
    """One run's spanning group on this daemon. `peers()`: (peer ID, store address) of the label's
    peers in this daemon's table; `local()`: (attached processes, the epoch to move past); `placed`
    takes each new Placement; `failed` is called for each tick whose connection to the coordinator's
    store, or an operation on it, failed; `awaited()`: the label's peers the run's first step waits
    for (--min-peers: those that announce training; 0 without --min-peers). `tick()` blocks (store
    operations): call it from a worker thread every TICK s."""

    def __init__(
        self,
        *,
        run_id: str,
        peer_id: str,
        label: str,
        host: str,
        peers: Callable[[], list[tuple[str, str]]],
        local: Callable[[], tuple[int, int]],
        placed: Callable[[Placement], None],
        failed: Callable[[], None] = lambda: None,
        awaited: Callable[[], int] = lambda: 0,
    ):
        self.run_id, self.peer_id, self.label, self.host = run_id, peer_id, label, host
        self.peers, self.local, self.placed, self.failed = peers, local, placed, failed
        self.awaited = awaited
        self._store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STORE_TIMEOUT)
        )
        self.address = f"{host}:{self._store.port}"
        self._clients: dict[str, dist.TCPStore] = {}
        self._owners: dict[str, dist.TCPStore] = {}  # a leader's connections to its lanes' owners
        self._beat = 0
        self.held = 0  # the epoch of the latest placement
        self._held_from = ""  # ... and its coordinator
        self.coordinator = ""
        self._took_over = -STALE  # when this daemon last took over as coordinator from another
        # The coordinator's side: when each daemon's beat last moved, the last epoch it issued, and
        # its list.
        self._moved: dict[str, tuple[int, float]] = {}
        self._issued = 0
        self._listed: tuple[tuple[str, int], ...] = ()

    def tick(self) -> None:
        table = self.peers()
        addresses = {peer: address for peer, address in table if address}
        coordinator = min([self.peer_id, *addresses])
        if coordinator != self.coordinator:
            logger.info("run %s: local group coordinator %s", self.run_id, coordinator[-8:])
            if coordinator == self.peer_id and self.coordinator:  # it takes over from another
                self._took_over = time.monotonic()
            self.coordinator = coordinator
            self._moved.clear()  # beats seen while it last coordinated are no news of now
        address = self.address if coordinator == self.peer_id else addresses[coordinator]
        try:
            store = self._connect(coordinator, address)
            procs, after = self.local()
            if self.held and self._held_from != coordinator:  # its numbers may be behind ours: move past ours
                after = max(after, self.held)
            self._beat += 1
            beat = {"beat": self._beat, "procs": procs, "held": self.held, "after": after, "t": time.time()}
            store.set(f"d/{self.peer_id}", json.dumps(beat))
            if coordinator == self.peer_id:
                self._coordinate([peer for peer, _ in table])
            if not store.check(["epoch"]):
                return
            epoch = int(store.get("epoch"))
            if epoch <= self.held:
                return
            listed = [(peer, procs) for peer, procs in json.loads(store.get(f"e/{epoch}"))]
        except (RuntimeError, ValueError, KeyError) as e:  # DistError is a RuntimeError
            self._clients.pop(coordinator, None)
            self.failed()
            logger.debug("run %s: local group store at %s: %s", self.run_id, address, e)
            return
        placement = place(listed, self.peer_id, epoch, f"tcp://{address}")
        if placement is not None:
            self.held, self._held_from = epoch, coordinator
            self.placed(placement)

    def _connect(self, coordinator: str, address: str) -> dist.Store:
        if coordinator == self.peer_id:
            return self._store
        store = self._clients.get(coordinator)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT))
            self._clients = {coordinator: store}
        return store

    def _coordinate(self, label_peers: list[str]) -> None:
        now, store, beats, ask = time.monotonic(), self._store, {}, 0
        for peer in {self.peer_id, *label_peers}:
            key = f"d/{peer}"
            if not store.check([key]):
                continue
            b = json.loads(store.get(key))
            moved = self._moved.get(peer)
            if moved is None:  # first seen: fresh if written within STALE s (one written here long ago is not)
                age = min(max(time.time() - float(b.get("t", 0.0)), 0.0), STALE + 1.0)
                self._moved[peer] = (b["beat"], now - age)
                if age > STALE:
                    continue
            elif moved[0] != b["beat"]:
                self._moved[peer] = (b["beat"], now)
            elif now - moved[1] > STALE:
                continue
            beats[peer] = b
            ask = max(ask, int(b["after"]), int(b["held"]) if self._issued == 0 else 0)
        listed = plan_epoch(beats, self.peer_id)
        if listed == self._listed and ask < self._issued:
            return
        if now - self._took_over < STALE and any(peer not in beats for peer in label_peers):
            return  # it took over moments ago: the label's others may still beat to the last coordinator
        self._issued = max(self._issued, ask) + 1
        self._listed = listed
        store.set(f"e/{self._issued}", json.dumps(listed))
        store.set("epoch", str(self._issued))
        if self._issued > 2:
            store.delete_key(f"e/{self._issued - 2}")
        logger.info(
            "run %s: local group epoch %d: %s",
            self.run_id,
            self._issued,
            ", ".join(f"{peer[-8:]} x{n}" for peer, n in listed) or "no process",
        )

    # -- lanes (the leader asks, the others answer) ----------------------------------------------

    def ask(self, address: str, request: bytes, timeout: float) -> bytes:
        """Blocking: hand `request` to the daemon whose store is at `address` and wait at most
        `timeout` s for its answer. Raises RuntimeError (DistError) when it does not answer."""
        store = self._owners.get(address)
        if store is None:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT))
            self._owners[address] = store
        try:
            n = store.add("asks", 1)
            store.set(f"q/{n}", request)
            store.wait([f"a/{n}"], timedelta(seconds=timeout))
            answer = store.get(f"a/{n}")
            store.delete_key(f"a/{n}")
            return answer
        except RuntimeError:
            self._owners.pop(address, None)  # a broken connection is not reused
            raise

    def asked(self, served: int) -> tuple[int, list[tuple[int, bytes]]]:
        """Blocking: the requests written into this daemon's store after the `served`-th, and the
        count to pass next time. A request whose counter moved but whose bytes did not come within
        STORE_TIMEOUT is skipped (its leader times out)."""
        store = self._store
        if store is None:
            return served, []
        n, found = store.add("asks", 0), []
        for k in range(served + 1, n + 1):
            try:
                store.wait([f"q/{k}"], timedelta(seconds=STORE_TIMEOUT))
                found.append((k, store.get(f"q/{k}")))
                store.delete_key(f"q/{k}")
            except RuntimeError:
                logger.warning("run %s: lane request %d never arrived", self.run_id, k)
        return n, found

    def answer(self, k: int, data: bytes) -> None:
        """Blocking: the answer to request `k` (its leader reads it from this daemon's store)."""
        if self._store is not None:
            self._store.set(f"a/{k}", data)
            self._store.delete_key(f"a/{k - 64}")  # one its leader gave up on long ago

    def close(self) -> None:
        """Drop the connections and this daemon's store (the run stops here)."""
        self._clients.clear()
        self._owners.clear()
        self._store = None


async def serve_lanes(
    span: GroupSpan,
    owned: Callable[[], tuple[int, ...]],
    numel: int,
    lanes: int,
    average: Callable[[torch.Tensor, float, int, list[int], str], Awaitable[list[RoundResult]]],
    at_round: Callable[[int], None],
    on_round: Callable[[RoundResult], None],
    on_refused: Callable[[str], None],
    timeout: float,
) -> None:
    """This daemon's side of its leader's lane requests (peers/dear/delegate.py), until cancelled:
    every ASK_POLL s, each new request in its store is checked against the lanes it owns now
    (`owned()`), announced (`at_round(round_t)`: this daemon is at that round's boundary), averaged
    (`average(vector, weight, round_t, lanes, payload)`, bounded by `timeout`),
    recorded as this daemon's rounds (`on_round`) and answered; one that does not check out is
    answered with the reason (`on_refused` counts it) so that its leader need not wait."""
    served, answering = 0, set()

    async def answer(k: int, data: bytes) -> None:
        try:
            request = decode_request(data, numel, lanes, owned())
        except Refused as e:
            logger.warning("run %s: a lane request refused: %s", span.run_id, e)
            on_refused(str(e))
            await asyncio.to_thread(span.answer, k, encode_refusal(str(e)))
            return
        at_round(request.round_t)
        vector = torch.zeros(numel)
        bounds, offset = lane_bounds(numel, lanes), 0
        for lane in request.lanes:
            s, e = bounds[lane]
            vector[s:e].numpy()[:] = request.values[offset : offset + e - s]
            offset += e - s
        try:
            async with asyncio.timeout(timeout):
                results = await average(vector, request.weight, request.round_t, list(request.lanes), request.payload)
        except TimeoutError:
            results = [
                RoundResult(
                    request.round_t, 1, None, f"round timed out after {timeout:.0f} s", lane=lane, interrupted=True
                )
                for lane in request.lanes
            ]
        for result in results:
            on_round(result)
        await asyncio.to_thread(span.answer, k, encode_answer(results, vector, lanes, request.payload))

    async def guarded(k: int, data: bytes) -> None:
        try:
            await answer(k, data)
        except Exception:  # this request's leader times out; the next ones are answered
            logger.exception("run %s: lane request %d failed", span.run_id, k)

    while True:
        await asyncio.sleep(ASK_POLL)
        try:
            served, found = await asyncio.to_thread(span.asked, served)
        except RuntimeError as e:  # the store closed: the run stops
            logger.debug("run %s: lane requests: %s", span.run_id, e)
            continue
        for k, data in found:
            task = asyncio.create_task(guarded(k, data), name=f"lanes:{span.run_id}:{k}")
            answering.add(task)
            task.add_done_callback(answering.discard)
