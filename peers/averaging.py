"""One Moshpit averaging round of a run: place peers on the grid, form the round's group, all-reduce.

Round t of a run with live peers P (this daemon included):
1. the grid shape comes from |P| (peers/moshpit.grid_shape), coordinates from the shared view of P
   (view_coords, re-drawn every sweep of d rounds), the group key from the coordinates with
   dimension t mod d masked out;
2. the round's rendezvous (if given; the daemon's waits for the mates of the group still in the
   two previous rounds, peers/membership.py), then peers/matchmaking forms the group under that key
   (one leader, one agreed member order): matchmaking only meets peers that arrive within about
   a second of each other, and peers that train at slightly different speeds would otherwise
   drift out of phase and meet nobody. Matchmaking looks for the mates the rendezvous did not find
   behind or gone, and does not run when that is none of them (`seek`);
3. the collective engine all-reduces the flat parameter vector within the group, weighted by the
   samples each member processed since its previous round. Each round listens on a fresh transport
   whose address goes into the matchmaking entry: a transport holds incoming bytes unread until its
   round's engine attaches, so a fast member cannot reach a slow one's previous round. The run's
   manifest picks the engine: the reliable GroupAllReduce (links by `--reliable-links`: direct TCP,
   else libp2p streams) or, with `averaging.engine=loss-tolerant`, the loss-tolerant LossyAllReduce, whose
   data goes per link (`--data-path`) as UDP datagrams where the link probe to that
   member passes (peers/linkprobe.py) and as packets over the reliable link where it does not. The Outcome says whether every member of the group holds the same result
   (COMPLETED), the result where its packets arrived and its own values elsewhere (PARTIAL, UDP
   only), or its own unchanged vector (ABORTED). The group waits for its all-gather the largest of
   its members' gather_timeout proposals, each from that member's measured rounds
   (peers/collective/gather_timeout.py).

A round that forms no group (alone, leader gone, views differed) changes nothing and says why.

**Lanes** (`averaging.lanes` = L > 1, peers/dear/hierarchy.py): the vector is cut into L slices,
each averaged in a round of its own, concurrently: its view is the live peers that have not
delegated it to a member of their DeAR group that averages it (the member records'
`delegated_lanes` and `dear_group`; hierarchy.lane_view), its group
keys and matchmaking entries live under the run's namespace plus "/lane<l>", and its all-reduce
runs on the lane's slice in place. The grid coordinates come from the run's namespace for every
lane, so where the views agree a peer meets the same mates in every lane. One rendezvous waits for
the mates of every lane at once. With L = 1 a round is exactly as above.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol
from dataclasses import dataclass, field

import tenacity
import torch

from hivemind.p2p import P2P

from peerd.peers.collective import AllReduceSettings, Group, GroupAllReduce, LossyAllReduce, Outcome, UdpTransport
from peerd.peers.collective import arctopk, arctopk_round
from peerd.peers.collective.codec import Format
from peerd.peers.collective.fallback import FallbackTransport, member_address
from peerd.peers.collective.gather_timeout import FLOOR, GatherTimeout, agreed, with_gather_timeout
from peerd.peers.collective.inbox import BufferPool, InboxBuffers
from peerd.peers.collective.linkauth import LinkAuth
from peerd.peers.collective.tcp import split_address
from peerd.peers.dear.hierarchy import lane_bounds, lane_view
from peerd.peers.events import PeerEvents
from peerd.peers.matchmaking import Matchmaker, Member
from peerd.peers.membership import Roll
from peerd.peers.moshpit import grid_shape, group_key, view_coords
from peerd.peers.pace import Pace, group_pace, on_the_wire
from peerd.peers.run_ids import RunSecret, run_namespace

logger = logging.getLogger(__name__)

START_ATTEMPTS = 3  # listeners tried per round when the OS's TCP port is taken for UDP


@dataclass(frozen=True, slots=True)
class RoundResult:
    round_t: int
    group_size: int  # members of the round's group, this daemon included (1: no group)
    outcome: Outcome | None  # None when no group formed
    reason: str
    links: dict[str, str] = field(default_factory=dict)  # peer ID -> "tcp", "libp2p" or "udp", per member reached
    bytes_by_transport: dict[str, tuple[int, int]] = field(default_factory=dict)  # transport -> (sent, received)
    waited: float = (
        0.0  # seconds the rendezvous waited for group mates; NaN in the other lanes of a round (counted once)
    )
    stragglers: int = 0  # group mates the rendezvous gave up on (still behind it)
    skipped: bool = False  # no matchmaking: the rendezvous found every planned mate of this lane away (`seek`)
    planned: int = 0  # group mates the grid gave this lane among the live peers (0: alone in the run)
    lane: int = 0  # the slice of the state vector this round averaged (peers/dear/hierarchy.py)
    # Not this daemon's round: its local group's other members averaged the lane (the thread's DeAR
    # groups), or another daemon of its spanning group did and counts it (peers/dear/delegate.py).
    delegated: bool = False
    # The round stopped without an outcome (an error, a timeout, a cancel) and may have written into
    # its lane; a result with no outcome and not interrupted (alone, no group) left the lane as it was.
    interrupted: bool = False
    # The run stopped it (leave, drain: daemon/joining.bounded_round): its lane holds this member's own
    # values, and an outer step must not apply them as the group's mean (daemon/diloco.py).
    cancelled: bool = False
    # Seconds from the round's start (its rendezvous: a wait for slower mates counts) to its last
    # lane's end, what the model of daemon/plan.py predicts; on the first lane only, NaN in the others
    # (counted once) and in a result that is no round.
    seconds: float = math.nan
    # The group's pace (peers/pace.py): the same on every member of the group, from their entries;
    # None where no group formed.
    pace: Pace | None = None
    # An ARC-Top-K round that completed: the rows it averaged (the vector holds their mean and zeros
    # elsewhere), from which the member's error feedback takes what it did not send (daemon/diloco.py).
    # Not compared: its rows are an array.
    selected: arctopk.Selected | None = field(default=None, compare=False)

    @property
    def completed(self) -> bool:
        return self.outcome is not None and self.outcome.completed

    @property
    def applied(self) -> bool:
        """The vector now holds the round's result, all of it (COMPLETED) or where it arrived (PARTIAL)."""
        return self.outcome is not None and self.outcome.applied

    @property
    def links_summary(self) -> str:
        """'tcp:2 libp2p:1': how many members this round reached through each transport."""
        kinds = sorted(set(self.links.values()), key=lambda k: (k != "tcp", k))
        return " ".join(f"{k}:{sum(v == k for v in self.links.values())}" for k in kinds)

    @property
    def outcome_name(self) -> str:
        """completed, partial, aborted or no_group: the `outcome` label of peerd_rounds_total
        (or "delegated", shown in status only: such a result is not counted as a round)."""
        if self.delegated:
            return "delegated"
        return "no_group" if self.outcome is None else self.outcome.status.value


