"""ARC-Top-K's pure parts: the shared sketch matrix, the rows every member derives alike, gather and
scatter over a padded last row, and error feedback that loses nothing over rounds."""

from __future__ import annotations

import numpy as np
import pytest

from peerd.peers.collective import arctopk
from peerd.peers.collective.arctopk import gather, keep, owe, scatter, select, sketch, sketch_matrix, split

ROW = 128  # two codec blocks: small vectors in these tests


def test_the_sketch_matrix_is_the_seeds_and_rows_are_whole_blocks():
    a, b = sketch_matrix(7, ROW, 4), sketch_matrix(7, ROW, 4)
    assert a.shape == (ROW, 4) and a.dtype == np.float32 and np.array_equal(a, b)
    assert not np.array_equal(a, sketch_matrix(8, ROW, 4))
    with pytest.raises(ValueError, match="multiple of the codec's block"):
        sketch_matrix(7, 100, 4)


def test_select_ranks_rows_by_the_squared_norm_and_a_tie_goes_to_the_lower_row():
    s = np.array([[1, 0], [0, 3], [2, 2], [0, -3], [0.5, 0.5]], np.float32)  # norms 1, 9, 8, 9, 0.5
    assert select(s, 1).tolist() == [1]  # 9 at rows 1 and 3: the lower
    assert select(s, 2).tolist() == [1, 3]
    assert select(s, 3).tolist() == [1, 2, 3]
    assert keep(10 * ROW, 0.2, ROW) == 2 and keep(10 * ROW, 0.001, ROW) == 1 and keep(ROW + 1, 1.0, ROW) == 2
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            keep(ROW, bad, ROW)


def test_members_derive_the_rows_that_hold_the_groups_energy():
    """Three members whose vectors are noise plus a shared signal in rows 2 and 5 (of 8, the last
    row padded): the averaged sketch ranks those two first on every member, though no member's own
    vector alone need rank them so."""
    rng = np.random.default_rng(0)
    n = 7 * ROW + 40
    v = sketch_matrix(3, ROW, 4)
    owed = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    for x in owed:
        x[2 * ROW : 3 * ROW] += 2.0
        x[5 * ROW : 6 * ROW] -= 2.0
    sketches = [sketch(x, v) for x in owed]
    assert sketches[0].shape == (8, 4)
    mean = np.mean(sketches, axis=0)
    assert select(mean, 2).tolist() == [2, 5]


def test_gather_and_scatter_keep_the_vectors_layout_over_a_padded_last_row():
    n = 3 * ROW + 5
    x = np.arange(n, dtype=np.float32)
    rows = np.array([0, 3])
    values = gather(x, rows, ROW)
    assert len(values) == 2 * ROW and values[ROW] == 3 * ROW and values[ROW + 4] == n - 1
    assert np.all(values[ROW + 5 :] == 0)  # the padding
    out = np.full(n, 7.0, np.float32)
    scatter(values, rows, out, ROW)
    assert np.array_equal(out[:ROW], x[:ROW]) and np.array_equal(out[3 * ROW :], x[3 * ROW :])
    assert np.all(out[ROW : 3 * ROW] == 0)
    out = np.full(4 * ROW, 7.0, np.float32)  # no padding
    scatter(gather(np.arange(4 * ROW, dtype=np.float32), np.array([1]), ROW), np.array([1]), out, ROW)
    assert out[ROW] == ROW and out.sum() == sum(range(ROW, 2 * ROW))


def test_split_sends_the_rows_as_the_codec_delivers_them_and_keeps_the_rest():
    rng = np.random.default_rng(1)
    owed = rng.standard_normal(4 * ROW).astype(np.float32)
    residual = np.full(4 * ROW, 99.0, np.float32)
    rows = np.array([1, 2])
    values = split(owed, rows, "fp32", residual, ROW)
    assert np.array_equal(values, owed[ROW : 3 * ROW])
    assert np.array_equal(residual[:ROW], owed[:ROW]) and np.all(residual[ROW : 3 * ROW] == 0)
    values = split(owed, rows, "int8", residual, ROW)
    inside = residual[ROW : 3 * ROW]
    assert np.array_equal(values + inside, owed[ROW : 3 * ROW])  # what rounding took stays
    assert 0 < np.abs(inside).max() <= np.abs(owed[ROW : 3 * ROW]).max() / 127  # at most a quantum
    assert np.array_equal(residual[3 * ROW :], owed[3 * ROW :])


