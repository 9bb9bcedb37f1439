"""DiLoCo's outer loop (daemon/diloco.py): the outer step and the phase bookkeeping, as pure functions
with exact values; the rounds are a stand-in that averages two members' payloads in process (the
real engines are tested in test_collective.py, test_udp.py and, end to end, test_diloco_training.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from peerd.daemon.diloco import OuterLoop, OuterSettings, outer_step
from peerd.peers.averaging import RoundResult
from peerd.peers.collective import arctopk
from peerd.peers.collective.outcome import Outcome, Status
from tests.helpers import on_loop as run
from tests.helpers import together

pytestmark = pytest.mark.usefixtures("loop_thread")  # the daemon's loop: end_phase and the rounds run there


def test_the_outer_step_is_nesterov_sgd_with_exact_values():
    p, m, g = torch.tensor([1.0, 2.0]), torch.zeros(2), torch.tensor([0.5, -1.0])
    outer_step(p, m, g, 0.7, 0.9, torch.empty(2))
    # m = 0.9*0 + g = [0.5, -1]; p = p - 0.7*(g + 0.9*m) = [1 - 0.7*0.95, 2 + 0.7*1.9]
    assert m.tolist() == [0.5, -1.0]
    assert torch.allclose(p, torch.tensor([1 - 0.7 * 0.95, 2 + 0.7 * 1.9]))
    reference = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(2):
        reference.grad = g.clone()
        sgd.step()
    outer_step(p, m, g, 0.7, 0.9, torch.empty(2))
    assert torch.equal(p, reference.detach())


class Pair:
    """Two members whose rounds meet: each round waits (bounded) for the other member's payload, then
    both payloads are replaced by their weighted mean (the engine's COMPLETED round)."""

    def __init__(self):
        self.entries: list = []
        self.met: asyncio.Event | None = None

    def member(self, params: list[torch.Tensor], overlap: bool, name: str) -> OuterLoop:
        async def average(vector, weight, round_t, fmt):
            assert fmt == "fp32"
            if not self.entries:
                self.met = asyncio.Event()
            met = self.met
            self.entries.append((vector, weight))
            if len(self.entries) == 2:
                total = sum(w for _, w in self.entries)
                mean = sum(v * w for v, w in self.entries) / total
                for v, _ in self.entries:
                    v.copy_(mean)
                self.entries.clear()
                met.set()
            await asyncio.wait_for(met.wait(), 10)
            return [RoundResult(round_t, 2, None, "emulated: every member meets")]

        settings = OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=overlap)
        return OuterLoop(params, settings, average, name)


def test_without_overlap_both_members_take_the_same_outer_step_and_restart_from_it():
    pair = Pair()
    pa, pb = [torch.tensor([1.0, 1.0])], [torch.tensor([1.0, 1.0])]
    a, b = pair.member(pa, False, "a"), pair.member(pb, False, "b")
    pa[0].sub_(torch.tensor([0.2, 0.0]))  # inner steps: a moved by P_a = [0.2, 0], b by P_b = [0, 0.4]
    pb[0].sub_(torch.tensor([0.0, 0.4]))
    done = together(lambda: a.end_phase(1, 1.0), lambda: b.end_phase(1, 3.0))
    assert [d.round_t for d in done] == [1, 1]
    # mean P = (1*[0.2, 0] + 3*[0, 0.4]) / 4 = [0.05, 0.3]; θ = 1 - 0.5*mean = [0.975, 0.85]
    for loop, params in ((a, pa), (b, pb)):
        assert torch.allclose(loop.theta, torch.tensor([0.975, 0.85]))
        assert torch.equal(params[0], loop.theta)  # the next phase starts from θ
    assert torch.equal(a.theta, b.theta)
    a.close()
    b.close()