def seek(planned: Sequence[str], roll: Roll) -> tuple[list[str], str]:
    """Which of a lane's `planned` mates (the view's group) its matchmaking meets, given where the
    rendezvous left them: those it did not find behind or gone, and why, for the round's result.

    Matchmaking waits for every mate it is given (the view's leader up to join_window for their
    joins; a follower up to join_timeout for its leader), then falls back to the DHT read: a mate
    that will not come costs the round seconds and, when it is the leader, often the group
    (docs/algorithms.md, "Who matchmaking looks for"). So the mates away are left out; when that
    is all of them the round does not look at all (an empty list). The DHT read could still meet a
    peer that this view does not list yet (a late joiner, a host back from a cut), but such a
    peer's view lists this one, so it is in the view a refresh later, by the next round; meanwhile
    the round is owed (daemon/diloco.py), its samples carried into the next."""
    away = set(roll.behind) | set(roll.gone)
    here = [p for p in planned if p not in away]
    if not planned or len(here) == len(planned):
        return here, ""
    behind, gone = sum(p in roll.behind for p in planned), sum(p in roll.gone for p in planned)
    why = f"{behind} behind, {gone} gone" if behind and gone else f"{behind} behind" if behind else f"{gone} gone"
    if here:
        return here, f"{len(here)} of {len(planned)} planned mates ({why})"
    return here, f"every planned mate is away ({why}): matchmaking skipped"


class Average(Protocol):
    """A trainer's round, awaited on the daemon's loop (daemon/joining.bounded_round makes one per
    run): averages `vector` in place with the round's group, one round per lane (`lanes` None:
    every lane), the vector travelling in `payload`'s format (peers/collective/codec.py);
    `restore`: a round that stops without an outcome leaves the lane as it was. One RoundResult
    per lane."""

    async def __call__(
        self,
        vector: torch.Tensor,
        weight: float,
        round_t: int,
        lanes: Sequence[int] | None = None,
        restore: bool = True,
        payload: str = "fp32",
    ) -> list[RoundResult]: ...


