"""The loss-tolerant aggregation rule as pure functions over packets, and the packet grid it runs on.

The grid. Shard j is cut into chunks of `chunk` elements (AllReduceSettings.chunk_elements) and
every chunk into packets of `stride` elements from its start (the transport's packet_elements;
a chunk's last packet may be shorter). Bounds, chunk and stride fix where every packet lies, so a
datagram names its packet by (shard, offset) and a receiver checks that it is one.

The rule (docs/loss-tolerance.md):
* owner side, `masked_mean`: each packet of the owner's result is the weighted mean over the
  members whose packet reached it, its own included: sum_k a_kp w_k v_kp / sum_k a_kp w_k, with the
  set of contributors (mask) and their total weight recorded per packet. A packet holding NaN or
  Inf is left out as if it were lost;
* member side, `keep_missing`: a member holds the owner's packet where it arrived and its own
  pre-round values where it did not.
`simulate_round` composes the two over a whole group: the reference the engine is tested against.

Arithmetic is the engines' one kernel (reduction.py: `fold`, `divide`), on one thread.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from peerd.peers.collective.group import chunk_bounds
from peerd.peers.collective.reduction import all_finite, divide, fold

Part = tuple[int, np.ndarray, float, np.ndarray]  # (member, values, weight, arrived: bool per packet)


class PacketGrid:
    """Where every packet of every shard lies: `first[j][c]` is chunk c's first packet (last entry:
    the shard's packet count), `starts[j]`/`counts[j]` each packet's offset in the shard and size."""

    def __init__(self, bounds: Sequence[tuple[int, int]], chunk: int, stride: int):
        if stride < 1:
            raise ValueError("packets hold at least one element")
        self.bounds, self.chunk, self.stride = tuple(bounds), chunk, stride
        self.first: list[list[int]] = []
        self.starts: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        for s, e in self.bounds:
            first, starts, counts = [0], [], []
            for a, b in chunk_bounds(0, e - s, chunk):
                offsets = np.arange(a, b, stride, dtype=np.int64)
                starts.append(offsets)
                counts.append(np.minimum(offsets + stride, b) - offsets)
                first.append(first[-1] + len(offsets))
            self.first.append(first)
            self.starts.append(np.concatenate(starts))
            self.counts.append(np.concatenate(counts))

    def packets(self, j: int) -> int:
        return self.first[j][-1]

    def chunk_packets(self, j: int, c: int) -> tuple[int, int]:
        return self.first[j][c], self.first[j][c + 1]

    def locate(self, j: int, offset: int, count: int) -> tuple[int, int] | None:
        """(chunk, packet) of the packet of shard j at `offset` holding `count` elements, or None if
        no packet of the grid is that."""
        length = self.bounds[j][1] - self.bounds[j][0]
        if not 0 <= offset < length:
            return None
        c, within = divmod(offset, self.chunk)
        if within % self.stride or count != min(self.stride, min(self.chunk, length - c * self.chunk) - within):
            return None
        return c, self.first[j][c] + within // self.stride


def packet_views(a: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """a as (full packets x stride) and the shorter last packet (possibly empty)."""
    full = len(a) // stride * stride
    return a[:full].reshape(-1, stride), a[full:]


def packets_finite(v: np.ndarray, stride: int) -> np.ndarray:
    """Per packet: all its values are finite."""
    head, tail = packet_views(np.isfinite(v), stride)
    ok = head.all(axis=1)
    return np.append(ok, tail.all()) if len(tail) else ok


def masked_mean(out: np.ndarray, parts: Sequence[Part], stride: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Write into `out` (float32) the per-packet weighted mean of the parts that arrived.

    Returns (mask, total, refused): per packet the contributors (bit k = member k) and their total
    weight; refused counts (member, packet) pairs left out for NaN/Inf. A packet with mask 0 had no
    usable contribution: its values in `out` mean nothing and it must not be sent."""
    refused = 0
    for attempt in range(2):
        mask, total = _accumulate(out, parts, stride)
        finite = all_finite(out)
        if finite or attempt:
            break
        clean = [(k, v, w, a & packets_finite(v, stride)) for k, v, w, a in parts]  # rare: find the culprits
        refused = sum(int(np.count_nonzero(p[3])) - int(np.count_nonzero(q[3])) for p, q in zip(parts, clean))
        parts = clean
    mask[total <= 0] = 0
    if not finite:  # finite parts whose mean overflows float32
        mask[~packets_finite(out, stride)] = 0
    return mask, total, refused