def test_error_feedback_over_200_rounds_delivers_what_every_member_owed():
    """Three members, each with a constant vector, at density 1/4: over the rounds every row takes
    its turn, and what was delivered (the rows' means) is the sum of the inputs' mean less what the
    residuals still hold, within float32 rounding; the residuals stay bounded."""
    rng = np.random.default_rng(2)
    n, members, rounds = 4 * ROW, 3, 200
    xs = [(rng.standard_normal(n) * (1 + 3 * (np.arange(n) < ROW))).astype(np.float32) for _ in range(members)]
    residuals = [np.zeros(n, np.float32) for _ in range(members)]
    v = sketch_matrix(5, ROW, arctopk.RANK)
    delivered = np.zeros(n)
    chosen = set()
    for _ in range(rounds):
        owed = [x + r for x, r in zip(xs, residuals, strict=True)]
        rows = select(np.mean([sketch(o, v) for o in owed], axis=0), keep(n, 0.25, ROW))
        chosen.update(rows.tolist())
        sent = [split(o, rows, "int8", r, ROW) for o, r in zip(owed, residuals, strict=True)]
        mean = np.zeros(n, np.float32)
        scatter(np.mean(sent, axis=0), rows, mean, ROW)
        delivered += mean
    total = rounds * np.mean(xs, axis=0) - np.mean(residuals, axis=0)
    assert chosen == {0, 1, 2, 3}  # not only the large row
    assert np.abs(delivered - total).max() < 1e-5 * rounds  # measured: 1.3e-4 (float32 sums)
    assert max(np.abs(r).max() for r in residuals) < 5 * max(np.abs(x).max() for x in xs)  # measured: 1.2


def test_decay_1_is_the_residual_whole_and_below_1_a_waiting_rows_residual_stays_bounded():
    """decay 1 owes x + residual bit for bit (the error feedback before decay existed); below 1 a row
    never sent, whose phases each add the same c (the progress θ never took), holds
    c (1 - β^n) / (1 - β) after n rounds, at most c / (1 - β), where decay 1 holds n c."""
    rng = np.random.default_rng(3)
    x, residual = (rng.standard_normal(3 * ROW).astype(np.float32) for _ in range(2))
    assert np.array_equal(owe(x, residual), x + residual) and np.array_equal(owe(x, residual, 1.0), x + residual)
    assert np.array_equal(owe(x, residual, 0.0), x)
    kept = residual.copy()
    split(owe(np.zeros_like(x), residual, 0.5), np.array([0]), "fp32", residual, ROW)
    assert np.array_equal(residual[ROW:], np.float32(0.5) * kept[ROW:])  # a round with nothing new halves what waits
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="decay"):
            owe(x, residual, bad)
    c = np.full(3 * ROW, 0.01, np.float32)
    rows = np.array([0])  # rows 1 and 2 wait every round
    for decay, rounds in ((1.0, 50), (0.9, 50), (0.5, 50)):
        residual = np.zeros(3 * ROW, np.float32)
        for _ in range(rounds):
            sent = split(owe(c, residual, decay), rows, "fp32", residual, ROW)
            assert np.array_equal(sent, c[:ROW])  # row 0 is sent whole every round: nothing of it waits
        waiting = residual[ROW:]
        expected = rounds * 0.01 if decay == 1 else 0.01 * (1 - decay**rounds) / (1 - decay)
        assert np.allclose(waiting, expected, rtol=1e-4), (decay, waiting[0], expected)
        assert np.all(residual[:ROW] == 0)
