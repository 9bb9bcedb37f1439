"""Membership of one run: announce this daemon (heartbeat) and keep the table of the run's peers.

Timing contract (defaults in daemon/config.py, DiscoveryConfig):
* every `heartbeat_interval` the daemon stores its signed record with expiration now + `peer_ttl`;
* every `refresh_interval` it reads the run's records and drops peers whose heartbeat has not
  advanced for `peer_ttl`, so a killed peer leaves the table within
  peer_ttl + refresh_interval + one DHT request timeout (10 + 1 + 4 = 15 s with the daemon's defaults);
* a peer that leaves on purpose stores a LEFT record and sends it to every known peer directly,
  so they drop it at once;
* before a round, a trainer announces its step at once and waits, bounded, for the mates of its
  round's group that are still up to two rounds behind (`rendezvous`): heartbeats alone are up to
  heartbeat_interval + refresh_interval old, longer than a whole round of a small model;
* a peer that timed out is pinged every REJOIN_INTERVAL for LOST_MEMORY seconds: after a partition
  the two sides' DHT routing tables have dropped each other and would never dial across again, so
  without this a healed partition stays two runs. An answer puts each node in the other's routing
  table; the next refresh then reads the other side's heartbeats. Before its first ping the peer's
  connections are closed (PeerNode.disconnect), so that the pings dial afresh: over the connection
  that outlived the cut, a heal was noticed 2.6-7.0 s after it (deploy/lab/cuts.toml; 6-13 s in
  bench.churn), with fresh dials 0.6-1.9 s (docs/lab.md).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from peerd.peers.events import PeerEvents
from peerd.peers.clock import now
from peerd.peers.node import P2PContext, PeerNode
from peerd.peers.records import LinkReport, MemberRecord, MemberState, RecordRejected, open_envelope, seal_record
from peerd.peers.run_ids import RunSecret, run_dht_key
from peerd.peers.sketch import Divergence, ParamSketch, divergence
from peerd.peers.table import PeerEntry, PeerTable
from peerd.protos import records_pb2

logger = logging.getLogger(__name__)

# A member's role in its heartbeat (ListPeers shows it): "trainer" while something trains the run on
# it (a task, or an attached process), "follower" while its processes train in a local group that
# another daemon leads on the WAN (daemon/groupspan.py), "idle" while it only takes part in
# discovery (no process attached, or no manifest yet: a daemon joins idle). Only trainers are round
# mates; trainers and followers are the peers with training (RunMembership.trainers).
TRAINER = "trainer"
FOLLOWER = "follower"
IDLE = "idle"

GOODBYE_HANDLER = "peerd.membership.Goodbye"
LOST_MEMORY = 600.0  # seconds a timed-out peer is still re-dialed: partitions that heal within this re-merge
# Seconds between two rounds of re-dialing timed-out peers: a healed or thawed peer waits for the
# next round's answer (which also lifts the DHT's ban on it, PeerNode.ping) before its records are read.
REJOIN_INTERVAL = 2.0
REJOIN_MAX = 8  # timed-out peers re-dialed per round, the most recently lost first
RENDEZVOUS_POLL = 0.2  # seconds between two looks at the table while waiting for group mates, and between reads


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a member's heartbeat says of the training on its daemon (all empty while nothing trains).
    Whoever builds one reads the sketches before the step: a trainer takes a sketch after reaching its
    step, so the record's step is never below its sketch's (peers refuse such a record)."""

    step: int = 0  # the global step
    sketches: tuple[ParamSketch, ...] = ()  # parameter sketches of the latest rounds, oldest first
    dear_address: str = ""  # its DeAR engine's or its local group store's address (a --local-group member)
    delegated_lanes: int = 0  # lanes its DeAR group's other members average for it, as a bit mask
    dear_group: str = ""  # that group's ID
    links: tuple[LinkReport, ...] = ()  # its fresh link reports (--local-group auto)


@dataclass(frozen=True, slots=True)
class Roll:
    """Where the group mates of a round stand when its rendezvous ends (RunMembership.rendezvous):
    those not listed announce the round's boundary (or a later step)."""

    behind: tuple[str, ...] = ()  # still before the boundary when the wait ended: given up on
    gone: tuple[str, ...] = ()  # not in the table (timed out, left, never seen) or further behind than the floor


