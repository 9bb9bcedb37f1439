"""A daemon that trains its --task runs in a child process (--train-process, daemon/taskchild.py):
a killed child is restarted and training goes on; one that always fails stops at the bound, and
status, metrics and health say so while the daemon keeps answering. (tests/test_training.py and
tests/test_restart.py run their main tests with the child too.)"""

from __future__ import annotations

import os
import signal

import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.procs import LocalDaemon
from peerd.daemon.taskchild import MAX_RESTARTS
from peerd.daemon.tasks import get_task
from peerd import PeerdError
from peerd.torch import Optimizer
from tests.failing_task import MESSAGE, NAME, plugin_env
from tests.helpers import THREAD, peerd, scrape, wait_for

pytestmark = pytest.mark.slow

PROCESS = ["--train-process", "--eval-every", "1000", "--checkpoint-every", "100"]


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

    os.kill(first.attached_pid, signal.SIGKILL)
    again = wait_for(
        lambda: (r := run_status(d, "kc")).attached_pid not in (0, first.attached_pid) and r,
        timeout=120,
        what="a new process attached",
    )
    assert again.train_process_restarts == 1 and again.train_state == "TRAINING", again
    assert again.step >= first.step  # it attached at the run's step, which the daemon kept
    m = scrape(d.metrics_url)
    assert m[("peerd_train_process_restarts_total", (("run", "kc"),))] == 1
    assert process_state(d, "kc") == {"RUNNING": 1, "RESTARTING": 0, "EXITED": 0, "FAILED": 0, "STOPPED": 0}
    shown = peerd("status", "--control", d.control).stdout
    assert f"kc: training process: pid {again.attached_pid}, RUNNING, restarts 1" in shown, shown
    wait_for(lambda: run_status(d, "kc").step >= again.step + 100, timeout=120, what="training goes on")

    # Only the daemon's own child attaches to its task's run, even with the task's very model.
    task = get_task("digits-mlp")
    model, inner = task.build(task.parse_hparams({}), 0)
    with pytest.raises(PeerdError, match="trains task 'digits-mlp' in a process of its daemon"):
        Optimizer(inner, run="kc", daemon=d.data_dir, model=model, attach_timeout=30)
    assert d.stop() == 0
    assert not _alive(again.attached_pid)  # stopped with its daemon


def test_a_training_process_that_always_fails_stops_at_the_bound_and_health_says_so(tmp_path):
    d = LocalDaemon(tmp_path / "d", ["--run", "doomed", "--task", NAME, *PROCESS], env=plugin_env(tmp_path / "site"))
    try:
        d.start()
        r = wait_for(
            lambda: (s := run_status(d, "doomed")).train_state == "FAILED" and s,
            timeout=240,
            what="the run FAILED after the restarts",
        )
        assert (r.train_process_state, r.train_process_restarts) == ("FAILED", MAX_RESTARTS), r
        assert f"failed {MAX_RESTARTS + 1} times" in r.error and MESSAGE in r.error, r.error
        m = scrape(d.metrics_url)
        assert m[("peerd_train_state", (("run", "doomed"), ("state", "FAILED")))] == 1
        assert m[("peerd_train_process_restarts_total", (("run", "doomed"),))] == MAX_RESTARTS
        assert process_state(d, "doomed")["FAILED"] == 1

        health = peerd("health", "--control", d.control)
        assert health.returncode == 1 and health.stdout.splitlines()[0] == "NOT_SERVING", health
        assert "run doomed: FAILED: training process exited with status 1" in health.stdout, health.stdout
        with ControlClient(d.control) as c:
            assert c.status().state == "READY"  # the daemon itself is up and answers

        # Leaving the failed run clears it, as for a thread's failure (tests/test_health.py).
        assert peerd("leave", "doomed", "--control", d.control).returncode == 0
        assert peerd("health", "--control", d.control).returncode == 0
        assert d.stop() == 0
    finally:
        d.kill_group()


def test_a_state_run_keeps_the_thread_and_says_why(spawn):
    args = ["--run", "st", "--task", "digits-mlp", "--max-steps", "20", "--set", "averaging.algorithm=state"]
    d = spawn("state-run", [*args, "--set", "averaging.average_every=10", *PROCESS])
    r = wait_for(lambda: (s := run_status(d, "st")).train_state == "FINISHED" and s, timeout=60, what="20 steps")
    assert r.step == 20 and r.train_process_state == "" and r.attached_pid == 0, r
    assert "trains in a thread of the daemon, not a child process: averaging.algorithm=state" in d.log_tail(200)
    assert d.stop() == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_restart_that_switches_train_process_on_or_off_resumes_the_run(spawn):
    args = ["--run", "sw", "--task", "digits-mlp", "--eval-every", "1000", "--checkpoint-every", "50"]
    d = spawn("switch", [*args, *THREAD])
    for training, then in ((["--train-process"], "process"), (THREAD, "thread")):
        wait_for(lambda: run_status(d, "sw").step >= 100, timeout=120, what="100 steps")
        assert d.stop() == 0
        stopped = max(int(p.name[5:17]) for p in (d.data_dir / "runs" / "sw" / "checkpoints").glob("ckpt-*.peerd"))
        d.args = [*args, *training]
        d.start()
        r = wait_for(
            lambda: (s := run_status(d, "sw")).train_state == "TRAINING" and s.step > stopped and s,
            timeout=120,
            what=f"the {then} trains on",
        )
        assert r.resumed_from == stopped and r.error == "", (then, r)
        assert bool(r.train_process_state) == (then == "process"), r
    assert d.stop() == 0
