"""The collective of a local group: the training processes attached to one daemon for one run, or
to the daemons of one --local-group label (daemon/attached.py and daemon/groupspan.py form the
group; docs/your-loop.md, "Several processes per machine").

Each process takes its place (peerd.attachment.Slot: epoch, rank, size, the epoch's rendezvous)
from its daemon and builds a torch.distributed Gloo process group of its own over a FileStore (one
daemon) or the group coordinator's TCPStore (several): no `init_process_group`, so that a script's
own torch.distributed, if any, is left alone, and a group can be re-formed (a new epoch) when a
member comes or goes, which a default process group cannot.

With `nccl=True` (peerd.torch.Optimizer's `nccl`), the backend of the step's gradient all-reduce is
chosen per epoch, by every member alike from what each wrote into the epoch's store
(`backend_for`): NCCL on the devices themselves where every member trains on CUDA and no two share
a GPU (NCCL refuses two ranks on one device), Gloo through host memory otherwise. The rest (digests,
broadcasts at a phase's end, DeAR's buckets) stays on Gloo.
"""

from __future__ import annotations

import hashlib
import io
import socket
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from peerd.attachment import Slot

DIGEST_BITS = 62  # a digest and its negation both fit an int64
RENDEZVOUS_POLL = 0.05  # seconds between two looks for an epoch's members
# Seconds Gloo's connection of the members may wait on the store once every member has arrived
# (their addresses go through it, moments apart). A stop of the daemon then removes the store's
# file under them: they waited the whole op timeout (60 s) before they regrouped.
CONNECT_TIMEOUT = 15.0


def device_key(device: torch.device) -> str:
    """What a member writes for `backend_for`: its host and GPU (the device's UUID), or "cpu"."""
    if device.type != "cuda":
        return device.type
    return f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}"


def backend_for(keys: list[str], nccl: bool) -> tuple[str, str]:
    """The gradient all-reduce's backend for members whose `device_key`s are `keys`, and why."""
    if not nccl:
        return "gloo", "NCCL not asked for"
    if any(not k.count("/") for k in keys):
        return "gloo", "not every member trains on CUDA"
    if len(set(keys)) < len(keys):
        return "gloo", "members share a GPU (NCCL takes one rank per device)"
    return "nccl", "every member on a GPU of its own"


class GroupBroke(Exception):
    """A collective of the local group failed (a member exited, stalled past the op timeout, or
    left for a new epoch): regroup."""


