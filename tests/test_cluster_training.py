"""Several real daemons train one run together: accuracy, and failures in the middle of it.

Each daemon is a `peerd start` subprocess on loopback. Accuracy is compared with
`train_single_process` on the same sample budget, computed in the test. The failure test kills one
daemon (SIGKILL), freezes another (SIGSTOP, later SIGCONT) and starts one late, and checks what
issue 3 promises: the run goes on, no global step goes backwards, live peers end a round holding the
same parameters (equal result digests, so distance 0), and the late and the frozen peers catch up by
downloading the run's state.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.tasks import get_task, train_single_process
from peerd.peers.collective import AllReduceSettings
from tests.helpers import peerd, scrape, wait_for

pytestmark = pytest.mark.heavy

RUN_ARGS = ["--eval-every", "1000", "--checkpoint-every", "50", "--torch-threads", "1"]
PEER_TTL, REFRESH = 4.0, 0.5
FAST_DISCOVERY = [
    "--heartbeat-interval",
    "1",
    "--refresh-interval",
    str(REFRESH),
    "--peer-ttl",
    str(PEER_TTL),
    "--dht-timeout",
    "2",
]


def status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def test_three_daemons_reach_single_process_accuracy(spawn):
    """SGD with momentum: local SGD then behaves like large-batch SGD. With Adam, averaging 3 peers'
    second moments (each from batch-32 gradients, noisier than one batch-96 gradient) shrinks the
    effective step; an in-process simulation of this very loop stayed 0.8 points behind at 300 and
    450 steps, so the Adam comparison would sit on the 1-point edge (docs/algorithms.md)."""
    steps, every, batch = 500, 10, 32
    hparams = {"optimizer": "sgd", "lr": "0.05"}
    create = ["--task", "digits-mlp", "--set", f"averaging.average_every={every}", "--set", "averaging.algorithm=state"]
    create += [arg for k, v in hparams.items() for arg in ("--set", f"{k}={v}")]
    args = ["--run", "acc", "--max-steps", str(steps), "--min-peers", "3", *RUN_ARGS]
    a = spawn("acc-a", [*args, *create])
    # c reaches its group only through libp2p streams (as behind a NAT); a and b dial directly.
    others = [
        spawn(f"acc-{n}", [*args, "--initial-peers", a.maddrs[0], *extra], wait=False)
        for n, extra in (("b", []), ("c", ["--reliable-links", "libp2p"]))
    ]
    for d in others:
        d.wait_ready()
    daemons = [a, *others]
    for d in daemons:
        wait_for(lambda: status(d, "acc").train_state == "FINISHED", timeout=240, what=f"{d.data_dir.name} finishes")
    finals = [status(d, "acc") for d in daemons]
    task = get_task("digits-mlp")
    h = task.parse_hparams({"optimizer": "sgd", "lr": 0.05})
    # The same sample budget: S steps of 3 x 32 samples. Mean of three seeds: one seed alone varies
    # by about half a point on this 360-image test set.
    single = sum(train_single_process(task, h, steps=steps, batch_size=3 * batch, seed=s).score for s in range(3)) / 3
    for r in finals:
        assert r.step == steps and r.local_step == steps, r
        assert r.last_round_outcome == "completed" and r.group_size == 3, r
        assert r.eval_metric == "accuracy"
        # Within 1 point, as issue 3 asks. At 300 steps one test image (0.28 points) decided it:
        # 0.9528 against a bound of 0.9539 failed twice. At 500 steps an in-process simulation of
        # this loop over 8 seeds scored 96.7-97.2 % against single-process 96.7-97.2 % (sd 0.2 points).
        print(f"accuracy {r.eval_score:.4f}, single process {single:.4f}")
        assert r.eval_score >= single - 0.01, (r.eval_score, single)
    for d, r in zip(daemons, finals):  # `peerd status` names the last round's group: all three
        assert r.last_round_group[0] == d.peer_id and sorted(r.last_round_group) == sorted(
            x.peer_id for x in daemons
        ), r
    assert "acc: group of round" in peerd("status", "--control", a.control).stdout
    # The last round ended with every member holding the same bytes: the same evaluation.
    assert len({r.eval_score for r in finals}) == 1, [r.eval_score for r in finals]
    # Divergence from sketches (peers/sketch.py): once every daemon has the others' sketches of the
    # last round (step 500, a heartbeat after it), all three compare the same three sketches.
    wait_for(
        lambda: all(status(d, "acc").param_divergence_step == steps for d in daemons),
        timeout=30,
        what="every daemon compares the sketches of the last round",
    )
    divergences = [scrape(d.metrics_url)[("peerd_param_divergence", (("run", "acc"),))] for d in daemons]
    to_mean = sorted(r.param_distance_to_group_mean for r in finals)  # exact, of the same round
    print(f"divergence {divergences}, distances to the group mean {to_mean}")
    assert divergences == [pytest.approx(divergences[0], rel=1e-9)] * 3, divergences
    # Peers drift between rounds (measured 0.19-0.27 here, parameter norm about 7-10; bound 1.0). The
    # largest pairwise distance lies between the largest distance to the group mean and the sum of
    # the two largest; the estimate's error (sd a few %) gets 25 % either way.
    assert 0 < divergences[0] < 1.0, divergences
    assert 0.75 * to_mean[-1] <= divergences[0] <= 1.25 * (to_mean[-1] + to_mean[-2]), (divergences, to_mean)
    m = scrape(a.metrics_url)
    assert m[("peerd_rounds_total", (("outcome", "completed"), ("run", "acc")))] >= steps // every - 2
    assert m[("peerd_group_size", (("run", "acc"),))] == 3
    # A reliable run without --local-group auto uses no link measurement: its peers are not probed.
    assert not any(name == "peerd_link_probes_total" and v for (name, _), v in m.items()), m
    assert finals[2].last_round_links == "libp2p:2" and finals[0].last_round_links == "tcp:2", finals
    c_metrics = scrape(others[1].metrics_url)
    assert c_metrics[("peerd_sent_bytes_total", (("transport", "libp2p"),))] > 0
    assert c_metrics[("peerd_sent_bytes_total", (("transport", "tcp"),))] == 0
    assert c_metrics[("peerd_links_total", (("transport", "libp2p"),))] >= 2 * (steps // every - 2)
    for d in daemons:
        assert d.stop() == 0


class StepWatch:
    """Polls each daemon's global step in the background and records any decrease."""

    def __init__(self, daemons, run: str):
        self.daemons, self.run = list(daemons), run
        self.last: dict[str, int] = {}
        self.history: dict[str, list[tuple[float, int]]] = {}
        self.regressions: list[str] = []
        self.frozen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def add(self, d) -> None:
        self.daemons.append(d)

    def _poll(self) -> None:
        while not self._stop.wait(0.3):
            for d in list(self.daemons):
                name = d.data_dir.name
                if name in self.frozen or d.proc.poll() is not None:
                    continue
                try:
                    r = status(d, self.run)
                except Exception:
                    continue
                if r.train_state in ("", "LOADING"):
                    continue  # a (re)started daemon has no step before it has loaded its state
                step = r.step
                if step < self.last.get(name, 0):
                    self.regressions.append(f"{name}: {self.last[name]} -> {step}")
                self.last[name] = max(step, self.last.get(name, 0))
                self.history.setdefault(name, []).append((time.monotonic(), step))

    def longest_stall(self, d, since: float) -> float:
        """The longest time since `since` (monotonic) that d's global step stood still, as polled."""
        samples = [(t, step) for t, step in list(self.history.get(d.data_dir.name, [])) if t >= since]
        longest, changed_at = 0.0, since
        for (_, before), (t, step) in zip(samples, samples[1:]):
            if step != before:
                changed_at = t
            longest = max(longest, t - changed_at)
        return longest

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_training_goes_on_through_a_kill_a_freeze_and_a_late_joiner(spawn, secret_file):
    """A secret run, so that every engine link also opens with the secret's hello (linkauth.py)."""
    every = 10
    create = ["--task", "digits-mlp", "--set", f"averaging.average_every={every}", "--set", "averaging.algorithm=state"]
    args = ["--run", "churn", "--run-secret-file", str(secret_file), "--min-peers", "3", *RUN_ARGS, *FAST_DISCOVERY]
    a = spawn("churn-a", [*args, *create])
    b, c = (spawn(f"churn-{n}", [*args, "--initial-peers", a.maddrs[0]], wait=False) for n in "bc")
    b.wait_ready()
    c.wait_ready()
    watch = StepWatch([a, b, c], "churn")
    try:
        try:
            wait_for(lambda: status(a, "churn").last_round_outcome == "completed", timeout=60, what="a first round")
        except AssertionError:
            for d in (b, c):
                os.kill(d.pid, signal.SIGUSR1)
            time.sleep(1)
            raise AssertionError("\n".join(d.log_tail(80) for d in (b, c)))

        # How long a dead or frozen member may hold a survivor's training up: a round it was in
        # aborts within the engine's longest round; after that it is in no new group once its
        # heartbeat has expired from the table (docs/algorithms.md, "Failures"). Plus 5 s of slack.
        stall_bound = AllReduceSettings().longest_round + PEER_TTL + REFRESH + 5.0
        c.proc.send_signal(signal.SIGKILL)  # mid-run, quite likely mid-round
        c.proc.wait(10)
        t_kill, killed_at = time.monotonic(), status(a, "churn").step
        wait_for(
            lambda: status(a, "churn").step >= killed_at + 3 * every, timeout=60, what="a trains on after the kill"
        )
        print(f"a's longest stall after the kill: {watch.longest_stall(a, t_kill):.1f} s (bound {stall_bound:.1f} s)")
        assert watch.longest_stall(a, t_kill) < stall_bound, (watch.longest_stall(a, t_kill), stall_bound)

        watch.frozen.add(b.data_dir.name)
        os.kill(b.pid, signal.SIGSTOP)
        t_freeze, frozen_at = time.monotonic(), status(a, "churn").step
        wait_for(
            lambda: status(a, "churn").step >= frozen_at + 3 * every, timeout=60, what="a trains on while b is frozen"
        )
        print(
            f"a's longest stall after the freeze: {watch.longest_stall(a, t_freeze):.1f} s (bound {stall_bound:.1f} s)"
        )
        assert watch.longest_stall(a, t_freeze) < stall_bound, (watch.longest_stall(a, t_freeze), stall_bound)

        late = spawn("churn-late", [*args, "--min-peers", "1", "--initial-peers", a.maddrs[0]])
        watch.add(late)
        wait_for(
            lambda: status(late, "churn").step >= status(a, "churn").step - every,
            timeout=60,
            what="late joiner catches up",
        )
        late_status = status(late, "churn")
        assert late_status.local_step < late_status.step, late_status  # it downloaded, not recomputed

        os.kill(b.pid, signal.SIGCONT)
        watch.frozen.discard(b.data_dir.name)
        wait_for(lambda: status(b, "churn").step >= status(a, "churn").step - every, timeout=60, what="b catches up")

        # Live peers converge on one state: a round in which all three completed with the same result.
        def agreed():
            rs = [status(d, "churn") for d in (a, b, late)]
            same_round = len({r.last_round for r in rs}) == 1 and all(r.last_round_outcome == "completed" for r in rs)
            return (
                same_round and len({r.last_round_digest for r in rs}) == 1 and all(r.group_size == 3 for r in rs) and rs
            )

        rs = wait_for(agreed, timeout=60, interval=0.05, what="a round all three live peers complete together")
        distances = {d.data_dir.name: round(r.param_distance_to_group_mean, 3) for d, r in zip((a, b, late), rs)}
        print(f"distance to the group mean before round {rs[0].last_round}: {distances}")
        # Distance to the group mean just before that round (parameter norm here: about 7-10).
        # Measured 0.0-0.17 over nine runs, quiet and with a core held busy; the stated bound is 1.0.
        # Runs 77, 80 and 99 (loaded) saw 1.09, 1.005 and 1.048 once each: the thawed b's process
        # applied a gradient of its pre-freeze parameters to the run's, right after attaching again
        # (fixed in peerd.torch.Optimizer.step; tests/FLAKY.md). The mean is nearly a's there (a's
        # weight holds its rounds alone), so b's distance is its distance to a.
        if not all(r.param_distance_to_group_mean < 1.0 for r in rs):
            where = {
                d.data_dir.name: f"step {r.step} local {r.local_step} synced from {r.synced_from} round {r.last_round}"
                for d, r in zip((a, b, late), rs)
            }
            raise AssertionError(
                "\n".join(
                    [f"distances to the group mean: {distances}", f"{where}", *(d.log_tail(60) for d in (a, b, late))]
                )
            )
        for d, result in ((late, "ok"), (b, "ok")):
            m = scrape(d.metrics_url)
            assert m.get(("peerd_state_syncs_total", (("result", result), ("run", "churn"))), 0) >= 1, d.log_tail(40)
        for d in (a, b, late):  # members of the run always hold the secret: no link of theirs was refused
            assert scrape(d.metrics_url).get(("peerd_rejected_total", (("reason", "wire_bad_hello"),)), 0) == 0

        # A restart resumes from whichever is newer, its checkpoint or the run: `late` checkpoints
        # as it stops, the others train on, and the restarted `late` loads its checkpoint, then
        # downloads the newer state. (A restart whose checkpoint is the newest: tests/test_training.py.)
        assert late.stop() == 0
        stopped_at = watch.last[late.data_dir.name]
        wait_for(
            lambda: status(a, "churn").step >= stopped_at + 3 * every, timeout=60, what="a trains on while late is down"
        )
        late.start()
        wait_for(
            lambda: status(late, "churn").step >= status(a, "churn").step - every,
            timeout=60,
            what="restarted late catches up",
        )
        resumed = status(late, "churn").resumed_from  # the restart's: it resumed from its checkpoint
        assert resumed >= stopped_at, late.log_tail(60)
        m = scrape(late.metrics_url)
        assert m.get(("peerd_state_syncs_total", (("result", "ok"), ("run", "churn"))), 0) >= 1, late.log_tail(40)
        assert status(late, "churn").synced_from > resumed and status(late, "churn").step > resumed
        assert not watch.regressions, watch.regressions
    finally:
        watch.stop()
        for d in (a, b, c):
            if d.proc.poll() is None:
                os.kill(d.pid, signal.SIGCONT)
    for d in (a, b, late):
        assert d.stop() == 0


def test_the_readme_demo_trains_and_the_loss_falls(tmp_path):
    """`./dev demo` runs `python -m peerd.daemon.demo`; here in a short mode that ends by itself."""
    import re
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "peerd.daemon.demo",
            "--steps",
            "600",
            "--interval",
            "0.5",
            "--duration",
            "150",
            "--dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "training ended, --steps 600" in out.stdout and "every daemon exited cleanly" in out.stdout, out.stdout[
        -3000:
    ]
    assert out.stdout.count("metrics http://127.0.0.1:") == 3
    # Rows: TIME DAEMON STATE STEP LOSS ...; the loss is a dash before the first step.
    losses = [float(x) for x in re.findall(r"peer0 +[A-Z]+ +\d+ +(\d+\.\d+)", out.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.6 * losses[0], (losses, out.stdout[-3000:])
    assert re.search(r"\d+ completed \(3\)", out.stdout), out.stdout[-3000:]
