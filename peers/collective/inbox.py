"""The receiving side of the engine: preallocated buffers, per-round bookkeeping, and the checks
every incoming header passes before its payload may touch either.

Buffers (allocated once per engine, or lent by a `BufferPool` to one engine after another; reused
every round):
* the caller's tensor `x`: owners' RESULT chunks land straight in it, and this member reduces its
  own shard in place, so COMPLETE costs nothing;
* `backup`: each chunk of `x` is copied here just before it is first overwritten (one chunk at a
  time), and copied back if the round aborts. A round opened with `restore=False` backs up only
  this member's own shard (its own contribution, read again while reducing): the caller holds the
  tensor's old value elsewhere and puts it back itself, which saves copying the other
  (size - 1) / size of the tensor every round;
* `inbox[k]`: member k's contribution to this member's shard;
* with a compressed payload (`AllReduceSettings.payload`, codec.py): `wire`, the encoded vector
  (contributions and this member's results are encoded there once and sent from there), and one
  staging buffer per member, where a payload lands and is checked before it is decoded into
  `inbox[k]` or `x` (a payload that fails is refused: `codec_bad_size`, `codec_bad_scale`).

Shards (starting on the codec's block bounds) travel in chunks on a fixed grid
(`AllReduceSettings.chunk_elements`), in order on each connection; a chunk off the grid or out of
order ends the connection ("wire_bad_offset").

Rounds: messages of the round in progress are accepted while its phase still wants them; messages
of the next round (number + 1) that arrive early are buffered deterministically: verdicts always,
contributions once this member's own shard is reduced (their buffers are then free), results only
between rounds (parked in `backup`, swapped into `x` when the round opens). Every other early
message, and every message of a past or a later round, is refused ("wire_early",
"wire_wrong_round") and its payload skipped. When a round ends, payloads of it still arriving are
thrown away rather than written into a tensor the caller owns again.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from peerd.peers.collective.codec import Codec, Format
from peerd.peers.collective.decision import Verdict, sum64
from peerd.peers.collective.group import Group, chunk_bounds, shard_bounds
from peerd.peers.collective.rounds import Phase, RoundState, bits
from peerd.peers.collective.transport import Action, Inbound
from peerd.peers.collective.wire import DIGEST_SIZE, HEADER_SIZE, INT8_BLOCK, AbortCode, DType, Header, Kind, WireError
from peerd.peers.events import PeerEvents


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


@dataclass(frozen=True, slots=True)
class InboxBuffers:
    """What an Inbox receives into, for any member of a group of `size` over `numel` elements in
    chunks of `chunk`: the backup, one contribution buffer per other member (as long as the longest
    shard; a member uses the front of each), and the scratch chunk of `_unpark`. Nothing carries
    over from one round to the next: every round writes a region before it reads it. Shards may be
    cut on int8 blocks or not: the parts fit either. A compressed payload's buffers (`coded`) are
    made on first use and kept with the rest."""

    key: tuple[int, int, int]  # (numel, size, chunk)
    backup: torch.Tensor
    parts: tuple[torch.Tensor, ...]
    swap: np.ndarray
    coded: dict[Format, tuple[np.ndarray, tuple[np.ndarray, ...]]] = field(default_factory=dict)

    @classmethod
    def new(cls, numel: int, size: int, chunk: int) -> "InboxBuffers":
        longest = max(e - s for align in (1, INT8_BLOCK) for s, e in shard_bounds(numel, size, align))
        return cls(
            key=(numel, size, chunk),
            backup=torch.zeros(numel, dtype=torch.float32),
            parts=tuple(torch.zeros(longest, dtype=torch.float32) for _ in range(size - 1)),
            swap=np.zeros(min(chunk, longest), dtype=np.float32),
        )

    def wire(self, codec: Codec) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """(the encoded vector, one staging buffer per other member, each for a chunk) in codec's format."""
        if codec.format not in self.coded:
            numel, size, chunk = self.key
            staging = codec.size(min(chunk, len(self.parts[0]) if self.parts else chunk))
            self.coded[codec.format] = (
                np.zeros(codec.size(numel), np.uint8),
                tuple(np.zeros(staging, np.uint8) for _ in self.parts),
            )
        return self.coded[codec.format]