@dataclass(kw_only=True, slots=True)
class DiscoverySettings:
    heartbeat_interval: float = 2.0
    refresh_interval: float = 1.0
    peer_ttl: float = 10.0
    goodbye_timeout: float = 2.0  # covers storing the LEFT record and telling all peers, concurrently


class RunMembership:
    """This daemon's membership in one run. start() announces; leave() withdraws."""

    def __init__(
        self,
        node: PeerNode,
        run_id: str,
        secret: RunSecret | None,
        settings: DiscoverySettings,
        *,
        version: str,
        role: str = TRAINER,
        events: PeerEvents | None = None,
        clock: Callable[[], float] = now,
    ):
        """`clock`: DHT time (wall-clock seconds, peers/clock.py), what records are stamped and
        aged with; a test hands in its own to move time on without waiting."""
        self.node, self.run_id, self.secret, self.settings = node, run_id, secret, settings
        self.clock = clock
        self.version, self.role = version, role
        self.events = events or PeerEvents()
        self.key = run_dht_key(run_id, secret)
        self.table = PeerTable(node.peer_id, settings.peer_ttl)
        self.joined_at = self.clock()
        self._tasks: list[asyncio.Task] = []
        self._maddrs: tuple[str, ...] = ()
        self._lost: dict[str, float] = {}  # peer ID -> when it timed out, until it is back or forgotten
        self._redialed: set[str] = set()  # lost peers whose connections were closed (PeerNode.disconnect)
        self.local_group = ""  # this daemon's --local-group label, put into each heartbeat
        self.probe_address = ""  # where this daemon answers link probes, put into each heartbeat
        # What the heartbeat says of this daemon's training, asked at each heartbeat (daemon/app.py's
        # RunTraining once the run trains); the record leaves it out while the member is not ACTIVE.
        self.announcement: Callable[[], Announcement] = Announcement
        self.published_links: tuple[float, tuple[LinkReport, ...]] = (
            0.0,
            (),
        )  # (timestamp, links) of the latest heartbeat
        self._divergence: Divergence | None = None  # the newest step's figure found so far

    @property
    def secured(self) -> bool:
        return self.secret is not None

    async def start(self) -> None:
        """Announce once and read the table once, then keep both going in the background."""
        self._maddrs = tuple(await self.node.visible_maddrs())
        await self.heartbeat()
        await self.refresh()
        self._tasks = [
            asyncio.create_task(
                self._every(self.settings.heartbeat_interval, self.heartbeat), name=f"heartbeat:{self.run_id}"
            ),
            asyncio.create_task(
                self._every(self.settings.refresh_interval, self.refresh), name=f"refresh:{self.run_id}"
            ),
            asyncio.create_task(self._every(REJOIN_INTERVAL, self.rejoin), name=f"rejoin:{self.run_id}"),
        ]

    async def leave(self) -> None:
        """Stop heartbeating, publish a LEFT record and tell every known peer directly (bounded)."""
        await self._cancel_tasks()
        envelope = self._envelope(MemberState.LEFT)
        request = records_pb2.GoodbyeRequest(run_key=self.key, envelope=envelope)
        timeout = self.settings.goodbye_timeout
        calls = [
            self.node.call(e.peer_id, GOODBYE_HANDLER, request, records_pb2.GoodbyeResponse, timeout)
            for e in self.table.entries()
        ]
        store = self.node.store(self.key, self.node.peer_id, envelope, self.clock() + self.settings.peer_ttl)
        try:
            # One bound for the whole goodbye: if p2pd is already gone (Ctrl-C in a terminal
            # signals it too), the drain must not wait out every DHT timeout.
            async with asyncio.timeout(timeout):
                results = await asyncio.gather(store, *calls, return_exceptions=True)
        except TimeoutError:
            logger.info("run %s: goodbye not finished within %.1f s", self.run_id, timeout)
            return
        failed = sum(isinstance(r, BaseException) for r in results[1:])
        if failed:
            logger.info("run %s: %d of %d peers did not acknowledge our goodbye", self.run_id, failed, len(calls))

    async def heartbeat(self) -> None:
        ok = await self.node.store(
            self.key, self.node.peer_id, self._envelope(MemberState.ACTIVE), self.clock() + self.settings.peer_ttl
        )
        self.events.heartbeat("ok" if ok else "error")

    async def refresh(self) -> None:
        records = await self.node.get(self.key)
        t = self.clock()
        for subkey, (value, _expiration) in records.items():
            self.accept(value, subkey=subkey, at=t)
        self._expire(t)

    def _expire(self, t: float) -> None:
        for peer_id in self.table.expire(t):
            logger.info("run %s: peer %s timed out", self.run_id, peer_id)
            self._lost[peer_id] = t

    async def rejoin(self) -> None:
        """Ping the peers that timed out recently and are still missing (see the module docstring)."""
        t, live = self.clock(), {e.peer_id for e in self.table.entries()}
        self._lost = {p: at for p, at in self._lost.items() if p not in live and t - at < LOST_MEMORY}
        targets = sorted(self._lost, key=self._lost.__getitem__, reverse=True)[:REJOIN_MAX]
        stale = [p for p in targets if p not in self._redialed]
        if stale:
            await asyncio.gather(*(self.node.disconnect(p) for p in stale))
        self._redialed = set(targets)
        if targets:
            answered = await asyncio.gather(*(self.node.ping(p) for p in targets))
            if any(answered):
                logger.info("run %s: %d of %d lost peers answered again", self.run_id, sum(answered), len(targets))

    async def rendezvous(self, mates: list[str], step: int, floor: int, timeout: float) -> Roll:
        """Announce this daemon's step now, then wait at most `timeout` seconds until none of `mates`
        announces a step in [floor, step): each has reached `step`, is further behind (it meets a
        later round, or downloads the state when two rounds behind), or left the table. Returns
        where the mates that will not be at this round stand: those still between (behind) and those
        further behind or not in the table (gone).

        The table is looked at every RENDEZVOUS_POLL seconds, the peer TTL applied on the clock each
        time, while reads of the run's records go on one at a time beside the looks: a read that
        waits out the DHT's request timeout (a request to a node that is gone) does not keep a mate
        that timed out in the table, and the members of a round stop waiting for it about together
        (a member that stopped later than the view's leader missed its join window)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # The first read goes with the announcement and is waited for: the table may be a few seconds old.
        reading = asyncio.ensure_future(asyncio.gather(self.heartbeat(), self.refresh()))
        reading.add_done_callback(self._read_done)
        await asyncio.wait({reading})
        while True:
            self._expire(self.clock())
            steps = {e.peer_id: e.step for e in self.table.entries()}
            behind = tuple(p for p in mates if floor <= steps.get(p, -1) < step)
            if not behind or loop.time() >= deadline:  # a read still going finishes on its own, as any refresh
                return Roll(behind, tuple(p for p in mates if steps.get(p, floor - 1) < floor))
            poll = min(RENDEZVOUS_POLL, max(deadline - loop.time(), 0.0))
            if reading.done():
                await asyncio.sleep(poll)
                reading = asyncio.ensure_future(self.refresh())
                reading.add_done_callback(self._read_done)
                poll = min(RENDEZVOUS_POLL, max(deadline - loop.time(), 0.0))
            await asyncio.wait({reading}, timeout=poll)

    def _read_done(self, reading: asyncio.Future) -> None:
        if not reading.cancelled() and reading.exception() is not None:  # one missed read; the deadline holds
            logger.debug("run %s: refresh during rendezvous failed", self.run_id, exc_info=reading.exception())

    def accept(self, envelope: object, *, subkey: str | None, at: float) -> str | None:
        """Check a record from the DHT or a peer and apply it; returns the table's verdict or None."""
        try:
            record = open_envelope(envelope, run_id=self.run_id, secret=self.secret, subkey=subkey, now=at)
        except RecordRejected as e:
            self.events.rejected(e.reason)
            logger.debug("run %s: rejected record under %r: %s", self.run_id, subkey, e)
            return None
        return self.table.observe(record, at)

    def peers(self) -> list[PeerEntry]:
        return self.table.entries()

    def trainers(self) -> list[PeerEntry]:
        """The peers with training: those that announce a process training the run there ("trainer"),
        or in a local group another daemon leads ("follower"). What --min-peers counts and a
        trainer compares its step with; an "idle" peer (nothing attached, or no manifest yet) is
        neither, whatever its daemon will train later."""
        return [e for e in self.table.entries() if e.role in (TRAINER, FOLLOWER)]

    def divergence(self) -> Divergence | None:
        """The largest estimated parameter distance between two live peers of the run, this daemon
        included, among their sketches taken at the newest step two of them share: each peer's
        latest, and this daemon's of its latest rounds (peers/sketch.py); None until two peers have
        a sketch of the same step.

        Kept until a figure of a newer step replaces it: right after a round each peer's new sketch
        reaches the others a heartbeat later, and meanwhile no step may have two."""
        peers = (e.sketch for e in self.table.entries() if e.sketch is not None)
        found = divergence([*self.announcement().sketches, *peers])
        if found is not None and (self._divergence is None or found.step >= self._divergence.step):
            self._divergence = found
        return self._divergence

    def _envelope(self, state: MemberState) -> bytes:
        active = state is MemberState.ACTIVE
        said = self.announcement() if active else Announcement()
        record = MemberRecord(
            run_id=self.run_id,
            peer_id=self.node.peer_id,
            maddrs=self._maddrs,
            version=self.version,
            role=self.role,
            state=state,
            timestamp=self.clock(),
            step=said.step,
            local_group=self.local_group,
            dear_address=said.dear_address,
            probe_address=self.probe_address if active else "",
            delegated_lanes=said.delegated_lanes,
            dear_group=said.dear_group,
            links=said.links,
            sketch=said.sketches[-1] if said.sketches else None,
        )
        if state is MemberState.ACTIVE:  # what peers see of this daemon's links: the local group uses the same
            self.published_links = (record.timestamp, record.links)
        return seal_record(record, self.node.identity, self.secret)

    async def _every(self, interval: float, action) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await action()
            except Exception:  # one failed tick must not end the loop; the next one retries
                logger.exception("run %s: %s failed", self.run_id, getattr(action, "__name__", action))

    async def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []


