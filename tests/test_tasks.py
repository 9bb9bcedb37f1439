"""Tasks: the registry (built-ins and entry points), hyper-parameter checks, data streams, and
short single-process trainings that must actually learn."""

from __future__ import annotations

import itertools
import subprocess
import sys
import math
from dataclasses import dataclass
from importlib.metadata import EntryPoint

import pytest
import torch

from peerd.daemon.tasks import (
    ENTRY_POINT_GROUP,
    Batch,
    EvalResult,
    Hparams,
    HparamsError,
    InvalidTaskName,
    Task,
    TaskLoadError,
    TaskNotFound,
    available_tasks,
    evaluating,
    generator,
    get_task,
    seeded,
    train_single_process,
)
from peerd.daemon.tasks import registry


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Small models run faster on one thread, and far faster when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- registry ---------------------------------------------------------------------------------


def test_builtins_are_listed_and_load():
    assert {"charlm", "digits-mlp"} <= set(available_tasks())
    for name in ("charlm", "digits-mlp"):
        task = get_task(name)
        assert isinstance(task, Task) and task.name == name


def test_unknown_task_lists_installed_ones():
    with pytest.raises(TaskNotFound, match=r"no task named 'nope'.*installed tasks: charlm, digits-mlp.*peerd\.tasks"):
        get_task("nope")


@pytest.mark.parametrize("name", ["", "bad name", "../digits-mlp", "-x", "x" * 65])
def test_malformed_task_name(name):
    with pytest.raises(InvalidTaskName):
        get_task(name)


# --- hyper-parameters -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task,values,message",
    [
        ("digits-mlp", {"hiden": 64}, r"task 'digits-mlp': unknown hyper-parameter 'hiden'; known: batch_size, hidden"),
        ("digits-mlp", {"lr": "0.1"}, r"'lr' must be float, got str"),
        ("digits-mlp", {"hidden": 64.0}, r"'hidden' must be int, got float"),
        ("digits-mlp", {"hidden": True}, r"'hidden' must be int, got bool"),
        ("digits-mlp", {"lr": float("nan")}, r"'lr' must be finite"),
        ("digits-mlp", {"lr": 0}, r"'lr' must be positive"),
        ("digits-mlp", {"optimizer": "lbfgs"}, r"'optimizer' must be 'adam' or 'sgd'"),
        ("digits-mlp", {"batch_size": 10**9}, r"'batch_size' must be at most"),
        ("charlm", {"n_heads": 3}, r"'n_heads' must be a divisor of d_model"),
        ("charlm", {"corpus_bytes": 10}, r"'corpus_bytes' must be in"),
        ("charlm", [("lr", 1.0)], r"must be a mapping"),
    ],
)
def test_bad_hparams_name_the_key(task, values, message):
    with pytest.raises(HparamsError, match=message):
        get_task(task).parse_hparams(values)


def test_hparams_round_trip_and_accept_ints_for_floats():
    task = get_task("digits-mlp")
    defaults = task.default_hparams()
    assert task.parse_hparams(defaults).to_dict() == defaults
    h = task.parse_hparams({"lr": 1, "optimizer": "sgd"})
    assert h.lr == 1.0 and isinstance(h.lr, float) and h.hidden == defaults["hidden"]


# --- data streams -----------------------------------------------------------------------------


def _first(task: Task, peer_seed: int, n: int = 3) -> list[Batch]:
    return list(itertools.islice(task.data(task.parse_hparams({"batch_size": 8}), peer_seed), n))


def _same(a: list[Batch], b: list[Batch]) -> bool:
    return all(torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["digits-mlp", "charlm"])
def test_data_is_deterministic_per_peer_seed_and_differs_across_seeds(name):
    task = get_task(name)
    batches = _first(task, 1)
    assert [b.samples for b in batches] == [8, 8, 8]
    assert _same(batches, _first(task, 1))
    assert not _same(batches, _first(task, 2))


def test_charlm_targets_are_inputs_shifted_by_one():
    batch = _first(get_task("charlm"), 0, 1)[0]
    assert batch.inputs.shape == batch.targets.shape == (8, 64)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_digits_stream_runs_across_epochs():
    """More batches than one epoch holds: the stream is endless, and every batch is full."""
    task = get_task("digits-mlp")
    stream = task.data(task.parse_hparams({"batch_size": 100}), 0)
    assert all(b.samples == 100 for b in itertools.islice(stream, 40))  # 4,000 samples, ~2.8 epochs