class BufferPool:
    """InboxBuffers kept from one engine to the next (the daemon builds an engine per round), so that
    a round allocates nothing. A set is lent to one engine at a time (`take`) and given back
    (`give`) only once nothing can write into it any more: its transport is closed. At most `keep`
    sets wait here; the oldest goes first (group sizes change with the run)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._free: list[InboxBuffers] = []

    def take(self, numel: int, size: int, chunk: int) -> InboxBuffers:
        key = (numel, size, chunk)
        for i in range(len(self._free) - 1, -1, -1):  # newest first: the likeliest still in cache
            if self._free[i].key == key:
                return self._free.pop(i)
        return InboxBuffers.new(numel, size, chunk)

    def give(self, buffers: InboxBuffers) -> None:
        self._free.append(buffers)
        if len(self._free) > self.keep:
            del self._free[0]


class Inbox:
    """The transport's sink for one group. Runs on the event loop; the round waits on it with `until`."""

    def __init__(
        self,
        group: Group,
        numel: int,
        chunk: int,
        events: PeerEvents,
        buffers: InboxBuffers | None = None,
        payload: Format | str = Format.FP32,
    ):
        self.group, self.numel, self.chunk, self.events = group, numel, chunk, events
        self.codec = Codec(payload)
        self.coded = self.codec.format is not Format.FP32  # payloads are staged, checked and decoded
        self.bounds = shard_bounds(numel, group.size, self.codec.block)
        self.chunks = tuple(chunk_bounds(s, e, chunk) for s, e in self.bounds)  # absolute [start, end)
        self.nchunks = tuple(len(c) for c in self.chunks)
        start, end = self.bounds[group.me]
        self.buffers = buffers or InboxBuffers.new(numel, group.size, chunk)
        if self.buffers.key != (numel, group.size, chunk):
            raise ValueError(f"buffers for {self.buffers.key} cannot serve {(numel, group.size, chunk)}")
        others = [k for k in range(group.size) if k != group.me]
        self.backup = self.buffers.backup
        self.inbox = {k: part[: end - start] for k, part in zip(others, self.buffers.parts)}
        self.backup_np, self._backup_bytes = self.backup.numpy(), as_bytes(self.backup)
        self.inbox_np = {k: t.numpy() for k, t in self.inbox.items()}
        self._swap = self.buffers.swap
        self.x: np.ndarray | None = None  # the caller's tensor, while a round runs
        self.x_bytes: memoryview | None = None  # x's bytes, while a round runs
        self._inbox_bytes = {k: as_bytes(t) for k, t in self.inbox.items()}
        self._verdict_bytes = {k: memoryview(bytearray(DIGEST_SIZE)) for k in self.inbox}
        if self.coded:
            self.wire, staging = self.buffers.wire(self.codec)
            self._staging = {k: memoryview(b) for k, b in zip(others, staging)}
        self.phase = Phase.IDLE
        self.round = 0  # the round in progress, or the last one run
        self.current: RoundState | None = None
        self.next: RoundState | None = None  # early arrivals for round + 1
        self.links: dict[int, Inbound] = {}  # the one connection each member currently speaks on
        self._filling: dict[Inbound, int] = {}  # connections receiving a payload, and its round
        self.fold: Callable[[RoundState, int, int], None] | None = None  # called as contributions arrive
        self._done: Callable[[], bool] | None = None  # what the round waits for
        self._ready: asyncio.Future | None = None
        self.keep_results = True  # back up chunks of other shards before results overwrite them

    def open(self, number: int, x: torch.Tensor, restore: bool = True) -> RoundState:
        self._discard(lambda n: n != number)  # e.g. parked for a round the caller skipped: not into backup
        nxt = self.next
        st = nxt if nxt is not None and nxt.number == number else self._new_state(number)
        self.current, self.next, self.round, self.phase = st, None, number, Phase.CONTRIBUTE
        self.x, self.x_bytes, self.keep_results = x.numpy(), as_bytes(x), restore
        for j, parked in enumerate(st.parked):
            for c in bits(parked & st.result_have[j]):
                self._unpark(st, j, c)
        return st

    def close(self) -> None:
        """End the round: payloads of it still arriving are thrown away, not written into x or backup."""
        self._discard(lambda n: n == self.round)
        self.current, self.phase, self.x, self.x_bytes = None, Phase.IDLE, None, None

    def _discard(self, which: Callable[[int], bool]) -> None:
        for link, number in list(self._filling.items()):
            if which(number):
                link.discard_payload()
                del self._filling[link]

    def encode(self, start: int, end: int) -> memoryview:
        """Encode x[start:end] (on block bounds) into its place in `wire`; returns those bytes."""
        return self.codec.encode(self.x[start:end], self.wire[self.codec.size(start) :])

    def wire_view(self, start: int, end: int) -> memoryview:
        """The bytes of `wire` that encode elements [start, end)."""
        return memoryview(self.wire[self.codec.size(start) : self.codec.size(end)])

    def payload(self, start: int, end: int) -> memoryview:
        """What goes on the wire for x[start:end]: x's own bytes, or their encoding in `wire`."""
        return self.encode(start, end) if self.coded else self.x_bytes[start * 4 : end * 4]

    def _destination(self, k: int, h: Header, values: memoryview) -> memoryview:
        """Where member k's payload lands: straight in `values` (float32), or staged to be decoded."""
        return self._staging[k][: h.length] if self.coded else values

    def _decoded(self, k: int, h: Header, out: np.ndarray, rejected: Callable[[str], None]) -> bool:
        """Decode member k's staged payload into out; False (counted by `rejected`) if it fails the codec's checks."""
        if not self.coded:
            return True
        try:
            self.codec.decode(self._staging[k][: h.length], out)
        except WireError as e:
            rejected(e.reason)
            return False
        return True

    async def until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Wait until done() holds or the loop clock reaches deadline; returns done().

        done() is checked in the callback that delivered each message, so the waiting task only
        wakes when there is something to do (not once per chunk that arrives)."""
        if done():
            return True
        self._done, self._ready = done, asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout_at(deadline):
                await self._ready
        except TimeoutError:
            pass
        finally:
            self._done = self._ready = None
        return done()

    def _changed(self) -> None:
        if self._ready is not None and not self._ready.done() and self._done():
            self._ready.set_result(None)

    def back_up(self, st: RoundState, j: int, c: int) -> None:
        """Save chunk c of shard j of x before it is overwritten (once per round; another member's
        shard only if the round restores it)."""
        if not st.backed[j] >> c & 1 and (self.keep_results or j == self.group.me):
            start, end = self.chunks[j][c]
            np.copyto(self.backup_np[start:end], self.x[start:end])
            st.backed[j] |= 1 << c

    def restore(self, st: RoundState) -> None:
        """Put back every chunk of x this round backed up: with `keep_results`, x is as it was
        before the round; without, other shards' chunks may hold the round's results."""
        for j, backed in enumerate(st.backed):
            for c in bits(backed):
                start, end = self.chunks[j][c]
                np.copyto(self.x[start:end], self.backup_np[start:end])
        st.backed = [0] * len(st.backed)

    def _unpark(self, st: RoundState, j: int, c: int) -> None:
        """A result chunk waiting in backup trades places with x's chunk, which becomes its backup."""
        start, end = self.chunks[j][c]
        tmp = self._swap[: end - start]
        np.copyto(tmp, self.x[start:end])
        np.copyto(self.x[start:end], self.backup_np[start:end])
        np.copyto(self.backup_np[start:end], tmp)
        st.parked[j] &= ~(1 << c)
        st.backed[j] |= 1 << c

    def ready(self, st: RoundState, c: int) -> bool:
        """Every other member's chunk c of my shard arrived, or will not come."""
        return all((st.contrib_have[k] | st.contrib_gone[k]) >> c & 1 or st.lost >> k & 1 for k in self.inbox)

    def gathered(self, st: RoundState) -> tuple[bool, bool]:
        """(every chunk of every shard is here, some chunk can no longer come)."""
        complete, hopeless = True, False
        for j, n in enumerate(self.nchunks):
            if st.result_have[j] != (1 << n) - 1:
                complete = False
                hopeless |= bool(st.result_gone[j]) or bool(st.lost >> j & 1) or j == self.group.me
        return complete, hopeless

    # ---- the Sink interface --------------------------------------------------------------------

    def _refuse_sender(self, link: Inbound, h: Header) -> Action | None:
        """DROP (counted) for a header of another run, from outside the group, or from a member other
        than the one this link already speaks for; None if the sender is acceptable."""
        g = self.group
        if h.run_tag != g.tag:
            return self._refuse("wire_wrong_run", Action.DROP)
        if h.sender >= g.size or h.sender == g.me:
            return self._refuse("wire_not_in_group", Action.DROP)
        if link.member is not None and link.member != h.sender:
            return self._refuse("wire_sender_mismatch", Action.DROP)
        return None

    def on_header(self, link: Inbound, h: Header) -> memoryview | Action:
        if (refused := self._refuse_sender(link, h)) is not None:
            return refused
        st = self._state(h.round, create=True)
        if st is None:
            return self._refuse("wire_wrong_round", Action.SKIP)
        if h.kind is Kind.CONTRIBUTION:
            dest = self._admit_contribution(st, h)
        elif h.kind is Kind.RESULT:
            dest = self._admit_result(st, h)
        elif h.kind is Kind.VERDICT:
            dest = self._admit_verdict(h)
        else:
            return self._refuse("wire_bad_kind", Action.DROP)  # DONE belongs to loss-tolerant rounds
        if not isinstance(dest, Action):
            self._bind(link, h.sender)
            self._filling[link] = h.round
        return dest

    def on_payload(self, link: Inbound, h: Header) -> None:
        self._filling.pop(link, None)
        st, k, c = self._state(h.round, create=False), h.sender, h.offset // self.chunk
        if st is None:
            if h.kind is not Kind.VERDICT:
                self.events.rejected("contribution_late" if h.kind is Kind.CONTRIBUTION else "result_late")
            return
        if h.kind is Kind.VERDICT:
            new = Verdict(ok=bool(h.flags), digest=bytes(self._verdict_bytes[k]), code=AbortCode(h.code))
            st.verdicts[k] = st.verdicts[k].then(new) if k in st.verdicts else new
        elif h.kind is Kind.CONTRIBUTION:
            if st is self.current and (self.phase is not Phase.CONTRIBUTE or c < st.reduced):
                self.events.rejected("contribution_late")  # its owner reduced that chunk without it
                return
            start, end = self.chunks[self.group.me][c]
            base = self.bounds[self.group.me][0]
            if not self._decoded(k, h, self.inbox_np[k][start - base : end - base], self.events.rejected):
                st.contrib_gone[k] |= 1 << c
                self._changed()
                return
            st.contrib_have[k] |= 1 << c
            st.weights[k] = h.weight
            if st is self.current and self.fold is not None:
                self.fold(st, k, c)
        else:
            if st is self.current and self.phase is Phase.DECIDE:
                self.events.rejected("result_late")  # this member already gave up on the round
                return
            start, end = self.chunks[k][c]
            parked = st.parked[k] >> c & 1
            if not self._decoded(k, h, (self.backup_np if parked else self.x)[start:end], self.events.rejected):
                st.result_gone[k] |= 1 << c
                st.parked[k] &= ~(1 << c)
                self._changed()
                return
            st.result_have[k] |= 1 << c
            st.result_mask[k][c], st.result_weight[k][c] = h.mask, h.weight
            st.result_sum[k][c] = sum64((self.backup_np if parked else self.x)[start:end])  # just received: in cache
            if parked and st is self.current:
                self._unpark(st, k, c)
        st.bytes_received += HEADER_SIZE + h.length
        self._changed()

    def on_lost(self, link: Inbound) -> None:
        self._filling.pop(link, None)
        k = link.member
        if k is None or self.links.get(k) is not link:
            return
        del self.links[k]
        for st in (self.current, self.next):
            if st is not None:
                st.lost |= 1 << k
        self._changed()

    # ---- admission -----------------------------------------------------------------------------

    def _admit_contribution(self, st: RoundState, h: Header) -> memoryview | Action:
        me, k = self.group.me, h.sender
        if h.shard != me:
            return self._refuse("wire_bad_shard", Action.DROP)
        if not (math.isfinite(h.weight) and h.weight >= 0):
            return self._refuse("wire_bad_weight", Action.DROP)
        c = st.contrib_next[k]
        bad = self._off_grid(me, c, h)
        if bad:
            return self._refuse(bad, Action.DROP)
        st.contrib_next[k] = c + 1
        late = st is self.current and (self.phase is not Phase.CONTRIBUTE or c < st.reduced)
        early = st is self.next and self.phase is Phase.CONTRIBUTE  # its buffer serves the round in progress
        if late or early:
            st.contrib_gone[k] |= 1 << c
            return self._refuse("contribution_late" if late else "wire_early", Action.SKIP)
        base = self.bounds[me][0]
        start, end = self.chunks[me][c]
        return self._destination(k, h, self._inbox_bytes[k][(start - base) * 4 : (end - base) * 4])

    def _admit_result(self, st: RoundState, h: Header) -> memoryview | Action:
        j = h.sender
        if h.shard != j:
            return self._refuse("wire_bad_shard", Action.DROP)
        if not (math.isfinite(h.weight) and h.weight > 0):
            return self._refuse("wire_bad_weight", Action.DROP)
        if not h.mask or h.mask >> self.group.size:
            return self._refuse("wire_bad_mask", Action.DROP)
        c = st.result_next[j]
        bad = self._off_grid(j, c, h)
        if bad:
            return self._refuse(bad, Action.DROP)
        st.result_next[j] = c + 1
        late = st is self.current and self.phase is Phase.DECIDE
        early = st is self.next and self.phase is not Phase.IDLE  # backup serves the round in progress
        if late or early:
            st.result_gone[j] |= 1 << c
            return self._refuse("result_late" if late else "wire_early", Action.SKIP)
        start, end = self.chunks[j][c]
        if st is self.next:
            st.parked[j] |= 1 << c
            return self._destination(j, h, self._backup_bytes[start * 4 : end * 4])
        self.back_up(st, j, c)
        return self._destination(j, h, self.x_bytes[start * 4 : end * 4])

    def _off_grid(self, shard: int, c: int, h: Header) -> str | None:
        """Why chunk c of shard cannot be what h announces, or None if it can."""
        if h.dtype is not self.codec.dtype:
            return "wire_bad_dtype"
        if c >= self.nchunks[shard]:
            return "wire_duplicate"  # more chunks than the shard has: a replay
        start, end = self.chunks[shard][c]
        if h.offset != start - self.bounds[shard][0]:
            return "wire_bad_offset"
        return None if h.count == end - start else "wire_bad_size"

    def _admit_verdict(self, h: Header) -> memoryview | Action:
        if h.dtype is not DType.BYTES or h.count != DIGEST_SIZE or h.flags > 1:
            return self._refuse("wire_bad_verdict", Action.DROP)
        if h.code not in AbortCode._value2member_map_ or (h.flags == 1) != (h.code == AbortCode.NONE):
            return self._refuse("wire_bad_verdict", Action.DROP)
        return self._verdict_bytes[h.sender]

    def _state(self, number: int, *, create: bool) -> RoundState | None:
        if self.current is not None and number == self.current.number:
            return self.current
        if number != self.round + 1:
            return None
        if create and (self.next is None or self.next.number != number):
            self.next = self._new_state(number)
        return self.next if self.next is not None and self.next.number == number else None

    def _new_state(self, number: int) -> RoundState:
        return RoundState.new(number, self.nchunks, self.group.me)

    def _bind(self, link: Inbound, member: int) -> None:
        """A member speaks on one connection: a newer one (it reconnected) replaces the older."""
        if link.member is None:
            old = self.links.get(member)
            link.member, self.links[member] = member, link
            if old is not None and old is not link:
                old.close()  # stops its reads at once, so two connections never fill the same buffer
            for st in (self.current, self.next):
                if st is not None:
                    st.lost &= ~(1 << member)

    def _refuse(self, reason: str, action: Action) -> Action:
        self.events.rejected(reason)
        return action
