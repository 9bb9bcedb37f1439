"""How much of a step's communication was hidden behind compute, measured from timestamps.

For one training step: `comm_seconds` is the length of the union of its ops' [started, finished]
intervals, as the backend stamped them (collective.py); `exposed_seconds` is the time the training
thread spent blocked in `Collective.wait` on those ops. What the training thread did not wait for
ran while it computed, so

    overlap_ratio = (comm_seconds - exposed_seconds) / comm_seconds      (clamped to [0, 1])

1.0: every byte moved behind compute; 0.0: the training thread waited for all of it (a plain
all-reduce after backward). On a machine whose cores also run the communication (loopback, no
offloading NIC), hidden communication still takes CPU from compute: the ratio says what the
schedule hid, not that it was free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from peerd.peers.dear.backend import Handle


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int  # the scheduler's step counter when the step's backward ran (from 0)
    buckets: int  # buckets communicated
    bytes: int  # bytes of the buckets (each counted once, though reduce-scatter and all-gather both move them)
    comm_seconds: float  # union of the step's op intervals
    exposed_seconds: float  # training thread blocked on them

    @property
    def overlap_ratio(self) -> float:
        if self.comm_seconds <= 0:
            return 0.0
        return min(1.0, max(0.0, (self.comm_seconds - self.exposed_seconds) / self.comm_seconds))

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "buckets": self.buckets,
            "bytes": self.bytes,
            "comm_seconds": round(self.comm_seconds, 6),
            "exposed_seconds": round(self.exposed_seconds, 6),
            "overlap_ratio": round(self.overlap_ratio, 4),
        }


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once); non-finite ones are skipped."""
    total, end = 0.0, -math.inf
    for lo, hi in sorted((lo, hi) for lo, hi in intervals if math.isfinite(lo) and math.isfinite(hi)):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


class StepLedger:
    """What one step communicated and how long the training thread waited for it."""

    def __init__(self, step: int):
        self.step = step
        self.handles: list[Handle] = []
        self.exposed = 0.0
        self.buckets = 0
        self.bytes = 0

    def stats(self) -> StepStats:
        comm = union_seconds((h.started, h.finished) for h in self.handles)
        return StepStats(self.step, self.buckets, self.bytes, comm, min(self.exposed, comm))
