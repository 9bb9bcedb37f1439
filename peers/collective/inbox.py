"""The receiving side of every engine: the one class that admits what arrives (`Inbox`), its
preallocated buffers, and the checks every incoming header passes before its payload may touch them.

What is admitted, and what it settles, is the engine's admission rule, plugged into the Inbox:
* `chunks.ChunkRule` (GroupAllReduce, over reliable streams): shards travel in chunks on a fixed
  grid (`AllReduceSettings.chunk_elements`), in order on each connection; verdicts end the round;
* `packets.PacketRule` (LossyAllReduce, over datagrams): packets of the packet grid, each at most
  once and in any order; nothing waits for a missing one, and DONE messages say what was sent;
* `halves.Halves` (DeAR's reduce-scatter and all-gather, over reliable streams): the messages of a
  FIFO of ops of any length, each op's slices in order per sender, the next op's parked; a message
  that does not fit its op breaks the engine. Its ops have no fixed length, so its inbox has no
  fixed buffers (`numel=None`): the rule keeps a receive buffer per sender.
The Inbox holds what they share: the sender checks, the one connection each member speaks on, the
count of what is refused, the payloads of a stream still arriving, the members lost; and, for the
all-reduce rounds (`RoundRule`), the buffers, the round in progress and the next one, the codec's
staging, the backup of x, and the wait (`until`) that wakes the round only when what it waits for
may have changed.

Buffers of an all-reduce round (allocated once per engine, or lent by a `BufferPool` to one engine
after another; reused every round):
* the caller's tensor `x`: owners' RESULT chunks land straight in it, and this member reduces its
  own shard in place, so COMPLETE costs nothing;
* `backup`: each chunk of `x` is copied here just before it is first overwritten (one chunk at a
  time), and copied back if the round aborts. A round opened with `restore=False` backs up only
  this member's own shard (its own contribution, read again while reducing): the caller holds the
  tensor's old value elsewhere and puts it back itself, which saves copying the other
  (size - 1) / size of the tensor every round. A rule whose rounds may end PARTIAL
  (`partial_results`: a missing packet keeps the old value) backs up every chunk it overwrites;
* `inbox[k]`: member k's contribution to this member's shard;
* with a compressed payload (`AllReduceSettings.payload`, codec.py): `wire`, the encoded vector
  (contributions and this member's results are encoded there once and sent from there), and one
  staging buffer per member, where a payload lands and is checked before it is decoded into
  `inbox[k]` or `x` (a payload that fails is refused: `codec_bad_size`, `codec_bad_scale`).

Rounds: messages of the round in progress are accepted while its phase still wants them; messages
of the next round (number + 1) that arrive early are kept as the rule allows; every message of a
past or a later round is refused ("wire_wrong_round") and its payload skipped. When a round ends,
or another opens, stream payloads of a different round still arriving are thrown away rather than
written into a tensor the caller owns again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from peerd.peers.collective.codec import Codec, Format
from peerd.peers.collective.group import Group, chunk_bounds, shard_bounds
from peerd.peers.collective.rounds import Phase, bits
from peerd.peers.collective.transport import Action, Inbound
from peerd.peers.collective.wire import BLOCK, Header, WireError
from peerd.peers.events import PeerEvents


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class Gathered(NamedTuple):
    """Where the all-gather stands for this member."""

    complete: bool  # every part of every shard's result is here
    over: bool  # nothing more is worth waiting for: complete, or what is missing can no longer come


class RoundBook(Protocol):
    """What the Inbox itself reads of a rule's per-round state (rounds.RoundState, packets.PacketRound)."""

    number: int
    backed: list[int]  # per shard: chunks of x copied to backup (restored if the round aborts)
    lost: int  # members whose connection closed, or whom this member could not reach


class AdmissionRule(Protocol):
    """What arrives, and what it settles: the part of receiving that differs between engines
    (chunks.ChunkRule, packets.PacketRule, halves.Halves). Made by the Inbox (`rule(inbox)`);
    called on the event loop."""

    def admit(self, link: Inbound, h: Header) -> memoryview | Action:
        """The Sink's on_header: where h's payload goes, or why it is refused (counted)."""

    def arrived(self, link: Inbound, h: Header) -> None:
        """The Sink's on_payload: h's payload is where `admit` put it."""

    def lost(self, member: int) -> None:
        """The connection `member` spoke on closed (the Inbox has marked the rounds it was in)."""


