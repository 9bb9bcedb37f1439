"""A round's pace (peers/pace.py): what a group agrees from its members' entries, exact values."""

import math

from peerd.peers.pace import MAX_PACE_SECONDS, Pace, group_pace, on_the_wire, pace_ok


def test_the_group_takes_the_slowest_step_and_the_longest_round_that_a_member_measured():
    assert group_pace([(0.1, 2.0), (0.3, 1.5), (0.2, 0.0)]) == Pace(0.3, 2.0, 3)
    # the same figures in another order: the same pace, on every member
    assert group_pace([(0.2, 0.0), (0.1, 2.0), (0.3, 1.5)]) == Pace(0.3, 2.0, 3)
    nothing = group_pace([(0.0, 0.0), (0.0, 0.0)])  # nobody measured yet (0: none)
    assert math.isnan(nothing.step_seconds) and math.isnan(nothing.round_seconds) and nothing.members == 2
    first = group_pace([(0.1, 0.0), (0.2, 0.0)])  # a first round: steps, no round yet
    assert first.step_seconds == 0.2 and math.isnan(first.round_seconds)


def test_what_an_entry_carries_and_what_a_reader_accepts():
    assert on_the_wire(math.nan) == 0.0 and on_the_wire(-1.0) == 0.0 and on_the_wire(2 * MAX_PACE_SECONDS) == 0.0
    assert on_the_wire(0.25) == 0.25
    assert pace_ok(0.0) and pace_ok(MAX_PACE_SECONDS)
    assert not pace_ok(math.nan) and not pace_ok(-0.5) and not pace_ok(math.inf) and not pace_ok(MAX_PACE_SECONDS + 1)