def test_with_overlap_a_round_still_in_flight_lands_at_the_next_phase_end_and_own_progress_is_kept():
    """As with a script's loop (daemon/attached.py), which calls only end_phase."""
    pair = Pair()
    pa, pb = [torch.tensor([0.0])], [torch.tensor([0.0])]
    a, b = pair.member(pa, True, "a"), pair.member(pb, True, "b")
    pa[0] -= 1.0
    pb[0] -= 3.0
    first = together(lambda: a.end_phase(1, 1.0), lambda: b.end_phase(1, 1.0))
    assert [d.round_t for d in first] == [None, None]  # nothing to apply yet: round 1 is in flight
    # Until the round lands, each member trains on from θ − P: its own progress.
    assert pa[0].item() == -1.0 and pb[0].item() == -3.0
    pa[0] -= 1.0  # the next phase: P = 1 on both
    pb[0] -= 1.0
    second = together(lambda: a.end_phase(2, 1.0), lambda: b.end_phase(2, 1.0))
    assert [d.round_t for d in second] == [1, 1]
    # Round 1's mean P = 2, θ = 0 - 0.5*2 = -1 on both; the inner parameters are θ minus phase 2's
    # own progress (1, not averaged yet).
    assert a.theta.item() == b.theta.item() == -1.0
    assert pa[0].item() == pb[0].item() == -2.0
    a.close()
    b.close()


def test_a_repair_round_adopts_the_mean_of_theta_minus_progress_without_an_outer_step():
    pair = Pair()
    pa, pb = [torch.tensor([1.0])], [torch.tensor([3.0])]  # members whose θ drifted apart
    a, b = pair.member(pa, False, "a"), pair.member(pb, False, "b")
    pa[0] -= 0.5
    together(lambda: a.end_phase(10, 1.0, repair=True), lambda: b.end_phase(10, 1.0, repair=True))
    # A repair averages θ − P: (1 - 0.5 + 3 - 0) / 2 = 1.75, adopted as θ, momentum untouched.
    for loop, params in ((a, pa), (b, pb)):
        assert loop.theta.item() == 1.75 and params[0].item() == 1.75
        assert loop.momentum.item() == 0.0
    a.close()
    b.close()


def test_with_overlap_a_round_lands_between_inner_steps_and_the_progress_so_far_is_kept():
    pair = Pair()
    pa, pb = [torch.tensor([0.0])], [torch.tensor([0.0])]
    a, b = pair.member(pa, True, "a"), pair.member(pb, True, "b")
    pa[0] -= 1.0  # phase 1: P_a = 1, P_b = 3
    pb[0] -= 3.0
    together(lambda: a.end_phase(1, 1.0), lambda: b.end_phase(1, 1.0))
    pa[0] -= 0.5  # phase 2 begins while round 1 is on the network
    pb[0] -= 0.5
    assert [run(a.landed()).round_t, run(b.landed()).round_t] == [1, 1]  # as the trainer would, once ended
    assert a.land() is None  # nothing in flight any more
    # Round 1's mean P = 2: θ = 0 - 0.5*2 = -1; each model is θ plus its progress since the phase
    # began (0.5), and that progress is now counted from θ.
    assert a.theta.item() == b.theta.item() == -1.0
    assert pa[0].item() == pb[0].item() == -1.5
    pa[0] -= 0.5
    pb[0] -= 0.5
    second = together(lambda: a.end_phase(2, 1.0), lambda: b.end_phase(2, 1.0))
    assert [d.round_t for d in second] == [None, None]  # round 1 landed already
    together(lambda: a.landed(), lambda: b.landed())
    # Round 2 averaged each phase's whole progress, P = -1 - (-2) = 1: θ = -1 - 0.5*1.
    assert a.theta.item() == b.theta.item() == -1.5
    assert pa[0].item() == pb[0].item() == -1.5
    a.close()
    b.close()


