"""Moshpit groups: the shape rule, coordinates, group keys, and averaging over simulated rounds.

Deterministic and fast: fixed seeds, no network. Averaging uses the benchmark's kernel
(bench.moshpit_sim), so the figures in docs/algorithms.md rest on tested code.
"""

import bisect
import itertools
import math

import numpy as np
import pytest

from bench.moshpit_sim import average_in_groups, moshpit_grouping, peer_ids, random_grouping, rounds_to_target
from peerd.peers.moshpit import (
    GridShape,
    grid_shape,
    group_key,
    group_members,
    hash_coords,
    slot_coords,
    view_coords,
)

RUN = "test-run"


def relative_errors(shape: GridShape, rounds: int, fail_rate: float, seed: int, *, grouping=None) -> list[float]:
    """Mean squared distance to the true mean after each round, relative to the initial one."""
    ids = peer_ids(shape.slots)
    grouping = grouping or moshpit_grouping(view_coords(ids, shape, run_id=RUN, epoch=seed), shape)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(ids), 4))
    mean = x.mean(axis=0)
    initial = np.mean(np.sum((x - mean) ** 2, axis=1))
    errors = []
    for t in range(rounds):
        live = rng.random(len(ids)) >= fail_rate
        x = average_in_groups(x, grouping(t, live, rng), live)
        errors.append(float(np.mean(np.sum((x - mean) ** 2, axis=1)) / initial))
    return errors


# ---- averaging ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sides", [(3, 3, 3), (4, 4), (2, 2, 2, 2, 2), (32, 32), (11, 3), (25, 20, 10)])
def test_full_grid_gives_the_exact_mean_in_d_rounds(sides):
    shape = GridShape(sides)
    errors = relative_errors(shape, shape.d, fail_rate=0.0, seed=1)
    assert errors[-1] < 1e-28  # float64 rounding only
    if shape.d > 1:
        assert errors[-2] > 1e-4  # and not a round earlier: the last dimension still mattered


