"""Parameter sketches: how far apart the run's peers' parameters are, without sending them.

Just before each averaging round a trainer takes a *sketch* of its parameter vector (P entries):
its values at m coordinates, one drawn at random inside each of m equal strata of [0, P), from a
seed derived from the run ID, so every peer of the run samples the same coordinates. When P <= m
the sketch holds every entry and the estimate below is exact. Peers publish their latest sketch with
the step it was taken at in their membership record (peers/records.py), and each daemon estimates
the largest distance between two peers from the sketches taken at the same step.

The estimate of ||x_i - x_j||^2 is sum_k n_k (s_i[k] - s_j[k])^2, n_k the size of stratum k
(about P / m): unbiased for any vector. Its error depends on how the difference spreads over the
coordinates. Spread evenly (as SGD drift over every weight is), the distance's relative error has
sd about sqrt(1 / (2m)): 3.1 % at m = 512. Carried by a fraction f of the coordinates, only the
strata there count, and the sd grows to about sqrt(1 / (2fm)) (f = 0.1: about 10 %); a
difference in a few coordinates that no stratum's pick hits (one bias vector drifting alone) is
missed. (A random projection has no such blind spot but costs a pass over all P entries; this
costs O(m): about 0.1 ms for P = 10^8.) The largest of several noisy estimates leans high by about their
error. tests/test_sketch.py measures both cases; docs/algorithms.md, "Divergence".
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

SKETCH_SIZE = 512  # coordinates a trainer samples: 2 KiB of float32 in its record
MAX_SKETCH_VALUES = 1024  # the most a record may carry (room for a later, larger SKETCH_SIZE)
# Own sketches a daemon keeps (its latest rounds'): a peer's latest published sketch is often of a
# round this daemon has already passed (rounds can be faster than heartbeats), and is compared
# with this daemon's sketch of that round.
HISTORY = 16


@dataclass(frozen=True, slots=True)
class ParamSketch:
    step: int  # the global step it was taken at: just before that step's averaging round
    size: int  # P, entries of the sender's parameter vector
    values: tuple[float, ...]  # min(P, m) sampled values, in stratum order


@dataclass(frozen=True, slots=True)
class Divergence:
    value: float  # the largest estimated pairwise L2 distance
    step: int  # the step every compared sketch was taken at
    peers: int  # how many sketches were compared (this daemon's included when comparable)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 over uint64: the same bits on every platform and library version."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def strata(size: int, m: int) -> np.ndarray:
    """Bounds of the min(size, m) strata of [0, size): stratum k is [b[k], b[k + 1])."""
    n = min(size, m)
    return np.arange(n + 1, dtype=np.int64) * size // n


@dataclass(frozen=True, slots=True)
class SketchPlan:
    """Which coordinates a run's sketches hold: the same on every peer of the run."""

    size: int
    indices: np.ndarray  # int64, one per stratum, increasing

    @classmethod
    def for_run(cls, run_id: str, size: int, m: int = SKETCH_SIZE) -> SketchPlan:
        if size <= 0 or m <= 0:
            raise ValueError(f"a sketch needs a non-empty vector and m > 0, not P={size}, m={m}")
        seed = int.from_bytes(hashlib.blake2b(f"peerd-sketch\x00{run_id}".encode(), digest_size=8).digest(), "little")
        bounds = strata(size, m)
        widths = np.diff(bounds)
        with np.errstate(over="ignore"):
            draws = _mix(np.arange(len(widths), dtype=np.uint64) ^ np.uint64(seed))
        return cls(size, bounds[:-1] + (draws % widths.astype(np.uint64)).astype(np.int64))

    def take(self, params: np.ndarray, step: int) -> ParamSketch:
        """The sketch of `params` (1-D, `size` entries) at `step`: O(m)."""
        if params.shape != (self.size,):
            raise ValueError(f"expected {self.size} parameters, got shape {params.shape}")
        return ParamSketch(step, self.size, tuple(params[self.indices].astype(np.float32).tolist()))


def _squared_distances(row: np.ndarray, rows: np.ndarray, size: int) -> np.ndarray:
    """The estimator: sum_k n_k (s_row[k] - s[k])^2 for each of `rows`, n_k the size of stratum k."""
    weights = np.diff(strata(size, row.shape[-1])).astype(np.float64)
    return (rows - row) ** 2 @ weights


def estimate(a: ParamSketch, b: ParamSketch) -> float:
    """Estimated ||x_a - x_b|| from two sketches of the same plan (exact when P <= m)."""
    if a.size != b.size or len(a.values) != len(b.values):
        raise ValueError("sketches of different plans are not comparable")
    x = np.asarray([a.values, b.values], dtype=np.float64)
    return math.sqrt(float(_squared_distances(x[0], x[1:], a.size)[0]))


def divergence(sketches: Iterable[ParamSketch]) -> Divergence | None:
    """The largest estimated pairwise distance among sketches taken at the same step, the newest
    step that at least two comparable sketches (same P and m) share; None when no step has two.
    The caller passes at most one sketch per peer and step: each peer's latest, and its own of
    the latest rounds.

    Only sketches of one step are compared: peers drift between rounds, so a distance between
    states of different steps would mostly measure training progress."""
    groups: dict[tuple[int, int, int], list[ParamSketch]] = {}
    for s in sketches:
        groups.setdefault((s.step, s.size, len(s.values)), []).append(s)
    comparable = [(key, group) for key, group in groups.items() if len(group) >= 2]
    if not comparable:
        return None
    (step, size, _), group = max(comparable, key=lambda kv: (kv[0][0], len(kv[1])))
    x = np.asarray([s.values for s in group], dtype=np.float64)
    # One row against the rows after it at a time: O(n^2 m) flops in n numpy calls.
    largest = max(float(_squared_distances(x[i], x[i + 1 :], size).max()) for i in range(len(group) - 1))
    return Divergence(math.sqrt(largest), step, len(group))
