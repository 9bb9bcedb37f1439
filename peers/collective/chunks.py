"""The admission rule of a reliable round (GroupAllReduce): a stream's chunks, in order, and verdicts.

Shards (starting on the codec's block bounds) travel in chunks on a fixed grid
(`AllReduceSettings.chunk_elements`), in order on each connection; a chunk off the grid or out of
order ends the connection ("wire_bad_offset"). What arrives is recorded per chunk in a
rounds.RoundState; the Inbox (inbox.py) holds the buffers it lands in.

Early messages (of round + 1) are kept deterministically: verdicts always, contributions once this
member's own shard is reduced (their buffers are then free), results only between rounds (parked
in the backup, swapped into x when the round opens). Every other early message is refused
("wire_early") and its payload skipped.
"""

from __future__ import annotations

import math

import numpy as np

from peerd.peers.collective.decision import Verdict, sum64
from peerd.peers.collective.inbox import Gathered, Inbox
from peerd.peers.collective.rounds import Phase, RoundState, bits
from peerd.peers.collective.transport import Action, Inbound
from peerd.peers.collective.wire import DIGEST_SIZE, HEADER_SIZE, AbortCode, DType, Header, Kind


class ChunkRule:
    """Admits the chunks and verdicts of reliable rounds into `inbox` (see the module docstring)."""

    partial_results = False  # a round completes with every chunk or aborts: restore=False is honoured

    def __init__(self, inbox: Inbox):
        self.inbox = inbox
        self._verdict_bytes = {k: memoryview(bytearray(DIGEST_SIZE)) for k in inbox.inbox}

    def new_state(self, number: int) -> RoundState:
        return RoundState.new(number, self.inbox.nchunks, self.inbox.group.me)

    def opened(self, st: RoundState) -> None:
        """Results parked in the backup before the round opened trade places with x's chunks."""
        for j, parked in enumerate(st.parked):
            for c in bits(parked & st.result_have[j]):
                self._unpark(st, j, c)

    def ready(self, st: RoundState, c: int) -> bool:
        """Every other member's chunk c of my shard arrived, or will not come."""
        return all((st.contrib_have[k] | st.contrib_gone[k]) >> c & 1 or st.lost >> k & 1 for k in self.inbox.inbox)

    def gathered(self, st: RoundState) -> Gathered:
        """Complete once every chunk of every shard is here; over as well once some chunk can no longer come."""
        complete, hopeless = True, False
        for j, n in enumerate(self.inbox.nchunks):
            if st.result_have[j] != (1 << n) - 1:
                complete = False
                hopeless |= bool(st.result_gone[j]) or bool(st.lost >> j & 1) or j == self.inbox.group.me
        return Gathered(complete, complete or hopeless)

    def lost(self, member: int) -> None:
        """Nothing beyond the `lost` bit the Inbox set in the rounds: `ready` and `gathered` read it."""

    # ---- the Sink's calls ----------------------------------------------------------------------

    def admit(self, link: Inbound, h: Header) -> memoryview | Action:
        ib = self.inbox
        if (refused := ib.refuse_sender(link, h)) is not None:
            return refused
        st = ib.state(h.round, create=True)
        if st is None:
            return ib.refuse("wire_wrong_round", Action.SKIP)
        if h.kind is Kind.CONTRIBUTION:
            dest = self._admit_contribution(st, h)
        elif h.kind is Kind.RESULT:
            dest = self._admit_result(st, h)
        elif h.kind is Kind.VERDICT:
            dest = self._admit_verdict(h)
        else:
            return ib.refuse("wire_bad_kind", Action.DROP)  # DONE belongs to loss-tolerant rounds
        if not isinstance(dest, Action):
            ib.bind(link, h.sender)
        return dest

    def arrived(self, link: Inbound, h: Header) -> None:
        ib = self.inbox
        st, k, c = ib.state(h.round, create=False), h.sender, h.offset // ib.chunk
        if st is None:
            if h.kind is not Kind.VERDICT:
                ib.events.rejected("contribution_late" if h.kind is Kind.CONTRIBUTION else "result_late")
            return
        if h.kind is Kind.VERDICT:
            new = Verdict(ok=bool(h.flags), digest=bytes(self._verdict_bytes[k]), code=AbortCode(h.code))
            st.verdicts[k] = st.verdicts[k].then(new) if k in st.verdicts else new
        elif h.kind is Kind.CONTRIBUTION:
            if st is ib.current and (ib.phase is not Phase.CONTRIBUTE or c < st.reduced):
                ib.events.rejected("contribution_late")  # its owner reduced that chunk without it
                return
            start, end = ib.chunks[ib.group.me][c]
            base = ib.bounds[ib.group.me][0]
            if not ib.decoded(k, h, ib.inbox_np[k][start - base : end - base], ib.events.rejected):
                st.contrib_gone[k] |= 1 << c
                ib.changed()
                return
            st.contrib_have[k] |= 1 << c
            st.weights[k] = h.weight
            if st is ib.current and ib.fold is not None:
                ib.fold(st, k, c)
        else:
            if st is ib.current and ib.phase is Phase.DECIDE:
                ib.events.rejected("result_late")  # this member already gave up on the round
                return
            start, end = ib.chunks[k][c]
            parked = st.parked[k] >> c & 1
            if not ib.decoded(k, h, (ib.backup_np if parked else ib.x)[start:end], ib.events.rejected):
                st.result_gone[k] |= 1 << c
                st.parked[k] &= ~(1 << c)
                ib.changed()
                return
            st.result_have[k] |= 1 << c
            st.result_mask[k][c], st.result_weight[k][c] = h.mask, h.weight
            st.result_sum[k][c] = sum64((ib.backup_np if parked else ib.x)[start:end])  # just received: in cache
            if parked and st is ib.current:
                self._unpark(st, k, c)
        st.bytes_received += HEADER_SIZE + h.length
        ib.changed()

    # ---- admission -----------------------------------------------------------------------------

    def _admit_contribution(self, st: RoundState, h: Header) -> memoryview | Action:
        ib = self.inbox
        me, k = ib.group.me, h.sender
        if h.shard != me:
            return ib.refuse("wire_bad_shard", Action.DROP)
        if not (math.isfinite(h.weight) and h.weight >= 0):
            return ib.refuse("wire_bad_weight", Action.DROP)
        c = st.contrib_next[k]
        bad = self._off_grid(me, c, h)
        if bad:
            return ib.refuse(bad, Action.DROP)
        st.contrib_next[k] = c + 1
        late = st is ib.current and (ib.phase is not Phase.CONTRIBUTE or c < st.reduced)
        early = st is ib.next and ib.phase is Phase.CONTRIBUTE  # its buffer serves the round in progress
        if late or early:
            st.contrib_gone[k] |= 1 << c
            return ib.refuse("contribution_late" if late else "wire_early", Action.SKIP)
        base = ib.bounds[me][0]
        start, end = ib.chunks[me][c]
        return ib.destination(k, h, ib.inbox_bytes[k][(start - base) * 4 : (end - base) * 4])

    def _admit_result(self, st: RoundState, h: Header) -> memoryview | Action:
        ib = self.inbox
        j = h.sender
        if h.shard != j:
            return ib.refuse("wire_bad_shard", Action.DROP)
        if not (math.isfinite(h.weight) and h.weight > 0):
            return ib.refuse("wire_bad_weight", Action.DROP)
        if not h.mask or h.mask >> ib.group.size:
            return ib.refuse("wire_bad_mask", Action.DROP)
        c = st.result_next[j]
        bad = self._off_grid(j, c, h)
        if bad:
            return ib.refuse(bad, Action.DROP)
        st.result_next[j] = c + 1
        late = st is ib.current and ib.phase is Phase.DECIDE
        early = st is ib.next and ib.phase is not Phase.IDLE  # backup serves the round in progress
        if late or early:
            st.result_gone[j] |= 1 << c
            return ib.refuse("result_late" if late else "wire_early", Action.SKIP)
        start, end = ib.chunks[j][c]
        if st is ib.next:
            st.parked[j] |= 1 << c
            return ib.destination(j, h, ib.backup_bytes[start * 4 : end * 4])
        ib.back_up(st, j, c)
        return ib.destination(j, h, ib.x_bytes[start * 4 : end * 4])

    def _off_grid(self, shard: int, c: int, h: Header) -> str | None:
        """Why chunk c of shard cannot be what h announces, or None if it can."""
        ib = self.inbox
        if h.dtype is not ib.codec.dtype:
            return "wire_bad_dtype"
        if c >= ib.nchunks[shard]:
            return "wire_duplicate"  # more chunks than the shard has: a replay
        start, end = ib.chunks[shard][c]
        if h.offset != start - ib.bounds[shard][0]:
            return "wire_bad_offset"
        return None if h.count == end - start else "wire_bad_size"

    def _admit_verdict(self, h: Header) -> memoryview | Action:
        if h.dtype is not DType.BYTES or h.count != DIGEST_SIZE or h.flags > 1:
            return self.inbox.refuse("wire_bad_verdict", Action.DROP)
        if h.code not in AbortCode._value2member_map_ or (h.flags == 1) != (h.code == AbortCode.NONE):
            return self.inbox.refuse("wire_bad_verdict", Action.DROP)
        return self._verdict_bytes[h.sender]

    def _unpark(self, st: RoundState, j: int, c: int) -> None:
        """A result chunk waiting in backup trades places with x's chunk, which becomes its backup."""
        ib = self.inbox
        start, end = ib.chunks[j][c]
        tmp = ib.swap[: end - start]
        np.copyto(tmp, ib.x[start:end])
        np.copyto(ib.x[start:end], ib.backup_np[start:end])
        np.copyto(ib.backup_np[start:end], tmp)
        st.parked[j] &= ~(1 << c)
        st.backed[j] |= 1 << c
