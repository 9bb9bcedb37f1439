"""Reduce-scatter and all-gather as separate primitives: the two halves of the group all-reduce, for
schedules that run them apart (DeAR: peers/dear/engine.py).

    halves = Halves(group, transport, settings=HalvesSettings(op_timeout=30.0), events=...)
    rs = halves.reduce_scatter(x)      # returns at once; ops run one after another, in call order
    ag = halves.all_gather(x)          # queued behind rs
    await ag                           # -> ag; ag.error == "" if it succeeded
    await halves.close()

Member i owns shard i of x (`shard_bounds`: sizes differ by at most one). Messages are the engine's
(wire.py: CONTRIBUTION, RESULT; `round` = the op's number in the sequence), in chunks of at most
`chunk_elements`, received without a copy where they belong. They come in through the engine's one
admission class, `inbox.Inbox` (the sender checks, the one connection each member speaks on, the
count of what is refused), with Halves as its rule (`admit`, `arrived`, `lost`):
* **reduce-scatter**: every member sends slice j of x to owner j; when the op completes, this
  member's shard of x holds sum_k(w_k x_k) / sum_k(w_k) over every member's slice (w_k = 1 unless
  given: the mean). Other shards are untouched. Contributions land in a receive buffer per sender
  and are added into the shard as they arrive (reduction.fold); the result is checked once for NaN/Inf.
* **all-gather**: every owner sends its shard of x to every member, received straight into x; when
  the op completes, x holds every owner's shard: the same bytes on every member that completed it.

**Order.** Ops run one at a time in call order (a FIFO), and every member must issue the same
sequence (kinds and lengths). An op needs a message from every other member, so no member can
finish op n before every member started it: messages of op n + 1 that arrive before it runs here
are parked (in the receive buffers; results copied into x when the op starts), those of any other
op refused ("wire_wrong_round").

**Time.** Every deadline is the event loop's (`asyncio.timeout`), and the stamps and the pace read
`clock` (time.monotonic: uvloop's own clock counts whole milliseconds, too coarse for ops of one).
A test runs Halves on a loop with virtual time (bench/vclock.py) and passes `clock=loop.time`: every
timeout is then decided, and measured, without waiting for it. An op starts when the one ahead of
it finished (`started`), and ends (`finished`) once every message it needs arrived and its own
sends were handed to the kernel (so the caller may reuse x at once), or when it fails: at the
latest `op_timeout` after it started. So an op queued behind q others ends at most
(q + 1) x op_timeout after the call.

**Failure** is a value: the op's `error` says why, nothing raises. A member whose connection closes
fails the op at once (every op needs it); a frozen one, at `op_timeout`; a message that does not
fit the op (another kind, shard, size or offset: the members issued different ops) at once, and is
counted by `PeerEvents.rejected` (wire_* reasons); a reduced shard holding NaN/Inf fails the
reduce-scatter ("contribution_nonfinite"; the all-reduce leaves such a contribution out instead,
which would break exactness here); an exception in the engine's own code fails the op with its name
and message (logged), rather than leave the op unresolved until the caller's watchdog gives up
(EngineCollective: "the engine's loop did nothing"). After a failure the engine is **broken**:
every queued and later op fails with the same reason, and all its connections are closed, so the
other members' ops fail at once too instead of at their timeout.

**What all-or-nothing means here.** GroupAllReduce ends each round with a verdict and a digest,
and restores the tensor on abort. A half has neither: it completes when *this member's* part is
done (its shard reduced, or every shard received), which says nothing about the others. After a
failure, members may disagree on how far the sequence got, and x is not restored (a failed
reduce-scatter may leave a partial sum in the shard, a failed all-gather some shards received).
The caller treats any failure as the end of the group and re-syncs state (DeAR does: the replicas
may differ by the buckets updated before the failure). Members that completed an all-gather hold
the same bytes, as every shard comes from one owner.

Not covered, as in allreduce.py: authentication beyond the transport's (linkauth in secret runs),
re-owning a dead member's shard, and reconnecting (a link that closes ends the group).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from peerd.peers.collective.allreduce import drain_links, open_links
from peerd.peers.collective.group import Group, shard_bounds
from peerd.peers.collective.inbox import Inbox, as_bytes
from peerd.peers.collective.reduction import all_finite, divide, fold
from peerd.peers.collective.rounds import Half
from peerd.peers.collective.transport import Action, Inbound, Link, Transport
from peerd.peers.collective.wire import DType, Header, Kind
from peerd.peers.events import PeerEvents

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class HalvesSettings:
    op_timeout: float = 30.0  # one op, from its start (the op ahead finished) to its end: dialing (first
    #                          op), sending, receiving, draining; a frozen member fails an op after this
    connect_timeout: float = 2.0  # dialing every member, at the first op (inside op_timeout)
    chunk_elements: int = 512 * 1024  # elements per message (2 MiB); every member must use the same value
    max_parked: int = 1 << 28  # elements per sender parked before their op is issued here (1 GiB)

    def __post_init__(self):
        for name in ("op_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if self.chunk_elements < 1 or self.max_parked < 1:
            raise ValueError("chunk_elements and max_parked must be at least 1")


_WIRE = {Half.REDUCE_SCATTER: Kind.CONTRIBUTION, Half.ALL_GATHER: Kind.RESULT}


@dataclass(eq=False, slots=True)
class HalfOp:
    """One queued op; `await op` returns it once it ended. Written by the engine only."""

    half: Half
    number: int  # position in this engine's sequence, from 0 (the header's round)
    x: torch.Tensor
    weight: float
    bounds: tuple[tuple[int, int], ...]  # of each member's shard of x: shard_bounds(len(x), size)
    done: asyncio.Future = field(repr=False)
    started: float = math.nan  # Halves.clock() when it began moving bytes
    finished: float = math.nan  # ... when it completed or failed
    error: str = ""  # why it failed; "" if it succeeded
    timeout: float = math.nan  # this op's own limit (seconds); NaN: the settings' op_timeout

    def __await__(self):
        return self.done.__await__()


@dataclass(slots=True)
class _Slot:
    """What arrived for one op (the one running, or the next): per sender, elements in order."""

    number: int
    kind: Kind | None = None  # of the messages received: every sender must agree, and with the op
    got: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    weight: dict[int, float] = field(default_factory=dict)  # reduce-scatter: each sender's weight
    size: dict[int, int] | None = None  # elements expected from each sender, once the op runs here
    missing: int = 0  # elements still expected, once the op runs here
    parking: dict[int, bool] = field(default_factory=dict)  # sender -> its payload in flight goes to its buffer


class Halves:
    """Reduce-scatters and all-gathers of float32 vectors within one group, over one transport (it
    delivers to this engine only). Calls must be made on the event loop; see the module docstring."""

    def __init__(
        self,
        group: Group,
        transport: Transport,
        *,
        settings: HalvesSettings | None = None,
        events: PeerEvents | None = None,
        pace: Callable[[int], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.group, self.transport = group, transport
        self.settings = settings or HalvesSettings()
        self.events = events or PeerEvents()
        self.pace = pace  # benchmarks emulating a slower link: an op of b bytes lasts at least pace(b) s
        self.clock = clock  # of the ops' stamps and the pace (the module docstring)
        self.error = ""  # set once: the engine is broken after it
        self.others = [k for k in range(group.size) if k != group.me]
        self.links: dict[int, Link | None] = {k: None for k in self.others}  # dialed, to send on
        self._lost: set[int] = set()  # members whose connection closed
        self._queue: collections.deque[HalfOp] = collections.deque()
        self._issued = 0
        self._runner: asyncio.Task | None = None
        self._closing = False
        self._slots = [_Slot(0), _Slot(1)]  # ops n and n + 1, at index n % 2
        self._buffers = [{k: np.empty(0, np.float32) for k in self.others} for _ in range(2)]
        self._running: HalfOp | None = None
        self._wake: asyncio.Future | None = None  # set when the running op has all it needs, or failed
        # Ops have no fixed length: the inbox keeps no buffers, the receive buffers above are the rule's.
        self.inbox = Inbox(group, None, self.settings.chunk_elements, self.events, lambda inbox: self)
        transport.attach(self.inbox)

    # ---- the API ---------------------------------------------------------------------------------

    def reduce_scatter(self, x: torch.Tensor, weight: float = 1.0) -> HalfOp:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, not {weight!r}")
        return self._submit(Half.REDUCE_SCATTER, x, weight)

    def all_gather(self, x: torch.Tensor, timeout: float | None = None) -> HalfOp:
        """`timeout` replaces op_timeout for this op: for an all-gather that waits on purpose for a
        member busy elsewhere first (peers/dear/hierarchy.py: an owner's WAN round)."""
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        op = self._submit(Half.ALL_GATHER, x, 1.0)
        op.timeout = math.nan if timeout is None else timeout
        return op

    async def close(self) -> None:
        """Refuse new ops, let the queued ones run (or fail), then close this engine's links. The
        transport stays open (its owner closes it)."""
        self._closing = True
        if self._runner is not None:
            await self._runner
        self._close_links()  # nothing is queued on them: every op that ended well drained its sends

    # ---- the queue -------------------------------------------------------------------------------

    def _submit(self, half: Half, x: torch.Tensor, weight: float) -> HalfOp:
        if self._closing:
            raise RuntimeError("this engine is closed")
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or not x.is_contiguous():
            raise ValueError("x must be a contiguous 1-D float32 CPU tensor")
        if x.numel() < self.group.size:
            raise ValueError(f"cannot shard {x.numel()} elements among {self.group.size} members")
        loop = asyncio.get_running_loop()
        op = HalfOp(half, self._issued, x, weight, shard_bounds(x.numel(), self.group.size), loop.create_future())
        self._issued += 1
        self._queue.append(op)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._serve())
        return op

    async def _serve(self) -> None:
        while self._queue:
            op = self._queue[0]
            op.started = self.clock()
            if not self.error:
                limit = self.settings.op_timeout if math.isnan(op.timeout) else op.timeout
                try:
                    await self._connect()  # bounded by connect_timeout, not by the op's limit
                    if not self.error:
                        async with asyncio.timeout(limit):
                            await self._run(op)
                except TimeoutError:
                    waiting = [k for k, n in self._waiting_for().items() if n]
                    self._break(f"timed out after {limit:g} s waiting for members {waiting}")
                except Exception as e:  # a bug: fail the op (and so the group) rather than leave it unresolved
                    logger.exception("%s #%d raised", op.half.value, op.number)
                    self._break(f"{type(e).__name__}: {e}")
            self._end(op)
            self._queue.popleft()

    async def _connect(self) -> None:
        """Open the links to the members, once (a first op on a loaded machine took longer to
        connect than a short op limit allows, and failed with every contribution in)."""
        if any(link is None for link in self.links.values()):
            s = self.settings
            unreachable = await open_links(self.transport, self.group.addresses, self.links, s.connect_timeout)
            if unreachable:
                return self._break(f"members {unreachable} cannot be reached")
            for k, link in self.links.items():
                link.on_close(functools.partial(self._on_link_closed, k, link))

    async def _run(self, op: HalfOp) -> None:
        closed = [k for k, link in self.links.items() if link.closed]
        if closed:
            return self._break(f"the connections to members {closed} closed")
        self._open(op)
        self._send(op)
        self._unpark(op)
        if self._slots[op.number % 2].missing and not self.error:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        if self.error:
            return
        if op.half is Half.REDUCE_SCATTER:
            self._finish_shard(op)
        # Until its sends are out, the op's payloads point into x. A link that closed meanwhile dropped
        # them: its member is gone, which the next op finds out.
        await drain_links(list(self.links.values()), self.settings.op_timeout)
        if self.pace is not None:
            await asyncio.sleep(op.started + self.pace(op.x.numel() * 4) - self.clock())

    def _end(self, op: HalfOp) -> None:
        """Stamp and resolve the op; its slot now serves op n + 2."""
        op.error, op.finished = self.error, self.clock()
        if self._running is op:
            self._running, self._wake = None, None
            self._slots[op.number % 2] = _Slot(op.number + 2)
        op.done.set_result(op)

    def _break(self, reason: str) -> None:
        """Fail the running op and every later one; close every connection, so the others notice at once."""
        if self.error:
            return
        op = self._running or (self._queue[0] if self._queue else None)
        self.error = f"{op.half.value} #{op.number}: {reason}" if op is not None else reason
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        self._close_links()

    def _close_links(self) -> None:
        for link in [*self.links.values(), *self.inbox.links.values()]:
            if link is not None:
                link.close()

    # ---- one op ----------------------------------------------------------------------------------

    def _open(self, op: HalfOp) -> None:
        """Make op the running one, and check what was parked for it."""
        slot, kind = self._slots[op.number % 2], _WIRE[op.half]
        bounds, me = op.bounds, self.group.me
        if op.half is Half.REDUCE_SCATTER:
            slot.size = {k: bounds[me][1] - bounds[me][0] for k in self.others}
        else:
            slot.size = {k: bounds[k][1] - bounds[k][0] for k in self.others}
        slot.missing = sum(slot.size.values()) - sum(slot.got.values())
        self._running = op
        if slot.kind not in (None, kind):
            return self._break(f"members sent {slot.kind.name} messages: they issued different ops")
        slot.kind = kind
        chunk = self.settings.chunk_elements
        over = [k for k, n in slot.got.items() if n > slot.size[k] or (n < slot.size[k] and n % chunk)]
        gone = [k for k in self._lost if slot.got[k] < slot.size[k]]
        if over:
            return self._break(f"members {over} sent more or less than their share: they issued ops of other lengths")
        if gone:
            self._break(f"the connections of members {gone} closed")

    def _unpark(self, op: HalfOp) -> None:
        """Fold in (reduce-scatter) or copy into x (all-gather) what arrived before op started here.
        After the sends: the members waiting for them need not wait for this."""
        if self.error:
            return
        slot, buffers = self._slots[op.number % 2], self._buffers[op.number % 2]
        x = op.x.numpy()
        if op.half is Half.REDUCE_SCATTER:
            start, end = op.bounds[self.group.me]
            if op.weight != 1.0:
                x[start:end] *= np.float32(op.weight)
            for k, n in slot.got.items():
                self._fold(op, slot, k, 0, n)
        else:
            for k, n in slot.got.items():
                start = op.bounds[k][0]
                np.copyto(x[start : start + n], buffers[k][:n])

    def _send(self, op: HalfOp) -> None:
        if self.error:
            return
        g, chunk, xb, kind = self.group, self.settings.chunk_elements, as_bytes(op.x), _WIRE[op.half]
        for k, link in self.links.items():
            shard = k if op.half is Half.REDUCE_SCATTER else g.me
            base, end = op.bounds[shard]
            for start in range(base, end, chunk):
                count = min(chunk, end - start)
                h = Header(
                    kind=kind,
                    run_tag=g.tag,
                    round=op.number,
                    sender=g.me,
                    shard=shard,
                    offset=start - base,
                    count=count,
                    weight=op.weight,
                )
                link.send(h, xb[start * 4 : (start + count) * 4])

    def _fold(self, op: HalfOp, slot: _Slot, k: int, start: int, end: int) -> None:
        """Add sender k's elements [start, end) of my shard (from its receive buffer) into x."""
        base = op.bounds[self.group.me][0]
        fold(op.x.numpy()[base + start : base + end], self._buffers[op.number % 2][k][start:end], slot.weight[k])

    def _finish_shard(self, op: HalfOp) -> None:
        """Divide my reduced shard by the total weight; refuse a result with NaN/Inf."""
        slot = self._slots[op.number % 2]
        total = op.weight + sum(slot.weight.values())
        start, end = op.bounds[self.group.me]
        out = op.x.numpy()[start:end]
        if total > 0:
            divide(out, total)
        if not (total > 0 and all_finite(out)):
            self.events.rejected("contribution_nonfinite")
            self._break("the reduced shard holds NaN or Inf (or every weight was 0)")

    def _waiting_for(self) -> dict[int, int]:
        """Elements the running op still expects, per member."""
        op = self._running
        if op is None:
            return {}
        slot = self._slots[op.number % 2]
        return {k: slot.size[k] - slot.got[k] for k in self.others} if slot.size else {}

    @staticmethod
    def _grow(buffers: dict[int, np.ndarray], k: int, n: int) -> None:
        """Sender k's receive buffer holds at least n elements (its content kept); grows, never shrinks."""
        old = buffers[k]
        if len(old) < n:
            new = np.empty(max(n, 2 * len(old)), np.float32)
            new[: len(old)] = old
            buffers[k] = new

    # ---- the admission rule (inbox.AdmissionRule) ---------------------------------------------

    def admit(self, link: Inbound, h: Header) -> memoryview | Action:
        if self.error:
            return Action.DROP  # broken: every connection is being closed
        if (refused := self.inbox.refuse_sender(link, h)) is not None:
            return refused
        k = h.sender
        self.inbox.bind(link, k)
        slot = self._slots[h.round % 2]
        if slot.number != h.round:
            return self.inbox.refuse("wire_wrong_round", Action.SKIP)
        bad = self._misfit(slot, h)
        if bad:
            self._break(f"member {k} sent a message that does not fit the op ({bad})")
            return self._refuse(bad)
        slot.kind = h.kind
        if h.kind is Kind.CONTRIBUTION:
            slot.weight[k] = h.weight
        op = self._running
        slot.parking[k] = op is None or op.number != h.round
        if h.kind is Kind.RESULT and not slot.parking[k]:  # straight into x
            start = op.bounds[k][0] + h.offset
            return as_bytes(op.x)[start * 4 : (start + h.count) * 4]
        # Grown only here: no payload of sender k is in flight between its headers.
        buffers, end = self._buffers[h.round % 2], h.offset + h.count
        self._grow(buffers, k, end)
        return memoryview(buffers[k][h.offset : end]).cast("B")

    def _misfit(self, slot: _Slot, h: Header) -> str:
        """Why h cannot be the next message of sender h.sender for this slot's op; "" if it can."""
        k = h.sender
        if h.kind not in (Kind.CONTRIBUTION, Kind.RESULT) or slot.kind not in (None, h.kind):
            return "wire_bad_kind"
        if h.shard != (self.group.me if h.kind is Kind.CONTRIBUTION else k):
            return "wire_bad_shard"
        if h.offset != slot.got[k]:
            return "wire_bad_offset"
        chunk = self.settings.chunk_elements
        if slot.size is None:  # parked: its op's length is not known here yet (checked when it starts)
            fits = 0 < h.count <= chunk and h.offset + h.count <= self.settings.max_parked
        else:  # chunks are full but the last of each slice
            fits = h.count == min(chunk, slot.size[k] - h.offset) > 0
        if h.dtype is not DType.FLOAT32:
            return "wire_bad_dtype"
        if not fits:
            return "wire_bad_size"
        if h.kind is Kind.CONTRIBUTION and not (
            math.isfinite(h.weight) and h.weight >= 0 and slot.weight.get(k, h.weight) == h.weight
        ):
            return "wire_bad_weight"
        return ""

    def arrived(self, link: Inbound, h: Header) -> None:
        slot, k = self._slots[h.round % 2], h.sender
        if slot.number != h.round or self.error:
            return
        slot.got[k] += h.count
        op = self._running
        if op is None or op.number != h.round:
            return  # parked: folded or copied when the op starts here
        start, end = h.offset, h.offset + h.count
        if h.kind is Kind.CONTRIBUTION:
            self._fold(op, slot, k, start, end)
        elif slot.parking[k]:  # its header came just before the op started here
            base = op.bounds[k][0]
            np.copyto(op.x.numpy()[base + start : base + end], self._buffers[h.round % 2][k][start:end])
        slot.missing -= h.count
        if not slot.missing and self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def lost(self, k: int) -> None:
        self._lost.add(k)
        if self._waiting_for().get(k):
            self._break(f"the connection of member {k} closed")

    def _on_link_closed(self, k: int, link: Link) -> None:
        """The link this member dialed to k closed (k closed it, or it broke): as on_lost, k is gone."""
        if self.links.get(k) is not link:
            return
        self._lost.add(k)
        if self._waiting_for().get(k):
            self._break(f"the connection to member {k} closed")

    def _refuse(self, reason: str) -> Action:
        return self.inbox.refuse(reason, Action.DROP)