# --- learning ---------------------------------------------------------------------------------


def test_digits_are_scikit_learns_whether_read_from_its_file_or_through_load_digits(monkeypatch):
    """The task reads the file scikit-learn ships without importing it; under a layout where the
    file is not found it asks load_digits. Both give scikit-learn's data set."""
    import importlib.util

    import numpy as np
    from sklearn.datasets import load_digits

    from peerd.daemon.tasks import digits

    expected = load_digits()
    read = digits._digits_rows()
    assert np.array_equal(read[:, :-1], expected.data) and np.array_equal(read[:, -1], expected.target)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert np.array_equal(digits._digits_rows(), read)


def test_the_daemon_builds_a_tasks_optimizer_without_importing_dynamo_and_restores_torch():
    """taskchild.optimizer_without_dynamo: the build imports no torch._dynamo (1.0 s of CPU), and
    afterwards torch's wrappers are as they were (the next call imports it, as torch does). In a
    fresh interpreter: this one may have imported it already."""
    code = """
import sys, torch
from peerd.daemon.taskchild import optimizer_without_dynamo
from peerd.daemon.tasks import get_task
task = get_task("digits-mlp")
with optimizer_without_dynamo():
    model, optimizer = task.build(task.parse_hparams({}), 0)
assert "torch._dynamo" not in sys.modules, "imported inside the block"
wrapped = [m.__wrapped__ for m in vars(torch.optim.Optimizer).values() if hasattr(m, "__wrapped__")]
assert wrapped and not any(hasattr(f, "__dynamo_disable") for f in wrapped), "left patched"
optimizer.zero_grad()
assert "torch._dynamo" in sys.modules, "torch's own behaviour after the block"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_digits_mlp_learns():
    """300 steps of 32 (about 7 epochs, ~0.1 s on one core) gave 95.6-96.1 % over 8 seeds."""
    task = get_task("digits-mlp")
    h = task.parse_hparams()
    result = train_single_process(task, h, steps=300, batch_size=32, seed=0)
    assert (result.metric, result.higher_is_better) == ("accuracy", True)
    assert result.score >= 0.93, result
    assert train_single_process(task, h, steps=300, batch_size=32, seed=0) == result  # deterministic


def test_charlm_learns():
    """From uniform (ln 256 = 5.55 nats/char) to about 2.6 after 30 steps; 1 nat of margin."""
    task = get_task("charlm")
    h = task.parse_hparams()
    model, _ = task.build(h, seed=0)  # the same model train_single_process starts from
    before = task.evaluate(model, h)
    assert before.loss == pytest.approx(math.log(256), abs=0.15)
    assert before.score == pytest.approx(before.loss / math.log(2))
    after = train_single_process(task, h, steps=30, batch_size=h.batch_size, seed=0)
    assert (after.metric, after.higher_is_better) == ("bits_per_char", False)
    assert after.loss < before.loss - 1.0, (before, after)
    assert after.better_than(before)


def test_build_is_seeded_and_leaves_global_rng_alone():
    task = get_task("digits-mlp")
    h = task.parse_hparams()
    state = torch.random.get_rng_state()
    a, _ = task.build(h, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    b, _ = task.build(h, seed=7)
    c, _ = task.build(h, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))


# --- a task registered by another package -------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class LineHparams(Hparams):
    lr: float = 0.1


class LineTask(Task):
    """Fit y = 3x - 1 with one linear unit: the smallest task that still trains."""

    name = "line-fit"
    hparams_type = LineHparams

    def build(self, hparams, seed):
        with seeded(seed):
            model = torch.nn.Linear(1, 1)
        return model, torch.optim.SGD(model.parameters(), lr=hparams.lr)

    def data(self, hparams, peer_seed):
        g = generator(peer_seed)
        while True:
            x = torch.rand(hparams.batch_size, 1, generator=g)
            yield Batch(x, 3 * x - 1)

    def loss(self, model, batch):
        return torch.nn.functional.mse_loss(model(batch.inputs), batch.targets)

    def evaluate(self, model, hparams):
        x = torch.linspace(0, 1, 11)[:, None]
        with evaluating(model):
            mse = self.loss(model, Batch(x, 3 * x - 1)).item()
        return EvalResult(score=mse, metric="mse", higher_is_better=False, loss=mse)


class NotATask:
    name = "not-a-task"


def _fake_entry_points(monkeypatch, *pairs: tuple[str, str]) -> None:
    """Make the registry see these (name, "module:Class") entry points, as if packages declared them."""
    eps = [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in pairs]

    def entry_points(*, group):
        assert group == ENTRY_POINT_GROUP
        return eps

    monkeypatch.setattr(registry, "entry_points", entry_points)


def test_entry_point_task_is_listed_loaded_and_trains(monkeypatch):
    _fake_entry_points(monkeypatch, ("line-fit", f"{__name__}:LineTask"))
    assert available_tasks() == ["charlm", "digits-mlp", "line-fit"]
    task = get_task("line-fit")
    assert isinstance(task, LineTask)
    assert task.default_hparams() == {"batch_size": 32, "lr": 0.1}
    assert train_single_process(task, task.parse_hparams(), steps=200, batch_size=16, seed=0).score < 0.01


def test_entry_point_cannot_take_a_builtin_name(monkeypatch):
    _fake_entry_points(monkeypatch, ("digits-mlp", f"{__name__}:LineTask"))
    assert type(get_task("digits-mlp")).__name__ == "DigitsMLP"


@pytest.mark.parametrize(
    "value,message",
    [
        ("no_such_package_xyz.tasks:Task", r"failed to load: ModuleNotFoundError"),
        (f"{__name__}:NotATask", r"is not a subclass of peerd\.daemon\.tasks\.Task"),
        (f"{__name__}:Task", r"declares the name None"),
    ],
)
def test_broken_entry_point_is_a_clear_error(monkeypatch, value, message):
    _fake_entry_points(monkeypatch, ("broken", value))
    assert "broken" in available_tasks()  # listing imports nothing, so it cannot notice
    with pytest.raises(TaskLoadError, match=rf"task 'broken' .*{message}"):
        get_task("broken")


def test_entry_point_registered_twice_is_refused(monkeypatch):
    _fake_entry_points(monkeypatch, ("line-fit", f"{__name__}:LineTask"), ("line-fit", "other.pkg:LineTask"))
    with pytest.raises(TaskLoadError, match="registered more than once"):
        get_task("line-fit")


def test_the_trainer_gathers_all_of_the_state_vector_or_one_slice():
    """The trainer's rounds run without the engine's backup (restore=False) and copy back from the
    model any lane that applied no result: to_flat(start, end) must write that slice and nothing else."""
    from peerd.daemon.flat import from_flat, to_flat

    tensors = [torch.arange(5.0).view(5, 1), torch.arange(10.0, 17.0), torch.tensor(99.0)]
    flat = torch.empty(13)
    to_flat(tensors, flat)
    assert flat.tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 99]
    for start, end in [(0, 13), (3, 7), (5, 12), (12, 13), (4, 5), (6, 6)]:
        part = torch.full((13,), -1.0)
        to_flat(tensors, part, start, end)
        assert torch.equal(part[start:end], flat[start:end]), (start, end)
        assert (part[:start] == -1).all() and (part[end:] == -1).all(), (start, end)
    from_flat(flat * 2, tensors)
    assert tensors[1].tolist() == [20, 22, 24, 26, 28, 30, 32] and float(tensors[2]) == 198


def test_a_state_round_puts_back_only_lanes_it_may_have_written():
    """After a round with restore=False, a state child copies back from the vector before it the lanes that ran
    the engine without applying a result, were interrupted, or got no result; a lane alone or without
    a group was not touched and costs no copy."""
    from peerd.daemon.diloco import lanes_to_put_back
    from peerd.peers.averaging import RoundResult
    from peerd.peers.collective import Outcome, Status

    def outcome(status):
        return Outcome(status, "", 1, (), (), 0, 0, 0.0, b"")

    results = [
        RoundResult(5, 3, outcome(Status.COMPLETED), "", lane=0),
        RoundResult(5, 3, outcome(Status.ABORTED), "", lane=1),
        RoundResult(5, 1, None, "alone in the run", lane=2),
        RoundResult(5, 1, None, "lane 3 failed: OSError", lane=3, interrupted=True),
        RoundResult(5, 2, outcome(Status.PARTIAL), "", lane=4),
    ]
    assert lanes_to_put_back(results, 6) == [1, 3, 5]  # lane 5: no result at all
    assert lanes_to_put_back([RoundResult(5, 1, None, "round timed out", interrupted=True)], 3) == [0, 1, 2]
    assert lanes_to_put_back([RoundResult(5, 1, None, "no group: alone")], 1) == []
