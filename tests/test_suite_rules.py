"""The suite's own rules (tests/suite_rules.py), in a pytest run of their own on three xdist workers:
a retry is printed in the last lines and appended to the ledger; no more than two heavy tests run at once,
and a test marked heavy(slots=2) with none beside it."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT
from tests.suite_rules import TRACEBACK_LINES

RUN = """
import os, time, pytest

LOG = os.environ["RULES_LOG"]

@pytest.mark.flaky(reruns=1)
def test_fails_once():
    if not os.path.exists(LOG + ".failed"):
        open(LOG + ".failed", "w").close()
        raise AssertionError("the first try fails")

@pytest.mark.heavy
@pytest.mark.parametrize("i", range(4))
def test_heavy(i):
    with open(LOG, "a") as f:
        f.write(f"{time.monotonic()} 1\\n")
    time.sleep(3)
    with open(LOG, "a") as f:
        f.write(f"{time.monotonic()} -1\\n")

@pytest.mark.heavy(slots=2)
def test_heavy_alone():
    with open(LOG, "a") as f:
        f.write(f"{time.monotonic()} 2\\n")
    time.sleep(3)
    with open(LOG, "a") as f:
        f.write(f"{time.monotonic()} -2\\n")
"""


def test_a_retry_is_printed_last_and_on_record_and_two_heavy_tests_run_at_most(tmp_path):
    """Heavy tests count one slot each, heavy(slots=2) two: at no moment do more than two run."""
    (tmp_path / "test_rules.py").write_text(RUN)
    log, ledger = tmp_path / "log", tmp_path / "ledger.md"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "-q", "-p", "no:cacheprovider"]
        + ["-n", "3", "--dist", "loadgroup", "--flaky-ledger", str(ledger), str(tmp_path / "test_rules.py")],
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "RULES_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-(TRACEBACK_LINES + 2) :]  # RETRIED, its traceback's end, the counts
    assert any(line.startswith("RETRIED ") and "test_fails_once" in line for line in last), last
    assert "AssertionError: the first try fails" in last[-2] and "6 passed, 1 rerun" in last[-1], last
    assert "test_fails_once" in ledger.read_text() and "the first try fails" in ledger.read_text()
    running = peak = 0
    events = sorted((float(t), int(d)) for t, d in (line.split() for line in log.read_text().splitlines()))
    for _, d in events:  # an end at the same instant as a start sorts first (-2 < -1 < 1 < 2)
        running += d
        peak = max(peak, running)
    assert len(events) == 10 and peak <= 2, events
