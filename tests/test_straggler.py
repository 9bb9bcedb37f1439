"""When a phase ends early and when a peer downloads the run's state (daemon/straggler.py) with a
made-up clock: MateWait, the straggler budget (DropCompute) and catch_up_from; and the shared file's
header through which the daemon ends an attached process's phase and reads its steps."""

from __future__ import annotations

from peerd.daemon.attached import SharedVector
import math

from peerd.daemon.straggler import MateWait, StragglerBudget, catch_up_from, rendezvous_patience
from peerd.attachment import Attachment
from peerd.peers.phases import Phases
from peerd.shared_file import PHASE_STEPS_OFFSET


def test_a_peer_behind_ends_its_phase_where_it_would_reach_the_boundary_after_its_mate_stops_waiting():
    # Boundary 20, this phase's pace 3 s a step, 2 s from the answer to the round's start, a 10 s wait.
    w = MateWait(patience=10.0)
    assert not w.over(99.0, 5, 20, 3.0, [19], 2.0)  # nobody at the boundary yet
    assert w.over(100.0, 5, 20, 3.0, [20], 2.0)  # 15 steps left: 100 + 45 + 2 > 100 + 10
    w = MateWait(patience=10.0)
    assert not w.over(100.0, 18, 20, 3.0, [20], 2.0)  # 2 steps: 100 + 6 + 2 <= 110, first seen at 100
    assert not w.over(103.0, 19, 20, 3.0, [20], 2.0)  # 103 + 3 + 2 <= 110
    assert not w.over(105.0, 19, 20, 3.0, [20], 2.0)  # 110 <= 110: it makes it
    assert w.over(105.5, 19, 20, 3.0, [20], 2.0)  # a slow step: 110.5, counted from the first sight
    w = MateWait(patience=10.0)
    assert w.over(100.0, 17, 20, 3.0, [20], 2.0)  # 3 steps: 111 > 110
    assert MateWait(10.0).over(100.0, 10, 20, 3.0, [25], 2.0)  # a mate past it, judged alike: 132 > 110
    assert not MateWait(10.0).over(100.0, 19, 20, 0.01, [25], 2.0)  # a fast phase arrives in time
    assert not MateWait(10.0).over(100.0, 0, 20, math.nan, [20], 2.0)  # no step yet: the next look decides
    assert not MateWait(10.0).over(100.0, 5, 20, 3.0, [], 2.0)  # alone


def test_a_mate_that_leaves_the_boundary_view_is_seen_anew_and_a_new_boundary_starts_over():
    w = MateWait(patience=10.0)
    assert not w.over(100.0, 18, 20, 3.0, [20], 2.0)  # first seen at 100
    assert not w.over(101.0, 18, 20, 3.0, [15], 2.0)  # a view without it: forgotten
    assert not w.over(108.0, 19, 20, 3.0, [20], 2.0)  # seen anew at 108: 108 + 3 + 2 <= 118
    assert not w.over(108.0, 38, 40, 3.0, [40], 2.0)  # the next boundary: first seen now, 116 <= 118
    assert w.over(109.0, 37, 40, 3.0, [40], 2.0)  # 109 + 9 + 2 = 120 > 118


def test_a_peer_downloads_the_state_only_two_rounds_behind():
    H = Phases(20)
    # At step 20: a peer at 20 to 59 is met (it waits at its boundary, or MateWait ends this phase
    # at once); one at 60 or beyond has closed the rounds this peer could still be in.
    assert catch_up_from(20, H, [20]) is None
    assert catch_up_from(20, H, [40]) is None  # exactly one round ahead: no newer state to give yet
    assert catch_up_from(20, H, [59]) is None
    assert catch_up_from(20, H, [60]) == 21
    assert catch_up_from(20, H, [15, 77]) == 21
    assert catch_up_from(0, H, []) is None


def test_a_round_with_live_mates_and_no_group_counts_as_missed():
    """peerd_rounds_missed_total: the grid gave this daemon mates and no group formed. Alone in the
    run, a round that formed a group, and one the run's stop cancelled are not missed rounds."""
    from peerd.daemon.metrics import DaemonMetrics
    from peerd.peers.averaging import RoundResult

    m = DaemonMetrics(version="t", states=("READY",), peers_by_run=dict)
    for result in (
        RoundResult(1, 1, None, "no mate came", planned=2),  # missed
        RoundResult(2, 1, None, "alone in the run", planned=0),
        RoundResult(3, 1, None, "round cancelled: the run stops", planned=2, interrupted=True, cancelled=True),
        RoundResult(4, 1, None, "no mate came", planned=1),  # missed
    ):
        m.observe_round("r", result)
    assert m.registry.get_sample_value("peerd_rounds_missed_total", {"run": "r"}) == 2.0


def test_a_round_waits_ten_seconds_or_a_third_of_its_timeout():
    assert rendezvous_patience(60.0) == 10.0
    assert rendezvous_patience(9.0) == 3.0


def test_a_phase_ends_once_half_the_peers_are_at_the_boundary_and_the_budget_has_run():
    budget = StragglerBudget(1.5)
    # Phase began at t=100, boundary at step 40; peers at 30, 35, 38: nobody there yet.
    assert not budget.over(101.0, 100.0, [30, 35, 38], 40)
    # One of three there is less than half.
    assert not budget.over(102.0, 100.0, [40, 35, 38], 40)
    # Two of three at t=104: they took 4 s, so this peer goes on until 100 + 1.5 * 4 = 106.
    assert not budget.over(104.0, 100.0, [40, 41, 38], 40)
    assert not budget.over(105.9, 100.0, [40, 41, 38], 40)
    assert budget.over(106.0, 100.0, [40, 41, 38], 40)
    # Said once, then it starts over for the next phase.
    assert not budget.over(106.5, 106.0, [40, 41, 38], 60)


def test_no_budget_no_peers_or_peers_falling_back_never_end_a_phase_early():
    assert not StragglerBudget(0.0).over(1e9, 0.0, [100], 40)
    assert not StragglerBudget(1.5).over(1e9, 0.0, [], 40)
    budget = StragglerBudget(1.5)
    assert not budget.over(104.0, 100.0, [40], 40)  # first seen there at t=104
    assert not budget.over(105.0, 100.0, [20], 40)  # a view without them: the count starts over
    assert not budget.over(107.0, 100.0, [40], 40)  # seen again at t=107: until 100 + 1.5 * 7
    assert budget.over(110.5, 100.0, [40], 40)


def test_the_daemon_ends_a_phase_through_the_header_and_the_process_reads_it(tmp_path):
    shared = SharedVector(tmp_path, 10)
    try:
        attachment = Attachment(
            run="r",
            daemon=tmp_path,
            control=None,
            layout=[],
            settings={},
            device="cpu",
            attach_timeout=1.0,
            reconnect_timeout=1.0,
        )
        vector, _theta = attachment._map_vector(str(shared.path), 10)
        assert attachment.phase_ends_at() == 0  # none asked
        shared.tensor.fill_(2.0)
        shared.end_phase_at(40)
        assert attachment.phase_ends_at() == 40
        assert vector.sum().item() == 20.0  # the parameters are untouched by the header
        attachment.stepped(7, 112.0, math.nan)  # the phase so far: steps the daemon reads, the rest for Renew
        assert shared.count(PHASE_STEPS_OFFSET) == 7 and attachment.phase_ends_at() == 40
        assert attachment.progress[0] == 112.0
        attachment._unmap()
    finally:
        shared.close()
    shared.end_phase_at(60)  # after close (the daemon stops): nothing to write, nothing raised
