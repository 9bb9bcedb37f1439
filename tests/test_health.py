"""What a daemon says about the runs it trains: peerd_train_state, and `peerd health` when a training
process FAILED (past its restarts; a killed one restarted: tests/test_train_process.py)."""

from __future__ import annotations

import json


from peerd.daemon.client import ControlClient
from peerd.daemon.metrics import TRAIN_STATES
from peerd.daemon.procs import LocalDaemon
from peerd.daemon.taskchild import MAX_RESTARTS
from tests.failing_task import MESSAGE, NAME, plugin_env
from tests.helpers import peerd, scrape, wait_for


def test_train_states_match_the_metrics_names():
    from peerd.daemon.attached import TrainState

    assert TRAIN_STATES == tuple(s.value for s in TrainState)


def train_state(d: LocalDaemon, run: str) -> dict[str, float]:
    """The run's peerd_train_state series: {state: value}."""
    series = [(dict(labels), v) for (name, labels), v in scrape(d.metrics_url).items() if name == "peerd_train_state"]
    return {labels["state"]: v for labels, v in series if labels["run"] == run}


def test_a_failed_training_process_is_in_metrics_and_health_and_the_others_train_on(tmp_path):
    """A run whose training process always fails (tests/failing_task.py) stops at the restart bound:
    FAILED in status, metrics and health, while the daemon answers and its other run trains on;
    leaving the failed run clears it."""
    args = ["--run", "fine", "--task", "digits-mlp", "--eval-every", "1000", "--checkpoint-every", "100"]
    d = LocalDaemon(tmp_path / "d", args, env=plugin_env(tmp_path / "site"))
    try:
        d.start()
        wait_for(lambda: train_state(d, "fine").get("TRAINING") == 1, timeout=60, what="run fine TRAINING")
        r = peerd("health", "--control", d.control)
        assert r.returncode == 0 and r.stdout.splitlines() == ["SERVING", "run fine: TRAINING"], r

        r = peerd("join", "doomed", "--task", NAME, "--control", d.control)
        assert r.returncode == 0, r

        def failed():
            states = train_state(d, "doomed")
            return states.get("FAILED") == 1 and states

        # Restarted MAX_RESTARTS times after a back-off of 1 s, doubling: about 20 s.
        states = wait_for(failed, timeout=240, what="run doomed FAILED after the restarts")
        assert states == {s: (1 if s == "FAILED" else 0) for s in TRAIN_STATES}
        assert train_state(d, "fine")["TRAINING"] == 1  # the other run trains on
        with ControlClient(d.control) as c:
            assert c.status().state == "READY"  # the daemon itself is up and answers
            r = next(r for r in c.status().runs if r.run_id == "doomed")
        assert (r.train_process_state, r.train_process_restarts) == ("FAILED", MAX_RESTARTS), r
        assert f"failed {MAX_RESTARTS + 1} times" in r.error and MESSAGE in r.error, r.error
        m = scrape(d.metrics_url)
        assert m[("peerd_train_process_restarts_total", (("run", "doomed"),))] == MAX_RESTARTS
        assert m[("peerd_train_process_state", (("run", "doomed"), ("state", "FAILED")))] == 1

        r = peerd("health", "--control", d.control)
        assert r.returncode == 1, r
        assert r.stdout.splitlines()[0] == "NOT_SERVING"
        assert "run doomed: FAILED: training process exited with status 1" in r.stdout, r.stdout
        assert "run fine: TRAINING" in r.stdout, r.stdout
        r = peerd("health", "--control", d.control, "--json")
        assert r.returncode == 1 and json.loads(r.stdout)["runs"]["doomed"]["train_state"] == "FAILED", r

        # Leaving the failed run is how an operator clears it: the daemon is healthy again.
        assert peerd("leave", "doomed", "--control", d.control).returncode == 0
        r = peerd("health", "--control", d.control)
        assert r.returncode == 0 and r.stdout.splitlines() == ["SERVING", "run fine: TRAINING"], r
        assert d.stop() == 0
    finally:
        d.kill_group()
