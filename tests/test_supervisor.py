"""The supervisor of a training process (daemon/supervisor.py): bounded restarts with the real
child (python -m peerd.daemon.taskproc) against a real daemon, and the decision alone."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.supervisor import TASK_PROGRAM, ChildState, Preloaded, Supervisor, after_exit

ROOT = Path(__file__).resolve().parent.parent


def test_after_an_exit_the_child_is_done_restarted_or_failed():
    assert after_exit(0, 0, 3)[0] is ChildState.EXITED
    state, reason = after_exit(-signal.SIGKILL, 1, 3)
    assert state is ChildState.RESTARTING and reason == "killed by SIGKILL; restart 1 of 3"
    state, reason = after_exit(2, 4, 3)
    assert state is ChildState.FAILED and reason.startswith("exited with status 2; failed 4 times")


def run_status(daemon, run: str):
    with ControlClient(daemon.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def child(daemon, task: str, max_steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "peerd.daemon.taskproc",
        "--run",
        "sv",
        "--task",
        task,
        "--daemon",
        str(daemon.data_dir),
    ] + ["--max-steps", str(max_steps), "--average-every", "20", "--eval-every", "100"]


async def until(predicate, timeout: float, what: str) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.1)


def test_a_killed_child_is_restarted_and_training_goes_on_from_the_runs_step(spawn):
    a = spawn("sv", ["--run", "sv"])

    async def scenario() -> None:
        sup = Supervisor("task sv", child(a, "digits-mlp", 2000), cwd=ROOT, max_restarts=2, backoff=0.1)
        sup.start()
        await until(lambda: run_status(a, "sv").step >= 100, 120, "100 steps")
        first = sup.pid
        assert run_status(a, "sv").attached_pid == first
        os.kill(first, signal.SIGKILL)
        await until(lambda: sup.pid != first and run_status(a, "sv").attached_pid == sup.pid, 120, "restarted")
        before = run_status(a, "sv").step
        assert before >= 100  # the daemon kept the run's step: the new child attaches there
        await until(lambda: sup.state is ChildState.EXITED, 180, "2000 steps")
        assert sup.failures == 1 and "killed by SIGKILL" in sup.error
        status = run_status(a, "sv")
        assert status.step == 2000 and status.eval_metric == "accuracy" and status.eval_score >= 0.85

    asyncio.run(scenario())


def test_a_child_that_always_fails_ends_failed_after_the_bound_and_the_daemon_answers(spawn):
    a = spawn("sv-fail", ["--run", "sv"])

    async def scenario() -> None:
        sup = Supervisor("task sv", child(a, "no-such-task", 100), cwd=ROOT, max_restarts=2, backoff=0.1)
        sup.start()
        await until(lambda: sup.state is ChildState.FAILED, 120, "FAILED")
        assert sup.failures == 3 and "failed 3 times" in sup.error and "no-such-task" in sup.error, sup.error
        await sup.stop()
        assert sup.state is ChildState.FAILED

    asyncio.run(scenario())
    with ControlClient(a.control) as c:
        assert c.status().state == "READY"


def test_failures_after_a_stable_run_start_the_count_anew():
    # A child that fails after 0.4 s, with a bound of 1 restart: were the failures counted over its
    # life, the second would end it FAILED. Each ran longer than stable_after, so none is the
    # second in a row; the restart counter still counts every one.
    argv = [sys.executable, "-c", "import time; time.sleep(0.4); raise SystemExit(3)"]

    async def scenario() -> None:
        sup = Supervisor("flaky", argv, max_restarts=1, backoff=0.05, stable_after=0.2)
        sup.start()
        await until(lambda: sup.restarts >= 3, 30, "3 restarts")
        assert sup.state is not ChildState.FAILED and sup.failures == 1, (sup.state, sup.failures)
        assert "exited with status 3; restart 1 of 1" in sup.error, sup.error
        await sup.stop()
        # The same child with a bound it cannot reset (stable_after beyond its life): FAILED at the second.
        sup = Supervisor("flaky", argv, max_restarts=1, backoff=0.05, stable_after=60)
        sup.start()
        await until(lambda: sup.state is ChildState.FAILED, 30, "FAILED")
        assert sup.failures == 2 and sup.restarts == 1, (sup.failures, sup.restarts)

    asyncio.run(scenario())


def test_a_stopped_child_detaches_and_is_reaped(spawn):
    a = spawn("sv-stop", ["--run", "sv"])

    async def scenario() -> None:
        sup = Supervisor("task sv", child(a, "digits-mlp", 0), cwd=ROOT, max_restarts=2, backoff=0.1)
        sup.start()
        await until(lambda: run_status(a, "sv").step >= 40, 120, "two phases")
        pid = sup.pid
        await sup.stop(grace=20)
        assert sup.state is ChildState.STOPPED and sup.failures == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped
        status = run_status(a, "sv")
        assert status.attached_pid == 0 and status.train_state == "STOPPED"  # it detached on SIGTERM

    asyncio.run(scenario())


# A program that, started with --preload, reads its other arguments from stdin (as taskproc does),
# then prints them with its pid and exits with the status its first argument names.
PRELOADING = [
    sys.executable,
    "-c",
    "import json, os, sys\n"
    "args = sys.argv[1:]\n"
    "if args == ['--preload']:\n"
    "    line = sys.stdin.readline()\n"
    "    if not line: raise SystemExit(0)\n"
    "    args = json.loads(line)\n"
    "print(os.getpid(), *args, file=sys.stderr)\n"
    "raise SystemExit(int(args[0]))",
]


def test_the_first_start_takes_the_preloaded_process_and_a_restart_starts_a_new_one():
    async def scenario() -> None:
        preloaded = await Preloaded(PRELOADING).start()
        early = preloaded.proc.pid
        sup = Supervisor("pre", [*PRELOADING, "3", "x"], max_restarts=1, backoff=0.05, preloaded=preloaded)
        sup.start()
        await until(lambda: sup.state is ChildState.FAILED, 30, "FAILED")
        # Two runs: the preloaded process given "3 x" on stdin, then a fresh one with them as arguments.
        assert [line.split()[1:] for line in sup.tail] == [["3", "x"], ["3", "x"]], list(sup.tail)
        assert int(sup.tail[0].split()[0]) == early and sup.pid != early

    asyncio.run(scenario())


def test_a_preloaded_process_of_another_program_or_never_started_is_ended():
    async def scenario() -> None:
        other = await Preloaded(PRELOADING).start()
        early = other.proc
        sup = Supervisor(
            "pre", [sys.executable, "-c", "import os, sys; print(os.getpid(), file=sys.stderr)"], preloaded=other
        )
        sup.start()
        await until(lambda: sup.state is ChildState.EXITED, 30, "EXITED")
        assert early.returncode == -signal.SIGKILL and int(sup.tail[0]) == sup.pid != early.pid  # a new one
        unused = await Preloaded(PRELOADING).start()
        proc = unused.proc
        await Supervisor("pre", [*PRELOADING, "0"], preloaded=unused).stop()  # stopped before it started
        assert proc.returncode == -signal.SIGKILL

    asyncio.run(scenario())


def test_taskproc_preloaded_imports_torch_and_trains_with_the_arguments_it_reads(spawn):
    """The real training process started with --preload (as a --task daemon starts it) attaches and
    trains with the arguments it reads from stdin."""
    a = spawn("sv-pre", ["--run", "sv"])

    async def scenario() -> None:
        preloaded = await Preloaded(TASK_PROGRAM, ROOT).start()
        early = preloaded.proc.pid
        sup = Supervisor("task sv", child(a, "digits-mlp", 60), cwd=ROOT, preloaded=preloaded)
        sup.start()
        await until(lambda: sup.state is ChildState.EXITED, 120, "60 steps")
        assert sup.pid == early and sup.failures == 0, list(sup.tail)
        assert run_status(a, "sv").step == 60

    asyncio.run(scenario())
