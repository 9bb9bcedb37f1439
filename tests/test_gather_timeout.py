"""The gather timeout a round's group waits: each member's proposal from its measured rounds, and
the group's agreement (peers/collective/gather_timeout.py). Pure: no clock, no network."""

import math

import pytest

from peerd.peers.collective import AllReduceSettings
from peerd.peers.collective.gather_timeout import FACTOR, FLOOR, WINDOW, GatherTimeout, agreed, with_gather_timeout


def test_before_any_round_the_proposal_is_the_configured_ceiling():
    assert GatherTimeout(10.0).proposal() == 10.0


def test_the_proposal_follows_the_longest_recent_round_within_floor_and_ceiling():
    g = GatherTimeout(10.0)
    g.observe(0.1, 10.0)
    assert g.proposal() == FLOOR  # 4 x 0.1 s is below the floor
    g.observe(1.0, 10.0)
    assert g.proposal() == FACTOR * 1.0
    g.observe(0.2, 10.0)
    assert g.proposal() == FACTOR * 1.0  # the longest of the window, not the latest
    g.observe(5.0, 10.0)
    assert g.proposal() == 10.0  # never above the ceiling


def test_a_slow_round_leaves_the_window_after_WINDOW_faster_ones():
    g = GatherTimeout(10.0)
    g.observe(2.0, 10.0)
    for _ in range(WINDOW - 1):
        g.observe(1.0, 10.0)
    assert g.proposal() == FACTOR * 2.0
    g.observe(1.0, 10.0)
    assert g.proposal() == FACTOR * 1.0


def test_a_round_that_waited_out_its_gather_timeout_or_a_bad_duration_is_not_a_measurement():
    g = GatherTimeout(10.0)
    for duration in (3.0, 3.5, math.nan, math.inf, -1.0):  # 3.0 and more: a silent member's deadline
        g.observe(duration, 3.0)
    assert g.proposal() == 10.0


def test_the_group_takes_the_largest_proposal_and_counts_none_as_the_ceiling():
    assert agreed([3.0, 4.5, 3.2], 10.0) == 4.5
    assert agreed([3.0, 0.0], 10.0) == 10.0  # a member from before proposals
    assert agreed([], 10.0) == 10.0


def test_settings_with_the_floor_are_valid_and_keep_the_other_waits_in_order():
    base = AllReduceSettings()
    s = with_gather_timeout(base, FLOOR)
    assert s.gather_timeout == FLOOR
    assert s.connect_timeout <= s.contribute_timeout < s.gather_timeout
    assert (s.verdict_timeout, s.drain_timeout, s.payload) == (base.verdict_timeout, base.drain_timeout, base.payload)
    assert with_gather_timeout(base, base.gather_timeout) == base  # the ceiling changes nothing


def test_a_floor_above_the_ceiling_is_refused():
    with pytest.raises(ValueError):
        GatherTimeout(2.0)
