"""ARC-Top-K: a top-k compressor whose k indices every member derives alike, so that the k values
travel as one dense vector through an ordinary all-reduce (no indices on the wire, no all-gather).

    V = sketch_matrix(seed, ROW, r)                # the same on every member (a seed the run shares)
    owed = owe(x, residual, decay)                 # this phase's vector and what earlier rounds kept
    s = sketch(owed, V)                            # rows x r: this member's sketch
    ...all-reduce s (mean)...
    rows = select(mean_s, k)                       # the same k rows on every member
    v = split(owed, rows, "int8", residual)        # k x ROW values as the codec delivers them
    ...all-reduce v (mean)...
    scatter(v, rows, out)                          # the mean where it was sent, zeros elsewhere

After Chen et al., "Communication-Efficient Distributed Learning with All-Reduce Compatible Top-K
Compressor": a vector is cut into rows of `row` values (the last one padded with zeros); a row's
sketch is its product with a random Gaussian matrix V (row x r) that every member draws from the
same seed; the group averages the sketches, and every member ranks the rows by the squared norm of
the averaged sketch and keeps the k largest. Rows, not single values, are the unit: a row is a
whole number of the codec's blocks (peers/collective/codec.py), so the dense k-vector is encoded,
cut into packets and lost by blocks as any other payload. Ties in the ranking go to the lower row,
so members that hold the same averaged sketch derive the same rows (`select`; the engines give
every member the same bytes of a mean).

Error feedback is the residual's (codec.with_feedback's, as the dense payloads use it): what a member
did not send, its rows outside the k and the quantization error of those inside, stays in its
residual (`split`) and is added to the next round's vector times `decay`, β (`owe`: SparseLoCo's
decayed error feedback). β = 1, the whole residual, diverges under DiLoCo (docs/benchmarks.md): θ
does not move at a row left out, so each next phase, starting again from θ, learns the row's
progress again and adds it to the residual once more, and a row that waits n rounds goes out with
n copies of it. β < 1 keeps at most 1 / (1 - β) copies: in bench.diloco_sim β = 0.5 with outer
momentum 0 trains at every density tried (0.01 to 0.5), though behind dense int8, and β = 0.95
(SparseLoCo's) still overshoots at 0.05 and 0.1. The paper's EF21M (momentum error feedback) is not
used (nor tried).

Bytes per value, for `density` d of the rows: the sketch, r values per row, plus d of the values,
each in the format its all-reduce uses. bench.diloco_sim (the one caller yet) averages the sketch as
fp32 (4 r / row bytes per value) and the rows in `--values` format: with row 1024, r 4 and int8 rows
(1 + 4/64 bytes a value), about 0.016 + d x 1.06 bytes; at d = 0.01, 0.026 bytes per value, 150x
fewer than float32's 4 (an int8 sketch would make it 0.004 + d x 1.06: 270x at d = 0.01).
"""

from __future__ import annotations

import numpy as np

from peerd.peers.collective.codec import Codec, Format, with_feedback
from peerd.peers.collective.wire import BLOCK

ROW = 1024  # values per row, the unit of selection: 16 codec blocks
RANK = 4  # r: the sketch's values per row


def rows_of(n: int, row: int = ROW) -> int:
    """Rows of a vector of n values (the last one padded with zeros)."""
    return -(-n // row)


def keep(n: int, density: float, row: int = ROW) -> int:
    """k: the rows a round sends, at least one, at most all."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], not {density!r}")
    return min(rows_of(n, row), max(1, round(density * rows_of(n, row))))


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


def owe(x: np.ndarray, residual: np.ndarray, decay: float = 1.0) -> np.ndarray:
    """What a member sketches and sends from: this phase's vector plus `decay` (SparseLoCo's β) times
    its residual. Below 1, progress a row kept for n rounds counts β^n, so a row that waits is not
    sent with every phase's re-learned copy of the same progress; 1: the whole residual."""
    if not 0 <= decay <= 1:
        raise ValueError(f"decay must be in [0, 1], not {decay!r}")
    return x + np.float32(decay) * residual


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