class Memberships:
    """All runs this daemon is in, and the one p2p handler that receives goodbyes for any of them."""

    def __init__(self, node: PeerNode, settings: DiscoverySettings, *, version: str, events: PeerEvents):
        self.node, self.settings, self.version, self.events = node, settings, version, events
        self.runs: dict[str, RunMembership] = {}

    async def start(self) -> None:
        await self.node.add_handler(GOODBYE_HANDLER, self._on_goodbye, records_pb2.GoodbyeRequest)

    async def join(self, run_id: str, secret: RunSecret | None, role: str = IDLE) -> bool:
        """Join run_id, announcing `role` in the first heartbeats (idle: nothing trains here until a
        process attaches and the trainer says so); False if already in it. Raises
        nothing for network trouble: heartbeats retry."""
        if run_id in self.runs:
            return False
        membership = RunMembership(
            self.node, run_id, secret, self.settings, version=self.version, role=role, events=self.events
        )
        self.runs[run_id] = membership
        try:
            await membership.start()
        except BaseException:
            del self.runs[run_id]
            raise
        return True

    async def leave(self, run_id: str) -> None:
        membership = self.runs.pop(run_id)
        await membership.leave()

    async def leave_all(self) -> None:
        await asyncio.gather(*(self.leave(run_id) for run_id in list(self.runs)), return_exceptions=True)

    async def _on_goodbye(
        self, request: records_pb2.GoodbyeRequest, context: P2PContext
    ) -> records_pb2.GoodbyeResponse:
        target = next((m for m in self.runs.values() if m.key == request.run_key), None)
        if target is None:
            self.events.rejected("goodbye_unknown_run")
        else:
            # The envelope must be signed by the peer that sent it: nobody can say goodbye for another.
            verdict = target.accept(request.envelope, subkey=context.remote_id.to_base58(), at=target.clock())
            if verdict not in (None, "left", "stale"):
                self.events.rejected("goodbye_not_left")
        return records_pb2.GoodbyeResponse()