def test_land_moves_parameters_held_as_several_tensors_as_it_moves_a_flat_vector():
    """A flat float32 vector (an attached process's, in the shared file) moves in place; a model's
    several tensors (the simulation's workers) through the scratch copy: the same values."""
    pair = Pair()
    pa = [torch.tensor([0.0, 0.0])]
    pb = [torch.tensor([0.0]), torch.tensor([[0.0]])]
    a, b = pair.member(pa, True, "a"), pair.member(pb, True, "b")
    assert a.scratch is None and b.scratch is not None
    pa[0] -= torch.tensor([1.0, 3.0])  # P = [1, 3] on both
    pb[0] -= 1.0
    pb[1] -= 3.0
    together(lambda: a.end_phase(1, 1.0), lambda: b.end_phase(1, 1.0))
    pa[0] -= 0.5
    pb[0] -= 0.5
    pb[1] -= 0.5
    assert [d.round_t for d in together(lambda: a.landed(), lambda: b.landed())] == [1, 1]
    # θ = 0 - 0.5*[1, 3]; each model θ plus its progress since (-0.5).
    assert a.theta.tolist() == b.theta.tolist() == [-0.5, -1.5]
    assert pa[0].tolist() == [pb[0].item(), pb[1].item()] == [-1.0, -2.0]
    a.close()
    b.close()


def test_land_into_hands_another_process_the_move_that_land_makes_here():
    """An attached process's parameters (daemon/attached.py): the daemon writes θ − s when the round
    ends (on_round_done says when), the process adds it; the same values as land() in place (on a
    vector of tensors here, through the scratch copy)."""
    pair = Pair()
    ended = threading.Event()
    pa, pb = [torch.tensor([0.0])], [torch.tensor([0.0])]
    a = pair.member(pa, True, "a")
    a.on_round_done = ended.set
    b = pair.member(pb, True, "b")
    pa[0] -= 1.0  # phase 1: P_a = 1, P_b = 3
    pb[0] -= 3.0
    together(lambda: a.end_phase(1, 1.0), lambda: b.end_phase(1, 1.0))
    x = pa[0].item() - 0.5  # the process trains on (its parameters, not the loop's vector)
    pb[0] -= 0.5
    assert ended.wait(10)
    move = torch.full((1,), float("nan"))
    landed = a.land_into(move)
    assert landed.round_t == 1 and a.land_into(move) is None  # nothing in flight any more
    run(b.landed())
    # θ = 0 - 0.5*2 = -1; s_a = -1: the move is 0, and x stays θ plus its progress since (-1.5), as
    # land() left b's (s_b = -3, moved by 2).
    assert a.theta.item() == b.theta.item() == -1.0
    assert move.item() == 0.0 and x + move.item() == pb[0].item() == -1.5
    assert pa[0].item() == -1.0  # the loop's own vector is left as written
    assert a.start.item() == -1.0  # progress now counted from θ
    a.close()
    b.close()


def test_land_into_waits_when_asked_and_a_round_that_raised_is_dropped(loop_thread):
    """What a detach does (daemon/attached.py): the round in flight lands in the checkpoint."""
    release = asyncio.Event()

    async def average(vector, weight, round_t, fmt):
        await asyncio.wait_for(release.wait(), 10)
        if round_t == 2:
            raise RuntimeError("the round broke")
        vector.mul_(0.5)  # the group's mean: half this member's P
        return [RoundResult(round_t, 2, None, "emulated")]

    p = [torch.tensor([0.0])]
    loop = OuterLoop(p, OuterSettings(lr=1.0, momentum=0.0, payload="fp32", overlap=True), average, "w")
    move = torch.zeros(1)
    p[0] -= 2.0  # P = 2
    run(loop.end_phase(1, 1.0))
    assert loop.land_into(move) is None  # still on the network
    threading.Timer(0.2, loop_thread.loop.call_soon_threadsafe, (release.set,)).start()
    assert loop.land_into(move, wait=True).round_t == 1
    assert loop.theta.item() == -1.0 and move.item() == 1.0  # θ = 0 - 1*mean(1); θ - s = -1 - (-2)
    run(loop.end_phase(2, 1.0))
    try:
        loop.land_into(move, wait=True)
    except RuntimeError as e:
        assert "broke" in str(e)
    else:
        raise AssertionError("the round's exception was not raised")
    assert loop.land_into(move, wait=True) is None and loop.theta.item() == -1.0  # dropped, θ unchanged
    loop.close()


