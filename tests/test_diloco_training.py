"""Three real daemons train digits-mlp with the default algorithm (DiLoCo: inner steps, int8
pseudo-gradients with error feedback, an outer Nesterov step, daemon/diloco.py) and reach the accuracy of
one process trained on the same samples; a late joiner downloads the outer state and catches up;
three daemons in a run with the defaults beat the same daemons alone at equal wall time."""

from __future__ import annotations

import signal
import time

import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.tasks import get_task, train_single_process
from peerd.peers.manifest import AveragingSettings
from tests.helpers import scrape, wait_for

pytestmark = pytest.mark.heavy

RUN_ARGS = ["--eval-every", "1000", "--checkpoint-every", "100", "--torch-threads", "1"]
FAST_DISCOVERY = ["--heartbeat-interval", "1", "--refresh-interval", "0.5", "--peer-ttl", "4", "--dht-timeout", "2"]


def status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


@pytest.mark.parametrize(
    "payload, engine", [("int8", "reliable"), ("arctopk", "reliable"), ("arctopk", "loss-tolerant")]
)
def test_three_daemons_with_the_default_algorithm_reach_single_process_accuracy(spawn, payload, engine):
    """int8, the default, and ARC-Top-K at its default density (half the rows a round), also with
    the loss-tolerant engine (its rows as UDP datagrams, its sketch over the reliable links)."""
    steps, batch = 600, 32
    # The default schedule: 15 rounds (H = 50, first phases 5, 10, 20, 15).
    rounds = AveragingSettings().phases.round_of(steps)
    create = ["--task", "digits-mlp", "--set", "optimizer=sgd", "--set", "lr=0.05"]
    create += ["--set", f"averaging.payload={payload}", "--set", f"averaging.engine={engine}"]
    args = ["--run", "dl", "--max-steps", str(steps), "--min-peers", "3", *RUN_ARGS, *FAST_DISCOVERY]
    a = spawn("dl-a", [*args, *create])
    others = [spawn(f"dl-{n}", [*args, "--initial-peers", a.maddrs[0]], wait=False) for n in "bc"]
    for d in others:
        d.wait_ready()
    daemons = [a, *others]
    for d in daemons:
        wait_for(lambda: status(d, "dl").train_state == "FINISHED", timeout=240, what=f"{d.data_dir.name} finishes")
    finals = [status(d, "dl") for d in daemons]
    task = get_task("digits-mlp")
    h = task.parse_hparams({"optimizer": "sgd", "lr": 0.05})
    single = sum(train_single_process(task, h, steps=steps, batch_size=3 * batch, seed=s).score for s in range(3)) / 3
    completed = []
    for d, r in zip(daemons, finals):
        print(
            f"{d.data_dir.name}: accuracy {r.eval_score:.4f}, single process {single:.4f}, last round "
            f"{r.last_round_outcome} of {r.group_size}"
        )
        assert r.step == steps, r
        # Within 3 % of one process (the bound). Measured at H = 50: 0.9722 without overlap,
        # 0.9639 and 0.9750 with it (now the default), against 0.9676 (one test image is 0.28 points);
        # arctopk at density 0.5: 0.9778 (all 15 rounds completed; int8 in the same session 0.9694).
        assert r.eval_score >= 0.97 * single, (r.eval_score, single)
        m = scrape(d.metrics_url)
        completed.append(m[("peerd_rounds_total", (("outcome", "completed"), ("run", "dl")))])
        assert completed[-1] >= rounds // 2, m
        # Samples reach the shared model through the rounds that applied them: all of them when every
        # round completed (the last lands at the finish).
        averaged, trained = (
            m[("peerd_samples_averaged_total", (("run", "dl"),))],
            m[("peerd_samples_total", (("run", "dl"),))],
        )
        assert 0 < averaged <= trained == steps * batch, m
        if completed[-1] == rounds:
            assert averaged == trained, m
        assert 0 < m[("peerd_train_compute_fraction", (("run", "dl"),))] <= 1
    # Every round completed on every member: every member ends at the same θ, hence the same score
    # (the final evaluation is taken after the last round landed). A round that one member missed
    # under load leaves it its own outer step until the next repair round (every 25 by default).
    if completed == [rounds] * len(daemons):
        assert len({r.eval_score for r in finals}) == 1, [r.eval_score for r in finals]
    for d in daemons:
        assert d.stop() == 0


def test_diloco_trains_on_through_a_kill_and_a_late_joiner_realigns_by_the_repair_round(spawn):
    """With overlap (averaging.overlap=true), a peer killed while a round is in flight: the others
    train on. A late joiner downloads the outer state [θ; m] and catches up; it missed the update in
    flight when it downloaded, and the next repair round (averaging.repair_every=2 here) makes every
    live θ the same again: the sketches of θ then agree exactly (divergence 0). No global step goes
    backwards."""
    from tests.test_cluster_training import StepWatch

    every = 20
    create = [
        "--task",
        "digits-mlp",
        "--set",
        f"averaging.average_every={every}",
        "--set",
        "averaging.repair_every=2",
        "--set",
        "averaging.overlap=true",
        "--set",
        "optimizer=sgd",
        "--set",
        "lr=0.05",
    ]
    args = ["--run", "dk", "--min-peers", "3", *RUN_ARGS, *FAST_DISCOVERY]
    a = spawn("dk-a", [*args, *create])
    b, c = (spawn(f"dk-{n}", [*args, "--initial-peers", a.maddrs[0]], wait=False) for n in "bc")
    b.wait_ready()
    c.wait_ready()
    watch = StepWatch([a, b, c], "dk")
    try:
        wait_for(lambda: status(a, "dk").last_round_outcome == "completed", timeout=90, what="a first round")
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(10)
        killed_at = status(a, "dk").step
        wait_for(lambda: status(a, "dk").step >= killed_at + 5 * every, timeout=90, what="a trains on after the kill")

        late = spawn("dk-late", [*args, "--min-peers", "1", "--initial-peers", a.maddrs[0]])
        watch.add(late)
        wait_for(
            lambda: status(late, "dk").step >= status(a, "dk").step - 2 * every,
            timeout=90,
            what="the late joiner catches up",
        )
        assert status(late, "dk").local_step < status(late, "dk").step  # it downloaded the outer state
        m = scrape(late.metrics_url)
        assert m.get(("peerd_state_syncs_total", (("result", "ok"), ("run", "dk"))), 0) >= 1, late.log_tail(40)
        joined_at = status(a, "dk").step

        def aligned():
            rs = [status(d, "dk") for d in (a, b, late)]
            return all(r.param_divergence_step > joined_at and r.param_divergence == 0.0 for r in rs) and rs

        wait_for(aligned, timeout=120, interval=0.2, what="every live θ the same again after a repair round")
        assert not watch.regressions, watch.regressions
    finally:
        watch.stop()
    for d in (a, b, late):
        assert d.stop() == 0, d.log_tail(30)  # 1: its drain outlasted drain_timeout (tests/FLAKY.md)


