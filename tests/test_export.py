"""`peerd export` (issue 16): a run's weights out of its checkpoints, as a plain state_dict that
torch.load(weights_only=True) reads and the task's model loads with strict=True.

State checkpoints (a state run's: the task's model and optimizer, daemon/algorithms.py) and DiLoCo
checkpoints of the format the daemon's trainer thread wrote (the inner "model" and the outer state;
files of older releases) are written here from real inner steps of the task: a state run's exported
weights are the model, a DiLoCo run's θ, not the inner parameters. A plug-in task with buffers and optimizer
groups in another order than model.parameters() checks how θ maps onto names. A run of a user's own
script (and a task's child: both write a model_layout) is a checkpoint written here by hand.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from peerd.daemon.checkpoint import CheckpointStore, identity_of
from peerd.daemon.cli import main
from peerd.daemon.export import ExportError, Kind, export
from peerd.daemon.flat import from_flat, to_flat
from peerd.daemon.tasks import Batch, EvalResult, Hparams, Task, generator, get_task, seeded

BN_TASK = "export-bn"


class BatchNormTask(Task):
    """Buffers (BatchNorm's running statistics, an int64 counter among them), and the optimizer's
    groups in another order than model.parameters(): biases first. θ follows the optimizer."""

    name = BN_TASK
    hparams_type = Hparams

    def build(self, hparams: Hparams, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        with seeded(seed):
            model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
            {"params": [p for n, p in named if not n.endswith("bias")]},
        ]
        return model, torch.optim.AdamW(groups, lr=1e-2)

    def data(self, hparams: Hparams, peer_seed: int) -> Iterator[Batch]:
        g = generator(peer_seed)
        while True:
            x = torch.randn(hparams.batch_size, 4, generator=g)
            yield Batch(x, (x[:, 0] > 0).long())

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch.inputs), batch.targets)

    def evaluate(self, model: nn.Module, hparams: Hparams) -> EvalResult:
        return EvalResult(score=0.0, metric="none", higher_is_better=True, loss=0.0)


@pytest.fixture
def bn_task_installed(tmp_path, monkeypatch):
    """BatchNormTask registered as a package would (a `peerd.tasks` entry point in a .dist-info)."""
    info = tmp_path / "site" / "peerd_test_export_task-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: peerd-test-export-task\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[peerd.tasks]\n{BN_TASK} = tests.test_export:BatchNormTask\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def inner_step(t: Task, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> None:
    """One step of the task's own optimizer, as its child takes it."""
    with torch.enable_grad():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        t.loss(model, batch).backward()
        optimizer.step()


@torch.no_grad()
def write_state(data_dir: Path, run: str, task: str, max_steps: int, checkpoint_every: int) -> None:
    """Checkpoints of a lone peer's state run, as a state child's daemon writes them (the model and
    the optimizer after real inner steps of the task; init seed 1, peer seed 2), at every
    `checkpoint_every` steps and at the end. A lone peer's rounds find no group: nothing else moves."""
    t = get_task(task)
    hparams = t.parse_hparams({})
    model, optimizer = t.build(hparams, 1)
    store = CheckpointStore(data_dir / "runs" / run / "checkpoints")
    identity = identity_of(run, t.name, {k: str(v) for k, v in hparams.to_dict().items()}, model)
    data = t.data(hparams, 2)
    for step in range(1, max_steps + 1):
        inner_step(t, model, optimizer, next(data))
        if step % checkpoint_every == 0 or step == max_steps:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "samples": 0, "local_step": step}
            store.save(step, state, identity)