# What daemon/joining.bounded_round returns for a round the stop cancelled.
STOPPED = [RoundResult(0, 1, None, "round cancelled: the run stops", interrupted=True, cancelled=True)]


async def stopped(*args):
    return STOPPED


def test_a_round_the_stop_cancelled_is_not_applied():
    # Without overlap: θ and m stay, and the model goes back to θ (not to θ minus its own P).
    p = [torch.tensor([1.0])]
    loop = OuterLoop(p, OuterSettings(lr=0.5, momentum=0.9, payload="fp32"), stopped, "s")
    p[0] -= 0.5
    done = run(loop.end_phase(1, 1.0))
    assert done.round_t == 1 and done.results == STOPPED
    assert loop.theta.item() == 1.0 and loop.momentum.item() == 0.0 and p[0].item() == 1.0
    loop.close()
    # With overlap, the round in flight when training ends: nothing moves, θ or the model.
    p = [torch.tensor([1.0])]
    loop = OuterLoop(p, OuterSettings(lr=0.5, momentum=0.9, payload="fp32", overlap=True), stopped, "o")
    p[0] -= 0.5
    run(loop.end_phase(1, 1.0))
    p[0] -= 0.25
    landed = run(loop.landed())
    assert landed.results == STOPPED and not landed.moved
    assert loop.theta.item() == 1.0 and loop.momentum.item() == 0.0 and p[0].item() == 0.25
    loop.close()


def missed(round_t: int) -> list[RoundResult]:
    """A round that met none of the mates the grid planned (their daemon was killed, frozen or cut off)."""
    return [RoundResult(round_t, 1, None, "no group: no mate answered", planned=1)]


class Script:
    """A stand-in round per round number: a list of results, or a callable(vector) that averages."""

    def __init__(self, plan):
        self.plan, self.seen = plan, []

    async def __call__(self, vector, weight, round_t, fmt):
        self.seen.append((round_t, vector.clone(), weight))
        step = self.plan[round_t]
        return step(round_t, vector) if callable(step) else step


def met(round_t, vector):
    vector.mul_(0.5)  # the group's mean: half this member's P
    return [RoundResult(round_t, 2, None, "emulated: the mates met")]


def test_a_round_that_met_no_mate_is_owed_to_the_next_and_its_samples_go_with_it():
    """Without overlap: θ and m stay, the inner parameters keep their progress, and the next round
    sends both phases' P with both phases' samples."""
    script = Script({1: missed(1), 2: met})
    p = [torch.tensor([1.0])]
    loop = OuterLoop(p, OuterSettings(lr=0.5, momentum=0.9, payload="fp32"), script, "owed")
    p[0] -= 0.25  # P = 0.25
    first = run(loop.end_phase(1, 10.0))
    assert first.deferred and not first.moved and first.weight == 10.0
    assert loop.theta.item() == 1.0 and loop.momentum.item() == 0.0 and p[0].item() == 0.75
    # Without overlap the next phase's P counts from θ again, which holds this one's: nothing kept aside.
    assert loop.residual.item() == 0.0 and loop.deferred_weight == 10.0
    p[0] -= 0.5  # phase 2: 0.5 more, from where phase 1 ended
    second = run(loop.end_phase(2, 30.0))
    (_, sent, weight) = script.seen[-1]
    assert sent.item() == 0.75 and weight == 40.0  # both phases' progress and samples
    assert second.moved and not second.deferred and second.weight == 40.0
    # The group's mean 0.375: m = 0.375, θ = 1 - 0.5 * (0.375 + 0.9 * 0.375); the model restarts there.
    assert loop.theta.item() == pytest.approx(1.0 - 0.5 * 0.375 * 1.9) and p[0].item() == loop.theta.item()
    assert loop.residual.item() == 0.0 and loop.deferred_weight == 0.0
    loop.close()


