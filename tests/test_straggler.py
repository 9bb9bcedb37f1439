"""The straggler budget (DropCompute; daemon/straggler.py) with a made-up clock, and the shared
file's header through which the daemon ends an attached process's phase."""

from __future__ import annotations

from peerd.daemon.attached import SharedVector
from peerd.daemon.straggler import StragglerBudget
from peerd.attachment import Attachment


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
        attachment._unmap()
    finally:
        shared.close()
    shared.end_phase_at(60)  # after close (the daemon stops): nothing to write, nothing raised
