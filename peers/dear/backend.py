"""What the DeAR scheduler needs from a collective: asynchronous reduce-scatter and all-gather.

    rs = collective.reduce_scatter(flat)   # returns at once; the bytes move in the background
    ag = collective.all_gather(rs)         # returns at once; runs after rs
    collective.wait(ag)                    # flat now holds the mean over ranks, on every rank

The contract every backend keeps (the backends are listed in peers/dear/__init__.py):

* **Buffers.** `flat` is a contiguous 1-D float32 tensor whose length is a multiple of `world`;
  shard r is `flat[r*s:(r+1)*s]` with s = len / world, and rank r owns shard r. The caller passes the
  same buffers step after step (a backend may keep scratch space per size) and touches neither a
  buffer nor its shards from the call until `wait` on its last op returned.
* **Reduce-scatter.** When the op completes, the owner's shard of `flat` holds the *mean* over all
  ranks of their shard of the matching call (equal weights). The other shards hold anything (the
  fake backend fills them with NaN): read them only after an all-gather.
* **All-gather.** `all_gather(rs)` takes a completed-or-pending reduce-scatter handle of this
  backend; when it completes, every shard of `rs.flat` holds its owner's bytes, so the whole buffer
  is identical on every rank.
* **Order.** Ops run in the order they are called, one after another (a FIFO), and every rank must
  issue the same sequence of ops (same kinds, same lengths), from one thread, as with any collective
  library. Nothing else synchronises the ranks.
* **Time.** A backend stamps each handle with `started` and `finished` (time.monotonic seconds: when
  the op began and stopped moving bytes, not when it was queued): the scheduler measures overlap and
  the tuner fits link costs from them.
* **Failure.** An op whose peer died (connection closed) fails at once; one whose peer froze fails
  after the backend's `timeout` (the time one op may take, start to finish). After any failure the
  collective is *broken*: every queued and later op fails with the same reason. `wait` never hangs:
  it returns or raises CollectiveError at most `timeout` after the op ahead of it finished (so at
  most (ops queued ahead + 1) x timeout after the call). A broken group stays broken: the caller
  drops it, and its replicas may differ (some buckets updated, others not) until state is re-synced.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

from peerd.peers.collective.group import shard_bounds
from peerd.peers.collective.rounds import Half


class CollectiveError(RuntimeError):
    """An op failed (a peer died or froze, the backend broke); the collective is unusable after it."""


@dataclass(eq=False, slots=True)
class Handle:
    """One op, queued or done. Written by the backend only; `done` is set once, after the rest.

    The training thread's view of an op, the same for every backend. It is not the engine's own op
    (halves.HalfOp), on purpose: that one resolves an asyncio future on the engine's loop, which a
    thread cannot wait on; engine.py copies its stamps and error here, then sets `done`."""

    half: Half
    flat: torch.Tensor
    seq: int  # position of the op in this collective's sequence, from 0
    started: float = math.nan  # time.monotonic() when the op began moving bytes
    finished: float = math.nan  # time.monotonic() when it completed or failed
    error: str = ""  # why it failed; "" if it succeeded
    timeout: float | None = None  # this op's own limit, where the backend takes one (all_gather); None: `timeout`
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class Collective(Protocol):
    """An ordered stream of asynchronous reduce-scatters and all-gathers within one fixed group."""

    world: int  # ranks in the group
    rank: int  # this process's rank, in [0, world)
    timeout: float  # seconds one op may take before it fails (see the module docstring)

    def reduce_scatter(self, flat: torch.Tensor) -> Handle:
        """Queue a reduce-scatter of `flat` (mean into the owner's shard); never blocks."""
        ...

    def all_gather(self, handle: Handle) -> Handle:
        """Queue the all-gather of a reduce-scatter's result into the same buffer; never blocks."""
        ...

    def wait(self, handle: Handle) -> None:
        """Block until the op completed; raise CollectiveError if it failed or the group broke."""
        ...

    def close(self) -> None:
        """Stop accepting ops (later calls raise CollectiveError); ops already queued run or fail first."""
        ...


class CollectiveBase:
    """What backends share: checking calls against the contract and numbering ops in call order.

    A subclass sets `world`, `rank`, `timeout`, implements `wait` and `close`, and `_issue(handle)`,
    which starts or queues the op and must not block."""

    world: int
    per_op_timeout = False  # the backend honours all_gather(..., timeout=)

    def __init__(self) -> None:
        self._seq = 0
        self._closed = False

    def reduce_scatter(self, flat: torch.Tensor) -> Handle:
        check_buffer(flat, self.world)
        return self._submit(Half.REDUCE_SCATTER, flat)

    def all_gather(self, handle: Handle, timeout: float | None = None) -> Handle:
        """`timeout` (seconds) replaces the collective's for this op, in backends that allow it
        (EngineCollective; gloo's is its process group's and cannot change: ValueError)."""
        if handle.half is not Half.REDUCE_SCATTER:
            raise ValueError("all_gather takes a reduce-scatter handle")
        if timeout is not None and not (self.per_op_timeout and math.isfinite(timeout) and timeout > 0):
            raise ValueError(
                f"{type(self).__name__} takes no per-op timeout {timeout!r} (a positive number, where allowed)"
            )
        return self._submit(Half.ALL_GATHER, handle.flat, timeout)

    def _submit(self, half: Half, flat: torch.Tensor, timeout: float | None = None) -> Handle:
        if self._closed:
            raise CollectiveError("collective is closed")
        handle = Handle(half, flat, self._seq, timeout=timeout)
        self._seq += 1
        self._issue(handle)
        return handle

    def _issue(self, handle: Handle) -> None:
        """Start the op in the background (the backend's one job); CollectiveBase calls it in order."""
        raise NotImplementedError("a backend (gloo.py, engine.py) overrides _issue")


def check_buffer(flat: torch.Tensor, world: int) -> None:
    """What every backend refuses before queueing: the buffer contract above."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"need a contiguous 1-D float32 buffer, got {flat.dtype} of shape {tuple(flat.shape)}")
    if flat.numel() == 0 or flat.numel() % world:
        raise ValueError(f"buffer of {flat.numel()} elements cannot be cut into {world} equal shards")


def shard(flat: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of `flat` (a view): the engine's `shard_bounds`, which cut a buffer of a
    multiple of `world` elements into the equal shards the contract above names."""
    start, end = shard_bounds(flat.numel(), world)[rank]
    return flat[start:end]