class Collective:
    """One epoch of a local group: all-reduce, broadcast and a digest check over Gloo. `rendezvous`
    bounds the wait for the epoch's members to arrive (a member may be inside a long EndPhase),
    `timeout` every collective after that; the wait gives up as soon as `superseded()` (the
    daemon formed a newer epoch: a member of this one left meanwhile; or the daemon stopped)."""

    def __init__(
        self,
        slot: Slot,
        timeout: float,
        rendezvous: float,
        superseded: Callable[[], bool],
        data: bool = False,
        device: torch.device = torch.device("cpu"),
        nccl: bool = False,
    ):
        """`data`: also a second Gloo backend, `self.data`, for DeAR's gradient buckets (its ops run in
        a thread of their own, so they must not share a backend with this one's). `device`: where
        this member's parameters are; `nccl`: NCCL where `backend_for` finds it possible (every member
        asks alike). `self.device`: where `sum_` takes its tensor (CUDA with NCCL, else the CPU)."""
        self.slot = slot
        self.data: dist.ProcessGroupGloo | None = None
        self.store: dist.Store | None = None
        self._nccl: dist.ProcessGroup | None = None
        self.device, self.backend, self.why = torch.device("cpu"), "gloo", ""
        self._timeout = timedelta(seconds=timeout)
        try:
            # Gloo's connection of the members waits on this store with its timeout (5 minutes by
            # default), and nothing else uses it once they are connected: CONNECT_TIMEOUT bounds how
            # long a member gone meanwhile (the daemon stopped and removed the file) holds the others.
            wait = timedelta(seconds=min(timeout, CONNECT_TIMEOUT))
            if slot.store.startswith("tcp://"):  # a group that spans daemons: its coordinator's store
                host, port = slot.store[len("tcp://") :].rsplit(":", 1)
                files = dist.TCPStore(host, int(port), is_master=False, timeout=wait)
            else:
                files = dist.FileStore(slot.store, slot.size)
                files.set_timeout(wait)
            store = self.store = dist.PrefixStore(f"peerd/{slot.epoch}/", files)
            store.set(f"device/{slot.rank}", device_key(device))
            store.set(f"here/{slot.rank}", "1")
            everyone, deadline = [f"here/{r}" for r in range(slot.size)], time.monotonic() + rendezvous
            while not store.check(everyone):
                if superseded():
                    raise GroupBroke(f"epoch {slot.epoch} was superseded before it formed")
                if time.monotonic() > deadline:
                    raise GroupBroke(f"epoch {slot.epoch}: not every member arrived within {rendezvous:.0f} s")
                time.sleep(RENDEZVOUS_POLL)
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=slot.host)]
            options._timeout = timedelta(seconds=timeout)
            self._group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), slot.rank, slot.size, options)
            if data:
                self.data = dist.ProcessGroupGloo(dist.PrefixStore("data/", store), slot.rank, slot.size, options)
            keys = [store.get(f"device/{r}").decode() for r in range(slot.size)]
            self.backend, self.why = backend_for(keys, nccl)
            if self.backend == "nccl":
                if device.index is None:  # "cuda": the process's current device
                    device = torch.device("cuda", torch.cuda.current_device())
                nccl_options = dist.ProcessGroupNCCL.Options()
                nccl_options._timeout = 2 * self._timeout  # sum_ gives up at once and aborts the group
                torch.cuda.set_device(device)
                self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), slot.rank, slot.size, nccl_options)
                self.device = device
        except RuntimeError as e:
            raise GroupBroke(f"epoch {slot.epoch} did not form: {_first_line(e)}") from None

    @property
    def leader(self) -> bool:
        return self.slot.rank == 0

    def sum_(self, tensor: torch.Tensor) -> None:
        """In place: the members' sum (a tensor on `self.device`)."""
        if self._nccl is None:
            self._wait(self._group.allreduce([tensor]))
            return
        try:  # NCCL's wait() only orders the stream: wait(timeout) blocks the CPU and raises when it passes
            self._nccl.allreduce([tensor]).wait(self._timeout)
        except RuntimeError as e:
            self._nccl.abort()  # before its watchdog (at twice the timeout) would end the process
            self._nccl = None
            raise GroupBroke(_first_line(e)) from None

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> None:
        """In place: the values of rank `root` (the leader by default; a CPU tensor)."""
        self._wait(self._group.broadcast(tensor, root))

    def furthest(self, step: int) -> int:
        """The rank of the member whose `step` is the highest (the lowest such rank), in one all-reduce."""
        key = torch.tensor([step * 2**20 + (2**20 - 1 - self.slot.rank)], dtype=torch.int64)
        self._wait(self._group.allreduce([key], _max()))
        return 2**20 - 1 - int(key) % 2**20

    def broadcast_state(self, state: dict | None, root: int = 0) -> dict:
        """Rank `root`'s `state` (any torch.save-able dict) on every member."""
        if self.slot.rank == root:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.broadcast_(size, root)
        if self.slot.rank != root:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.broadcast_(data, root)
        return state if self.slot.rank == root else torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def same(self, tensors: list[torch.Tensor]) -> tuple[bool, int]:
        """Whether every member holds bit-identical `tensors` (a digest of their bytes, compared in one
        all-reduce); and this member's digest."""
        h = hashlib.blake2b(digest_size=8)
        for t in tensors:
            h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
        mine = int.from_bytes(h.digest(), "little") >> (64 - DIGEST_BITS)
        extremes = torch.tensor([mine, -mine], dtype=torch.int64)
        self._wait(self._group.allreduce([extremes], _max()))
        return int(extremes[0]) == -int(extremes[1]), mine

    def signal(self, key: str) -> None:
        """Set `key` in the epoch's store (the leader: the phase's end is ready to broadcast)."""
        try:
            self.store.set(key, "1")
        except RuntimeError as e:
            raise GroupBroke(_first_line(e)) from None

    def await_signal(self, key: str, timeout: float, superseded: Callable[[], bool]) -> None:
        """Until `key` is set (bounded by `timeout`), polling: GroupBroke on the epoch's end."""
        deadline = time.monotonic() + timeout
        try:
            while not self.store.check([key]):
                if superseded():
                    raise GroupBroke(f"epoch {self.slot.epoch} was superseded while waiting for the leader")
                if time.monotonic() > deadline:
                    raise GroupBroke(f"the leader did not end the phase within {timeout:.0f} s")
                time.sleep(RENDEZVOUS_POLL)
        except RuntimeError as e:
            raise GroupBroke(_first_line(e)) from None

    def _wait(self, work) -> None:
        """The op's end; GroupBroke, holding no reference to `work`, where it failed (a traceback
        that held the op would keep this epoch's Gloo connections open: peerd/torch.py regroups)."""
        try:
            work.wait()
            return
        except RuntimeError as e:
            why = _first_line(e)
        del work
        raise GroupBroke(why)

    def close(self) -> None:
        if self._nccl is not None:
            try:
                self._nccl.shutdown()  # frees the communicator now (a broken one's kernels are aborted)
            except RuntimeError:
                pass
        self._group = self.data = self.store = self._nccl = None


def _max():
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    return options


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