def test_an_aborted_round_is_owed_a_member_alone_is_not_and_at_most_two_rounds_in_a_row():
    from peerd.peers.collective.outcome import Outcome, Status

    aborted = Outcome(Status.ABORTED, "a member stopped answering", 1, (), (0.0,), 0, 0, 1.0, b"")
    alone = [RoundResult(3, 1, None, "alone in the run")]  # no mate planned
    rounds = {1: [RoundResult(1, 2, aborted, aborted.reason)], 2: missed(2), 3: missed(3), 4: alone, 5: alone}
    p = [torch.tensor([0.0])]
    loop = OuterLoop(p, OuterSettings(lr=1.0, momentum=0.0, payload="fp32"), Script(rounds), "cap")
    done = []
    for t in range(1, 5):
        p[0] -= 1.0  # every phase: P = 1
        done.append(run(loop.end_phase(t, 1.0)))
    # Rounds 1 and 2 owed; round 3, the third in a row, takes the outer step on all three phases'
    # P alone (θ = 0 - 3): a member out of step with the run still trains.
    assert [d.deferred for d in done] == [True, True, False, False]
    assert done[2].weight == 3.0 and done[3].weight == 1.0
    # Round 4: alone in the run, its own step at once (θ = -3 - 1).
    assert loop.theta.item() == -4.0 and p[0].item() == -4.0 and loop.residual.item() == 0.0
    loop.close()


def test_with_overlap_an_owed_round_moves_nothing_in_the_process_and_goes_out_with_the_next():
    """land_into (an attached process): no move is written; the process keeps its parameters, and the
    next phase's round carries both phases' progress."""
    script = Script({1: missed(1), 2: met})
    ended = threading.Event()
    p = [torch.tensor([0.0])]
    loop = OuterLoop(p, OuterSettings(lr=1.0, momentum=0.0, payload="fp32", overlap=True), script, "ov")
    loop.on_round_done = ended.set
    p[0] -= 1.0  # phase 1: P = 1
    run(loop.end_phase(1, 5.0))
    assert ended.wait(10)
    move = torch.full((1,), float("nan"))
    landed = loop.land_into(move)
    assert landed.deferred and not landed.moved and move.isnan().all()  # nothing for the process to add
    assert loop.theta.item() == 0.0 and loop.residual.item() == 1.0
    p[0] -= 2.0  # phase 2: P = 2 (from -1, where phase 2 began)
    run(loop.end_phase(2, 5.0))
    applied = loop.land_into(move, wait=True)
    (t, sent, weight) = script.seen[-1]
    assert (t, sent.item(), weight) == (2, 3.0, 10.0)
    # θ = 0 - the mean 1.5; phase 3 began at -3, so the move θ - s = 1.5 takes the process to θ plus
    # its progress since.
    assert applied.moved and loop.theta.item() == -1.5 and move.item() == -1.5 - (-3.0)
    loop.close()


def test_an_owed_int8_round_keeps_every_value_it_did_not_send():
    """codec.with_feedback left payload + residual = P + the old residual. Owed, with or without
    overlap, the next round's payload and residual again add up to everything: both phases' P and
    the old residual; nothing is lost to the quantization or counted twice."""
    for overlap in (False, True):
        script = Script({1: missed(1), 2: [RoundResult(2, 1, None, "alone in the run")]})
        torch.manual_seed(0)
        p = [torch.zeros(256)]
        loop = OuterLoop(p, OuterSettings(lr=1.0, momentum=0.0, payload="int8", overlap=overlap), script, "q")
        loop.residual.copy_(torch.randn(256) * 1e-3)  # a previous round's quantization error
        before = loop.residual.clone()
        first, second = torch.randn(256), torch.randn(256)
        p[0] -= first
        run(loop.end_phase(1, 1.0))
        p[0] -= second
        run(loop.end_phase(2, 1.0))
        run(loop.landed())
        (t, sent, _) = script.seen[-1]
        assert t == 2 and torch.allclose(sent + loop.residual, first + second + before, atol=1e-5), overlap
        loop.close()


