"""ARC-Top-K: a top-k compressor whose k indices every member derives alike, so that the k values
travel as one dense vector through an ordinary all-reduce (no indices on the wire, no all-gather).
A run's `averaging.payload = "arctopk"`, with `averaging.density` of the rows.

    V = sketch_matrix(seed)                        # the same on every member (a seed the run shares)
    s = sketch(x, V)                               # rows x r: this member's sketch of P + residual
    ...all-reduce s (mean, float32)...
    rows = select(mean_s, k)                       # the same k rows on every member
    v = gather(x, rows), as VALUES delivers them   # k x ROW values, then the selection check
    ...all-reduce v (mean)...
    scatter(v, rows, x)                            # the mean where it was sent, zeros elsewhere
    split(x_before, rows, VALUES, residual)        # daemon/diloco.py: what this member did not send

After Chen et al., "Communication-Efficient Distributed Learning with All-Reduce Compatible Top-K
Compressor": a vector is cut into rows of ROW values (the last one padded with zeros); a row's
sketch is its product with a random Gaussian matrix V (ROW x RANK) that every member draws from the
same seed; the group averages the sketches, and every member ranks the rows by the squared norm of
the averaged sketch and keeps the k largest. Rows, not single values, are the unit: a row is a
whole number of the codec's blocks (peers/collective/codec.py), so the dense k-vector is encoded
and cut as any other payload. Ties in the ranking go to the lower row, so members that hold the
same averaged sketch derive the same rows (`select`); the sketch always goes through the reliable
engine, whose verdict makes every completer's mean the same bytes (in a loss-tolerant run, over the
round's reliable control links: a PARTIAL mean differs between members, and so would the rows),
and the values' all-reduce (loss-tolerant in such a run) carries a check (`check_values`) that fails
on every member if one selected other rows (arctopk_round.py, the round; this module is numpy only:
the manifest names its payload in daemons that never load torch).

Error feedback (daemon/diloco.py, OuterLoop): what a member did not send, its rows outside the k and
the rounding error of those inside (`split`), stays in its own parameters, which start the next
phase from θ minus it, not in a residual added to the next round's vector. The residual's way
diverged under DiLoCo (docs/benchmarks.md, "ARC-Top-K"): θ does not move at a row left out, so the
next phase, starting again from θ, learned the row's progress again and added it once more, and a
row that waited n rounds went out with n copies of it. Kept in the parameters, it is learned once.

Bytes per value, for `density` d of the rows: the sketch, RANK float32 values per ROW values
(0.016 bytes per value), plus d x VALUES' 1 + 4/64 bytes, plus a block for the check: about
0.016 + 1.06 d bytes per value, against int8's 1.06 and float32's 4.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from peerd.peers.collective.codec import Codec, Format, with_feedback
from peerd.peers.collective.wire import BLOCK

PAYLOAD = "arctopk"  # its name as a run's payload (averaging.payload)
ROW = 1024  # values per row, the unit of selection: 16 codec blocks
RANK = 4  # r: the sketch's values per row
VALUES = Format.INT8  # the rows' format in a run's rounds
DENSITY = 0.5  # a run's averaging.density unless its manifest says otherwise
CHECK = BLOCK  # values of the selection check sent after the rows: one codec block


def rows_of(n: int, row: int = ROW) -> int:
    """Rows of a vector of n values (the last one padded with zeros)."""
    return -(-n // row)


def keep(n: int, density: float, row: int = ROW) -> int:
    """k: the rows a round sends, at least one, at most all."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], not {density!r}")
    return min(rows_of(n, row), max(1, round(density * rows_of(n, row))))


def round_bytes(n: int, density: float) -> int:
    """The bytes of the two vectors a round all-reduces for a vector of n values: the sketch in
    float32 and the k rows in VALUES with the check (peers/collective/wire.payload_size's)."""
    return 4 * rows_of(n) * RANK + Codec(VALUES).size(keep(n, density) * ROW + CHECK)


def sketch_matrix(seed: int, row: int = ROW, rank: int = RANK) -> np.ndarray:
    """V: row x rank standard normal float32 values, the same for the same seed on every member."""
    if row % BLOCK:
        raise ValueError(f"row must be a multiple of the codec's block ({BLOCK}), not {row}")
    return np.random.Generator(np.random.PCG64(seed)).standard_normal((row, rank), dtype=np.float32)


def _padded(x: np.ndarray, row: int) -> np.ndarray:
    rows = rows_of(len(x), row)
    if rows * row == len(x):
        return x.reshape(rows, row)
    out = np.zeros((rows, row), np.float32)
    out.reshape(-1)[: len(x)] = x
    return out


def sketch(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    """This member's sketch of x (float32): each row's product with V, rows x rank."""
    return _padded(x, v.shape[0]) @ v


def select(mean_sketch: np.ndarray, k: int) -> np.ndarray:
    """The k rows whose averaged sketch has the largest squared norm, in increasing order; a tie
    goes to the lower row."""
    norms = np.einsum("ij,ij->i", mean_sketch, mean_sketch)
    order = np.argsort(-norms, kind="stable")  # stable: equal norms keep the lower row first
    return np.sort(order[:k])


def gather(x: np.ndarray, rows: np.ndarray, row: int = ROW) -> np.ndarray:
    """The values of `rows` of x, one dense float32 vector of len(rows) x row values."""
    return _padded(x, row)[rows].reshape(-1).copy()


def scatter(values: np.ndarray, rows: np.ndarray, out: np.ndarray, row: int = ROW) -> None:
    """out := the values at `rows`, zeros elsewhere (out: the vector's n values)."""
    out.fill(0)
    grid = _padded(out, row) if len(out) % row else out.reshape(-1, row)
    grid[rows] = values.reshape(len(rows), row)
    if len(out) % row:
        out[:] = grid.reshape(-1)[: len(out)]


def split(owed: np.ndarray, rows: np.ndarray, fmt: Format | str, residual: np.ndarray, row: int = ROW) -> np.ndarray:
    """Error feedback for one round, after `select`: `owed` is this phase's vector plus the residual
    (float32, what was sketched); returns the values this member sends (gathered at `rows`, as the
    codec delivers them), and writes into `residual` the rest: everything outside `rows`, the
    rounding error inside."""
    values = gather(owed, rows, row)
    lost = np.zeros_like(values)
    with_feedback(values, lost, fmt, Codec(fmt))  # values as delivered; lost: what rounding took
    sent = np.empty_like(owed)
    scatter(values, rows, sent, row)
    np.subtract(owed, sent, out=residual)  # outside rows: owed; inside: owed - delivered
    return values


class Selected(NamedTuple):
    """The rows a round averaged, and the format their values went in (what this member sent of
    them is `split`'s values for that format)."""

    rows: np.ndarray
    fmt: str


def check_values(rows: np.ndarray) -> np.ndarray:
    """CHECK values of ±1, the bits of a digest of `rows`: averaged with the rows' values, they stay
    ±1 only where every member selected the same rows (`agree`)."""
    digest = hashlib.blake2b(np.ascontiguousarray(rows, np.int64).tobytes(), digest_size=CHECK // 8).digest()
    bits = np.unpackbits(np.frombuffer(digest, np.uint8))
    return np.where(bits == 1, np.float32(1), np.float32(-1))


def agree(mean: np.ndarray, mine: np.ndarray) -> bool:
    """Whether the group's mean of the check values is this member's own: a member that selected
    other rows pulls some of them off ±1 by twice its share of the weight (int8 keeps a share of
    1/254 and more)."""
    return bool(np.abs(mean - mine).max() < 1 / 254)
