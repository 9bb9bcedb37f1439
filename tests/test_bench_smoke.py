"""Smoke test of bench.daemon_costs: it runs to the end and prints the promised JSON lines.

No figure is asserted: timings on a shared CI machine say nothing, and docs/benchmarks.md holds the
measured ones.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 240.0  # seconds for the --quick run (about 50 s): 7 daemon starts, 10 s idling, one peer TTL
REQUIRED = {"bench", "metric", "ours", "baseline", "ratio", "unit"}


@pytest.mark.slow
def test_daemon_costs_quick_prints_json_lines():
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.daemon_costs", "--quick"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the benchmark then kills the daemons it started, which live in their own sessions.
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"bench.daemon_costs --quick took over {RUN_TIMEOUT:.0f} s; stderr:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err[-3000:]}"
    lines = out.splitlines()
    assert lines, f"no output; stderr:\n{err[-3000:]}"
    records = [json.loads(line) for line in lines]
    for r in records:
        assert REQUIRED <= r.keys(), r
    assert records[-1]["bench"] == "daemon_costs"
    assert records[-1]["metric"] == "start_to_ready_s"