async def alone(vector, weight, round_t, fmt):
    return [RoundResult(round_t, 1, None, "alone in the run")]


def test_a_shared_outer_state_keeps_its_values_and_the_loop_moves_to_a_copy_only_when_lent():
    """Snapshots peers download are [θ; m] itself (share), not a copy per round: the loop moves its
    own to a copy before the next change, once, and not at all while nothing holds it."""
    for overlap in (False, True):
        p = [torch.tensor([1.0])]
        settings = OuterSettings(lr=0.5, momentum=0.5, payload="fp32", overlap=overlap)
        loop = OuterLoop(p, settings, alone, "cow")
        own = loop.outer
        p[0] -= 0.5
        run(loop.end_phase(1, 1.0))
        run(loop.landed())
        assert loop.outer is own  # nothing held it: no copy
        lent = loop.share()
        kept = lent.clone()
        p[0] -= 0.5
        run(loop.end_phase(2, 1.0))
        run(loop.landed())
        assert torch.equal(lent, kept) and loop.outer is not lent  # the snapshot's values stay
        assert loop.theta.item() != kept[0].item()  # θ took its step in the copy
        if not overlap:
            assert loop.start is loop.theta  # s is still θ itself
        copy = loop.outer
        loop.share()
        loop.adopt(torch.tensor([3.0, 0.0]))  # a download or a checkpoint: no copy of what it replaces
        assert loop.outer is not copy and loop.theta.item() == 3.0 and copy[0].item() != 3.0
        loop.close()


@pytest.mark.parametrize("plan", ["met", "missed", "repair", "lane lost"])
def test_without_overlap_p_is_read_again_a_chunk_at_a_time_with_the_same_arithmetic(monkeypatch, plan):
    """Without overlap P = θ − y is not kept: it is read again from the shared vector in chunks.
    Over several chunks and two lanes (blocks start at each lane's start), the int8 payload, the
    residual, θ, m and the distance are those of the arithmetic on whole vectors; a lane the round
    left partly written (the engine restores nothing: restore=False) is written again from P and
    the residual, and takes this member's own step."""
    import numpy as np

    from peerd.daemon import diloco
    from peerd.peers.collective import codec

    monkeypatch.setattr(diloco, "CHUNK", 128)  # two lanes of 500: chunks of 128, the last short
    n, lr, mu = 1000, 0.7, 0.9

    def met(round_t, vector):
        vector[:500].mul_(0.5)  # the group's mean: half this member's P
        if plan == "lane lost":
            vector[500:700].fill_(123.0)  # partly written, then its lane failed
            return [
                RoundResult(round_t, 2, None, "emulated: the mates met"),
                RoundResult(round_t, 1, None, "lane 1 failed", lane=1, interrupted=True),
            ]
        vector[500:].mul_(0.5)
        return [RoundResult(round_t, 2, None, "emulated: the mates met", lane=lane) for lane in (0, 1)]

    g = torch.Generator().manual_seed(1)
    theta0 = torch.randn(n, generator=g)
    step = torch.randn(n, generator=g) * 0.01
    residual0 = torch.randn(n, generator=g) * 1e-4
    vector = [theta0.clone()]  # the shared file: one flat float32 vector
    rounds = {1: met if plan != "missed" else missed(1)}
    loop = OuterLoop(vector, OuterSettings(lr=lr, momentum=mu, payload="int8", lanes=2), Script(rounds), plan)
    assert loop.progress is None  # s is θ: P is not kept
    loop.residual.copy_(residual0)
    vector[0] -= step  # the phase: y = θ − step
    applied = run(loop.end_phase(1, 4.0, repair=plan == "repair"))
    (_, sent, _) = loop.average.seen[-1]

    P = theta0 - (theta0 - step)  # as the loop computes it: s − y
    if plan == "repair":
        payload, residual = theta0 - P, residual0
    else:
        payload, residual = P.clone(), residual0.clone()
        for a, b in ((0, 500), (500, 1000)):
            codec.with_feedback(payload[a:b].numpy(), residual[a:b].numpy(), "int8")
    assert torch.equal(sent, payload)
    if plan == "missed":  # owed: θ, m, y and the residual stay as they were
        assert applied.deferred and torch.equal(loop.residual, residual0)
        assert torch.equal(loop.theta, theta0) and torch.equal(vector[0], theta0 - step)
        loop.close()
        return
    mean = payload.clone()
    mean[: 1000 if plan != "lane lost" else 500] *= 0.5
    theta, m = theta0.clone(), torch.zeros(n)
    if plan == "repair":
        distance = float((P - theta0 + mean).norm())
        theta = mean
    else:
        distance = float(torch.dist(P, mean))
        outer_step(theta, m, mean.clone(), lr, mu, torch.empty(n))
    assert torch.equal(loop.residual, residual) and torch.equal(loop.momentum, m)
    assert torch.equal(loop.theta, theta) and torch.equal(vector[0], theta)
    assert np.isclose(loop.distance, distance, rtol=1e-5)
    loop.close()