class RoundRule(AdmissionRule, Protocol):
    """The rule of an all-reduce round, which the Inbox opens and closes (`open`, `close`)."""

    partial_results: bool  # rounds may end holding part of the result: every overwritten chunk is backed up

    def new_state(self, number: int) -> RoundBook:
        """The bookkeeping of round `number`, before anything arrived."""

    def opened(self, st: RoundBook) -> None:
        """Round st is now the one in progress and x the caller's tensor: move in what waited for it."""

    def ready(self, st: RoundBook, c: int) -> bool:
        """Chunk c of this member's shard has every contribution it will get."""

    def gathered(self, st: RoundBook) -> Gathered:
        """How far the all-gather got."""


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
        longest = max(e - s for align in (1, BLOCK) for s, e in shard_bounds(numel, size, align))
        return cls(
            key=(numel, size, chunk),
            # Not zeroed: pages no round writes stay unmapped, so that rounds opened with
            # restore=False hold only this member's own shard of it (and results parked early).
            backup=torch.empty(numel, dtype=torch.float32),
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
    """The transport's sink for one group, whatever the transport; `rule` (a class taking the
    inbox: chunks.ChunkRule, functools.partial(packets.PacketRule, stride=...), or a function
    returning halves.Halves) decides what is admitted. With `numel` None the inbox has no buffers
    and no rounds of its own: the rule keeps them (Halves). Runs on the event loop; an all-reduce
    round waits on it with `until`."""

    def __init__(
        self,
        group: Group,
        numel: int | None,
        chunk: int,
        events: PeerEvents,
        rule: Callable[["Inbox"], AdmissionRule],
        buffers: InboxBuffers | None = None,
        payload: Format | str = Format.FP32,
    ):
        self.group, self.numel, self.chunk, self.events = group, numel, chunk, events
        self.phase = Phase.IDLE
        self.round = 0  # the round in progress, or the last one run
        self.current: RoundBook | None = None
        self.next: RoundBook | None = None  # early arrivals for round + 1
        self.links: dict[int, Inbound] = {}  # the one connection each member currently speaks on
        self._filling: dict[Inbound, int] = {}  # stream connections receiving a payload, and its round
        self.fold: Callable[[RoundBook, int, int], None] | None = None  # called as contributions arrive
        self._done: Callable[[], bool] | None = None  # what the round waits for
        self._ready: asyncio.Future | None = None
        self.keep_results = True  # back up chunks of other shards before results overwrite them
        if numel is not None:
            self._lay_out(numel, chunk, buffers, payload)
        self.rule = rule(self)

    def _lay_out(self, numel: int, chunk: int, buffers: InboxBuffers | None, payload: Format | str) -> None:
        """The shards, chunks and buffers of an all-reduce round over `numel` elements."""
        group = self.group
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
        self.backup_np, self.backup_bytes = self.backup.numpy(), as_bytes(self.backup)
        self.inbox_np = {k: t.numpy() for k, t in self.inbox.items()}
        self.swap = self.buffers.swap
        self.x: np.ndarray | None = None  # the caller's tensor, while a round runs
        self.x_bytes: memoryview | None = None  # x's bytes, while a round runs
        self.inbox_bytes = {k: as_bytes(t) for k, t in self.inbox.items()}
        if self.coded:
            self.wire, staging = self.buffers.wire(self.codec)
            self._staging = {k: memoryview(b) for k, b in zip(others, staging)}

    def open(self, number: int, x: torch.Tensor, restore: bool = True) -> RoundBook:
        """Start round `number` on the caller's flat tensor x. restore=False: back up only this
        member's own shard (see the module docstring), unless the rule's rounds may end PARTIAL."""
        self._discard(lambda n: n != number)  # e.g. parked for a round the caller skipped: not into backup
        nxt = self.next
        st = nxt if nxt is not None and nxt.number == number else self.rule.new_state(number)
        self.current, self.next, self.round, self.phase = st, None, number, Phase.CONTRIBUTE
        self.x, self.x_bytes = x.numpy(), as_bytes(x)
        self.keep_results = restore or self.rule.partial_results
        self.rule.opened(st)
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

    def destination(self, k: int, h: Header, values: memoryview) -> memoryview:
        """Where member k's payload lands: straight in `values` (float32), or staged to be decoded."""
        return self._staging[k][: h.length] if self.coded else values

    def decoded(self, k: int, h: Header, out: np.ndarray, rejected: Callable[[str], None]) -> bool:
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

    def changed(self) -> None:
        """Something the round may wait for arrived: wake it if what it waits for now holds."""
        if self._ready is not None and not self._ready.done() and self._done():
            self._ready.set_result(None)

    def back_up(self, st: RoundBook, j: int, c: int) -> None:
        """Save chunk c of shard j of x before it is overwritten (once per round; another member's
        shard only if the round restores it)."""
        if not st.backed[j] >> c & 1 and (self.keep_results or j == self.group.me):
            start, end = self.chunks[j][c]
            np.copyto(self.backup_np[start:end], self.x[start:end])
            st.backed[j] |= 1 << c

    def restore(self, st: RoundBook) -> None:
        """Put back every chunk of x this round backed up: with `keep_results`, x is as it was
        before the round; without, other shards' chunks may hold the round's results."""
        for j, backed in enumerate(st.backed):
            for c in bits(backed):
                start, end = self.chunks[j][c]
                np.copyto(self.x[start:end], self.backup_np[start:end])
        st.backed = [0] * len(st.backed)

    # ---- the Sink interface --------------------------------------------------------------------

    def refuse_sender(self, link: Inbound, h: Header) -> Action | None:
        """DROP (counted) for a header of another run, from outside the group, or from a member other
        than the one this link already speaks for; None if the sender is acceptable."""
        g = self.group
        if h.run_tag != g.tag:
            return self.refuse("wire_wrong_run", Action.DROP)
        if h.sender >= g.size or h.sender == g.me:
            return self.refuse("wire_not_in_group", Action.DROP)
        if link.member is not None and link.member != h.sender:
            return self.refuse("wire_sender_mismatch", Action.DROP)
        return None

    def on_header(self, link: Inbound, h: Header) -> memoryview | Action:
        dest = self.rule.admit(link, h)
        if not isinstance(dest, Action) and not getattr(link, "datagram", False):
            self._filling[link] = h.round  # a stream payload may still be arriving when its round ends
        return dest

    def on_payload(self, link: Inbound, h: Header) -> None:
        self._filling.pop(link, None)
        self.rule.arrived(link, h)

    def on_lost(self, link: Inbound) -> None:
        self._filling.pop(link, None)
        k = link.member
        if k is None or self.links.get(k) is not link:
            return
        del self.links[k]
        for st in (self.current, self.next):
            if st is not None:
                st.lost |= 1 << k
        self.changed()
        self.rule.lost(k)

    def state(self, number: int, *, create: bool) -> RoundBook | None:
        """Round `number`'s state if it is the one in progress or the next (made if `create`);
        None if a message of it must be refused."""
        if self.current is not None and number == self.current.number:
            return self.current
        if number != self.round + 1:
            return None
        if create and (self.next is None or self.next.number != number):
            self.next = self.rule.new_state(number)
        return self.next if self.next is not None and self.next.number == number else None

    def bind(self, link: Inbound, member: int) -> None:
        """A member speaks on one connection: a newer one (it reconnected) replaces the older."""
        if link.member is None:
            old = self.links.get(member)
            link.member, self.links[member] = member, link
            if old is not None and old is not link:
                old.close()  # stops its reads at once, so two connections never fill the same buffer
            for st in (self.current, self.next):
                if st is not None:
                    st.lost &= ~(1 << member)

    def refuse(self, reason: str, action: Action) -> Action:
        """Count a refused stream message (`PeerEvents.rejected`); returns what to do with it."""
        self.events.rejected(reason)
        return action
