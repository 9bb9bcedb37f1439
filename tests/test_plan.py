"""`peerd plan`: the model's arithmetic with exact values, the command's output and refusals, and
the inputs a daemon's run gives it (`--run`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from peerd.daemon.plan import (
    DEFAULT_EVERY,
    DEFAULT_GROUP,
    DEFAULT_RTT_MS,
    FIXED_RTTS,
    FIXED_S,
    MissingInput,
    RunFigures,
    compare,
    fit_every,
    inputs,
    plan,
    round_seconds,
)
from tests.helpers import ROOT


def test_a_1b_model_at_100_mbit_exact_values():
    """1e9 parameters, 1 s steps, 100 Mbit/s, 50 ms, two members: int8's payload is 1.0625e9 bytes
    (a 4-byte scale per 64 values), each member sends half of it twice, and the round takes the
    fixed cost plus 85 s."""
    plans = {p.payload: p for p in plan(10**9, 1.0, 100.0, 50.0, every=50)}
    assert list(plans) == ["int2", "arctopk", "int4", "int8", "fp16", "fp32"]  # smallest bytes first
    int8 = plans["int8"]
    assert int8.bytes_per_outer_step == 1_062_500_000
    assert int8.round_s == round(FIXED_S + FIXED_RTTS * 0.05 + 85.0, 3) == 85.655
    assert int8.compute_fraction == round(50 / 85.655, 4)  # overlap: compute waits for the rest
    assert int8.hiding_every == 103  # 1.2 x 85.655 s of 1 s steps
    assert plans["fp32"].bytes_per_outer_step == 4 * 10**9 and plans["int2"].bytes_per_outer_step == 312_500_000
    # arctopk at density 0.5: 976,563 rows of 1,024; the sketch, 4 float32 values a row; 488,282 rows
    # and a check block of 64 values in int8, 68 bytes per 64 values (a 4-byte scale).
    rows, k = 976_563, 488_282
    assert plans["arctopk"].bytes_per_outer_step == 16 * rows + (k * 1024 + 64) * 68 // 64 == 546_875_892
    sparse = {p.payload: p for p in plan(10**9, 1.0, 100.0, 50.0, every=50, density=0.01)}
    assert sparse["arctopk"].bytes_per_outer_step == 16 * rows + (9_766 * 1024 + 64) * 68 // 64 == 26_250_484
    with pytest.raises(ValueError, match="density"):
        plan(10**9, 1.0, 100.0, 50.0, every=50, density=0.0)
    without = {p.payload: p for p in plan(10**9, 1.0, 100.0, 50.0, every=50, overlap=False)}
    assert without["int8"].compute_fraction == round(50 / (50 + 85.655), 4)
    assert all(p.compute_fraction == 1.0 for p in plan(10**9, 1.0, 100.0, 50.0, every=400) if p.payload != "fp32")


def test_auto_picks_the_smallest_rung_whose_phase_hides_the_round_exact_values():
    """averaging.average_every=auto: 1.2 x the round over the step time, up the ladder 10, 20, 40,
    80, 160, 200 (the top); at a bound, the bound; without figures, the top (the schedule's)."""
    assert fit_every(0.1, 2.0, 10, 200).every == 40  # needs 24
    assert fit_every(0.1, 2.5, 10, 200).every == 40  # needs 30
    assert fit_every(0.1, 2.75, 10, 200).every == 40  # needs 33: the same rung
    assert fit_every(0.1, 3.5, 10, 200).every == 80  # needs 42
    assert fit_every(0.1, 14.0, 10, 200).every == 200  # needs 168: the top rung is the bound
    fit = fit_every(0.1, 2.0, 10, 200)
    assert fit.reason == "1.2 x a 2 s round over 0.1 s steps needs H >= 24: 40 on the ladder 10, 20, ... 200"
    slow = fit_every(0.5, 100.0, 10, 200)  # needs 240
    assert slow.every == 200 and "the largest H, average_every_max=200; compute waits" in slow.reason
    fast = fit_every(0.1, 0.5, 10, 200)  # needs 6
    assert fast.every == 10 and fast.reason.endswith("the smallest H, average_every_min=10")
    assert fit_every(0.1, 0.0, 1, 8).every == 1
    assert fit_every(math.nan, 2.0, 10, 200).every == fit_every(0.1, math.nan, 10, 200).every == 200
    assert "no completed round yet" in fit_every(0.1, math.nan, 10, 200).reason
    assert fit_every(0.1, 2.0, 7, 7).every == 7
    for low, high in ((0, 10), (20, 10)):
        with pytest.raises(ValueError, match="1 <= low <= high"):
            fit_every(0.1, 2.0, low, high)


def test_members_with_figures_a_little_apart_pick_the_same_rung():
    """The ladder: two members whose step times differ by 20 % (and whose round differs by 10 %)
    agree; a pure function, so the same figures always give the same H."""
    assert fit_every(0.10, 2.0, 10, 200) == fit_every(0.10, 2.0, 10, 200)
    assert fit_every(0.10, 2.0, 10, 200).every == fit_every(0.12, 2.2, 10, 200).every == 40


def test_a_group_of_g_sends_2_g_minus_1_over_g_of_the_vector():
    assert round_seconds(10**6, 4, 8.0, 0.0) == pytest.approx(FIXED_S + 1.5)  # 1.5 MB at 1 MB/s
    plans = {p.payload: p for p in plan(64, 1.0, 1.0, 0.0, every=1, group=4)}
    assert plans["fp32"].bytes_per_outer_step == 384  # 256 x 1.5
    # arctopk pads a vector to whole rows: 1,024 values and the check in int8 (1,156 bytes) and a
    # sketch of 16: the largest payload of a model this small.
    assert (
        plans["arctopk"].bytes_per_outer_step
        == math.ceil(1.5 * (16 + 1156))
        == max(plans.values(), key=lambda p: p.bytes_per_outer_step).bytes_per_outer_step
    )


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"params": 0}, "params"),
        ({"every": 0}, "every"),
        ({"group": 1}, "group"),
        ({"step_s": 0.0}, "step_s"),
        ({"mbit": float("nan")}, "mbit"),
        ({"rtt_ms": -1.0}, "rtt_ms"),
    ],
)
def test_bad_input_is_refused_naming_it(kw, message):
    args = {"params": 100, "step_s": 1.0, "mbit": 10.0, "rtt_ms": 0.0, "every": 10} | kw
    with pytest.raises(ValueError, match=message):
        plan(**args)


