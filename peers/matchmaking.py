"""Matchmaking: turn the peers that published under one Moshpit group key into one agreed group.

Protocol of one round t (every wait bounded; settings in MatchmakingSettings):
1. Each peer stores a signed (sealed in secret runs) GroupEntry under the group key, subkey = its
   peer ID: round, engine address, weight, timestamp, and what its group agrees from its members'
   entries: a gather_timeout proposal (peers/collective/gather_timeout.py) and its pace
   (peers/pace.py). The expiration covers the store itself, the
   join window and the joins (`MatchmakingSettings.entry_ttl` plus one DHT request timeout).
2. `join_window` seconds after its store, each peer reads the key. The leader is the smallest
   peer ID among the valid entries (the reader's own entry always counts).
   Direct path (form_group's `mates`, the group that the membership view gives): no window, and no
   wait for the DHT (the store of step 1 goes on beside it). The view's leader waits for its mates'
   joins (at most join_window) and decides as soon as all are in; each follower sends its join at
   once (a join that arrives before the leader's own form_group waits for it, bounded). Whoever
   does not complete it falls back to the read at join_window, once its own store is done.
3. Followers send JoinGroupRequest to the leader and wait up to `join_timeout` for the answer.
   The leader accepts joins until `assemble_slack` seconds after its own read (or until every
   peer its read showed has joined, whichever is first), then decides with
   `decide_group` (itself and the joiners, ordered by peer ID, capped at max_group_size) and
   answers every pending join with the same ordered member list. That list is its own result.

Timeouts: `join_window` covers DHT propagation of everyone's entries before the read;
`assemble_slack` covers followers that read later than the leader (clock skew, a slower get) and
the join RPC; `join_timeout` covers a follower's whole wait for the leader's decision (it must
exceed assemble_slack). A DHT store or get is bounded by NodeSettings.request_timeout.

Contract: every member of a returned MatchedGroup received the same members, order and leader. A peer
gets no group (None with a reason) when it is alone, when the leader it elected is dead or slow,
or when views differed (the callee was not the leader, or had already decided). Entries that
fail their checks and joins from an unknown group or from a peer other than the entry's signer
are refused and counted through PeerEvents.rejected. There is no acknowledgement phase: a
follower whose join_timeout fires while the leader's answer is in flight gets None although the
leader counts it in; the collective round must treat it as a member that contributed nothing.
Peers are expected to call form_group for a round within about join_window of each other.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from peerd.peers.clock import now
from peerd.peers.collective.gather_timeout import MAX_PROPOSAL
from peerd.peers.envelope import RecordKind, RecordRejected, open_payload, parse, seal
from peerd.peers.events import PeerEvents
from peerd.peers.node import P2PContext, PeerNode
from peerd.peers.records import MAX_CLOCK_SKEW_SECONDS
from peerd.peers.run_ids import RunSecret
from peerd.peers.pace import pace_ok
from peerd.protos import records_pb2 as pb

logger = logging.getLogger(__name__)

JOIN_HANDLER = "peerd.matchmaking.JoinGroup"
ENTRY_FORMAT_VERSION = 1
MAX_EARLY_JOINS = 64  # joins that may wait at once for this daemon's session of their round to start
EARLY_JOIN_POLL = 0.02  # seconds between two looks for that session
MAX_ADDR_CHARS = 256

__all__ = ["Entry", "Matched", "MatchedGroup", "Member", "Matchmaker", "MatchmakingSettings", "decide_group"]


@dataclass(kw_only=True, slots=True)
class MatchmakingSettings:
    join_window: float = 1.0  # from my store to my read of the key: lets everyone's entries propagate
    assemble_slack: float = 1.0  # the leader takes joins this long after its read: later readers, RPC
    join_timeout: float = 3.0  # a follower's whole wait for the leader's decision
    max_group_size: int = 32  # G: the leader keeps the first G peers by peer ID

    def __post_init__(self) -> None:
        if min(self.join_window, self.assemble_slack) < 0 or self.join_timeout <= self.assemble_slack:
            raise ValueError("timeouts must be >= 0 and join_timeout > assemble_slack")
        if self.max_group_size < 2:
            raise ValueError(f"max_group_size must be at least 2, got {self.max_group_size}")

    @property
    def entry_ttl(self) -> float:
        """How long an entry must stay readable after its store: up to the last follower's join."""
        return self.join_window + self.assemble_slack + self.join_timeout