def _accumulate(out: np.ndarray, parts: Sequence[Part], stride: int) -> tuple[np.ndarray, np.ndarray]:
    npk = -(-len(out) // stride)
    mask, total = np.zeros(npk, np.uint64), np.zeros(npk, np.float64)
    out.fill(0.0)
    for k, v, w, arrived in parts:  # packets that did not arrive hold stale values: never read
        for a, b in arrived_runs(arrived, stride, len(out)):
            fold(out[a:b], v[a:b], w)
        total += arrived * w
        mask |= arrived.astype(np.uint64) << np.uint64(k)
    head, tail = packet_views(out, stride)
    by = np.where(total > 0, total, 1.0)  # a packet nobody reached stays zero (its mask says so)
    with np.errstate(all="ignore"):
        divide(head, by[: len(head), None])
        if len(tail):
            divide(tail, by[-1])
    return mask, total


def arrived_runs(arrived: np.ndarray, stride: int, length: int) -> list[tuple[int, int]]:
    """[start, end) in elements of each run of consecutive packets that arrived, of a vector of
    `length` elements cut into packets of `stride`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], arrived.astype(np.int8), [0]))))
    return [(int(a) * stride, min(int(b) * stride, length)) for a, b in zip(edges[::2], edges[1::2])]


def keep_missing(x: np.ndarray, result: np.ndarray, held: np.ndarray, stride: int) -> None:
    """x takes result's packets where `held`; elsewhere it keeps its own values."""
    x_head, x_tail = packet_views(x, stride)
    r_head, r_tail = packet_views(result, stride)
    np.copyto(x_head, r_head, where=held[: len(x_head), None])
    if len(x_tail) and held[-1]:
        x_tail[:] = r_tail


def simulate_round(
    grid: PacketGrid,
    xs: Sequence[np.ndarray],
    weights: Sequence[float],
    contributed: Sequence[Sequence[np.ndarray]],
    received: Sequence[Sequence[np.ndarray]],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One loss-tolerant round of a whole group, in place on xs (one flat vector per member).

    contributed[k][j]: per packet of shard j, whether member k's contribution reached owner j;
    received[m][j]: whether owner j's result packet reached member m (both ignored where k or m is
    j). A packet its owner could not compute (mask 0) reaches nobody. Returns per shard (mask, total)."""
    n, out = len(xs), []
    for j, (s, e) in enumerate(grid.bounds):
        result = np.empty(e - s, np.float32)
        mask, total = np.zeros(grid.packets(j), np.uint64), np.zeros(grid.packets(j))
        for c, (a, b) in enumerate(chunk_bounds(0, e - s, grid.chunk)):
            p0, p1 = grid.chunk_packets(j, c)
            parts = [
                (k, xs[k][s + a : s + b], weights[k], np.ones(p1 - p0, bool) if k == j else contributed[k][j][p0:p1])
                for k in range(n)
            ]
            mask[p0:p1], total[p0:p1], _ = masked_mean(result[a:b], parts, grid.stride)
        for m in range(n):
            held = mask != 0
            if m != j:
                held &= received[m][j]
            for c, (a, b) in enumerate(chunk_bounds(0, e - s, grid.chunk)):
                p0, p1 = grid.chunk_packets(j, c)
                keep_missing(xs[m][s + a : s + b], result[a:b], held[p0:p1], grid.stride)
        out.append((mask, total))
    return out
