"""Moshpit averaging against random groups and gossip, simulated: rounds to reach a target error.

    python -m bench.moshpit_sim [--seeds 10] [--max-rounds 200] [--fail-rates 0 0.005]

The setup of the Moshpit SGD paper's averaging experiment (Ryabinin et al., NeurIPS 2021, sec. 4.1):
N = 1024 peers, each with a vector of DIM values drawn from N(0, 1); every method averages in groups
round after round, and we count the rounds until the mean over peers of the squared distance to
the true mean, divided by the same quantity before the first round, is at most 1e-9. A failure rate
p means that in every round each peer independently sits the round out with probability p: it
neither sends nor receives, keeps its value, and is back the next round. Every group averages its
live members exactly: no network, no loss, no time; only who meets whom is compared.

* moshpit (ours): `peerd.peers.moshpit` with the shape `grid_shape(1024)` = 32x32 and view-based
  coordinates all peers agree on, fixed over the rounds;
* random groups of 32 (baseline): the live peers are shuffled and cut into groups of 32 every round;
* gossip: the live peers are paired at random every round; each pair averages.

Also measured, to choose how the daemon assigns coordinates: moshpit with hash-based coordinates,
and with view-based ones while half of the peers have not yet seen one new peer; and, over a range
of peer counts, peerd's shape rule against equal sides (the paper's M^d, M = ceil(N^(1/d))).
Every method runs on the same seeds, with the same initial values and the same failures.
Tables on stderr; JSON lines on stdout, the last one the headline.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from bench.common import emit, progress, result
from peerd.peers.moshpit import Coords, GridShape, grid_shape, group_members, hash_coords, view_coords

BENCH = "moshpit_sim"
N = 1024
GROUP = 32  # the max group size for moshpit and the group size of the random-groups baseline
DIM = 4  # values per peer; the error is summed over them
TARGET = 1e-9  # relative mean squared error
FAIL_RATES = (0.0, 0.005)  # the paper's two settings; the headline is the last rate
EXAMPLES = (33, 37, 50, 100, 250, 500, 1000, 1025, 1331, 2000, 4096)  # peer counts shown one by one
SWEEP = range(33, 4097, 61)  # every 61st count from G + 1 to G^2 * 4, not chosen for being round
SWEEP_SEEDS = 3
RUN_ID = "sim"

# A method turns (round, live peers, rng) into a group label per peer: peers with the same label
# average together; the label of a peer that sits the round out is ignored.
Grouping = Callable[[int, np.ndarray, np.random.Generator], np.ndarray]
Results = dict[tuple[str, float], list[int | None]]  # (method, failure rate) -> rounds, one per seed


def average_in_groups(x: np.ndarray, labels: np.ndarray, live: np.ndarray) -> np.ndarray:
    """Each live peer gets the mean of the live peers with its label; the others keep their value.
    x: (peers, dim); labels: (peers,) ints; live: (peers,) bools."""
    idx = np.flatnonzero(live)
    _, group = np.unique(labels[idx], return_inverse=True)
    counts = np.bincount(group).astype(x.dtype)
    sums = np.stack([np.bincount(group, weights=column) for column in x[idx].T], axis=1)
    out = x.copy()
    out[idx] = sums[group] / counts[group, None]
    return out


def moshpit_grouping(coords: dict[str, Coords], shape: GridShape) -> Grouping:
    """Groups exactly as peerd.peers.moshpit.group_members assembles them. Coordinates stay fixed and the
    key of round t differs from that of round t mod d only in t, so one labelling per dimension."""
    position = {p: i for i, p in enumerate(sorted(coords))}
    by_dim = []
    for dim in range(shape.d):
        labels = np.empty(len(position), dtype=np.int64)
        for label, members in enumerate(group_members(RUN_ID, dim, coords, shape).values()):
            labels[[position[p] for p in members]] = label
        by_dim.append(labels)
    return lambda t, live, rng: by_dim[t % shape.d]


def random_grouping(size: int) -> Grouping:
    """Live peers shuffled and cut into groups of `size` (the last one smaller); size 2 is gossip."""

    def labels(t: int, live: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        out = np.zeros(len(live), dtype=np.int64)
        out[rng.permutation(np.flatnonzero(live))] = np.arange(int(live.sum())) // size
        return out

    return labels


def peer_ids(n: int) -> list[str]:
    return [f"peer-{i:05d}" for i in range(n)]


def equal_sides_shape(n: int, group: int) -> GridShape:
    """The rule peerd does not use, for comparison: the fewest d with M = ceil(n^(1/d)) <= group,
    sides (M,) * d (the paper's M^d grid, with empty slots when n is not a d-th power)."""
    d = 1
    while (m := next(m for m in itertools.count(1) if m**d >= n)) > group:
        d += 1
    return GridShape((m,) * d)


def methods(n: int, group: int, seed: int) -> dict[str, Grouping]:
    ids = peer_ids(n)
    shape = grid_shape(n, group)
    # Half of the peers have not yet seen the newest peer (`joiner`): their view lacks it.
    rng = np.random.default_rng([seed, 3])
    joiner = ids[int(rng.integers(n))]
    stale = set(rng.choice([p for p in ids if p != joiner], size=(n - 1) // 2, replace=False).tolist())
    fresh_view = view_coords(ids, shape, run_id=RUN_ID, epoch=seed)
    stale_view = view_coords([p for p in ids if p != joiner], shape, run_id=RUN_ID, epoch=seed)
    hashed = {p: hash_coords(p, shape, run_id=RUN_ID, epoch=seed) for p in ids}
    mixed = {p: (stale_view if p in stale else fresh_view)[p] for p in ids}
    return {
        "moshpit": moshpit_grouping(fresh_view, shape),
        "random groups": random_grouping(group),
        "gossip": random_grouping(2),
        "moshpit, hash coords": moshpit_grouping(hashed, shape),
        "moshpit, half miss a joiner": moshpit_grouping(mixed, shape),
    }


@functools.lru_cache(maxsize=8)
def _grid_grouping(n: int, shape: GridShape) -> Grouping:
    # Built once per shape: the initial values are i.i.d., so which peer sits where does not matter.
    return moshpit_grouping(view_coords(peer_ids(n), shape, run_id=RUN_ID, epoch=0), shape)


def shape_rules(n: int, group: int, seed: int) -> dict[str, Grouping]:
    shapes = {"peerd rule": grid_shape(n, group), "equal sides": equal_sides_shape(n, group)}
    return {name: _grid_grouping(n, s) for name, s in shapes.items()} | {"random groups": random_grouping(group)}


def rounds_to_target(
    grouping: Grouping, n: int, fail_rate: float, seed: int, target: float, max_rounds: int
) -> int | None:
    """Rounds until the mean squared error to the true mean, relative to the initial one, is at
    most `target`; None if not within max_rounds."""
    x = np.random.default_rng([seed, 0]).standard_normal((n, DIM))
    failures, groups = np.random.default_rng([seed, 1]), np.random.default_rng([seed, 2])
    mean = x.mean(axis=0)  # averaging in groups keeps the sum, so this stays the true mean
    initial = np.mean(np.sum((x - mean) ** 2, axis=1))
    for t in range(max_rounds):
        live = failures.random(n) >= fail_rate
        x = average_in_groups(x, grouping(t, live, groups), live)
        if np.mean(np.sum((x - mean) ** 2, axis=1)) / initial <= target:
            return t + 1
    return None


def measure(
    make: Callable[[int, int, int], dict[str, Grouping]], n: int, rates: list[float], seeds: int, max_rounds: int
) -> Results:
    rounds: Results = {}
    for seed in range(seeds):
        for name, grouping in make(n, GROUP, seed).items():
            for p in rates:
                rounds.setdefault((name, p), []).append(rounds_to_target(grouping, n, p, seed, TARGET, max_rounds))
    return rounds


def mean_rounds(xs: list[int | None]) -> float | None:
    """The mean over seeds; None when any seed did not reach the target."""
    return None if None in xs else round(statistics.fmean(xs), 2)


def cell(xs: list[int | None], max_rounds: int) -> str:
    done = [x for x in xs if x is not None]
    return f">{max_rounds}" if len(done) < len(xs) else f"{statistics.fmean(done):.1f} [{min(done)}-{max(done)}]"


def _rates(rounds: Results) -> list[float]:
    return list(dict.fromkeys(p for _, p in rounds))


def table(rounds: Results, max_rounds: int) -> str:
    header = f"{'rounds to 1e-9, mean [min-max]':<30}" + "".join(f"{f'p = {p:.1%}':>16}" for p in _rates(rounds))
    lines = [header, "-" * len(header)]
    for name in dict.fromkeys(name for name, _ in rounds):
        lines.append(f"{name:<30}" + "".join(f"{cell(rounds[(name, p)], max_rounds):>16}" for p in _rates(rounds)))
    return "\n".join(lines)


def sweep_table(by_n: dict[int, Results]) -> str:
    """One row per peer count: the two shapes, then mean rounds per method, per failure rate."""
    names = list(dict.fromkeys(name for name, _ in next(iter(by_n.values()))))
    rates = _rates(next(iter(by_n.values())))
    header = f"{'N':>5}  {'peerd shape':<12}{'equal sides':<12}" + "".join(
        f"{f'{name}, p={p:.1%}':>{max(len(name) + 10, 10)}}" for p in rates for name in names
    )
    lines = [header, "-" * len(header)]
    for n, rounds in by_n.items():
        row = f"{n:>5}  {str(grid_shape(n, GROUP)):<12}{str(equal_sides_shape(n, GROUP)):<12}"
        for p in rates:
            for name in names:
                mean = mean_rounds(rounds[(name, p)])
                row += f"{'-' if mean is None else f'{mean:.1f}':>{max(len(name) + 10, 10)}}"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-rounds", type=int, default=200)
    parser.add_argument(
        "--fail-rates",
        type=float,
        nargs="+",
        default=list(FAIL_RATES),
        metavar="P",
        help="per-round failure probabilities (default: %(default)s); the headline uses the last",
    )
    args = parser.parse_args()
    rates, common = args.fail_rates, {"n": N, "seeds": args.seeds, "target": TARGET, "max_rounds": args.max_rounds}

    started = time.monotonic()
    by_n = {n: measure(shape_rules, n, rates, args.seeds, args.max_rounds) for n in EXAMPLES}
    progress(BENCH, f"shape rules, groups of at most {GROUP}, {args.seeds} seeds\n{sweep_table(by_n)}")
    swept = {n: measure(shape_rules, n, rates, SWEEP_SEEDS, args.max_rounds) for n in SWEEP}

    def over_sweep(key: tuple[str, float], part: Sequence[int] = SWEEP) -> float | None:
        means = [mean_rounds(swept[n][key]) for n in part]
        return None if None in means else round(statistics.fmean(means), 2)

    for part in ([n for n in SWEEP if n <= GROUP**2], [n for n in SWEEP if n > GROUP**2]):
        progress(
            BENCH,
            f"mean over n = {part[0]}, {part[1]}, ..., {part[-1]}, {SWEEP_SEEDS} seeds: "
            + ", ".join(f"{name} p={p:.1%} {over_sweep((name, p), part)}" for name, p in swept[part[0]]),
        )
    rounds = measure(methods, N, rates, args.seeds, args.max_rounds)
    progress(
        BENCH,
        f"N = {N}, {grid_shape(N, GROUP)} grid, {DIM} values per peer, {args.seeds} seeds, "
        f"{time.monotonic() - started:.1f} s in all\n{table(rounds, args.max_rounds)}",
    )

    records = [
        result(
            BENCH,
            f"rounds_to_1e-9_p{p:g}_sweep_peerd_shape_vs_equal_sides",
            over_sweep(("peerd rule", p)),
            over_sweep(("equal sides", p)),
            "rounds",
            fail_rate=p,
            n=f"{SWEEP.start}..{SWEEP[-1]} step {SWEEP.step}",
            seeds=SWEEP_SEEDS,
            note="mean over the peer counts n",
        )
        for p in rates
    ]
    ours = {p: mean_rounds(rounds[("moshpit", p)]) for p in rates}
    for p in rates:
        for metric, name in (
            ("gossip", "gossip"),
            ("hash_coords", "moshpit, hash coords"),
            ("stale_views", "moshpit, half miss a joiner"),
        ):
            records.append(
                result(
                    BENCH,
                    f"rounds_to_1e-9_p{p:g}_vs_{metric}",
                    ours[p],
                    mean_rounds(rounds[(name, p)]),
                    "rounds",
                    fail_rate=p,
                    **common,
                )
            )
    for p in rates:  # the headline (by default p = 0.5 %) goes last
        records.append(
            result(
                BENCH,
                f"rounds_to_1e-9_p{p:g}_vs_random_groups",
                ours[p],
                mean_rounds(rounds[("random groups", p)]),
                "rounds",
                fail_rate=p,
                group=GROUP,
                **common,
            )
        )
    for record in records:
        emit(record)


if __name__ == "__main__":
    main()
