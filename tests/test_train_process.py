"""A daemon trains its --task runs in child processes (daemon/taskchild.py): a killed child is
restarted and training goes on (one that always fails: tests/test_health.py); state runs; a local
group of children; a task's buffers."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

from peerd.daemon.checkpoint import CheckpointStore
from peerd.daemon.cli import build_parser
from peerd.daemon.config import OPTIONS, load_config
from peerd.daemon.client import ControlClient
from peerd.daemon.export import export
from peerd.daemon.procs import LocalDaemon
from peerd.daemon.taskchild import STATE_FILE, child_argv
from peerd.daemon.taskproc import parse_args
from peerd.daemon.tasks import get_task
from peerd.peers.manifest import RunManifest
from peerd import PeerdError
from peerd.torch import Optimizer
from tests.helpers import peerd, scrape, wait_for


PROCESS = ["--eval-every", "1000", "--checkpoint-every", "100"]


def run_status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def process_state(d, run: str) -> dict[str, float]:
    """The run's peerd_train_process_state series: {state: value}."""
    m = scrape(d.metrics_url)
    return {dict(k)["state"]: v for (name, k), v in m.items() if name == "peerd_train_process_state"}


def test_a_killed_training_process_is_restarted_and_training_goes_on(spawn):
    d = spawn("killed-child", ["--run", "kc", "--task", "digits-mlp", *PROCESS])
    first = wait_for(
        lambda: (r := run_status(d, "kc")).step >= 100 and r.attached_pid and r, timeout=120, what="100 steps"
    )
    assert (first.train_state, first.train_process_state, first.train_process_restarts) == ("TRAINING", "RUNNING", 0)
    assert first.attached_pid not in (0, d.pid)  # a process of its own
    # The one the daemon started with itself, which imported torch while the daemon started
    # (supervisor.Preloaded); a restart starts a new one with its arguments.
    assert _argv(first.attached_pid)[-1] == "--preload", _argv(first.attached_pid)

    os.kill(first.attached_pid, signal.SIGKILL)
    again = wait_for(
        lambda: (r := run_status(d, "kc")).attached_pid not in (0, first.attached_pid) and r,
        timeout=120,
        what="a new process attached",
    )
    assert again.train_process_restarts == 1 and again.train_state == "TRAINING", again
    assert "--preload" not in _argv(again.attached_pid) and "--run" in _argv(again.attached_pid)
    assert again.step >= first.step  # it attached at the run's step, which the daemon kept
    m = scrape(d.metrics_url)
    assert m[("peerd_train_process_restarts_total", (("run", "kc"),))] == 1
    assert process_state(d, "kc") == {"RUNNING": 1, "RESTARTING": 0, "EXITED": 0, "FAILED": 0, "STOPPED": 0}
    shown = peerd("status", "--control", d.control).stdout
    assert f"kc: training process: pid {again.attached_pid}, RUNNING, restarts 1" in shown, shown
    wait_for(lambda: run_status(d, "kc").step >= again.step + 100, timeout=120, what="training goes on")
    # gRPC's fork handlers are off in the daemon (peerd/__init__.py): with them on, a fork while
    # other threads were in gRPC logged this line and could crash the new child before its exec
    # (tests/FLAKY.md: a restart "killed by SIGSEGV" within a millisecond of its start).
    assert "skipping fork() handlers" not in d.log_path.read_text(errors="replace")

    # Only the daemon's own child attaches to its task's run, even with the task's very model.
    task = get_task("digits-mlp")
    model, inner = task.build(task.parse_hparams({}), 0)
    with pytest.raises(PeerdError, match="trains task 'digits-mlp' in a process of its daemon"):
        Optimizer(inner, run="kc", daemon=d.data_dir, model=model, attach_timeout=30)
    assert d.stop() == 0
    assert not _alive(again.attached_pid)  # stopped with its daemon