def top_k_round(rows, fmt="fp32"):
    """A stand-in ARC-Top-K round of a group whose mean is half this member's values at `rows` (of
    arctopk.ROW values each) and that sent nothing elsewhere: what ArcTopKRound leaves in the vector."""

    def step(round_t, vector):
        sent = arctopk.gather(vector.numpy(), rows)
        arctopk.Codec(fmt).roundtrip(sent)
        arctopk.scatter(sent * np.float32(0.5), rows, vector.numpy())
        done = Outcome(Status.COMPLETED, "emulated", 1, ("a", "b"), (1.0,), 0, 0, 0.1, b"d")
        return [RoundResult(round_t, 2, done, "emulated", selected=arctopk.Selected(np.array(rows), fmt))]

    return step


@pytest.mark.parametrize("overlap", [False, True])
def test_arctopk_keeps_what_a_member_did_not_send_in_its_parameters_not_in_a_residual(overlap):
    """Two rows; the round averages row 0 only. θ moves at row 0; the member's parameters keep row
    1's progress (θ − residual: nothing of it lost, nothing owed twice), the residual is empty, and
    the next phase's P, counted from θ, holds row 1's progress plus the new."""
    n, row = 2 * arctopk.ROW, arctopk.ROW
    script = Script({1: top_k_round([0]), 2: top_k_round([1]), 3: top_k_round([1])})
    p = [torch.zeros(n)]
    loop = OuterLoop(p, OuterSettings(lr=1.0, momentum=0.0, payload="arctopk", overlap=overlap), script, "k")
    p[0] -= 0.25  # P = 0.25 everywhere
    run(loop.end_phase(1, 1.0))
    if overlap:  # the round lands at the next phase's end, after another 0.25
        p[0] -= 0.25
        run(loop.end_phase(2, 1.0))
    assert torch.equal(loop.theta[:row], torch.full((row,), -0.125))  # the mean 0.125 at row 0, lr 1
    assert torch.equal(loop.theta[row:], torch.zeros(row))  # row 1 was not sent: θ stays
    assert loop.distance == pytest.approx(0.125 * row**0.5)  # |P − P̄| over row 0 only: row 1 had no mean
    assert torch.equal(loop.residual, torch.zeros(n))
    ahead = -0.25 if overlap else 0.0  # with overlap, phase 2's own progress since the round began
    assert torch.equal(p[0][:row], loop.theta[:row] + ahead)
    assert torch.equal(p[0][row:], torch.full((row,), -0.25 + ahead))  # θ − row 1's unsent 0.25
    p[0] -= 0.5
    run(loop.end_phase(3 if overlap else 2, 1.0))
    (_, sent, _) = script.seen[-1]  # the next round's P + residual: what was held back goes out once
    if overlap:  # round 2 (phase 2's P, 0.25 a row) sent row 1: row 0's 0.25 waited, in the parameters
        expected = [0.25 + 0.5, 0.5]
    else:  # round 1 left row 1's 0.25
        expected = [0.5, 0.25 + 0.5]
    assert torch.equal(sent, torch.tensor(expected).repeat_interleave(row))
    loop.close()


