"""Stopping as a terminal does it: signals to a whole process group (Ctrl-C, a closed terminal),
for a foreground `peerd start` and for the demo. Nothing it started may be left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from peerd.daemon.client import ControlClient
from tests.helpers import ROOT, wait_for


TRIES = 5
EXIT_BOUND = 2.0  # seconds from Ctrl-C to a foreground daemon's exit (docs/operations.md: under a second)


def live_descendants(pid: int) -> set[int]:
    """Live (non-zombie) processes under pid: the daemons, their p2pd, anything else."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return alive({c.pid for c in children})


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.add(p)
        except psutil.NoSuchProcess:
            pass
    return out


def training_step(d) -> int:
    with ControlClient(d.control) as c:
        return next((r.local_step for r in c.status().runs if r.run_id == "ctrl-c"), 0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "hangup"])
def test_signal_to_the_whole_group_stops_a_training_daemon_at_once(spawn, tmp_path, sig):
    """A terminal signals the whole foreground group, p2pd included: each try exits 0 within
    EXIT_BOUND and leaves no process behind (the drain used to wait 10 s on the p2pd that was gone)."""
    tries = TRIES if sig == signal.SIGINT else 1
    results = []
    for i in range(tries):
        # LocalDaemon starts peerd in a session and process group of its own, as a shell starts a job.
        d = spawn(f"fg{i}", ["--run", "ctrl-c", "--task", "digits-mlp", "--eval-every", "20"], data_dir=tmp_path / "d")
        # Training, not still loading: a resumed try reports its checkpoint's step before the trainer
        # has built its data (about a second for digits-mlp), and a stop waits for that.
        first = training_step(d)
        wait_for(lambda: training_step(d) > first, timeout=60, what="training")
        children = live_descendants(d.pid)
        assert children, "p2pd runs under the daemon"
        t0 = time.monotonic()
        os.killpg(d.pid, sig)
        if sig == signal.SIGHUP:  # a closing terminal can hang up twice (its shell, then the kernel)
            os.killpg(d.pid, sig)
        try:
            code = d.proc.wait(EXIT_BOUND + 10)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        if code is None:
            d.kill_group()
        wait_for(lambda: not alive(children | {d.pid}), timeout=2, what="no process of the daemon left")
        results.append((code, round(took, 2)))
    print(f"{sig.name}: exit codes and seconds to exit per try: {results}")
    assert all(code == 0 and took < EXIT_BOUND for code, took in results), (results, d.log_tail())


def start_demo(tmp_path: Path) -> tuple[subprocess.Popen, Path, set[int]]:
    """`python -m peerd.daemon.demo` with two daemons in a process group of its own (a terminal's job),
    once both daemons are ready; returns it, its output file and every process it started."""
    out = tmp_path / "demo.out"
    cmd = [sys.executable, "-m", "peerd.daemon.demo", "--daemons", "2", "--duration", "120", "--interval", "1"]
    with open(out, "wb") as f:
        demo = subprocess.Popen(
            [*cmd, "--dir", str(tmp_path / "demo")], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, process_group=0
        )

    def ready_pids() -> set[int]:
        pids = set()
        for name in ("peer0", "peer1"):
            try:
                pids.add(json.loads((tmp_path / "demo" / name / "ready.json").read_text())["pid"])
            except (OSError, ValueError, KeyError):
                return set()
        return pids

    try:
        daemons = wait_for(ready_pids, timeout=90, what="the demo's two daemons ready")
        wait_for(lambda: "SAMPLES/S" in out.read_text(), timeout=10, what="the demo's table header: it saw them ready")
        # Each daemon and its p2pd: four processes at least.
        started = wait_for(lambda: (p := live_descendants(demo.pid)) >= daemons and len(p) >= 4 and p, timeout=10)
    except AssertionError:
        os.killpg(demo.pid, signal.SIGKILL)
        raise
    return demo, out, started


