"""A deterministic in-process Collective for tests of the scheduling logic: no threads, no sockets.

    fabric = FakeFabric(world=2)
    a, b = fabric.endpoint(0), fabric.endpoint(1)   # one per simulated rank, driven by one thread

Op k completes the moment the last rank issues its op k (all ranks' earlier ops completed before:
each rank issues in order), and computes on every rank's buffer at once. `wait` on an op that not
every rank has issued raises CollectiveError naming the missing ranks: a real group would hang
until its timeout, so a test that drives ranks in the wrong order fails at once instead. Ops whose
kinds or lengths differ between ranks fail, as they would corrupt a real group. After a
reduce-scatter the shards a rank does not own are set to NaN, so reading them early shows.
`kill(rank)` breaks the group as a dead peer would. `log` lists (rank, half, seq, numel) in call order.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch

from peerd.peers.collective.rounds import Half
from peerd.peers.dear.backend import CollectiveBase, CollectiveError, Handle, shard


class FakeFabric:
    """The simulated group; `clock` stamps started/finished (both at completion: ops take no time)."""

    def __init__(self, world: int, clock: Callable[[], float] | None = None):
        self.world = world
        self.clock = clock or itertools.count().__next__
        self.log: list[tuple[int, Half, int, int]] = []
        self.error = ""
        self._ops: dict[int, list[Handle | None]] = {}  # seq -> each rank's handle, None until issued

    def endpoint(self, rank: int) -> FakeCollective:
        return FakeCollective(self, rank)

    def kill(self, rank: int) -> None:
        self._break(f"rank {rank} died")

    def _issue(self, rank: int, handle: Handle) -> None:
        self.log.append((rank, handle.half, handle.seq, handle.flat.numel()))
        if self.error:
            return self._fail(handle)
        slots = self._ops.setdefault(handle.seq, [None] * self.world)
        slots[rank] = handle
        issued = [h for h in slots if h is not None]
        if any(h.half is not handle.half or h.flat.numel() != handle.flat.numel() for h in issued):
            return self._break(f"op #{handle.seq}: ranks issued different ops")
        if len(issued) == self.world:
            del self._ops[handle.seq]
            self._complete(issued)

    def _complete(self, handles: list[Handle]) -> None:
        flats = [h.flat for h in handles]
        if handles[0].half is Half.REDUCE_SCATTER:
            means = [torch.stack([shard(f, self.world, r) for f in flats]).mean(dim=0) for r in range(self.world)]
            for rank, flat in enumerate(flats):
                flat.fill_(math.nan)
                shard(flat, self.world, rank).copy_(means[rank])
        else:
            owned = [shard(f, self.world, r).clone() for r, f in enumerate(flats)]
            for flat in flats:
                for r in range(self.world):
                    shard(flat, self.world, r).copy_(owned[r])
        now = self.clock()
        for h in handles:
            h.started = h.finished = now
            h.done.set()

    def _break(self, reason: str) -> None:
        self.error = self.error or reason
        for slots in self._ops.values():
            for h in slots:
                if h is not None:
                    self._fail(h)
        self._ops.clear()

    def _fail(self, handle: Handle) -> None:
        handle.started = handle.finished = self.clock()
        handle.error = self.error
        handle.done.set()


class FakeCollective(CollectiveBase):
    """One rank's view of a FakeFabric; follows the Collective protocol."""

    timeout = 0.0  # nothing ever waits

    def __init__(self, fabric: FakeFabric, rank: int):
        super().__init__()
        self.fabric, self.rank, self.world = fabric, rank, fabric.world

    def wait(self, handle: Handle) -> None:
        if not handle.done.is_set():
            slots = self.fabric._ops.get(handle.seq, [])
            missing = [r for r, h in enumerate(slots) if h is None]
            raise CollectiveError(f"{handle.half.value} #{handle.seq} would block: ranks {missing} have not issued it")
        if handle.error:
            raise CollectiveError(f"{handle.half.value} #{handle.seq}: {handle.error}")

    def close(self) -> None:
        self._closed = True

    def _issue(self, handle: Handle) -> None:
        self.fabric._issue(self.rank, handle)
