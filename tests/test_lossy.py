"""The loss-tolerant rule as pure functions (peers/collective/lossy.py): the packet grid, the per-packet
weighted mean, its unbiasedness under independent loss, and bounded drift between members.

Everything here is numpy on fixed seeds: deterministic, and well under a second per test. That the
engine computes exactly this rule over real UDP is checked in tests/test_udp.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from peerd.peers.collective import shard_bounds
from peerd.peers.collective.lossy import PacketGrid, keep_missing, masked_mean, packet_views, simulate_round


def expand(per_packet: np.ndarray, length: int, stride: int) -> np.ndarray:
    """A per-packet array as per-element values."""
    return np.repeat(per_packet, stride)[:length]


def test_the_grid_locates_exactly_the_packets_it_has():
    grid = PacketGrid([(0, 10), (10, 19)], chunk=4, stride=3)  # chunks of 4 cut into packets of 3 and 1
    assert grid.first[0] == [0, 2, 4, 5] and grid.packets(1) == 5
    assert grid.starts[0].tolist() == [0, 3, 4, 7, 8] and grid.counts[0].tolist() == [3, 1, 3, 1, 2]
    assert grid.counts[1].tolist() == [3, 1, 3, 1, 1]
    for j in (0, 1):  # every packet is found where the grid puts it, and nothing else is
        found = {grid.locate(j, int(s), int(c)) for s, c in zip(grid.starts[j], grid.counts[j])}
        assert sorted(p for _, p in found) == list(range(grid.packets(j)))
    for offset, count in [(1, 3), (0, 2), (3, 3), (10, 1), (-1, 3), (8, 3), (0, 0)]:
        assert grid.locate(0, offset, count) is None


def test_masked_mean_is_the_weighted_mean_over_what_arrived():
    stride, length = 3, 10  # packets [0,3) [3,6) [6,9) [9,10)
    v = [np.arange(length, dtype=np.float32) * (k + 1) for k in range(3)]
    arrived = [np.ones(4, bool), np.array([1, 0, 1, 0], bool), np.array([0, 0, 1, 1], bool)]
    w = [1.0, 2.0, 3.0]
    out = np.empty(length, np.float32)
    mask, total, refused = masked_mean(out, [(k, v[k], w[k], arrived[k]) for k in range(3)], stride)
    assert mask.tolist() == [0b011, 0b001, 0b111, 0b101] and total.tolist() == [3.0, 1.0, 6.0, 4.0] and refused == 0
    a = np.stack([expand(x, length, stride) for x in arrived]) * np.array(w)[:, None]
    np.testing.assert_allclose(out, (a * np.stack(v)).sum(0) / a.sum(0), rtol=1e-6)

    v[2][7] = np.nan  # packet 2 of member 2 arrived with a NaN: left out of that packet only
    v[1][4] = np.inf  # packet 1 of member 1 did not arrive: its Inf is never read
    mask, total, refused = masked_mean(out, [(k, v[k], w[k], arrived[k]) for k in range(3)], stride)
    assert mask.tolist() == [0b011, 0b001, 0b011, 0b101] and refused == 1
    np.testing.assert_allclose(out[6:9], (v[0][6:9] * 1 + v[1][6:9] * 2) / 3, rtol=1e-6)
    assert np.isfinite(out).all()

    mask, _, _ = masked_mean(out, [(0, v[0], 0.0, np.ones(4, bool))], stride)  # zero weight: nothing usable
    assert not mask.any()


def test_a_member_keeps_its_own_values_where_result_packets_are_missing():
    x, result = np.zeros(10, np.float32), np.ones(10, np.float32)
    keep_missing(x, result, np.array([1, 0, 0, 1], bool), 3)
    assert x.tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]


def test_the_rule_is_unbiased_and_zero_filling_is_not():
    """Contributions are noisy measurements of one vector (gradients, or parameters that drifted);
    each packet of each non-owner is lost with probability 0.3, independently of its content. Over
    4,000 trials the error of the rule's estimate against that trial's true weighted mean has mean
    zero within 4.5 standard errors on every element; zero-filling (missing packets count as zeros,
    the sum divided by the full weight) is off by more than 20 on every element (about 60 here)."""
    rng = np.random.default_rng(2026)
    n, length, stride, trials, loss = 4, 48, 4, 4000, 0.3
    w = np.array([1.0, 2.0, 3.0, 4.0])
    mu = (3.0 + np.linspace(-1.0, 1.0, length)).astype(np.float32)
    npk = length // stride
    out = np.empty(length, np.float32)
    rule_err, zero_err = np.empty((trials, length)), np.empty((trials, length))
    for t in range(trials):
        xs = (mu + rng.normal(0.0, 1.0, (n, length))).astype(np.float32)
        arrived = rng.random((n, npk)) >= loss
        arrived[0] = True  # the owner's own contribution is always there
        masked_mean(out, [(k, xs[k], w[k], arrived[k]) for k in range(n)], stride)
        truth = (w[:, None] * xs).sum(0) / w.sum()
        kept = np.stack([expand(a, length, stride) for a in arrived])
        rule_err[t] = out - truth
        zero_err[t] = (w[:, None] * xs * kept).sum(0) / w.sum() - truth

    def z(err):
        return err.mean(0) / (err.std(0, ddof=1) / np.sqrt(trials))

    assert np.abs(z(rule_err)).max() < 4.5, np.abs(z(rule_err)).max()
    assert np.abs(z(zero_err)).min() > 20, np.abs(z(zero_err)).min()


@pytest.mark.parametrize("loss", [0.10, 0.20])
def test_drift_between_members_stays_bounded_over_1000_steps(loss):
    """Four members train (a shared step plus their own noise, sigma per element) and run one
    loss-tolerant round per step, with every contribution and result packet lost independently at
    `loss`. The repair is the next rounds: a member that missed a packet holds its own value there
    only until a later round's packet arrives, so per round the squared pairwise distance shrinks
    to about loss times itself plus one step of drift, and settles near
    D* = sqrt(2 sigma^2 L loss / (1 - loss)) whatever the number of steps. Without rounds the
    distance grows as sqrt(steps)."""
    n, length, stride, steps, sigma = 4, 4096, 64, 1000, 0.01
    grid = PacketGrid(shard_bounds(length, n), chunk=length, stride=stride)
    rng = np.random.default_rng(7)
    xs = [np.zeros(length, np.float32) for _ in range(n)]
    free = [np.zeros(length, np.float32) for _ in range(n)]
    weights = [1.0, 2.0, 3.0, 4.0]

    def arrivals():
        return [[rng.random(grid.packets(j)) >= loss for j in range(n)] for _ in range(n)]

    def spread(vs):
        return max(float(np.linalg.norm(vs[a] - vs[b])) for a in range(n) for b in range(a + 1, n))

    distance = np.empty(steps)
    for t in range(steps):
        shared = rng.normal(0.0, sigma, length).astype(np.float32)
        for m in range(n):
            step = shared + rng.normal(0.0, sigma, length).astype(np.float32)
            xs[m] += step
            free[m] += step
        simulate_round(grid, xs, weights, arrivals(), arrivals())
        distance[t] = spread(xs)

    stationary = np.sqrt(2 * sigma**2 * length * loss / (1 - loss))
    bound = 2.0 * stationary  # the steady state's largest value over 1000 steps, six pairs, with margin
    assert distance.max() < bound, (distance.max(), bound)
    assert distance[500:].mean() < 1.1 * distance[:500].mean()  # no growth from the first half to the second
    assert 0.7 * stationary < distance[100:].mean() < 1.3 * stationary  # and the analysis is the right one
    assert spread(free) > 10 * bound  # what the rounds repair


def test_simulate_round_without_loss_is_the_exact_weighted_mean():
    n, length = 3, 1001
    grid = PacketGrid(shard_bounds(length, n), chunk=100, stride=7)
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=length).astype(np.float32) for _ in range(n)]
    expect = sum(w * x for w, x in zip((1.0, 2.0, 3.0), xs)) / 6.0
    everything = [[np.ones(grid.packets(j), bool) for j in range(n)] for _ in range(n)]
    per_shard = simulate_round(grid, xs, [1.0, 2.0, 3.0], everything, everything)
    for x in xs:
        np.testing.assert_allclose(x, expect, rtol=1e-5, atol=1e-6)
    assert all((mask == 0b111).all() and (total == 6.0).all() for mask, total in per_shard)
    head, tail = packet_views(np.arange(10), 4)
    assert head.shape == (2, 4) and tail.tolist() == [8, 9]
