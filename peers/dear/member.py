"""This daemon's place in a local group (operator-labelled, or by measured links with the reserved
label `auto`): when to form a DeAR group, and its engine.

    member = LocalGroupMember(run_id=..., peer_id=..., label="rack7", host="10.0.0.5", peers=table_view)
    member.prepare()                        # a fresh engine listening; member.address goes into heartbeats
    collective = member.try_form(round_members)   # after a Moshpit round; None: train alone this time
    ...
    member.drop(reason)                     # the group broke (or its members may differ): close, re-arm

**When a group forms** (`plan_group`, pure): this daemon's live peer table (the membership's, which
already drops peers unheard for `peer_ttl`), its own label and engine address, and the members of
the Moshpit round that just completed. The local group is `local_groups(...)`'s label-only decision
(every table entry counts as live: the table did the expiry). With the label AUTO it is the
decision by links among the peers labelled AUTO: each one's link reports from its latest record
(this daemon's own: those of its latest heartbeat, what the peers saw), both directions of every
pair fresh (at most `max_age` old, on the records' clock) and within the thresholds; so every member
reaches the same decision from the same records. It forms only if it has at least two
members, every one of them took part in that completed round (so all hold the round's result, the
same digest, at the same global step: identical state to start from) and every one published an
engine address. Ranks are the members' order by peer ID, the same on every member.

Members decide on their own from their own tables; if they disagree (a heartbeat not yet seen, a
stale address), the first DeAR op fails: at once when a connection is refused or closed, after
the op timeout when a peer never joins. Every member then drops the group (a member that drops it
closes its engine, which fails the others' next op at once) and tries again after a later round.

**Engines are single-use**: a broken EngineCollective stays broken, so `drop()` closes it and starts
a fresh one on a new port, announced by the next heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peerd.peers.collective.linkauth import LinkAuth
from peerd.peers.collective.tcp import TcpTransport
from peerd.peers.clock import now as dht_now
from peerd.peers.dear.localgroup import LinkSample, LocalGroupRules, PeerSample, local_groups
from peerd.peers.events import PeerEvents
from peerd.peers.linkprobe import LinkReport

if TYPE_CHECKING:  # the engine (and torch) is imported when a group forms: the daemon imports this module idle
    from peerd.peers.dear.engine import EngineCollective

logger = logging.getLogger(__name__)

OP_TIMEOUT = 5.0  # seconds one DeAR op may take (EngineCollective's timeout): how long a frozen member stalls a step
# DeAR steps between fusion re-tunes (DeARSettings.retune_every): every member re-tunes at the same
# steps, since they take every DeAR step together; one costs a flushed step and a tiny all-reduce.
RETUNE_EVERY = 50
AUTO = "auto"  # the reserved label: form a group with the peers whose measured links pass the thresholds


@dataclass(frozen=True, slots=True)
class GroupPeer:
    peer: str  # peer ID
    label: str  # its --local-group ("" when unset)
    address: str  # its DeAR engine's "host:port" ("" when none)
    links: tuple[LinkReport, ...] = ()  # its link reports (label AUTO), as of `timestamp`
    timestamp: float = 0.0  # the DHT time of the record they came in: a report was measured at timestamp - age


@dataclass(frozen=True, slots=True)
class Formation:
    members: tuple[str, ...]  # sorted peer IDs of the local group (this daemon included); () when none
    rank: int  # this daemon's index in members; -1 when not forming
    addresses: tuple[str, ...]  # addresses[i]: members[i]'s engine
    form: bool  # every condition holds: build the DeAR group now
    reason: str  # one human-readable line


def plan_group(
    me: GroupPeer, peers: Sequence[GroupPeer], round_members: Collection[str], rules: LocalGroupRules, now: float
) -> Formation:
    """Whether to form this daemon's local group right after a completed round (module docstring)."""
    known = {p.peer: p for p in peers if p.peer != me.peer}
    known[me.peer] = me
    if me.label == AUTO:  # by links, among the peers that opted in (labelled AUTO): module docstring
        auto = [p for p in known.values() if p.label == AUTO]
        links = [
            LinkSample(p.peer, r.peer_id, r.rtt, r.bandwidth, r.loss, p.timestamp - r.age)
            for p in auto
            for r in p.links
        ]
        decision = local_groups([PeerSample(p.peer, now) for p in auto], links, rules, now)
    else:
        decision = local_groups([PeerSample(p.peer, now, p.label) for p in known.values()], (), rules, now)
    group = decision.group_of(me.peer)
    if not me.label or group is None:
        return Formation((), -1, (), False, f"no local group: {decision.reason}")
    addresses = tuple(known[m].address for m in group)
    rank = group.index(me.peer)
    absent = [m for m in group if m not in round_members]
    if absent:
        return Formation(group, rank, addresses, False, f"{len(absent)} of {len(group)} members were not in the round")
    if not all(_dialable(a) for a in addresses):
        return Formation(group, rank, addresses, False, "not every member has announced a valid engine address yet")
    how = "by links" if me.label == AUTO else f"by label {me.label!r}"
    return Formation(group, rank, addresses, True, f"forming [{', '.join(group)}] {how}")