@pytest.mark.parametrize("fail_rate", [0.05, 0.1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_failures_the_error_keeps_shrinking(fail_rate, seed):
    shape = grid_shape(256)  # 16x16
    errors = relative_errors(shape, 12, fail_rate, seed)
    # Averaging in groups never moves values away from the mean, whoever takes part.
    assert all(b <= a * (1 + 1e-9) for a, b in zip(errors, errors[1:]))
    # Measured with these seeds: at most 8.0e-4, 7.2e-7 and 1.1e-9; the thresholds leave 10x or more.
    assert errors[3] < 1e-2 and errors[7] < 1e-5 and errors[11] < 1e-7


def test_the_failure_check_catches_a_grid_that_does_not_rotate():
    """The thresholds above fail for a grouping that never leaves dimension 0 (it stalls near 0.07)."""
    shape = grid_shape(256)
    frozen = moshpit_grouping(view_coords(peer_ids(256), shape, run_id=RUN, epoch=0), shape)
    errors = relative_errors(shape, 12, 0.05, 0, grouping=lambda t, live, rng: frozen(0, live, rng))
    assert errors[3] > 1e-2


def test_average_in_groups_keeps_the_sum_and_leaves_absent_peers_alone():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((10, 3))
    labels = np.array([0, 0, 1, 1, 1, 2, 2, 5, 5, 5])
    live = np.array([1, 1, 1, 0, 1, 1, 1, 1, 0, 0], dtype=bool)
    out = average_in_groups(x, labels, live)
    np.testing.assert_allclose(out.sum(axis=0), x.sum(axis=0))
    np.testing.assert_array_equal(out[~live], x[~live])
    np.testing.assert_allclose(out[2], (x[2] + x[4]) / 2)
    np.testing.assert_array_equal(out[7], x[7])  # the only live member of its group


def test_paper_setting_reaches_1e9_in_two_rounds_and_random_groups_do_not():
    assert grid_shape(1024) == GridShape((32, 32))
    moshpit = moshpit_grouping(view_coords(peer_ids(1024), grid_shape(1024), run_id=RUN, epoch=0), grid_shape(1024))
    assert rounds_to_target(moshpit, 1024, 0.0, seed=0, target=1e-9, max_rounds=50) == 2
    assert rounds_to_target(random_grouping(32), 1024, 0.0, seed=0, target=1e-9, max_rounds=50) > 4


# ---- the shape rule -------------------------------------------------------------------------------


def _products(d: int, g: int) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """Every product of d sides in [2, g], sorted, and for each the most even sides (brute force)."""
    best: dict[int, tuple[int, ...]] = {}
    for sides in itertools.combinations_with_replacement(range(g, 1, -1), d):
        p = math.prod(sides)
        best[p] = min(best.get(p, sides), sides)
    return sorted(best), best


@pytest.mark.parametrize("g", [2, 3, 4, 8, 32])
def test_grid_shape_rule_for_every_n(g):
    tables = {}
    for n in range(1, 5001):
        shape = grid_shape(n, g)
        assert max(shape.sides) <= g, (n, shape)  # no group exceeds the bound
        assert shape.slots >= n
        if n <= g:
            assert shape.sides == (n,)
            continue
        assert g ** (shape.d - 1) < n <= g**shape.d  # d is minimal: d - 1 sides of g hold fewer
        if shape.d not in tables:
            tables[shape.d] = _products(shape.d, g)
        products, best = tables[shape.d]
        assert shape.slots == products[bisect.bisect_left(products, n)]  # the fewest empty slots
        assert shape.sides == best[shape.slots]  # the most even sides among those


@pytest.mark.parametrize(
    "n, sides, says",
    [
        (1, (1,), "alone"),
        (2, (2,), "exact"),
        (31, (31,), "exact"),  # a prime that fits one group
        (32, (32,), "exact"),
        (33, (11, 3), "exact"),  # just above one group: two rounds, still exact
        (37, (19, 2), "1 empty"),  # a prime above the bound: one empty slot
        (1000, (32, 32), "24 empty"),  # no two sides <= 32 multiply to 1000..1023
        (1024, (32, 32), "exact"),  # the paper's grid
        (1025, (19, 9, 6), "1 empty"),  # just above 32^2: a third dimension
        (1331, (11, 11, 11), "exact"),
        (32769, (23, 19, 15, 5), "6 empty"),
    ],
)
def test_grid_shape_edge_cases(n, sides, says):
    shape = grid_shape(n)
    assert shape.sides == sides
    assert says in shape.reason and str(n) in shape.reason


def test_grid_shape_rejects_impossible_inputs():
    with pytest.raises(ValueError):
        grid_shape(0)
    with pytest.raises(ValueError):
        grid_shape(10, max_group_size=1)
    for sides in [(), (0,), (2, 3)]:  # no dimension, an empty side, not largest first
        with pytest.raises(ValueError):
            GridShape(sides)


# ---- coordinates ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sides", [(5,), (4, 4), (6, 4), (19, 9, 6), (3, 3, 2, 2)])
def test_slot_coords_is_a_bijection(sides):
    shape = GridShape(sides)
    coords = [slot_coords(i, shape) for i in range(shape.slots)]
    assert set(coords) == set(itertools.product(*(range(m) for m in sides)))
    with pytest.raises(ValueError):
        slot_coords(shape.slots, shape)


@pytest.mark.parametrize("n", [1000, 1001, 1023, 993, 1025, 37, 97, 5000, 2039])
def test_empty_slots_leave_each_group_at_most_one_short(n):
    shape = grid_shape(n)
    assert shape.slots - n <= min(shape.sides)  # the condition under which the skew spreads them
    coords = view_coords(peer_ids(n), shape, run_id=RUN, epoch=0)
    for t in range(shape.d):
        sizes = {len(m) for m in group_members(RUN, t, coords, shape).values()}
        assert sizes <= {shape.sides[t], shape.sides[t] - 1}, (t, sizes)


def test_view_coords_are_deterministic_distinct_and_order_free():
    shape = grid_shape(100)
    ids = peer_ids(100)
    a = view_coords(ids, shape, run_id=RUN, epoch=3)
    assert a == view_coords(list(reversed(ids)) + ids[:5], shape, run_id=RUN, epoch=3)
    assert len(set(a.values())) == 100
    assert a != view_coords(ids, shape, run_id=RUN, epoch=4)  # a new epoch reshuffles neighbours
    with pytest.raises(ValueError):
        view_coords(peer_ids(101), shape, run_id=RUN, epoch=3)


def test_a_view_missing_one_peer_moves_only_the_peers_ordered_after_it():
    """The cost of view-based coordinates: views that differ disagree about part of the grid."""
    shape = grid_shape(100)
    ids = peer_ids(100)
    full = view_coords(ids, shape, run_id=RUN, epoch=0)
    order = list(full)  # in slot order
    missing = order[60]
    partial = view_coords([p for p in ids if p != missing], shape, run_id=RUN, epoch=0)
    assert all(partial[p] == full[p] for p in order[:60])
    assert sum(partial[p] != full[p] for p in order[61:]) == 39


def test_hash_coords_agree_across_different_views():
    shape = grid_shape(1024)
    ids = peer_ids(1024)
    view_a, view_b = ids[:700], ids[300:]  # two peers that know different parts of the run
    seen_by_a = {p: hash_coords(p, shape, run_id=RUN, epoch=5) for p in view_a}
    seen_by_b = {p: hash_coords(p, shape, run_id=RUN, epoch=5) for p in view_b}
    assert all(seen_by_a[p] == seen_by_b[p] for p in ids[300:700])
    assert all(0 <= c < m for coords in seen_by_a.values() for c, m in zip(coords, shape.sides))
    assert seen_by_a[ids[0]] == hash_coords(ids[0], shape, run_id=RUN, epoch=5)  # deterministic
    others = [hash_coords(p, shape, run_id=RUN, epoch=6) for p in view_a]
    assert sum(o != s for o, s in zip(others, seen_by_a.values())) > 600  # an epoch re-draws them


def test_hash_coords_make_uneven_groups():
    """Why the daemon uses view-based coordinates: hashing overfills some groups."""
    shape = grid_shape(1024)
    coords = {p: hash_coords(p, shape, run_id=RUN, epoch=0) for p in peer_ids(1024)}
    sizes = [len(m) for t in range(2) for m in group_members(RUN, t, coords, shape).values()]
    assert max(sizes) > 1.25 * shape.M and min(sizes) < 0.75 * shape.M  # measured: 20 to 47


# ---- group keys -----------------------------------------------------------------------------------


def test_group_key_masks_the_dimension_of_the_round():
    shape = GridShape((4, 3, 2))
    assert group_key(RUN, 0, (1, 2, 0), shape) == f"peerd/v1/run/{RUN}/moshpit/4x3x2/0/*.2.0"
    assert group_key(RUN, 4, (1, 2, 0), shape) == f"peerd/v1/run/{RUN}/moshpit/4x3x2/4/1.*.0"
    assert group_key(RUN, 4, (1, 2, 0), shape) == group_key(RUN, 4, (1, 0, 0), shape)
    assert group_key(RUN, 4, (1, 2, 0), shape) != group_key(RUN, 4, (0, 2, 0), shape)
    assert group_key(RUN, 1, (1, 2, 0), shape) != group_key(RUN, 4, (1, 2, 0), shape)  # the round counts
    assert group_key(RUN, 0, (1, 2), GridShape((4, 3))) != group_key(RUN, 0, (1, 2), GridShape((3, 3)))
    assert group_key(RUN, 7, (5,), GridShape((9,))) == group_key(RUN, 7, (0,), GridShape((9,)))
    # One group of all: views of 2 and 3 peers (a peer just joined) name the same group.
    assert group_key(RUN, 7, (1,), GridShape((2,))) == group_key(RUN, 7, (2,), GridShape((3,)))
    assert group_key(RUN, 7, (1,), GridShape((2,))) == f"peerd/v1/run/{RUN}/moshpit/all/7/*"
    assert group_key(RUN, 7, (1,), GridShape((3,))) != group_key(RUN, 7, (1, 0), GridShape((3, 2)))
    for bad in [(4, 0, 0), (0, 0), (-1, 0, 0)]:
        with pytest.raises(ValueError):
            group_key(RUN, 0, bad, shape)
    with pytest.raises(ValueError):
        group_key(RUN, -1, (0, 0, 0), shape)


def test_group_members_partitions_a_full_grid_into_lines():
    shape = GridShape((4, 3, 2))
    coords = view_coords(peer_ids(shape.slots), shape, run_id=RUN, epoch=0)
    for t in range(5):
        groups = group_members(RUN, t, coords, shape)
        assert len(groups) == shape.slots // shape.sides[t % 3]
        assert sorted(p for m in groups.values() for p in m) == sorted(coords)
        for key, members in groups.items():
            assert all(group_key(RUN, t, coords[p], shape) == key for p in members)
            assert len(members) == shape.sides[t % 3]
