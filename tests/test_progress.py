"""The progress line a foreground daemon logs per training run, every --progress-interval seconds."""

from __future__ import annotations

import re
from datetime import datetime

import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.procs import LocalDaemon
from tests.helpers import wait_for


INTERVAL = 1.0
LINE = re.compile(
    r"^(\S+ \S+) INFO peerd\.daemon\.progress: run (\S+): (\w+) step (\d+) \(local \d+\), loss \S+, \d+ samples/s, "
    r"(last round \d+ \w+ \(group \d+\)|no round yet)$",
    re.M,
)


def progress_lines(d: LocalDaemon) -> list[tuple[float, str, str]]:
    """(time, run, state) of each progress line in the daemon's log."""
    text = d.log_path.read_text(errors="replace")
    return [(datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), m[2], m[3]) for m in LINE.finditer(text)]


def training(d: LocalDaemon) -> bool:
    with ControlClient(d.control) as c:
        return any(r.train_state == "TRAINING" and r.step > 0 for r in c.status().runs)


@pytest.mark.heavy
def test_progress_lines_come_at_the_interval_and_not_when_off(tmp_path):
    args = ["--run", "prog", "--task", "digits-mlp", "--eval-every", "1000"]
    on = LocalDaemon(tmp_path / "on", [*args, "--progress-interval", str(INTERVAL)])
    off = LocalDaemon(tmp_path / "off", [*args, "--progress-interval", "0"])
    try:
        on.start(wait=False)
        off.start(wait=False)
        on.wait_ready()
        off.wait_ready()
        # Both trainers, each a child process that starts on its own time (seconds apart on a busy machine).
        wait_for(lambda: training(on) and training(off), timeout=60, what="both daemons training")
        seen = len(progress_lines(on))
        lines = wait_for(lambda: (p := progress_lines(on))[seen:][3:] and p, timeout=30, what="4 more progress lines")
        assert {(run, state) for _, run, state in lines[seen:]} == {("prog", "TRAINING")}
        gaps = [b - a for (a, _, _), (b, _, _) in zip(lines, lines[1:])]
        assert all(0.5 * INTERVAL <= g <= 2.5 * INTERVAL for g in gaps), gaps  # a fixed schedule, on a busy machine
        assert progress_lines(off) == []  # it trained through the same 4 intervals
        assert on.stop() == 0 and off.stop() == 0
    finally:
        on.kill_group()
        off.kill_group()


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_a_bad_interval_is_refused(value):
    from peerd.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="progress_interval"):
        load_config({"progress_interval": value}, environ={})