class MoshpitAverager:
    """Runs the averaging rounds of one run on the daemon's event loop."""

    def __init__(
        self,
        *,
        run_id: str,
        secret: RunSecret | None,
        peer_id: str,
        matchmaker: Matchmaker,
        bind_host: str,
        advertise_host: str,
        max_group_size: int,
        p2p: P2P | None = None,
        reliable_links: str = "auto",
        loss_tolerant: bool = False,
        data_path: str = "udp",
        udp_path_ok: Callable[[str], bool] | None = None,
        datagram_bytes: int = 1472,
        udp_rate_bps: float | None = None,
        settings: AllReduceSettings | None = None,
        events: PeerEvents | None = None,
        rendezvous: Callable[[int, list[str]], Awaitable[Roll]] | None = None,
        lanes: int = 1,
        density: float = arctopk.DENSITY,
    ):
        """`rendezvous(round_t, mates)` waits (bounded) for the mates of round_t's group and returns
        where those that will not be there stand (peers/membership.Roll); matchmaking meets the
        others (`seek`). In loss-tolerant rounds `data_path` says how data reaches a member:
        "udp" (always datagrams), "reliable" (always packets over the reliable link) or "auto"
        (datagrams where `udp_path_ok(peer_id)`, the link prober's verdict, says the path passes)."""
        if data_path not in ("auto", "udp", "reliable"):
            raise ValueError(f"data_path must be auto, udp or reliable, not {data_path!r}")
        self.data_path, self.udp_path_ok = data_path, udp_path_ok or (lambda peer_id: False)
        self.run_id, self.secret, self.peer_id = run_id, secret, peer_id
        self.rendezvous = rendezvous
        self.namespace = run_namespace(run_id, secret)
        self.matchmaker, self.bind_host, self.advertise_host = matchmaker, bind_host, advertise_host
        self.max_group_size = max_group_size
        self.p2p, self.reliable_links = p2p, reliable_links
        self.loss_tolerant, self.datagram_bytes, self.udp_rate_bps = loss_tolerant, datagram_bytes, udp_rate_bps
        self.settings = settings or AllReduceSettings()
        # settings.gather_timeout is the ceiling; each round's group agrees on its own from its
        # members' measured rounds (peers/collective/gather_timeout.py).
        ceiling = self.settings.gather_timeout
        self.gather_timeout = GatherTimeout(ceiling, floor=min(FLOOR, ceiling))
        self.events = events or PeerEvents()
        self.lanes = lanes
        self.density = density  # ARC-Top-K's share of the rows (payload "arctopk")
        # Each round builds its own engine (its transport is keyed by the round's group), but the
        # receive buffers (a full-size backup and one buffer per other member) carry over.
        self.buffers = BufferPool(keep=2 * lanes)

    async def average(
        self,
        vector: torch.Tensor,
        weight: float,
        round_t: int,
        live_peers: Mapping[str, tuple[int, str]],
        lanes: Sequence[int] | None = None,
        group: str = "",
        restore: bool = True,
        payload: str = "fp32",
        pace: Pace = Pace(),
    ) -> list[RoundResult]:
        """Average `lanes` of `vector` (flat float32, in place; every lane of the run when None) with
        this round's groups, one round per lane. `live_peers`: peer ID -> (the lanes it delegated as
        a bit mask, its DeAR group's ID), as announced; `group`: this daemon's DeAR group ID ("" when
        none). Returns one RoundResult per lane, in lane order. restore=False: a lane whose round
        did not complete may hold part of a result (GroupAllReduce.all_reduce); the caller puts
        back the lanes that did not apply a result. `payload`: how the vector travels (fp32, fp16 or
        int8 blocks, peers/collective/codec.py); owners reduce in float32 either way. `pace`: this
        daemon's own (peers/pace.py), for its matchmaking entries."""
        mine = sorted(range(self.lanes) if lanes is None else set(lanes))
        bounds = lane_bounds(vector.numel(), self.lanes)
        plans: dict[int, tuple[str, str, list[str]] | None] = {}
        for lane in mine:
            view = lane_view(self.peer_id, mine, group, live_peers, lane)
            if len(view) == 1:
                plans[lane] = None
                continue
            shape = grid_shape(len(view), self.max_group_size)
            coords = view_coords(view, shape, run_id=self.namespace, epoch=round_t // shape.d)
            namespace = self.namespace if self.lanes == 1 else f"{self.namespace}/lane{lane}"
            key = group_key(namespace, round_t, coords[self.peer_id], shape)
            mates = [p for p in view if p != self.peer_id and group_key(namespace, round_t, coords[p], shape) == key]
            plans[lane] = (namespace, key, mates)
        began, waited, roll = time.monotonic(), 0.0, Roll()
        mates = sorted({p for plan in plans.values() if plan for p in plan[2]})
        if self.rendezvous is not None and mates:
            started = time.monotonic()
            roll = await self.rendezvous(round_t, mates)
            waited = time.monotonic() - started

        async def one(lane: int) -> RoundResult:
            if plans[lane] is None:
                return RoundResult(round_t, 1, None, "alone in the run", lane=lane)
            namespace, key, planned = plans[lane]
            here, why = seek(planned, roll)
            if not here:
                return RoundResult(round_t, 1, None, f"no group: {why}", skipped=True, lane=lane)
            s, e = bounds[lane]
            try:
                result = await self._round(
                    vector[s:e], weight, round_t, namespace, key, lane, restore, payload, here, pace
                )
                return dataclasses.replace(result, reason=f"{result.reason} ({why})") if why else result
            except (OSError, RuntimeError) as error:  # one lane's listener or engine: the other lanes go on
                logger.exception("run %s: round %d lane %d failed", self.run_id, round_t, lane)
                return RoundResult(
                    round_t,
                    1,
                    None,
                    f"lane {lane} failed: {type(error).__name__}: {error}",
                    lane=lane,
                    interrupted=True,
                )

        results = [
            dataclasses.replace(r, planned=len(plans[lane][2]) if plans[lane] else 0)
            for lane, r in zip(mine, await asyncio.gather(*(one(lane) for lane in mine)))
        ]
        took = time.monotonic() - began
        # The rendezvous served every lane: its wait is counted once, with the first, as the round's time.
        return [
            dataclasses.replace(r, waited=waited, stragglers=len(roll.behind), seconds=took)
            if k == 0
            else dataclasses.replace(r, waited=math.nan)
            for k, r in enumerate(results)
        ]

    async def _round(
        self,
        vector: torch.Tensor,
        weight: float,
        round_t: int,
        namespace: str,
        key: str,
        lane: int,
        restore: bool,
        payload: str = "fp32",
        mates: Sequence[str] = (),
        pace: Pace = Pace(),
    ) -> RoundResult:
        """One lane's round under group key `key`: listen, matchmaking (directly with `mates`, the group
        the view gives, peers/matchmaking.py), all-reduce of `vector` (a slice)."""
        transport, address = await self._listen(key)
        buffers: InboxBuffers | None = None
        try:
            port = split_address(address)[1]
            me = Member(
                self.peer_id,
                f"{self.advertise_host}:{port}",
                float(weight),
                self.gather_timeout.proposal(),
                on_the_wire(pace.step_seconds),
                on_the_wire(pace.round_seconds),
            )
            matched = await self.matchmaker.form_group(namespace, self.secret, round_t, key, me, mates)
            if matched.group is None:
                return RoundResult(round_t, 1, None, f"no group: {matched.reason}", lane=lane)
            g = matched.group
            agreed_pace = group_pace((m.step_seconds, m.round_seconds) for m in g.members)
            addresses = [member_address(m.engine_addr, m.peer_id) for m in g.members]
            group = Group(self.run_id, [m.peer_id for m in g.members], addresses, g.my_index)
            if self.loss_tolerant:
                transport.datagrams = self._datagrams({a: m.peer_id for a, m in zip(addresses, g.members)})
            gather = agreed((m.gather_timeout for m in g.members), self.settings.gather_timeout)
            if payload == arctopk.PAYLOAD:
                if (sketched := arctopk.rows_of(vector.numel()) * arctopk.RANK) < group.size:
                    why = f"a sketch of {sketched} values cannot be shared among {group.size} members"
                    return RoundResult(round_t, group.size, None, why, lane=lane, pace=agreed_pace)
                outcome, selected = await self._top_k(vector, weight, group, transport, gather)
            else:
                engine_type = LossyAllReduce if self.loss_tolerant else GroupAllReduce
                if -(-vector.numel() // Format(payload).alignment) < group.size:
                    # Fewer blocks than members (a tiny model): every member owns a shard only in float32,
                    # which all members decide alike from the same size and group.
                    payload = "fp32"
                    if vector.numel() < group.size:
                        return RoundResult(
                            round_t,
                            group.size,
                            None,
                            f"{vector.numel()} values cannot be shared among {group.size} members",
                            lane=lane,
                            pace=agreed_pace,
                        )
                buffers = self.buffers.take(vector.numel(), group.size, self.settings.chunk_elements)
                settings = dataclasses.replace(with_gather_timeout(self.settings, gather), payload=payload)
                engine = engine_type(
                    group, transport, vector.numel(), settings=settings, events=self.events, buffers=buffers
                )
                selected = None
                try:
                    # A fresh engine's first round is number 1; the group key already names round_t.
                    outcome = await engine.all_reduce(vector, float(weight), 1, restore=restore)
                finally:
                    await engine.close()
            if outcome.completed:
                self.gather_timeout.observe(outcome.duration, gather)
            return RoundResult(
                round_t,
                group.size,
                outcome,
                outcome.reason,
                self._links(transport, group),
                transport.bytes_by_transport(),
                lane=lane,
                pace=agreed_pace,
                selected=selected,
            )
        finally:
            await transport.close()
            if buffers is not None:  # only now: a closed transport writes into nothing
                self.buffers.give(buffers)

    async def _top_k(
        self,
        vector: torch.Tensor,
        weight: float,
        group: Group,
        transport: FallbackTransport | UdpTransport,
        gather: float,
    ) -> tuple[Outcome, arctopk.Selected | None]:
        """An ARC-Top-K round of the formed group on its transport (peers/collective/arctopk_round.py);
        `gather`: the group's gather timeout, each of its two all-reduces'."""
        two = arctopk_round.ArcTopKRound(
            self.run_id,
            group,
            transport,
            vector.numel(),
            self.density,
            with_gather_timeout(self.settings, gather),
            self.events,
            lossy=self.loss_tolerant,
        )
        try:
            return await two.all_reduce(vector, float(weight))
        finally:
            await two.close()

    async def _listen(self, key: str) -> tuple[FallbackTransport | UdpTransport, str]:
        """A started listener for this round and its address. The UDP engine needs one port free for
        both TCP and UDP, which the OS does not promise: a clash is retried on a fresh port."""
        async for attempt in tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, OSError) and e.errno == errno.EADDRINUSE),
            stop=tenacity.stop_after_attempt(START_ATTEMPTS),
            reraise=True,
        ):
            with attempt:
                transport = self._transport(key)
                try:
                    return transport, await transport.start()
                except OSError:
                    await transport.close()
                    raise
        raise AssertionError("unreachable")  # tenacity returns or raises from inside the loop

    def _transport(self, key: str) -> FallbackTransport | UdpTransport:
        """This round's listener. Reliable links (all data, or the UDP engine's few control messages)
        go over direct TCP, else libp2p streams; in a secret run every link and datagram is keyed by
        the secret and this round's group key."""
        auth = LinkAuth(self.secret.engine_key, key) if self.secret is not None else None
        mode = self.reliable_links if self.p2p is not None else "tcp"
        reliable = FallbackTransport(self.bind_host, 0, p2p=self.p2p, mode=mode, auth=auth, events=self.events)
        if not self.loss_tolerant:
            return reliable
        return UdpTransport(
            self.bind_host,
            0,
            secret=self.secret.engine_key if self.secret else None,
            session=key,
            control=reliable,
            max_datagram=self.datagram_bytes,
            rate_bps=self.udp_rate_bps,
            events=self.events,
        )

    def _datagrams(self, peer_of: dict[str, str]) -> Callable[[str], bool]:
        """Whether this round sends its data to the member at `address` as datagrams."""
        if self.data_path != "auto":
            mode = self.data_path == "udp"
            return lambda address: mode
        return lambda address: self.udp_path_ok(peer_of.get(address, ""))

    def _links(self, transport, group: Group) -> dict[str, str]:
        """peer ID -> how this round's data reached that member: udp, tcp or libp2p."""
        reliable = transport.control if self.loss_tolerant else transport
        paths = getattr(transport, "data_paths", {})
        links = {}
        for k, a in enumerate(group.addresses):
            if paths.get(a) == "udp":
                links[group.members[k]] = "udp"
            elif a in reliable.choices:
                links[group.members[k]] = reliable.choices[a]
        if "libp2p" in links.values():
            logger.info(
                "reached %d of %d members through libp2p streams",
                sum(v == "libp2p" for v in links.values()),
                len(links),
            )
        return links
