"""Eight real daemons on loopback train in Moshpit's 4 x 2 grid and complete rounds with full groups in
both of its dimensions (issue 28). The machinery is bench.scale's (docs/benchmarks.md, "Scale"), with
a shorter window: the daemons, their p2pd and their training processes are real subprocesses; the task
is paced-digits, whose steps cost a fixed, small amount of CPU, so that eight trees fit on 2 cores.
"""

from __future__ import annotations

import argparse
import collections

import pytest

from bench import paced_task
from bench.scale import Scale, classify
from peerd.peers.moshpit import grid_shape

N = 8
MAX_GROUP = 4  # grid 4 x 2: groups of 4 in even rounds, of 2 in odd ones
H = 60  # at 20 paced steps/s a round every 3 s
WINDOW_S = 30.0  # about 10 rounds per daemon, 80 in all
# Measured (bench.scale, N = 8, 90 s windows, H = 100): 1.000 of the polled rounds full, twice, on a
# quiet machine. Required here: 0.8, for a suite that runs beside this test on 2 cores: a round a
# daemon misses while the machine is briefly saturated (its mates then meet in a smaller group) is
# CPU, not the protocol; a protocol fault (a dimension that never forms, views that miss peers)
# takes most rounds with it.
FULL_SHARE_REQUIRED = 0.8


@pytest.mark.heavy(slots=2)  # 8 daemons, 8 p2pd, 8 training processes: no other heavy test beside them
@pytest.mark.timeout(400)
def test_eight_daemons_complete_rounds_in_full_groups_over_both_grid_dimensions(tmp_path):
    args = argparse.Namespace(
        max_group_size=MAX_GROUP, average_every=H, task=paced_task.NAME, steps_per_second=20.0, seconds=WINDOW_S
    )
    shape = grid_shape(N, MAX_GROUP)
    assert shape.d == 2 and sorted(shape.sides) == [2, 4]
    scale = Scale(tmp_path, args)
    try:
        scale.start(N)
        scale.join()
        scale.wait_training(N)
        seen = scale.poll_rounds(WINDOW_S)
    finally:
        scale.cleanup()
    rounds = classify(seen, shape)
    full = collections.Counter(dim for dim, ok in rounds if ok)
    share = sum(full.values()) / len(rounds) if rounds else 0.0
    detail = f"{sum(full.values())} of {len(rounds)} polled rounds full, by dimension {dict(full)}: {seen}"
    assert len(rounds) >= N * 4, f"too few rounds seen in {WINDOW_S} s: {detail}"
    assert share >= FULL_SHARE_REQUIRED, detail
    assert full[0] >= N and full[1] >= N, f"full groups in both grid dimensions: {detail}"
    # Every daemon took part in full groups of both sizes: no daemon trained as an outsider.
    for i, s in enumerate(seen):
        mine = classify([s], shape)
        assert {dim for dim, ok in mine if ok} == {0, 1}, f"daemon {i}: {s}"