def _dialable(address: str) -> bool:
    """'host:port' with a port in 1..65535 (addresses come from peers' records: checked before use)."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


class LocalGroupMember:
    """Owns this daemon's current EngineCollective. Called from the trainer thread only; `address`,
    `size` and `rank` are plain attributes the event loop reads for heartbeats, status and metrics."""

    def __init__(
        self,
        *,
        run_id: str,
        peer_id: str,
        label: str,
        host: str,
        peers: Callable[[], Sequence[GroupPeer]],
        timeout: float = OP_TIMEOUT,
        rules: LocalGroupRules | None = None,
        events: PeerEvents | None = None,
        clock: Callable[[], float] = dht_now,
        engine_key: bytes | None = None,
        own_links: Callable[[], tuple[float, tuple[LinkReport, ...]]] = lambda: (0.0, ()),
    ):
        self.run_id, self.peer_id, self.label, self.host = run_id, peer_id, label, host
        # The daemon measures each link from one side per record: a pair needs both sides' reports.
        rules = rules or LocalGroupRules(both_directions=True)
        self.peers, self.timeout, self.rules, self.events, self.clock = peers, timeout, rules, events, clock
        self.own_links = own_links  # (timestamp, links) of this daemon's latest heartbeat (label AUTO)
        self.address = ""  # the engine's address while one listens; announced in heartbeats
        self.collective: EngineCollective | None = None  # joined: a DeAR group is active
        self.members: tuple[str, ...] = ()  # the active group's members; () when none
        self.rank = -1  # this daemon's rank in the active group; -1 when none
        self.last_reason = ""  # why the latest try_form / drop did what it did
        self._engine: EngineCollective | None = None  # listening, not yet joined
        # In a secret run every DeAR link opens with a hello keyed by the run's secret and the label,
        # as the Moshpit rounds' links do (peers/collective/linkauth.py).
        self._auth = LinkAuth(engine_key, f"dear:{run_id}:{label}") if engine_key is not None else None

    @property
    def size(self) -> int:
        return len(self.members)

    def prepare(self) -> None:
        """Have an engine listening (and its address announced) for the next formation."""
        if self._engine is None:
            from peerd.peers.dear.engine import EngineCollective

            self._engine = EngineCollective(
                rank=0,
                world=1,
                timeout=self.timeout,
                run_id=self.run_id,
                events=self.events,
                transport=lambda: TcpTransport(self.host, 0, events=self.events, auth=self._auth),
            )
            self.address = self._engine.start()

    def try_form(self, round_members: Collection[str]) -> EngineCollective | None:
        """After a completed round: join the group if plan_group says so; returns the collective or None."""
        plan = self._plan(round_members)
        self.last_reason = plan.reason
        if not plan.form or self._engine is None:
            return None
        engine, self._engine = self._engine, None
        engine.rank, engine.world = (
            plan.rank,
            len(plan.members),
        )  # read from join() on (start() used rank only to name its thread)
        try:
            engine.join(plan.addresses)
        except (ValueError, TimeoutError) as e:  # an address the engine refuses, or its loop stuck
            self.last_reason = f"joining failed: {e}"
            engine.close()
            self.prepare()
            return None
        self.collective, self.members, self.rank = engine, plan.members, plan.rank
        logger.info("run %s: local group %r formed: rank %d of %d", self.run_id, self.label, self.rank, self.size)
        return engine

    def outdated(self, round_members: Collection[str]) -> bool:
        """The active group is no longer the one plan_group decides (with AUTO: a peer's links became
        close, or stopped being so): the caller drops it, and the next round forms the new one.
        `last_reason` then says what the new decision is and why."""
        if self.collective is None:
            return False
        plan = self._plan(round_members)
        if plan.members == self.members:
            return False
        self.last_reason = plan.reason
        return True

    def _plan(self, round_members: Collection[str]) -> Formation:
        timestamp, links = self.own_links()
        me = GroupPeer(self.peer_id, self.label, self.address, links, timestamp)
        return plan_group(me, self.peers(), round_members, self.rules, self.clock())

    def drop(self, reason: str) -> None:
        """Leave the active group (if any): close its engine, and have a fresh one listening."""
        if self.collective is not None:
            logger.info("run %s: local group %r dropped: %s", self.run_id, self.label, reason)
            collective, self.collective, self.members, self.rank = self.collective, None, (), -1
            self.address = ""  # nobody should dial the broken engine while a fresh one starts
            collective.close()
            self.last_reason = reason
        self.prepare()

    def close(self) -> None:
        for engine in (self.collective, self._engine):
            if engine is not None:
                engine.close()
        self.collective = self._engine = None
        self.members, self.rank, self.address = (), -1, ""