class Member(NamedTuple):
    peer_id: str
    engine_addr: str  # "host:port" of the member's collective engine
    weight: float  # samples since its last round
    gather_timeout: float = 0.0  # seconds it proposes for the round's all-gather; 0: none
    #                              (peers/collective/gather_timeout.py)
    step_seconds: float = 0.0  # its pace: inner step time (latest phase) and recent round duration; 0: none
    round_seconds: float = 0.0  # (peers/pace.py)


@dataclass(frozen=True, slots=True)
class Entry:
    """A checked GroupEntry: what one peer said about itself for one round under one key."""

    member: Member
    key: str
    round_t: int
    timestamp: float


@dataclass(frozen=True, slots=True)
class MatchedGroup:
    """One round's group, identical at every member except `my_index`."""

    run: str  # the run namespace (run ID, or the opaque namespace of a secret run)
    round_t: int
    key: str
    members: tuple[Member, ...]  # ordered by peer ID; members[0] is the leader
    my_index: int

    @property
    def leader(self) -> str:  # the smallest peer ID, which decided the group
        return self.members[0].peer_id


@dataclass(frozen=True, slots=True)
class Matched:
    """The outcome of form_group: a group, or None and why."""

    group: MatchedGroup | None
    reason: str


def admissible(entry: Entry, *, key: str, round_t: int, now: float, max_age: float) -> str | None:
    """Why `entry` cannot take part in the group of (key, round_t) at time `now`, or None if it can."""
    if entry.key != key or entry.round_t != round_t:
        return "entry_wrong_round"
    if entry.timestamp < now - max_age:
        return "entry_stale"
    if entry.timestamp > now + MAX_CLOCK_SKEW_SECONDS:
        return "record_future"
    return None


def decide_group(
    entries: Iterable[Entry], *, key: str, round_t: int, now: float, max_age: float, max_group_size: int
) -> tuple[tuple[Member, ...], str]:
    """The leader's decision: admissible entries, one per peer (its latest), ordered by peer ID,
    the first `max_group_size` kept. Returns (members, a human-readable reason)."""
    latest: dict[str, Entry] = {}
    excluded: dict[str, int] = {}
    for e in entries:
        why = admissible(e, key=key, round_t=round_t, now=now, max_age=max_age)
        if why is not None:
            excluded[why] = excluded.get(why, 0) + 1
        elif e.member.peer_id not in latest or e.timestamp > latest[e.member.peer_id].timestamp:
            latest[e.member.peer_id] = e
    ordered = [latest[p].member for p in sorted(latest)]
    kept = tuple(ordered[:max_group_size])
    reason = f"{len(kept)} member(s)"
    if len(ordered) > len(kept):
        reason += f", {len(ordered) - len(kept)} over max_group_size {max_group_size}"
    for why, n in sorted(excluded.items()):
        reason += f", {n} {why}"
    return kept, reason


def open_entry(data: object, *, namespace: str, secret: RunSecret | None, subkey: str) -> Entry:
    """Verify an entry envelope signed by `subkey` and decode it; raises RecordRejected."""
    body_bytes, signer = open_payload(data, RecordKind.GROUP_ENTRY, run_id=namespace, secret=secret, subkey=subkey)
    body = parse(pb.GroupEntry, body_bytes)
    if body.format_version != ENTRY_FORMAT_VERSION:
        raise RecordRejected("record_version", f"group entry format {body.format_version}")
    host, _, port = body.engine_addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or len(body.engine_addr) > MAX_ADDR_CHARS:
        raise RecordRejected("record_malformed", "engine address is not host:port")
    if not math.isfinite(body.weight) or body.weight < 0 or not math.isfinite(body.timestamp):
        raise RecordRejected("record_malformed", "weight or timestamp out of range")
    if not proposal_ok(body.gather_timeout):
        raise RecordRejected("record_malformed", "gather_timeout out of range")
    if not (pace_ok(body.step_seconds) and pace_ok(body.round_seconds)):
        raise RecordRejected("record_malformed", "step_seconds or round_seconds out of range")
    member = Member(signer, body.engine_addr, body.weight, body.gather_timeout, body.step_seconds, body.round_seconds)
    return Entry(member, body.group_key, body.round, body.timestamp)