@torch.no_grad()
def write_diloco(data_dir: Path, run: str, task: str, max_steps: int, checkpoint_every: int, every: int = 4) -> None:
    """Checkpoints of a lone peer's DiLoCo run in the thread's format, at every `checkpoint_every`
    steps and at the end: the inner model and optimizer after real inner steps of the task (init seed
    1, peer seed 2), and the outer state [θ; m]. A lone round every `every` steps takes θ to the
    inner parameters (an outer step of lr 1, no momentum); the end leaves the model at θ, as the
    thread's finish did."""
    t = get_task(task)
    hparams = t.parse_hparams({})
    model, optimizer = t.build(hparams, 1)
    params = [p for group in optimizer.param_groups for p in group["params"]]  # θ's order (daemon/flat.py)
    n = sum(p.numel() for p in params)
    outer = torch.zeros(2 * n)
    to_flat(params, outer[:n])
    store = CheckpointStore(data_dir / "runs" / run / "checkpoints")
    identity = identity_of(run, t.name, {k: str(v) for k, v in hparams.to_dict().items()}, model)
    data = t.data(hparams, 2)

    def save(step: int) -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "samples": 0, "local_step": step}
        store.save(step, {**state, "outer": outer.clone(), "residual": torch.zeros(n)}, identity)

    for step in range(1, max_steps + 1):
        inner_step(t, model, optimizer, next(data))
        if step % every == 0:
            to_flat(params, outer[:n])
        if step == max_steps:
            from_flat(outer[:n], params)
        if step % checkpoint_every == 0 or step == max_steps:
            save(step)


def checkpoint_of(data_dir: Path, run: str, step: int):
    return CheckpointStore.read(data_dir / "runs" / run / "checkpoints" / f"ckpt-{step:012d}.peerd")