@pytest.mark.heavy
def test_a_task_run_trains_in_a_local_group_of_children_one_peer_of_the_run(spawn):
    """--train-processes 2: the daemon starts two children for its DiLoCo task run, each with its
    own data, which are its local group (one WAN peer; docs/your-loop.md), averaging their gradients
    under DeAR with --dear (its overlap ratio in status and metrics); with a second daemon training
    in one child (no group, no DeAR), the rounds complete with two peers and both reach --max-steps."""
    common = ["--run", "tg", "--max-steps", "60", "--min-peers", "2", "--eval-every", "1000", "--torch-threads", "1"]
    task = ["--task", "digits-mlp", "--set", "averaging.average_every=20", "--train-processes", "2", "--dear"]
    a = spawn("tg-a", [*common, *task])
    b = spawn("tg-b", [*common, "--initial-peers", a.maddrs[0]])
    r = wait_for(lambda: (s := run_status(a, "tg")).attached_processes == 2 and s, timeout=120, what="two children")
    assert r.attached_pid not in (0, a.pid) and r.attached_group_epoch >= 1, r
    with ControlClient(b.control) as c:
        assert len(c.list_peers("tg").peers) == 1  # the group is one peer of the run
    done = [
        wait_for(lambda: (s := run_status(d, "tg")).train_state == "FINISHED" and s, timeout=180, what="60 steps")
        for d in (a, b)
    ]
    for r in done:
        assert r.step == 60 and r.train_process_state == "EXITED", r
        assert (r.last_round_outcome, r.group_size) == ("completed", 2), r
    assert done[0].last_round_digest == done[1].last_round_digest
    assert done[0].eval_metric == "accuracy" and done[0].eval_score > 0.5, done[0]  # the group's leader reports
    assert 0 <= done[0].dear_overlap_ratio <= 1 and math.isnan(done[1].dear_overlap_ratio), done
    m = scrape(a.metrics_url)
    assert m[("peerd_dear_overlap_ratio", (("run", "tg"),))] == pytest.approx(done[0].dear_overlap_ratio)
    assert not any(name == "peerd_dear_overlap_ratio" for name, _ in scrape(b.metrics_url))


def test_task_children_run_their_group_under_dear_with_dear():
    """train.dear (--dear; off by default) gives every --task child --dear."""
    manifest = RunManifest(run_id="cd", task="digits-mlp", creator="me", created_at=1.0)
    for argv, dear in (([], False), (["--dear"], True), (["--no-dear"], False)):
        start = build_parser().parse_args(["start", "--train-processes", "2", *argv])
        config = load_config({o.path: getattr(start, o.path) for o in OPTIONS if hasattr(start, o.path)}, environ={})
        child = child_argv(manifest, Path("/d"), config.train, 0)
        assert child[1:3] == ["-m", "peerd.daemon.taskproc"] and parse_args(child[3:]).dear is dear, child


def test_a_state_run_with_a_local_group_trains_in_a_child(spawn):
    """No run trains in the daemon's interpreter: a state run with --local-group (once its trainer
    thread's) trains in a child, placed in its group."""
    args = ["--run", "st", "--task", "digits-mlp", "--max-steps", "20", "--set", "averaging.algorithm=state"]
    d = spawn("state-run", [*args, "--set", "averaging.average_every=10", "--local-group", "rack", *PROCESS])
    r = wait_for(lambda: (s := run_status(d, "st")).train_state == "FINISHED" and s, timeout=60, what="20 steps")
    assert r.step == 20 and r.train_process_state == "EXITED" and r.local_group == "rack", r
    assert r.local_group_size == 1 and r.local_group_rank == 0 and r.wan_share == 1.0, r
    assert d.stop() == 0


