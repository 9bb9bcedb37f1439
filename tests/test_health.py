"""What a daemon says about the runs it trains: peerd_train_state, and `peerd health` when a trainer FAILED."""

from __future__ import annotations

import json


from peerd.daemon.metrics import TRAIN_STATES
from peerd.daemon.procs import LocalDaemon
from tests.failing_task import MESSAGE, NAME, plugin_env
from tests.helpers import THREAD, peerd, scrape, wait_for


def test_train_states_match_the_trainer():
    from peerd.daemon.trainer import TrainState

    assert TRAIN_STATES == tuple(s.value for s in TrainState)


def train_state(d: LocalDaemon, run: str) -> dict[str, float]:
    """The run's peerd_train_state series: {state: value}."""
    series = [(dict(labels), v) for (name, labels), v in scrape(d.metrics_url).items() if name == "peerd_train_state"]
    return {labels["state"]: v for labels, v in series if labels["run"] == run}


def test_a_failed_trainer_is_in_metrics_and_health(tmp_path):
    # The trainer thread's failure: its exception is the error. A child process's failure, after its
    # restarts, is tests/test_train_process.py's.
    args = ["--run", "fine", "--task", "digits-mlp", *THREAD]
    d = LocalDaemon(tmp_path / "d", args, env=plugin_env(tmp_path / "site"))
    try:
        d.start()
        wait_for(lambda: train_state(d, "fine").get("TRAINING") == 1, timeout=30, what="run fine TRAINING")
        r = peerd("health", "--control", d.control)
        assert r.returncode == 0 and r.stdout.splitlines() == ["SERVING", "run fine: TRAINING"], r

        r = peerd("join", "doomed", "--task", NAME, "--control", d.control)
        assert r.returncode == 0, r

        def failed():
            states = train_state(d, "doomed")
            return states.get("FAILED") == 1 and states

        states = wait_for(failed, timeout=30, what="run doomed FAILED")
        assert states == {s: (1 if s == "FAILED" else 0) for s in TRAIN_STATES}
        assert train_state(d, "fine")["TRAINING"] == 1  # the other run trains on

        r = peerd("health", "--control", d.control)
        assert r.returncode == 1, r
        assert r.stdout.splitlines()[0] == "NOT_SERVING"
        assert f"run doomed: FAILED: RuntimeError: {MESSAGE}" in r.stdout and "run fine: TRAINING" in r.stdout
        r = peerd("health", "--control", d.control, "--json")
        assert r.returncode == 1 and json.loads(r.stdout)["runs"]["doomed"]["train_state"] == "FAILED", r

        # Leaving the failed run is how an operator clears it: the daemon is healthy again.
        assert peerd("leave", "doomed", "--control", d.control).returncode == 0
        r = peerd("health", "--control", d.control)
        assert r.returncode == 0 and r.stdout.splitlines() == ["SERVING", "run fine: TRAINING"], r
        assert d.stop() == 0
    finally:
        d.kill_group()
