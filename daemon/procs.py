"""Start real `peerd start` processes and wait for them to be ready: for the demo, tests and benches.

Readiness comes from each daemon's ready.json, never from its log text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peerd.daemon.supervisor import PARENT_ENV

READY_TIMEOUT = 60.0  # seconds from spawn to ready.json: p2pd start plus DHT bootstrap, with margin (a CI run with two workers saw one take over 30 s)
STOP_TIMEOUT = 20.0  # seconds from SIGTERM to exit; above the daemon's default drain_timeout


class DaemonFailed(RuntimeError):
    pass


@dataclass
class LocalDaemon:
    """One `peerd start` subprocess on loopback with OS-chosen ports, in its own session."""

    data_dir: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    ready: dict[str, Any] = field(default_factory=dict)

    def start(self, wait: bool = True) -> "LocalDaemon":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "ready.json").unlink(missing_ok=True)
        self.ready = {}  # a restart's, not the last run's
        self.log_path = self.log_path or self.data_dir.parent / f"{self.data_dir.name}.log"
        cmd = [
            sys.executable,
            "-m",
            "peerd.daemon.cli",
            "start",
            "--data-dir",
            str(self.data_dir),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            *self.args,
        ]
        env = {**os.environ, **(self.env or {})}
        env.pop(PARENT_ENV, None)
        if threading.current_thread() is threading.main_thread():
            # The daemon goes (SIGTERM) when this process goes, even killed (a test run's worker, a
            # demo): none is left training in the background. Linux ties it to the starting thread,
            # so only the main thread asks for it.
            env[PARENT_ENV] = str(os.getpid())
        with open(self.log_path, "ab") as log:
            # A new session, so that a test can reap the daemon and p2pd as one process group.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll_ready():
                return self.ready
            time.sleep(0.05)
        raise DaemonFailed(f"daemon not ready after {timeout:.0f} s; log:\n{self.log_tail()}")

    def poll_ready(self) -> bool:
        """One look at ready.json; raises DaemonFailed if the daemon has exited."""
        if self.ready.get("pid") == self.proc.pid:
            return True
        if self.proc.poll() is not None:
            raise DaemonFailed(f"daemon exited with {self.proc.returncode} before ready; log:\n{self.log_tail()}")
        try:
            ready = json.loads((self.data_dir / "ready.json").read_text())
        except (OSError, ValueError):
            return False
        if ready.get("pid") != self.proc.pid:
            return False
        self.ready = ready
        return True

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def peer_id(self) -> str:
        return self.ready["peer_id"]

    @property
    def maddrs(self) -> list[str]:
        return self.ready["maddrs"]

    @property
    def metrics_url(self) -> str:
        return self.ready["metrics_url"]

    @property
    def control(self) -> str:
        return self.ready["control"]

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait; returns the exit code. Kills the whole group if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            raise DaemonFailed(f"daemon did not exit {timeout:.0f} s after SIGTERM; log:\n{self.log_tail()}")

    def send_signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill_group(self) -> None:
        """SIGKILL the daemon and everything in its session (p2pd included)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stop_all(daemons: list[LocalDaemon], timeout: float = STOP_TIMEOUT, hurry=lambda: False) -> list[int | None]:
    """SIGTERM every daemon at once, so that they drain in parallel, and wait for them all.

    Kills the whole group (p2pd included) of those still running after `timeout`, or as soon as
    hurry() returns true (a second Ctrl-C). Returns each exit code; None for a daemon killed here.
    """
    for d in daemons:
        d.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(d.proc.poll() is None for d in daemons if d.proc) and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
    codes: list[int | None] = []
    for d in daemons:
        if d.proc is not None and d.proc.poll() is None:
            d.kill_group()
            codes.append(None)
        else:
            codes.append(d.proc.returncode if d.proc else 0)
    return codes