def theta_by_name(task: str, outer: torch.Tensor) -> dict[str, torch.Tensor]:
    """θ (the first half of [θ; m]) cut by the trainer's order of the parameters: the optimizer's."""
    t = get_task(task)
    model, optimizer = t.build(t.parse_hparams({}), 0)
    names = {id(p): n for n, p in model.named_parameters()}
    out, offset = {}, 0
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        out[names[id(p)]] = outer[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    assert 2 * offset == outer.numel()
    return out


def load_strict(task: str, path: Path) -> tuple[dict[str, torch.Tensor], nn.Module]:
    weights = torch.load(path, weights_only=True)
    assert type(weights) is dict and all(torch.is_tensor(v) for v in weights.values())
    t = get_task(task)
    model, _ = t.build(t.parse_hparams({}), 0)
    model.load_state_dict(weights, strict=True)
    return weights, model


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One data dir with two digits-mlp runs: `dl` under DiLoCo, checkpoints at steps 6 (mid-phase:
    the inner parameters are not θ) and 7 (the end: the model left at θ); `st` under
    algorithm=state, checkpoints at 4 and 5."""
    data_dir = tmp_path_factory.mktemp("data")
    write_diloco(data_dir, "dl", "digits-mlp", max_steps=7, checkpoint_every=3)
    write_state(data_dir, "st", "digits-mlp", max_steps=5, checkpoint_every=4)
    return data_dir


def test_diloco_exports_theta_not_the_inner_parameters(runs, tmp_path):
    ckpt = checkpoint_of(runs, "dl", 6)
    r = export(runs, "dl", tmp_path / "model.pt", step=6)
    assert (r.step, r.kind, r.checkpoint, r.warnings) == (6, Kind.DILOCO, ckpt.path, ())
    weights, model = load_strict("digits-mlp", r.path)
    theta = theta_by_name("digits-mlp", ckpt.state["outer"])
    assert weights.keys() == ckpt.state["model"].keys() == theta.keys()
    for name, value in theta.items():
        assert torch.equal(weights[name], value), name
        assert torch.equal(model.get_parameter(name).detach(), value), name
    assert any(not torch.equal(ckpt.state["model"][n], theta[n]) for n in theta), (
        "mid-phase: inner params differ from θ"
    )
    assert r.parameters == sum(v.numel() for v in theta.values()) == ckpt.state["outer"].numel() // 2

    # By default the newest checkpoint: the end of training, where the model was left at θ.
    r = export(runs, "dl", tmp_path / "newest.pt")
    newest = checkpoint_of(runs, "dl", 7)
    assert (r.step, r.kind) == (7, Kind.DILOCO)
    weights, _ = load_strict("digits-mlp", r.path)
    for name, value in theta_by_name("digits-mlp", newest.state["outer"]).items():
        assert torch.equal(weights[name], value), name
    initial, _ = get_task("digits-mlp").build(get_task("digits-mlp").parse_hparams({}), 1)  # the trainer's init_seed
    assert not torch.equal(weights["0.weight"], initial[0].weight.detach()), "the round at step 4 moved θ"


def test_state_exports_the_model(runs, tmp_path):
    r = export(runs, "st", tmp_path / "model.pt")
    assert (r.step, r.kind, r.parameters) == (5, Kind.STATE, 64 * 128 + 128 + 128 * 10 + 10)
    weights, _ = load_strict("digits-mlp", r.path)
    model_state = checkpoint_of(runs, "st", 5).state["model"]
    assert weights.keys() == model_state.keys()
    assert all(torch.equal(weights[k], v) for k, v in model_state.items())


def test_theta_maps_by_the_optimizers_order_and_buffers_come_from_the_model(bn_task_installed, tmp_path):
    write_diloco(tmp_path, "bn", BN_TASK, max_steps=6, checkpoint_every=3)
    ckpt = checkpoint_of(tmp_path, "bn", 3)  # mid-phase, before any round: θ is still the start
    r = export(tmp_path, "bn", tmp_path / "model.pt", step=3)
    weights, model = load_strict(BN_TASK, r.path)
    theta = theta_by_name(BN_TASK, ckpt.state["outer"])
    buffers = {n for n, _ in model.named_buffers()}
    assert buffers == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert weights.keys() == theta.keys() | buffers
    for name, value in theta.items():
        assert torch.equal(weights[name], value), name
    for name in buffers:  # not averaged: this peer's own statistics, as the inner model holds them
        assert torch.equal(weights[name], ckpt.state["model"][name]), name
    assert weights["1.num_batches_tracked"].dtype == torch.int64 and int(weights["1.num_batches_tracked"]) == 3
    assert r.parameters == sum(v.numel() for v in theta.values())


def test_a_scripts_run_is_cut_by_its_model_layout(tmp_path):
    layout = [
        ["encoder.weight", [3, 4], "torch.float32"],
        ["encoder.bias", [3], "torch.bfloat16"],
        ["scale", [], "torch.float16"],
    ]
    theta = torch.randn(16)
    outer = torch.cat([theta, torch.randn(16)])  # [θ; m]
    state = {"outer": outer, "residual": torch.zeros(16), "model_layout": layout, "samples": 640, "local_step": 20}
    CheckpointStore(tmp_path / "runs" / "mine" / "checkpoints").save(20, state, {"run_id": "mine", "task": ""})
    r = export(tmp_path, "mine", tmp_path / "model.pt")
    assert (r.step, r.kind, r.parameters) == (20, Kind.SCRIPT, 16)
    weights = torch.load(r.path, weights_only=True)
    assert list(weights) == ["encoder.weight", "encoder.bias", "scale"]
    assert torch.equal(weights["encoder.weight"], theta[:12].view(3, 4))
    assert weights["encoder.bias"].dtype == torch.bfloat16 and torch.equal(
        weights["encoder.bias"], theta[12:15].bfloat16()
    )
    assert weights["scale"].shape == () and weights["scale"].dtype == torch.float16
    assert torch.equal(weights["scale"], theta[15].half())

    # A layout that does not cover θ is refused, not cut short.
    state["model_layout"] = layout[:2]
    CheckpointStore(tmp_path / "runs" / "short" / "checkpoints").save(1, state, {"run_id": "short", "task": ""})
    with pytest.raises(ExportError, match="model_layout holds 15 values, its outer state 2 x 16"):
        export(tmp_path, "short", tmp_path / "short.pt")


def test_a_checkpoint_that_does_not_verify_is_skipped_for_the_next_newest(runs, tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(runs / "runs" / "dl", data_dir / "runs" / "dl")
    newest = data_dir / "runs" / "dl" / "checkpoints" / "ckpt-000000000007.peerd"
    newest.write_bytes(newest.read_bytes()[:1000])  # a torn write
    r = export(data_dir, "dl", tmp_path / "model.pt")
    assert r.step == 6
    (warning,) = r.warnings
    assert warning.startswith("checkpoint ckpt-000000000007.peerd skipped: payload is ") and warning.endswith(
        "(torn write)"
    )
    with pytest.raises(ExportError, match="no checkpoint of step 7 verifies .*torn write"):
        export(data_dir, "dl", tmp_path / "model.pt", step=7)


def test_checkpoints_of_another_model_beside_the_one_exported_are_named(runs, tmp_path):
    """E.g. a run created anew with the same ID and other hyper-parameters: its steps start again."""
    data_dir = tmp_path / "data"
    shutil.copytree(runs / "runs" / "dl", data_dir / "runs" / "dl")
    ckpt = checkpoint_of(runs, "dl", 7)
    identity = {**ckpt.identity, "hparams": {**ckpt.identity["hparams"], "lr": "0.01"}}
    CheckpointStore(data_dir / "runs" / "dl" / "checkpoints").save(2, ckpt.state, identity)
    r = export(data_dir, "dl", tmp_path / "model.pt")
    assert r.step == 7
    assert r.warnings == (
        "checkpoints of another model are kept beside ckpt-000000000007.peerd: "
        "ckpt-000000000002.peerd (hyper-parameters lr=0.01 (now 0.003)); --step picks one",
    )
    assert export(data_dir, "dl", tmp_path / "model.pt", step=2).step == 2


def test_what_cannot_be_exported_is_named(runs, tmp_path):
    out = tmp_path / "model.pt"
    with pytest.raises(ExportError, match=r"no run 'nope' in .* \(runs there: dl, st\)"):
        export(runs, "nope", out)
    with pytest.raises(ExportError, match="it has no runs: is it the daemon's --data-dir"):
        export(tmp_path / "empty", "dl", out)
    (tmp_path / "runs" / "fresh").mkdir(parents=True)
    with pytest.raises(ExportError, match="run 'fresh' has no checkpoint yet"):
        export(tmp_path, "fresh", out)
    with pytest.raises(ExportError, match=r"no checkpoint of step 5 \(steps kept: 6, 7\)"):
        export(runs, "dl", out, step=5)
    with pytest.raises(ExportError, match="is a directory"):
        export(runs, "dl", tmp_path)
    with pytest.raises(ExportError, match="cannot write .*No such file or directory"):
        export(runs, "dl", tmp_path / "missing" / "model.pt")
    assert not out.exists()

    # A checkpoint whose task this machine does not have cannot be mapped onto names.
    identity = {"run_id": "other", "task": "not-installed", "hparams": {}, "layout": "x"}
    CheckpointStore(tmp_path / "runs" / "other" / "checkpoints").save(
        3, {"model": {}, "outer": torch.zeros(4)}, identity
    )
    with pytest.raises(ExportError, match="of task 'not-installed', which cannot be built here: no task named"):
        export(tmp_path, "other", out)


def test_the_cli_writes_the_weights_or_exits_2_with_one_line(runs, tmp_path, capsys):
    out = tmp_path / "model.pt"
    assert main(["export", "dl", "--out", str(out), "--data-dir", str(runs)]) == 0
    stdout = capsys.readouterr().out
    assert stdout == f"wrote {out}: run dl at step 7, 9,610 parameters (θ, DiLoCo's outer parameters)\n"
    load_strict("digits-mlp", out)

    assert main(["export", "st", "--out", str(out), "--data-dir", str(runs), "--step", "4", "--json"]) == 0
    assert '"kind": "state"' in capsys.readouterr().out

    assert main(["export", "dl", "--out", str(out), "--data-dir", str(runs), "--step", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "peerd: error: run 'dl' has no checkpoint of step 3 (steps kept: 6, 7)\n"

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "θ" in capsys.readouterr().out


def test_export_while_a_daemon_writes_checkpoints(tmp_path):
    """A daemon writes a checkpoint every step and deletes the older ones meanwhile: every export
    reads a whole one."""
    writer = threading.Thread(target=write_state, args=(tmp_path, "busy", "digits-mlp", 200, 1), daemon=True)
    writer.start()
    steps = []
    deadline = time.monotonic() + 60
    while (writer.is_alive() or not steps) and time.monotonic() < deadline:
        try:
            r = export(tmp_path, "busy", tmp_path / "model.pt")
        except ExportError:  # no checkpoint yet
            assert not steps
            time.sleep(0.01)
            continue
        load_strict("digits-mlp", r.path)
        steps.append(r.step)
    writer.join(60)
    assert len(steps) >= 2 and steps == sorted(steps), steps
