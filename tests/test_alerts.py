"""deploy/alerts.yml: valid rules, loaded by deploy/prometheus.yml, and unit-tested with promtool
(tests/alerts_test.yml: a FAILED training run fires PeerdTrainingFailed at once, and more)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus package)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_rules_are_valid_and_loaded_by_the_prometheus_config():
    r = promtool("check", "rules", "deploy/alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("check", "config", "deploy/prometheus.yml")
    assert r.returncode == 0 and "1 rule files found" in r.stdout, r.stdout + r.stderr


def test_rules_fire_as_tested():
    r = promtool("test", "rules", "tests/alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
