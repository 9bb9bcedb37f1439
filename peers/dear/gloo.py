"""The Collective of collective.py over torch.distributed's gloo backend, for processes on fast links.

    dist.init_process_group("gloo", store=..., rank=r, world_size=n, timeout=timedelta(seconds=T))
    collective = GlooCollective(timeout=T)    # T: the same timeout the process group was given
    ...
    collective.close()                        # before dist.destroy_process_group()

or over a Gloo backend built without the default group (a local group of peerd.torch processes,
peerd/local_group.py): `GlooCollective(timeout=T, backend=dist.ProcessGroupGloo(store, r, n, options))`.

Reduce-scatter is `all_to_all_single` plus a local sum: gloo's own `reduce_scatter` runs a full
all-reduce underneath, so it moves twice the bytes (measured on this machine, 32 MiB over two
processes: 43 ms against 11-14 ms for the all-to-all). All-gather is `all_gather_single` with the
owner's shard as input, written in place into the buffer.

One named thread per collective runs the ops in call order, each to completion (gloo's async work
handles still need a thread to do the local sum and to start the next op after it; a FIFO thread
keeps the order identical on every rank without a second process group). The thread blocks inside
gloo; gloo fails an op after the process group's timeout (a frozen peer) or at once when a peer's
connection closes (a dead one), and then this collective is broken (collective.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from peerd.peers.collective.rounds import Half
from peerd.peers.dear.backend import CollectiveBase, CollectiveError, Handle, shard

logger = logging.getLogger(__name__)

STALL_GRACE = 5.0  # seconds beyond `timeout` before wait() stops trusting gloo to honour its own timeout
JOIN_TIMEOUT = 5.0  # seconds close() waits for the thread to finish the queued ops and stop


class GlooCollective(CollectiveBase):
    """Collective over a gloo process group (the default one unless `group` is given).

    `timeout` must be the process group's own timeout: it is what `wait` bounds each op by.
    `backend`: a ProcessGroupGloo of its own (not registered with torch.distributed), used
    through its own methods.
    `min_seconds` is a seam for benchmarks that emulate a slower link: an op of b bytes lasts at
    least min_seconds(b), the thread sleeping the rest (off the CPU, as a wire would be)."""

    def __init__(
        self,
        *,
        timeout: float,
        group: dist.ProcessGroup | None = None,
        backend: dist.ProcessGroupGloo | None = None,
        min_seconds: Callable[[int], float] | None = None,
    ):
        super().__init__()
        self.group, self.backend, self.timeout, self.min_seconds = group, backend, timeout, min_seconds
        self.world = backend.size() if backend is not None else dist.get_world_size(group)
        self.rank = backend.rank() if backend is not None else dist.get_rank(group)
        self._scratch = torch.empty(0)  # all-to-all output; one op at a time, so one buffer
        self._queue: queue.SimpleQueue[Handle | None] = queue.SimpleQueue()
        self._error = ""  # set once, by the thread or by wait(); the collective is broken after it
        self._progress = time.monotonic()  # when the thread last started or finished an op
        self._thread = threading.Thread(target=self._serve, name=f"dear-gloo-{self.rank}", daemon=True)
        self._thread.start()

    def wait(self, handle: Handle) -> None:
        while not handle.done.wait(self.timeout):
            if time.monotonic() - self._progress > self.timeout + STALL_GRACE:
                self._error = self._error or f"gloo made no progress for {self.timeout + STALL_GRACE:.0f} s"
                raise CollectiveError(f"{handle.half.value} #{handle.seq}: {self._error}")
        if handle.error:
            raise CollectiveError(f"{handle.half.value} #{handle.seq}: {handle.error}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(JOIN_TIMEOUT)
        if self._thread.is_alive():  # stuck inside gloo: it is a daemon thread, the process can still exit
            logger.warning("%s did not stop within %.0f s", self._thread.name, JOIN_TIMEOUT)

    def _issue(self, handle: Handle) -> None:
        self._queue.put(handle)

    def _serve(self) -> None:
        while (handle := self._queue.get()) is not None:
            self._progress = handle.started = time.monotonic()
            if not self._error:
                try:
                    self._run(handle)
                    if self.min_seconds is not None:
                        time.sleep(max(0.0, handle.started + self.min_seconds(handle.nbytes) - time.monotonic()))
                except RuntimeError as e:  # gloo: timeout, connection closed, aborted group
                    self._error = f"{handle.half.value} #{handle.seq} failed: {type(e).__name__}: {e}"
                    logger.warning("rank %d: %s", self.rank, self._error)
            self._progress = handle.finished = time.monotonic()
            handle.error = self._error
            handle.done.set()

    def _run(self, handle: Handle) -> None:
        flat, world = handle.flat, self.world
        mine = shard(flat, world, self.rank)
        if handle.half is Half.ALL_GATHER:
            if self.backend is not None:
                self.backend._allgather_base(flat, mine.clone()).wait()  # the input may not alias the output
            else:
                dist.all_gather_single(flat, mine, group=self.group)
            return
        if self._scratch.numel() < flat.numel():
            self._scratch = torch.empty(flat.numel())  # grows to the largest bucket once, then reused
        received = self._scratch[: flat.numel()]
        if self.backend is not None:  # row j: rank j's slice of my shard
            self.backend.alltoall_base(received, flat, [], []).wait()
        else:
            dist.all_to_all_single(received, flat, group=self.group)
        torch.sum(received.view(world, -1), dim=0, out=mine)
        mine.div_(world)
