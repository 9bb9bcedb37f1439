"""The run's phase schedule (peers/phases.py): exact boundaries, rounds and lengths."""

import pytest

from peerd.daemon.straggler import catch_up_from
from peerd.peers.manifest import AveragingSettings
from peerd.peers.phases import Phases


def test_short_first_phases_double_within_the_first_h_steps_then_stay_h():
    p = Phases(50, 5)
    assert [p.end(r) for r in range(8)] == [0, 5, 15, 35, 50, 100, 150, 200]
    assert [p.length(p.end(r)) for r in range(7)] == [5, 10, 20, 15, 50, 50, 50]  # the 4th: the rest of H
    # A step's round is the last boundary at or before it.
    assert [p.round_of(s) for s in (0, 4, 5, 14, 15, 34, 35, 49, 50, 99, 100, 1000)] == [
        0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 23
    ]  # fmt: skip
    assert [p.next_end(s) for s in (0, 4, 5, 35, 49, 50, 80)] == [5, 5, 15, 50, 50, 100, 100]
    assert all(p.end(p.round_of(p.end(r))) == p.end(r) for r in range(40))
    assert all(p.round_of(p.end(r + 1) - 1) == r for r in range(40))
    # From step H on, the boundaries are H's multiples whatever the first phase.
    assert [Phases(40, 5).end(r) for r in range(6)] == [0, 5, 15, 35, 40, 80]
    assert [Phases(100, 1).end(r) for r in range(9)] == [0, 1, 3, 7, 15, 31, 63, 100, 200]
    assert [Phases(10, 5).end(r) for r in range(4)] == [0, 5, 10, 20]


def test_a_first_phase_of_zero_or_at_least_h_is_every_phase_h():
    for phases in (Phases(50), Phases(50, 0), Phases(50, 50), Phases(50, 80)):
        assert [phases.end(r) for r in range(4)] == [0, 50, 100, 150]
        assert [phases.round_of(s) for s in (0, 49, 50, 149, 150)] == [0, 0, 1, 2, 3]
        assert phases.next_end(50) == 100 and phases.length(73) == 50
        assert phases.ahead(60, 2) == 160  # two rounds on, as far into its phase
    # A first phase past H/2 is one short phase, the rest of H, then H.
    assert [Phases(50, 30).end(r) for r in range(4)] == [0, 30, 50, 100]


def test_the_rendezvous_floor_before_the_start_and_the_catch_up_rule():
    p = Phases(50, 5)
    assert (p.end(-2), p.end(-1)) == (-10, -5)  # round 1's floor (round - 2) stays below step 0
    assert Phases(50).end(-2) == -100  # as `step - 2 H` was
    assert p.ahead(6, 2) == 36  # step 6 is 1 into round 1's phase: 1 into round 3's
    # Two rounds ahead of step 15 (round 2; phases of 20 then 15) is step 50.
    assert catch_up_from(15, p, [49]) is None
    assert catch_up_from(15, p, [50]) == 16
    assert catch_up_from(100, Phases(50), [199]) is None and catch_up_from(100, Phases(50), [200]) == 101


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError):
        Phases(0)
    with pytest.raises(ValueError):
        Phases(50, -1)
    with pytest.raises(ValueError, match="first_phase"):
        AveragingSettings(first_phase=-1)


def test_new_runs_start_with_short_phases():
    assert AveragingSettings().phases == Phases(50, 5)
    assert AveragingSettings(average_every=4).phases.end(3) == 12  # a first phase past H: every phase H