def proposal_ok(gather_timeout: float) -> bool:
    return 0 <= gather_timeout <= MAX_PROPOSAL  # False for NaN


@dataclass(slots=True)
class _Session:
    """The state of one form_group call that followers may join: (key, round) while it runs."""

    entry: Entry
    namespace: str
    secret: RunSecret | None
    joins: dict[str, Entry] = field(default_factory=dict)
    decision: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    expected: frozenset[str] = frozenset()  # the leader's read: once all of these joined it decides
    assembled: asyncio.Event = field(default_factory=asyncio.Event)

    def check_assembled(self) -> None:
        if self.expected and self.expected <= self.joins.keys():
            self.assembled.set()


class Matchmaker:
    """Forms this daemon's groups; start() registers the join handler on the node (once)."""

    def __init__(self, node: PeerNode, settings: MatchmakingSettings, events: PeerEvents | None = None):
        self.node, self.settings, self.events = node, settings, events or node.events
        self._sessions: dict[tuple[str, int], _Session] = {}
        self._early_joins = 0  # joins waiting for their session to start (_session_of)
        self._stores: set[asyncio.Task] = set()  # entries still being stored after their form_group returned

    async def start(self) -> None:
        await self.node.add_handler(JOIN_HANDLER, self._on_join, pb.JoinGroupRequest)

    async def publish(self, namespace: str, secret: RunSecret | None, round_t: int, key: str, me: Member) -> bytes:
        """Step 1 alone (also a seam for tests): store my signed entry; returns its envelope."""
        envelope = self._entry_envelope(namespace, secret, round_t, key, me)
        await self._store(key, me, envelope)
        return envelope

    def _entry_envelope(self, namespace: str, secret: RunSecret | None, round_t: int, key: str, me: Member) -> bytes:
        if me.peer_id != self.node.peer_id:
            raise ValueError("a daemon only publishes entries about itself")
        body = pb.GroupEntry(
            format_version=ENTRY_FORMAT_VERSION,
            group_key=key,
            round=round_t,
            engine_addr=me.engine_addr,
            weight=me.weight,
            timestamp=now(),
            gather_timeout=me.gather_timeout,
            step_seconds=me.step_seconds,
            round_seconds=me.round_seconds,
        ).SerializeToString()
        return seal(RecordKind.GROUP_ENTRY, body, self.node.identity, secret, namespace)

    async def _store(self, key: str, me: Member, envelope: bytes) -> None:
        expiration = now() + self.node.settings.request_timeout + self.settings.entry_ttl
        if not await self.node.store(key, me.peer_id, envelope, expiration):
            logger.info("group %s: my entry was not stored; only peers that see it can join me", key)

    async def form_group(
        self,
        namespace: str,
        secret: RunSecret | None,
        round_t: int,
        key: str,
        me: Member,
        mates: Iterable[str] = (),
    ) -> Matched:
        """Form the group of (key, round_t); see the module docstring for the protocol and timeouts.
        `mates`: the peers this daemon's membership view puts in the group. When given, the group
        forms directly: the view's leader (the smallest ID) decides as soon as every mate joined it,
        and followers join it at once, so a round whose mates all agree waits for no window. A view
        that disagrees falls back to the DHT read at the end of the join window."""
        sk = (key, round_t)
        if sk in self._sessions:
            raise RuntimeError(f"already forming the group {key} of round {round_t}")
        session = self._sessions[sk] = _Session(Entry(me, key, round_t, now()), namespace, secret)
        mates = frozenset(mates) - {me.peer_id}
        started = asyncio.get_running_loop().time()
        try:
            envelope = self._entry_envelope(namespace, secret, round_t, key, me)
            # The direct path needs no DHT: the store (a lookup and a store, about 2 RTTs) runs beside
            # it, for the peers whose view falls back to the read, and outlives a direct success.
            store = asyncio.ensure_future(self._store(key, me, envelope))
            self._stores.add(store)
            store.add_done_callback(self._stores.discard)
            if mates:
                direct = await self._direct(session, mates, envelope, namespace, round_t, key)
                if direct is not None:
                    return direct
            await store  # bounded by the DHT's request_timeout; my own read must find my entry
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(0.0, self.settings.join_window - elapsed))
            if session.decision.done():  # led directly and decided: the fallback cannot lead again
                return Matched(None, "the view's group did not assemble")
            seen = await self._read(namespace, secret, round_t, key)
            leader = min([me.peer_id, *seen])
            if leader == me.peer_id:
                session.expected = frozenset(seen) - {me.peer_id}
                session.check_assembled()
                return await self._lead(session, namespace, round_t, key)
            session.decision.set_result(None)  # not the leader: refuse whoever joins us
            return await self._follow(leader, envelope, namespace, round_t, key)
        finally:
            if not session.decision.done():
                session.decision.set_result(None)
            # Joins that arrive a little late get an honest LATE, not an "unknown group" refusal.
            asyncio.get_running_loop().call_later(self.settings.join_timeout, self._forget, sk, session)

    async def _direct(
        self, session: _Session, mates: frozenset[str], envelope: bytes, namespace: str, round_t: int, key: str
    ) -> Matched | None:
        """The view's fast path: the group, or None to fall back to the DHT read."""
        me = session.entry.member.peer_id
        leader = min(mates | {me})
        if leader == me:
            session.expected = mates
            session.check_assembled()
            try:
                async with asyncio.timeout(self.settings.join_window):
                    await session.assembled.wait()
            except TimeoutError:
                return None  # some mates did not come: read the key, as without a view
            return await self._lead(session, namespace, round_t, key)
        matched = await self._follow(leader, envelope, namespace, round_t, key)
        return matched if matched.group is not None else None

    async def _read(self, namespace: str, secret: RunSecret | None, round_t: int, key: str) -> list[str]:
        """Peer IDs of the valid entries under the key; invalid ones are counted and dropped."""
        valid, t = [], now()
        for subkey, (value, _expiration) in (await self.node.get(key)).items():
            try:
                entry = open_entry(value, namespace=namespace, secret=secret, subkey=subkey)
                why = admissible(entry, key=key, round_t=round_t, now=t, max_age=self._max_age)
                if why is not None:
                    raise RecordRejected(why, f"entry of {subkey}")
            except RecordRejected as e:
                self.events.rejected(e.reason)
                continue
            valid.append(entry.member.peer_id)
        return valid

    async def _lead(self, session: _Session, namespace: str, round_t: int, key: str) -> Matched:
        try:  # everyone the read showed has joined: no need to wait out the slack
            async with asyncio.timeout(self.settings.assemble_slack):
                await session.assembled.wait()
        except TimeoutError:
            pass
        members, reason = decide_group(
            [session.entry, *session.joins.values()],
            key=key,
            round_t=round_t,
            now=now(),
            max_age=self._max_age,
            max_group_size=self.settings.max_group_size,
        )
        session.decision.set_result(members)
        if len(members) < 2:
            return Matched(None, f"alone: nobody joined ({reason})")
        return Matched(MatchedGroup(namespace, round_t, key, members, 0), f"leader: {reason}")

    async def _follow(self, leader: str, envelope: bytes, namespace: str, round_t: int, key: str) -> Matched:
        request = pb.JoinGroupRequest(group_key=key, round=round_t, envelope=envelope)
        try:
            timeout = self.settings.join_timeout
            response = await self.node.call(leader, JOIN_HANDLER, request, pb.JoinGroupResponse, timeout)
        except TimeoutError:
            return Matched(None, f"leader {leader} did not answer within {timeout} s")
        except Exception as e:  # p2pd raises several types when the leader is gone
            return Matched(None, f"leader {leader} unreachable: {type(e).__name__}: {' '.join(str(e).split())}")
        if response.status != pb.JOIN_STATUS_ACCEPTED:
            return Matched(None, f"leader {leader} answered {pb.JoinStatus.Name(response.status)}")
        members = tuple(
            Member(m.peer_id, m.engine_addr, m.weight, m.gather_timeout, m.step_seconds, m.round_seconds)
            for m in response.members
        )
        ids = [m.peer_id for m in members]
        bad = not all(
            proposal_ok(m.gather_timeout) and pace_ok(m.step_seconds) and pace_ok(m.round_seconds) for m in members
        )
        if bad or not ids or ids[0] != leader or self.node.peer_id not in ids or ids != sorted(set(ids)):
            self.events.rejected("join_bad_answer")
            return Matched(None, f"leader {leader} answered an inconsistent group")
        return Matched(MatchedGroup(namespace, round_t, key, members, ids.index(self.node.peer_id)), "follower")

    async def _on_join(self, request: pb.JoinGroupRequest, context: P2PContext) -> pb.JoinGroupResponse:
        sk = (request.group_key, request.round)
        session = await self._session_of(sk)
        if session is None:
            self.events.rejected("join_unknown_group")
            return pb.JoinGroupResponse(status=pb.JOIN_STATUS_REFUSED)
        try:
            # Signed by the caller itself: nobody can join (or push out) a group in another's name.
            caller = context.remote_id.to_base58()
            entry = open_entry(request.envelope, namespace=session.namespace, secret=session.secret, subkey=caller)
            why = admissible(entry, key=sk[0], round_t=sk[1], now=now(), max_age=self._max_age)
            if why is not None:
                raise RecordRejected(why, "join for another group or round")
            if caller < self.node.peer_id:  # an honest joiner elects the smallest ID it knows, its own included
                raise RecordRejected("join_not_leader", "a peer with a smaller ID cannot elect us")
        except RecordRejected as e:
            self.events.rejected(e.reason)
            return pb.JoinGroupResponse(status=pb.JOIN_STATUS_REFUSED)
        if session.decision.done():
            late = session.decision.result() is not None
            return pb.JoinGroupResponse(status=pb.JOIN_STATUS_LATE if late else pb.JOIN_STATUS_NOT_LEADER)
        session.joins[caller] = entry
        session.check_assembled()
        try:
            async with asyncio.timeout(self.settings.join_timeout):  # backstop: form_group always decides
                members = await asyncio.shield(session.decision)
        except TimeoutError:
            return pb.JoinGroupResponse(status=pb.JOIN_STATUS_LATE)
        finally:
            if not session.decision.done():  # the joiner gave up (or we did): it must not be counted in
                session.joins.pop(caller, None)
        if members is None:
            return pb.JoinGroupResponse(status=pb.JOIN_STATUS_NOT_LEADER)
        if entry.member.peer_id not in {m.peer_id for m in members}:
            return pb.JoinGroupResponse(status=pb.JOIN_STATUS_GROUP_FULL)
        wire = [
            pb.GroupMember(
                peer_id=m.peer_id,
                engine_addr=m.engine_addr,
                weight=m.weight,
                gather_timeout=m.gather_timeout,
                step_seconds=m.step_seconds,
                round_seconds=m.round_seconds,
            )
            for m in members
        ]
        return pb.JoinGroupResponse(status=pb.JOIN_STATUS_ACCEPTED, members=wire)

    async def _session_of(self, sk: tuple[str, int]) -> _Session | None:
        """The session a join is for. A follower on the direct path may call before this daemon
        starts its own form_group of that round: such a join waits for it, polling, at most
        join_window, and at most MAX_EARLY_JOINS at once (more are refused at once)."""
        session = self._sessions.get(sk)
        if session is not None or self._early_joins >= MAX_EARLY_JOINS:
            return session
        self._early_joins += 1
        try:
            for _ in range(max(1, math.ceil(self.settings.join_window / EARLY_JOIN_POLL))):
                await asyncio.sleep(EARLY_JOIN_POLL)
                if (session := self._sessions.get(sk)) is not None:
                    return session
            return None
        finally:
            self._early_joins -= 1

    @property
    def _max_age(self) -> float:
        return self.node.settings.request_timeout + self.settings.entry_ttl

    def _forget(self, sk: tuple[str, int], session: _Session) -> None:
        if self._sessions.get(sk) is session:
            del self._sessions[sk]