def check_stopped(demo: subprocess.Popen, out: Path, started: set[int], how: str) -> str:
    try:
        code = demo.wait(30)
    except subprocess.TimeoutExpired:
        code = None
    deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to be gone
    while (leftover := alive(started)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in leftover:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    text = out.read_text(errors="replace")
    assert code is not None and code >= 0, f"the demo did not exit by itself after {how} ({code}):\n{text}"
    assert not leftover, f"{how} left processes the demo started: {leftover}\n{text}"
    assert "Traceback" not in text, text
    return text


@pytest.mark.heavy
def test_demo_stops_every_daemon_when_its_terminal_closes(tmp_path):
    demo, out, started = start_demo(tmp_path)
    os.killpg(demo.pid, signal.SIGHUP)
    os.killpg(demo.pid, signal.SIGHUP)  # a closing terminal can hang up twice: still a clean stop
    text = check_stopped(demo, out, started, "SIGHUP")
    assert demo.returncode == 0 and "every daemon exited cleanly" in text, text
    assert f"kept in {tmp_path / 'demo'}" in text, text  # the summary says where the data dirs are
    assert "status --data-dir" in text and "SAMPLES/S" in text and "nan" not in text, text


@pytest.mark.heavy
def test_demo_stops_every_daemon_on_a_double_ctrl_c(tmp_path):
    demo, out, started = start_demo(tmp_path)
    os.killpg(demo.pid, signal.SIGINT)
    wait_for(lambda: "stopping" in out.read_text(), timeout=10, what="the demo stopping its daemons")
    # An impatient user, while it stops them and on until it has exited: Python puts the default
    # handler back as it exits, and a Ctrl-C then used to kill the demo after a clean stop (exit -2).
    deadline = time.monotonic() + 30
    while demo.poll() is None and time.monotonic() < deadline:
        os.killpg(demo.pid, signal.SIGINT)
        time.sleep(0.02)
    check_stopped(demo, out, started, "Ctrl-C pressed again and again")


def test_demo_rows_show_a_dash_for_what_has_not_happened_yet():
    from peerd.daemon.demo import HEADER, progress_line
    from peerd.protos import control_pb2

    before = control_pb2.RunStatus(run_id="demo", train_state="LOADING", loss=float("nan"))
    after = control_pb2.RunStatus(
        run_id="demo",
        train_state="TRAINING",
        step=20,
        local_step=20,
        loss=1.23456,
        samples_per_second=850.4,
        last_round=2,
        last_round_outcome="completed",
        group_size=3,
        eval_metric="accuracy",
        eval_score=0.8123,
    )
    assert progress_line("5s", "peer0", before).split() == ["5s", "peer0", "LOADING", "0", "-", "-", "-", "-"]
    row = progress_line("", "peer1", after)
    assert row.split() == ["peer1", "TRAINING", "20", "1.2346", "850", "2", "completed", "(3)", "accuracy", "0.812"]
    assert len(HEADER.split()) == 9 and row.index("1.2346") < HEADER.index("SAMPLES/S"), (HEADER, row)


def test_a_daemon_goes_when_the_process_that_started_it_is_killed(tmp_path):
    """A test run's worker or a demo killed with SIGKILL runs no clean-up: the daemons it started
    (daemon/procs.py) still go (SIGTERM from Linux, PR_SET_PDEATHSIG), p2pd with them."""
    launcher = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from peerd.daemon.procs import LocalDaemon\n"
        "d = LocalDaemon(Path(sys.argv[1]), [])\n"
        "d.start(wait=True)\n"
        "print(d.proc.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", launcher, str(tmp_path / "orphan")], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(p.stdout.readline())
        family = {pid, *live_descendants(pid)}
        assert len(family) >= 2, family  # the daemon and its p2pd
        p.kill()
        p.wait(10)
        wait_for(lambda: not alive(family), timeout=30, what=f"the orphaned daemon {pid} and its p2pd to exit")
    finally:
        p.kill()
        for q in alive({*locals().get("family", set())}):
            os.kill(q, signal.SIGKILL)