@pytest.mark.heavy
def test_a_state_run_trains_in_children_resumes_and_a_late_peer_downloads_its_state(spawn):
    """Two daemons train a state run in their children: a completed round leaves both with the same
    state (digest, evaluation). Their checkpoints hold the model and the optimizer's state (the
    thread's format); restarted, they resume from them and train on together; a third daemon, far
    behind, downloads the run's state."""
    state = ["--task", "digits-mlp", "--set", "averaging.algorithm=state", "--set", "averaging.average_every=10"]
    args = ["--run", "sc", "--eval-every", "1000", "--checkpoint-every", "30", "--torch-threads", "1"]
    a = spawn("sc-a", [*args, *state, "--max-steps", "60", "--min-peers", "2"])
    b = spawn("sc-b", [*args, "--max-steps", "60", "--min-peers", "2", "--initial-peers", a.maddrs[0]])
    done = [
        wait_for(lambda: (s := run_status(d, "sc")).train_state == "FINISHED" and s, timeout=120, what="60 steps")
        for d in (a, b)
    ]
    for r in done:
        assert r.step == 60 and r.train_process_state == "EXITED", r  # trained in its child
        assert (r.last_round_outcome, r.group_size) == ("completed", 2), r
        assert r.param_distance_to_group_mean > 0, r
    assert done[0].last_round_digest == done[1].last_round_digest != "", done
    assert done[0].eval_score == done[1].eval_score, done  # the same parameters after the round
    for d in (a, b):
        assert d.stop() == 0
    store = CheckpointStore(a.data_dir / "runs" / "sc" / "checkpoints")
    saved = store.load_latest()
    assert saved.step == 60 and {"model", "optimizer"} <= set(saved.state), saved.state.keys()
    moments = [s["exp_avg"] for s in saved.state["optimizer"]["state"].values()]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # Adam's, from the child

    # Restarted with no step limit: each resumes from its checkpoint.
    a.args = [*args, "--min-peers", "2"]
    a.start()
    b.args = [*args, "--min-peers", "2", "--initial-peers", a.maddrs[0]]  # a's new address
    b.start()
    for d in (a, b):
        r = wait_for(
            lambda: (s := run_status(d, "sc")).train_state == "TRAINING" and s.step > 60 and s,
            timeout=120,
            what="training goes on",
        )
        assert r.resumed_from == 60 and r.error == "" and r.attached_pid, r
    wait_for(
        lambda: (s := run_status(a, "sc")).last_round_outcome == "completed" and s.group_size == 2 and s.step > 70,
        timeout=60,
        what="a round of the two",
    )

    # A late peer in a child: far behind, it downloads the run's state, then rounds with the others.
    c = spawn("sc-c", [*args, "--initial-peers", a.maddrs[0]])
    r = wait_for(lambda: (s := run_status(c, "sc")).synced_from > 60 and s, timeout=120, what="c downloads")
    assert r.attached_pid != 0 and r.resumed_from == 0, r
    wait_for(
        lambda: (s := run_status(c, "sc")).last_round_outcome == "completed" and s.step > r.synced_from and s,
        timeout=60,
        what="c completes a round",
    )
    m = scrape(c.metrics_url)
    # The state vector: the parameters and Adam's two moments, 4 bytes each.
    task = get_task("digits-mlp")
    params = sum(p.numel() for p in task.build(task.parse_hparams({}), 0)[0].parameters())
    assert m[("peerd_state_syncs_total", (("result", "ok"), ("run", "sc")))] >= 1
    assert m[("peerd_state_sync_bytes_total", (("run", "sc"),))] >= 3 * 4 * params
    for d in (a, b, c):
        assert d.stop() == 0


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().rstrip("\0").split("\0")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_tasks_buffers_are_kept_by_its_training_process_resumed_and_exported(tmp_path, monkeypatch):
    """BatchNorm's running statistics are not parameters: neither averaged nor in the daemon's
    checkpoints. The child keeps them with its optimizer's state: a restart resumes them, and
    `peerd export` writes them, so that the task's model loads the file strictly."""
    from tests.test_export import BN_TASK, BatchNormTask

    info = tmp_path / "site" / "peerd_test_export_task-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: peerd-test-export-task\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[peerd.tasks]\n{BN_TASK} = tests.test_export:BatchNormTask\n")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")) if p)}
    run = ["--run", "bn", "--task", BN_TASK, "--set", "averaging.average_every=4", "--set", "averaging.first_phase=0"]
    d = LocalDaemon(tmp_path / "d", [*run, "--max-steps", "8", *PROCESS], env=env)
    state = tmp_path / "d" / "runs" / "bn" / STATE_FILE
    try:
        for steps in (8, 16):  # the second start resumes from the first's files
            d.args = [*run, "--max-steps", str(steps), *PROCESS]
            d.start()
            wait_for(lambda: run_status(d, "bn").train_state == "FINISHED", timeout=120, what=f"{steps} steps")
            assert d.stop() == 0
            buffers = torch.load(state, weights_only=True)["buffers"]
            assert int(buffers["1.num_batches_tracked"]) == steps  # a forward in training mode per step
        monkeypatch.syspath_prepend(str(tmp_path / "site"))  # `peerd export` here builds the task's model
        r = export(tmp_path / "d", "bn", tmp_path / "model.pt")
        weights = torch.load(r.path, weights_only=True)
        task = BatchNormTask()
        model, _ = task.build(task.parse_hparams({}), 0)
        model.load_state_dict(weights, strict=True)
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(weights[name], buffers[name]), name
        assert float(weights["1.running_mean"].abs().sum()) > 0  # trained, not BatchNorm's initial zeros
    finally:
        d.kill_group()
