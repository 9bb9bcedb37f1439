"""The admission rule of a loss-tolerant round (LossyAllReduce): every datagram checked against the
packet grid and the round before it touches a buffer, and what arrived recorded per packet.

Buffers, the round lifecycle (`until`), the sender checks and the backup of x before a chunk is
first overwritten are the Inbox's (inbox.py), as for a reliable round; what this rule does
differently from chunks.ChunkRule:
* the unit is a packet of the grid (lossy.PacketGrid), delivered at most once, in any order;
* nothing waits for a missing packet: an owner settles chunk c of its shard for sender k once k's
  chunk c is complete, a later chunk of k's arrived (k sends in order), k said DONE, or k is gone;
  a member settles owner j's shard once it is complete, j said DONE, or j is gone. DONE comes as
  datagrams and over the reliable transport (udp.py); the first copy counts, the others change nothing;
* RESULT packets land straight in x, where a missing one leaves this member's own value, so every
  chunk of x a round overwrites is backed up (`partial_results`), whatever `restore` says (with a
  compressed payload, a packet is staged and decoded there; one that fails the codec's checks is
  refused, `codec_bad_scale` or `codec_bad_size`, and counts as lost);
* early datagrams (of round + 1): contributions are buffered when the inbox buffers are free
  (between rounds, or once this member's shard is reduced), results are refused ("wire_early"):
  parking them the way the reliable inbox does buys nothing when a member may miss packets anyway.
Every refused datagram is counted by `PeerEvents.packet_rejected(reason)`; control messages (DONE,
over the reliable transport) by `PeerEvents.rejected(reason)`, like every other stream message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from peerd.peers.collective.datagram import OVERHEAD
from peerd.peers.collective.inbox import Gathered, Inbox
from peerd.peers.collective.lossy import PacketGrid
from peerd.peers.collective.rounds import Phase
from peerd.peers.collective.transport import Action, Inbound
from peerd.peers.collective.wire import Header, Kind

_EMPTY = memoryview(bytearray(0))  # the buffer for payloads of no bytes (DONE)


@dataclass(slots=True)
class PacketRound:
    """What arrived for one round. Dicts are keyed by the other members; lists are indexed by shard."""

    number: int
    have: dict[int, np.ndarray]  # per sender: which packets of my shard arrived (bool)
    got: dict[int, list[int]]  # per sender: packets of my shard arrived, per chunk
    front: dict[int, int]  # per sender: the highest chunk of my shard heard of (-1: none)
    weights: dict[int, float]  # per sender: its weight this round, from its first packet
    held: list[np.ndarray]  # per shard: packets of the owner's result that are in x here (bool)
    held_count: list[int]
    rmask: list[np.ndarray]  # per shard, per packet: contributors to the owner's result (uint64)
    rweight: list[np.ndarray]  # per shard, per packet: their total weight (float64)
    backed: list[int]  # per shard: chunks of x copied to backup (restored if the round aborts)
    told: dict[int, int] = field(default_factory=dict)  # sender -> packets of my shard it says it sent
    result_told: dict[int, int] = field(default_factory=dict)  # owner -> packets of its shard it sent
    reduced: int = 0  # chunks of this member's own shard reduced and sent
    lost: int = 0  # members whose control link closed, or whom this member could not reach
    heard: int = 0  # members from whom a datagram of this round was accepted
    bytes_sent: int = 0
    bytes_received: int = 0

    @classmethod
    def new(cls, number: int, grid: PacketGrid, me: int) -> "PacketRound":
        n, mine = len(grid.bounds), grid.packets(me)
        others = [k for k in range(n) if k != me]
        return cls(
            number=number,
            have={k: np.zeros(mine, bool) for k in others},
            got={k: [0] * (len(grid.first[me]) - 1) for k in others},
            front=dict.fromkeys(others, -1),
            weights={},
            held=[np.zeros(grid.packets(j), bool) for j in range(n)],
            held_count=[0] * n,
            rmask=[np.zeros(grid.packets(j), np.uint64) for j in range(n)],
            rweight=[np.zeros(grid.packets(j)) for j in range(n)],
            backed=[0] * n,
        )


class PacketRule:
    """Admits the packets and DONE messages of loss-tolerant rounds into `inbox` (see the module
    docstring); `stride` is the packet grid's (elements per packet)."""

    partial_results = True  # a missing result packet keeps this member's old value: back up every chunk

    def __init__(self, inbox: Inbox, stride: int):
        self.inbox = inbox
        group = inbox.group
        self.grid = PacketGrid(inbox.bounds, inbox.chunk, stride)
        self.others = [k for k in range(group.size) if k != group.me]
        first = self.grid.first[group.me]
        self.want = [b - a for a, b in zip(first, first[1:])]  # packets per chunk of my shard
        self._pending: tuple[PacketRound, int, int] | None = None  # (round, chunk, packet) between the two calls

    def new_state(self, number: int) -> PacketRound:
        return PacketRound.new(number, self.grid, self.inbox.group.me)

    def opened(self, st: PacketRound) -> None:
        """Nothing waits to be moved in: early results are refused, early contributions are in place."""

    def ready(self, st: PacketRound, c: int) -> bool:
        """Nothing more will come for chunk c of my shard (see the module docstring)."""
        want = self.want[c]
        return all(st.got[k][c] >= want or st.front[k] > c or k in st.told or st.lost >> k & 1 for k in self.others)

    def gathered(self, st: PacketRound) -> Gathered:
        """Complete once every packet of every shard is here; over once nothing more will come of
        any other owner's result."""
        complete = all(int(n) == self.grid.packets(j) for j, n in enumerate(st.held_count))
        over = all(
            st.held_count[j] >= self.grid.packets(j) or j in st.result_told or st.lost >> j & 1 for j in self.others
        )
        return Gathered(complete, over)

    def lost(self, member: int) -> None:
        """Nothing beyond the `lost` bit the Inbox set in the rounds: `ready` and `gathered` read it."""

    def missing(self, st: PacketRound) -> int:
        """Datagrams this member should have received this round and did not, by the grid and the
        DONE counts (members never heard from this round are counted by the outcome, not here)."""
        me, lost = self.inbox.group.me, 0
        for k in self.others:
            if st.heard >> k & 1 or k in st.told or k in st.result_told:
                got = sum(st.got[k])
                lost += max(0, st.told.get(k, self.grid.packets(me)) - got)
                lost += max(0, st.result_told.get(k, self.grid.packets(k)) - st.held_count[k])
        return lost

    # ---- the Sink's calls ----------------------------------------------------------------------

    def admit(self, link: Inbound, h: Header) -> memoryview | Action:
        if not getattr(link, "datagram", False):
            return self._control(link, h)
        g = self.inbox.group
        if h.run_tag != g.tag:
            return self._drop("wire_wrong_run")
        if h.sender >= g.size or h.sender == g.me:
            return self._drop("wire_not_in_group")
        if not (math.isfinite(h.weight) and h.weight >= 0):
            return self._drop("wire_bad_weight")
        st = self.inbox.state(h.round, create=True)
        if st is None:
            return self._drop("wire_wrong_round")
        if h.kind is Kind.DONE:
            bad = self._bad_done(h)
            return self._drop(bad) if bad else _EMPTY
        if h.kind is Kind.CONTRIBUTION:
            return self._admit_contribution(st, h)
        return self._admit_result(st, h)

    def arrived(self, link: Inbound, h: Header) -> None:
        if h.kind is Kind.DONE:
            self._record_done(h)
            return
        (st, c, p), self._pending = self._pending, None
        ib, k, changed = self.inbox, h.sender, False
        rejected = ib.events.packet_rejected if getattr(link, "datagram", False) else ib.events.rejected
        if h.kind is Kind.CONTRIBUTION:
            if not ib.decoded(k, h, ib.inbox_np[k][h.offset : h.offset + h.count], rejected):
                return
        else:
            start = ib.bounds[k][0] + h.offset
            if not ib.decoded(k, h, ib.x[start : start + h.count], rejected):
                return
        if h.kind is Kind.CONTRIBUTION:
            st.have[k][p] = True
            st.got[k][c] += 1
            st.weights[k] = h.weight
            changed = st.front[k] < c or st.got[k][c] == self.want[c]
            st.front[k] = max(st.front[k], c)
        else:
            st.held[k][p] = True
            st.held_count[k] += 1
            st.rmask[k][p], st.rweight[k][p] = h.mask, h.weight
            changed = st.held_count[k] == self.grid.packets(k)
        st.heard |= 1 << k
        st.bytes_received += OVERHEAD + h.length
        if changed:  # only these can settle something: no wake-up per packet
            ib.changed()

    def _admit_contribution(self, st: PacketRound, h: Header) -> memoryview | Action:
        ib = self.inbox
        me, k = ib.group.me, h.sender
        if h.shard != me:
            return self._drop("wire_bad_shard")
        if h.dtype is not ib.codec.dtype:
            return self._drop("wire_bad_dtype")  # not the run's payload format
        where = self.grid.locate(me, h.offset, h.count)
        if where is None:
            return self._drop("wire_bad_offset")
        c, p = where
        if st.have[k][p]:
            return self._drop("wire_duplicate")
        if st.weights.get(k, h.weight) != h.weight:
            return self._drop("wire_bad_weight")  # one weight per sender and round
        if st is ib.current and (ib.phase is not Phase.CONTRIBUTE or c < st.reduced):
            return self._drop("contribution_late")  # its owner reduced that chunk without it
        if st is ib.next and ib.phase is Phase.CONTRIBUTE:
            return self._drop("wire_early")  # its buffer serves the round in progress
        self._pending = (st, c, p)
        return ib.destination(k, h, ib.inbox_bytes[k][h.offset * 4 : (h.offset + h.count) * 4])

    def _admit_result(self, st: PacketRound, h: Header) -> memoryview | Action:
        ib, j = self.inbox, h.sender
        if h.shard != j:
            return self._drop("wire_bad_shard")
        if not h.weight > 0:
            return self._drop("wire_bad_weight")
        if not h.mask or h.mask >> ib.group.size:
            return self._drop("wire_bad_mask")
        if h.dtype is not ib.codec.dtype:
            return self._drop("wire_bad_dtype")
        where = self.grid.locate(j, h.offset, h.count)
        if where is None:
            return self._drop("wire_bad_offset")
        if st is not ib.current:
            return self._drop("wire_early")
        c, p = where
        if st.held[j][p]:
            return self._drop("wire_duplicate")
        if ib.phase is Phase.DECIDE:
            return self._drop("result_late")  # this member stopped gathering
        ib.back_up(st, j, c)
        self._pending = (st, c, p)
        start = ib.bounds[j][0] + h.offset
        return ib.destination(j, h, ib.x_bytes[start * 4 : (start + h.count) * 4])

    def _drop(self, reason: str) -> Action:
        """Count a refused datagram (`PeerEvents.packet_rejected`); its payload is skipped."""
        self.inbox.events.packet_rejected(reason)
        return Action.SKIP

    # ---- control messages (over the reliable transport) ----------------------------------------

    def _control(self, link: Inbound, h: Header) -> memoryview | Action:
        ib = self.inbox
        if (refused := ib.refuse_sender(link, h)) is not None:
            return refused
        if h.kind in (Kind.CONTRIBUTION, Kind.RESULT):
            return self._stream_data(link, h)
        if h.kind is not Kind.DONE:
            return ib.refuse("wire_bad_kind", Action.DROP)
        if ib.state(h.round, create=True) is None:
            return ib.refuse("wire_wrong_round", Action.SKIP)
        bad = self._bad_done(h)
        if bad:
            return ib.refuse(bad, Action.DROP)
        ib.bind(link, h.sender)
        return _EMPTY  # a zero-length payload: on_payload follows at once

    def _stream_data(self, link: Inbound, h: Header) -> memoryview | Action:
        """A data packet over a member's reliable link (its UDP path failed the probe; udpsend.py,
        StreamPacketLink): the checks of a datagram, and the link then speaks for that member."""
        ib = self.inbox
        if not (math.isfinite(h.weight) and h.weight >= 0):
            return ib.refuse("wire_bad_weight", Action.DROP)
        st = ib.state(h.round, create=True)
        if st is None:
            return ib.refuse("wire_wrong_round", Action.SKIP)
        dest = self._admit_contribution(st, h) if h.kind is Kind.CONTRIBUTION else self._admit_result(st, h)
        if not isinstance(dest, Action):
            ib.bind(link, h.sender)
        return dest

    def _bad_done(self, h: Header) -> str | None:
        if h.length or h.code not in (Kind.CONTRIBUTION, Kind.RESULT):
            return "wire_bad_done"
        if h.shard != (self.inbox.group.me if h.code == Kind.CONTRIBUTION else h.sender):
            return "wire_bad_shard"
        return None

    def _record_done(self, h: Header) -> None:
        st = self.inbox.state(h.round, create=False)
        if st is None:
            return
        told = st.told if h.code == Kind.CONTRIBUTION else st.result_told
        if h.sender not in told:  # the first of its copies
            told[h.sender] = h.offset
            self.inbox.changed()
