"""`peerd plan`: the model's arithmetic with exact values, and the command's output and refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from peerd.daemon.plan import FIXED_RTTS, FIXED_S, plan, round_seconds
from tests.helpers import ROOT


def test_a_1b_model_at_100_mbit_exact_values():
    """1e9 parameters, 1 s steps, 100 Mbit/s, 50 ms, two members: int8's payload is 1.0625e9 bytes
    (a 4-byte scale per 64 values), each member sends half of it twice, and the round takes the
    fixed cost plus 85 s."""
    plans = {p.payload: p for p in plan(10**9, 1.0, 100.0, 50.0, every=50)}
    assert list(plans) == ["int2", "int4", "int8", "fp16", "fp32"]  # smallest bytes first
    int8 = plans["int8"]
    assert int8.bytes_per_outer_step == 1_062_500_000
    assert int8.round_s == round(FIXED_S + FIXED_RTTS * 0.05 + 85.0, 3) == 85.655
    assert int8.compute_fraction == round(50 / 85.655, 4)  # overlap: compute waits for the rest
    assert int8.hiding_every == 103  # 1.2 x 85.655 s of 1 s steps
    assert plans["fp32"].bytes_per_outer_step == 4 * 10**9 and plans["int2"].bytes_per_outer_step == 312_500_000
    without = {p.payload: p for p in plan(10**9, 1.0, 100.0, 50.0, every=50, overlap=False)}
    assert without["int8"].compute_fraction == round(50 / (50 + 85.655), 4)
    assert all(p.compute_fraction == 1.0 for p in plan(10**9, 1.0, 100.0, 50.0, every=400) if p.payload != "fp32")


def test_a_group_of_g_sends_2_g_minus_1_over_g_of_the_vector():
    assert round_seconds(10**6, 4, 8.0, 0.0) == pytest.approx(FIXED_S + 1.5)  # 1.5 MB at 1 MB/s
    assert plan(64, 1.0, 1.0, 0.0, every=1, group=4)[-1].bytes_per_outer_step == 384  # fp32: 256 x 1.5


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
    assert rows[0].split()[:2] == ["PAYLOAD", "BYTES/OUTER"] and rows[3].split()[:3] == ["int8", "1.06", "GB"]
    out = peerd(*base, "--json")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[2] == {
        "payload": "int8",
        "bytes_per_outer_step": 1_062_500_000,
        "round_s": 85.655,
        "compute_fraction": round(50 / 85.655, 4),
        "hiding_every": 103,
    }
    for bad in (["--params", "1.5"], ["--mbit", "0"], ["--group", "1"]):
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
