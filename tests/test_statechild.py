"""A state run's child's daemon half (a TaskChild holding daemon/algorithms.py StateAveraging),
driven directly with stand-in rounds:
the vector is the thread's state vector, a round that stopped midway leaves it as it was, a
completed one leaves the mean, and the checkpoints are the thread's, loaded back into the vector.
(Real daemons and children: tests/test_train_process.py.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from peerd.daemon.checkpoint import CheckpointStore
from peerd.daemon.export import Kind, checkpoint_weights
from peerd.daemon.flat import state_tensors
from peerd.daemon.algorithms import StateAveraging
from peerd.daemon.taskchild import TaskChild
from peerd.daemon.tasks import get_task
from peerd.peers.averaging import RoundResult
from peerd.peers.dear.hierarchy import lane_bounds
from peerd.peers.manifest import TensorSpec
from peerd.peers.phases import Phases
from peerd.torch import from_vector, to_vector
from tests.helpers import on_loop as run

H = 5


@dataclass
class Done:
    """A stand-in outcome: the round completed and its result is in the vector."""

    completed: bool = True
    applied: bool = True
    status = type("Status", (), {"value": "completed"})


pytestmark = pytest.mark.usefixtures("loop_thread")  # the daemon's loop: end_phase and the rounds run there


def built():
    task = get_task("digits-mlp")
    return task.build(task.parse_hparams({}), 0)


def state_child(tmp_path, average) -> TaskChild:
    model, optimizer = built()
    return TaskChild(
        algorithm=StateAveraging(model, optimizer),
        lanes=2,
        argv=["true"],
        max_steps=0,
        run_id="sv",
        layout=tuple(TensorSpec(n, tuple(p.shape), "torch.float32") for n, p in model.named_parameters()),
        identity={"run_id": "sv", "task": "digits-mlp", "hparams": {}, "layout": "x"},
        store=CheckpointStore(tmp_path / "checkpoints"),
        phases=Phases(H),
        round_timeout=10.0,
        checkpoint_every=10_000,
        shared_dir=tmp_path,
        average=average,
    )


def test_a_state_childs_rounds_and_checkpoints_are_the_threads(tmp_path):
    rounds = []

    async def average(vector, weight, round_t, lanes, restore=True, payload="fp32"):
        assert not restore  # as the thread: lanes a round left partly written are put back by the caller
        rounds.append(round_t)
        if round_t == 1:  # stopped midway in lane 0, which it wrote; lane 1 had no group (left alone)
            a, b = lane_bounds(len(vector), 2)[0]
            vector[a:b].mul_(0.5)
            return [
                RoundResult(round_t, 2, None, "timed out", interrupted=True),
                RoundResult(round_t, 1, None, "alone", lane=1),
            ]
        vector.mul_(0.5)  # the group's mean, say
        return [RoundResult(round_t, 2, Done(), "", lane=lane) for lane in (0, 1)]

    t = state_child(tmp_path, average)
    try:
        # The process's side: its own model and Adam after some steps, handed over as the state vector.
        model, optimizer = built()
        tensors, n_params = state_tensors(optimizer)
        assert t.numel == sum(x.numel() for x in tensors) > 2 * sum(p.numel() for p in model.parameters())
        info = t.attach(pid=0, device="cpu", step=0)
        assert info.upload and info.numel == t.numel
        vector = t._shared.tensor
        to_vector(tensors, vector, False)
        run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # the run's first state
        with torch.no_grad():
            for x in tensors:
                x.add_(1.0)
        to_vector(tensors, vector, False)
        written = vector.clone()
        run(t.end_phase(info.session, H, 32.0, 1.0, 0.1))  # round 1: put back where it wrote
        assert rounds == [1] and torch.equal(vector, written)
        assert t.last_round.reason == "timed out" and math.isnan(t.param_distance_to_group_mean)
        end = run(t.end_phase(info.session, H, 32.0, 1.0, 0.1))  # round 2 completes: the mean (here: half)
        assert end.outcome == "completed" and torch.equal(vector, written * 0.5)
        assert torch.equal(t.snapshot.tensor, vector)  # what peers download: the state vector
        n = sum(p.numel() for p in model.parameters())
        assert t.param_distance_to_group_mean == pytest.approx(torch.dist(written[:n] * 0.5, written[:n]).item())
        from_vector(vector, tensors, False)  # the process reads it back: parameters and Adam's moments
        assert torch.equal(tensors[n_params - 1].view(-1), vector[n - tensors[n_params - 1].numel() : n])

        t._checkpoint()  # the thread's format: a fresh model and optimizer take it whole
        saved = t.store.load_latest()
        assert checkpoint_weights(saved)[0] is Kind.STATE  # what `peerd export` reads it as (run 78: not a script's)
        model2, optimizer2 = built()
        model2.load_state_dict(saved.state["model"])
        optimizer2.load_state_dict(saved.state["optimizer"])
        again = torch.empty(t.numel)
        to_vector(state_tensors(optimizer2)[0], again, False)
        assert torch.equal(again, vector)
        assert all(int(s["step"]) == 2 * H for s in saved.state["optimizer"]["state"].values())
    finally:
        t.stop()

    resumed = state_child(tmp_path, average)  # a restart: the checkpoint back into the vector
    try:
        resumed.load()
        assert resumed.step == 2 * H and torch.equal(resumed._shared.tensor, again)
    finally:
        resumed.stop()


def test_a_state_that_replaces_the_vector_drops_the_weight_its_rounds_alone_carried():
    """A round that applies nothing carries its samples to the next; a download (adopt) replaces the
    vector, and with it what those samples trained: the next round weighs its own phase only. (Read
    in the code for run 99's failure: a thawed daemon's stale phase weighed in the round after its
    download.)"""
    weights = []

    async def average(vector, weight, round_t, lanes, restore=True, payload="fp32"):
        weights.append(weight)
        if round_t in (1, 4):
            return [RoundResult(round_t, 1, None, "alone")]
        return [RoundResult(round_t, 2, Done(), "")]

    model, optimizer = built()
    algorithm = StateAveraging(model, optimizer)
    vector = torch.zeros(algorithm.numel(0))
    algorithm.bind(vector, average, "sv", None, 1)
    run(algorithm.round(1, 32.0))
    run(algorithm.round(2, 32.0))
    assert weights == [32.0, 64.0]  # the first round's samples counted in the second
    run(algorithm.round(3, 32.0))  # nothing carried after a round that applied
    run(algorithm.round(4, 16.0))  # alone again: carried...
    algorithm.adopt(torch.ones(len(vector)))  # ...until the state is replaced
    run(algorithm.round(5, 32.0))
    assert weights == [32.0, 64.0, 32.0, 16.0, 32.0] and torch.equal(vector, torch.ones(len(vector)))