WINDOW = 30.0  # seconds from the moment all six daemons train to their stop
TASK, HPARAMS = "charlm", {"d_model": "32", "n_layers": "1", "n_heads": "2", "context": "32"}  # a light charlm


def evaluate_latest(d, run: str) -> tuple[int, float, float]:
    """(step, score, eval loss) of the checkpoint a daemon wrote when it stopped: the run's model
    (under DiLoCo θ, the outer parameters every member of a completed round shares)."""
    from peerd.daemon.checkpoint import CheckpointStore
    from peerd.daemon.export import checkpoint_weights

    task = get_task(TASK)
    hparams = task.parse_hparams({k: int(v) for k, v in HPARAMS.items()})
    ckpt = CheckpointStore(d.data_dir / "runs" / run / "checkpoints").load_latest()
    assert ckpt is not None, d.log_tail(30)
    model, _ = task.build(hparams, 0)
    loaded = model.load_state_dict(checkpoint_weights(ckpt)[1], strict=False)
    assert not [n for n, _ in model.named_parameters() if n in loaded.missing_keys], loaded
    result = task.evaluate(model, hparams)
    return ckpt.step, result.score, result.loss


@pytest.mark.heavy(slots=2)  # six daemons and their children: no other heavy test beside them
def test_three_daemons_with_the_defaults_beat_the_same_daemons_alone_at_equal_wall_time(spawn):
    """Issue 25: three daemons in one run with the defaults of new runs (DiLoCo, H = 50 with short
    first phases, overlap, int8, the straggler budget) against the same daemons alone (each its own
    run with the same defaults: its rounds find nobody and it takes its own outer steps), all six
    launched at once on one machine and stopped at once WINDOW seconds after all six train: the
    run's model (θ, from the stop's checkpoint) against theirs. Equal wall time: the run pays for
    its rounds, and a busy machine slows both sides alike.

    Measured (bits/char, the run's θ against the mean of the three alone; 2026-11-28, 2 cores):
    this window, quiet 2.506 against 2.579, one core held busy 2.570 against 2.669; a window of 40 s
    from the launch (about 30 s of training), quiet 2.562 against 2.649 and 2.573 against 2.677, one
    core busy 2.683 against 2.694 and 2.690 against 2.727, two cores busy 2.687 against 2.758. In
    the suite it had 40 s from the launch first and its daemons did not all train within them (a
    loaded machine): hence the window from the moment all six train, and slots=2. The bound is the
    measured claim itself: the run's model is better than the mean of the daemons alone. (Each
    daemon alone training the state algorithm, its rounds no-ops, did worse still: 2.79, 2.78, 2.79
    against the run's 2.54.)
    """
    from peerd.daemon.procs import stop_all

    common = ["--task", TASK, *(a for k, v in HPARAMS.items() for a in ("--set", f"{k}={v}"))]
    common += ["--eval-every", "100000", "--torch-threads", "1", *FAST_DISCOVERY]
    a = spawn("beat-a", ["--run", "beat", "--min-peers", "3", *common])
    run = [a] + [
        spawn(f"beat-{n}", ["--run", "beat", "--min-peers", "3", "--initial-peers", a.maddrs[0], *common], wait=False)
        for n in "bc"
    ]
    alone = [spawn(f"alone-{n}", ["--run", f"alone-{n}", *common], wait=False) for n in "abc"]
    for d in [*run[1:], *alone]:
        d.wait_ready()
    # The window opens once all six train (a loaded machine may take a minute to get there); the
    # daemons alone, which wait for no peer, have trained a little longer by then.
    runs = [(d, "beat") for d in run] + [(d, f"alone-{n}") for d, n in zip(alone, "abc")]
    wait_for(lambda: all(status(d, r).local_step > 0 for d, r in runs), timeout=180, what="all six train")
    time.sleep(WINDOW)
    codes = stop_all([*run, *alone])
    assert None not in codes, codes  # none had to be killed: each wrote its checkpoint as it stopped
    ours = [evaluate_latest(d, "beat") for d in run]
    theirs = [evaluate_latest(d, f"alone-{n}") for d, n in zip(alone, "abc")]
    print(f"run (step, bits/char, loss): {ours}\nalone: {theirs}")
    run_score, alone_score = (sum(r[1] for r in rs) / 3 for rs in (ours, theirs))
    assert all(r[0] > 0 for r in ours + theirs), (ours, theirs)  # every one trained
    assert run_score < alone_score, (ours, theirs)  # bits/char: lower is better