def peerd(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "peerd.daemon.cli", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_command_prints_a_table_or_json_lines_and_refuses_bad_input():
    base = ["plan", "--params", "1e9", "--step-seconds", "1", "--mbit", "100", "--every", "50"]
    out = peerd(*base)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert rows[0].split()[:2] == ["PAYLOAD", "BYTES/OUTER"] and rows[4].split()[:3] == ["int8", "1.06", "GB"]
    assert rows[2].split()[:3] == ["arctopk", "546.88", "MB"] and "arctopk at density 0.5" in rows[-1]
    sparse = peerd(*base, "--density", "0.01").stdout.splitlines()
    assert sparse[1].split()[:3] == ["arctopk", "26.25", "MB"] and "arctopk at density 0.01" in sparse[-1]
    out = peerd(*base, "--json")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[3] == {
        "payload": "int8",
        "bytes_per_outer_step": 1_062_500_000,
        "round_s": 85.655,
        "compute_fraction": round(50 / 85.655, 4),
        "hiding_every": 103,
    }
    for bad in (["--params", "1.5"], ["--mbit", "0"], ["--group", "1"], ["--density", "0"]):
        out = peerd(*base, *bad)
        assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.strip(), out


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_reader_that_left_gets_no_traceback(buffered):
    """`peerd plan --json | head -1`, its reader gone before the command prints (so that the write
    fails every time, not only when the reader wins a race): the command ends quietly with 141, as one
    killed by SIGPIPE, whether a print fails (unbuffered) or the flush at the end (buffered)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    argv = ["plan", "--params", "1e9", "--step-seconds", "1", "--mbit", "100", "--json"]
    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "peerd.daemon.cli", *argv]
        out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.returncode == 141, out


def figures(**kw) -> RunFigures:
    """A run as a daemon's status shows it after some phases and rounds."""
    base = dict(
        run_id="r",
        parameters=10**6,
        step_seconds=0.25,
        average_every=100,
        group_size=3,
        round_seconds=1.5,
        payload="int8",
        overlap=False,
        algorithm="diloco",
    )
    return RunFigures(**(base | kw))


def test_the_daemon_fills_what_is_not_given_and_a_flag_overrides_it():
    taken = inputs(mbit=100.0, run=figures())
    assert (taken.params, taken.step_seconds, taken.every, taken.group, taken.overlap) == (10**6, 0.25, 100, 3, False)
    assert (taken.mbit, taken.rtt_ms) == (100.0, DEFAULT_RTT_MS)  # the link: by hand, or the default
    assert taken.from_daemon == ("params", "step_seconds", "every", "group", "overlap")
    given = inputs(params=5, step_seconds=2.0, mbit=10.0, rtt_ms=0.0, every=7, group=4, overlap=True, run=figures())
    assert (given.params, given.step_seconds, given.rtt_ms, given.every, given.group) == (5, 2.0, 0.0, 7, 4)
    assert given.overlap and given.from_daemon == ()
    some = inputs(step_seconds=1.0, group=2, mbit=10.0, run=figures())
    assert some.from_daemon == ("params", "every", "overlap") and (some.step_seconds, some.group) == (1.0, 2)


def test_what_the_run_does_not_know_yet_is_the_default_or_names_the_flag_to_give():
    # Its last round formed no group, or none ran yet: the default group; no manifest: the defaults.
    for group_size in (0, 1):
        assert inputs(mbit=1.0, run=figures(group_size=group_size)).group == DEFAULT_GROUP
    unknown = inputs(mbit=1.0, run=figures(average_every=0, payload=""))
    assert unknown.every == DEFAULT_EVERY and unknown.overlap and "overlap" not in unknown.from_daemon
    with pytest.raises(MissingInput, match="no step time yet .* give --step-seconds"):
        inputs(mbit=1.0, run=figures(step_seconds=math.nan))
    with pytest.raises(MissingInput, match="no model on this daemon .* give --params"):
        inputs(step_seconds=1.0, mbit=1.0, run=figures(parameters=0))
    with pytest.raises(MissingInput, match=r"--params is required \(or --run"):
        inputs(mbit=1.0)
    assert inputs(params=9, step_seconds=0.1, mbit=1.0, run=figures(parameters=0, step_seconds=math.nan)).params == 9


def test_the_measured_round_is_set_against_the_model_for_the_runs_payload():
    given = inputs(mbit=100.0, rtt_ms=50.0, run=figures(parameters=10**9, group_size=2))
    c = compare(figures(parameters=10**9, group_size=2), given)
    assert c.payload == "int8" and c.model_s == 85.655 and c.measured_s == 1.5  # the plan's own int8 figure
    assert c.ratio == pytest.approx(1.5 / 85.655)
    assert compare(figures(payload=""), given) is None  # no manifest, no payload
    assert math.isnan(compare(figures(round_seconds=math.nan), given).measured_s)


def test_status_shows_the_median_of_the_last_16_completed_rounds():
    """DaemonMetrics.round_seconds (RunStatus.round_seconds): completed rounds only, their whole time
    (RoundResult.seconds, NaN where a result is no round's first lane)."""
    from peerd.daemon.metrics import RECENT_ROUNDS, DaemonMetrics
    from peerd.peers.averaging import RoundResult
    from peerd.peers.collective.outcome import Outcome, Status

    def result(status: Status, seconds: float) -> RoundResult:
        outcome = Outcome(status, "", 1, ("a", "b"), (1.0,), 0, 0, 0.01, b"")
        return RoundResult(1, 2, outcome, "", seconds=seconds)

    m = DaemonMetrics(version="t", states=("READY",), peers_by_run=dict)
    assert math.isnan(m.round_seconds("r"))
    m.observe_round("r", result(Status.ABORTED, 99.0))
    m.observe_round("r", RoundResult(1, 1, None, "alone in the run", seconds=0.0))
    m.observe_round("r", result(Status.COMPLETED, math.nan))  # a round's other lane
    assert math.isnan(m.round_seconds("r"))
    for k in range(RECENT_ROUNDS + 4):  # 0..19: the first four fall out of the window
        m.observe_round("r", result(Status.COMPLETED, float(k)))
    assert m.round_seconds("r") == 11.5 and math.isnan(m.round_seconds("other"))


def test_plan_from_a_daemons_run_takes_its_parameter_count_and_step_time(spawn):
    """A real daemon and a script of Linear(8, 1) (9 parameters) that trains 30 steps in phases of 10:
    `peerd plan --run` takes the model's count, the measured step time and H from the daemon, the
    link from the flags. Before the script attaches the run has no model, then no step time: each
    refusal names the flag to give; a run the daemon is not in, and no daemon, are refused too."""
    d = spawn("plan", ["--run", "plan-run"])
    where = ["--data-dir", str(d.data_dir)]
    out = peerd("plan", "--run", "plan-run", "--mbit", "100", *where)
    assert out.returncode == 2 and "no model on this daemon" in out.stderr and "--params" in out.stderr, out
    out = peerd("plan", "--run", "nope", "--mbit", "100", *where)
    assert out.returncode == 2 and "not in run 'nope' (its runs: plan-run)" in out.stderr, out
    out = peerd("plan", "--run", "plan-run", "--mbit", "100", "--data-dir", str(d.data_dir.parent / "none"))
    assert out.returncode == 1 and "no daemon answering" in out.stderr, out
    script = [sys.executable, str(ROOT / "tests" / "attach_script.py"), "--run", "plan-run", "--daemon"]
    proc = subprocess.run(
        [*script, str(d.data_dir), "--steps", "30", "--every", "10", "--dim", "8"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = peerd("plan", "--run", "plan-run", "--mbit", "100", "--json", *where)
    assert out.returncode == 0, out.stderr
    *payloads, run = [json.loads(line) for line in out.stdout.splitlines()]
    assert [p["payload"] for p in payloads] == [
        "int2",
        "int4",
        "int8",
        "fp16",
        "fp32",
        "arctopk",
    ]  # 9 values: a row pads
    assert run["run_id"] == "plan-run" and run["from_daemon"] == ["params", "step_seconds", "every", "overlap"]
    assert run["inputs"]["params"] == 9 and run["inputs"]["step_seconds"] > 0, run
    assert run["inputs"]["every"] == 10 and run["inputs"]["group"] == DEFAULT_GROUP and not run["inputs"]["overlap"]
    assert run["inputs"]["mbit"] == 100 and run["inputs"]["rtt_ms"] == DEFAULT_RTT_MS
    assert run["payload"] == "int8" and run["round_s_model"] > 0 and run["round_s_measured"] is None  # alone: no group
    out = peerd("plan", "--run", "plan-run", "--mbit", "100", "--params", "1e9", "--every", "50", *where)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("run plan-run: from the daemon: ") and "1,000,000,000 parameters" in out.stdout
    assert "measured round: none completed yet" in out.stdout.splitlines()[-1], out.stdout