def test_arctopk_carries_the_rows_rounding_error_and_a_round_without_rows_takes_everything():
    n, row = 2 * arctopk.ROW, arctopk.ROW
    alone_round = [RoundResult(2, 1, None, "alone in the run")]
    script = Script({1: top_k_round([0], "int8"), 2: alone_round})
    p = [torch.zeros(n)]
    loop = OuterLoop(p, OuterSettings(lr=1.0, momentum=0.0, payload="arctopk"), script, "k")
    progress = torch.linspace(0.001, 0.9, n)
    p[0] -= progress
    run(loop.end_phase(1, 1.0))
    delivered = progress[:row].numpy().copy()
    arctopk.Codec("int8").roundtrip(delivered)
    assert not np.array_equal(delivered, progress[:row].numpy())  # int8 lost something of row 0
    # What was not delivered of row 0 (its rounding error) and all of row 1 stay in the parameters.
    assert torch.allclose(p[0][:row], loop.theta[:row] - (progress[:row] - torch.from_numpy(delivered)), atol=1e-7)
    assert torch.equal(p[0][row:], -progress[row:]) and torch.equal(loop.residual, torch.zeros(n))
    theta = loop.theta.clone()
    p[0] -= 0.125
    run(loop.end_phase(2, 1.0))  # alone: the outer step takes the member's own P whole
    assert torch.allclose(loop.theta, p[0]) and torch.equal(loop.residual, torch.zeros(n))
    assert not torch.equal(loop.theta, theta)
    loop.close()


def test_arctopk_with_lanes_takes_each_lanes_rows_from_its_own_start():
    """Two lanes of two rows each: lane 0's round averaged its row 1, lane 1's its row 0 (rows count
    from each lane's start). θ moves at the vector's rows 1 and 2; rows 0 and 3 stay in the
    parameters, and the distance is over the two rows averaged."""
    row = arctopk.ROW

    def step(round_t, vector):
        results = []
        for lane, own_row in ((0, 1), (1, 0)):
            part = vector[2 * row * lane : 2 * row * (lane + 1)].numpy()
            sent = arctopk.gather(part, np.array([own_row]))
            arctopk.scatter(sent * np.float32(0.5), np.array([own_row]), part)
            done = Outcome(Status.COMPLETED, "emulated", 1, ("a", "b"), (1.0,), 0, 0, 0.1, b"d")
            chosen = arctopk.Selected(np.array([own_row]), "fp32")
            results.append(RoundResult(round_t, 2, done, "emulated", lane=lane, selected=chosen))
        return results

    p = [torch.zeros(4 * row)]
    settings = OuterSettings(lr=1.0, momentum=0.0, payload="arctopk", lanes=2)
    loop = OuterLoop(p, settings, Script({1: step}), "k")
    p[0] -= torch.tensor([1.0, 2.0, 3.0, 4.0]).repeat_interleave(row)  # P: 1, 2, 3, 4 by row
    run(loop.end_phase(1, 1.0))
    assert torch.equal(loop.theta, torch.tensor([0.0, -1.0, -1.5, 0.0]).repeat_interleave(row))
    assert torch.equal(p[0], loop.theta - torch.tensor([1.0, 0.0, 0.0, 4.0]).repeat_interleave(row))
    assert torch.equal(loop.residual, torch.zeros(4 * row))
    assert loop.distance == pytest.approx(((1.0**2 + 1.5**2) * row) ** 0.5)
    loop.close()
