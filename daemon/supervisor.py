"""A child process the daemon starts, reaps and restarts a bounded number of times: the training
process of a `--task` run (python -m peerd.daemon.taskproc; daemon/taskchild.py;
DESIGN.md, "Processes").

The child dies with the daemon: it is started with PEERD_PARENT_PID, and die_with_parent() (called
first thing in the child) asks Linux to kill it when its parent goes (PR_SET_PDEATHSIG), closing
the race with a parent that died before the call.

A child's first start may take a process started earlier with the same program and no arguments
yet (`Preloaded`: it imports its libraries while the daemon starts, and reads its arguments from
stdin as one JSON line; daemon/taskproc.py `--preload`); a restart starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from enum import Enum
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_GRACE = 30.0  # seconds a child has after SIGTERM (it detaches: the daemon checkpoints) before SIGKILL
PARENT_ENV = "PEERD_PARENT_PID"
PRELOAD_FLAG = "--preload"  # a child's argument: read the others from stdin (Preloaded)
TASK_PROGRAM = [sys.executable, "-m", "peerd.daemon.taskproc"]  # a --task run's training process
PR_SET_PDEATHSIG = 1
TAIL_LINES = 20  # lines of the child's stderr kept for the error a failure shows
STABLE_AFTER = 600.0  # seconds a child runs before a failure no longer counts toward the bound with earlier ones


class ChildState(Enum):
    RUNNING = "RUNNING"  # spawned, not yet exited
    RESTARTING = "RESTARTING"  # it exited with an error; started again after the back-off
    EXITED = "EXITED"  # it exited with status 0: its work is done
    FAILED = "FAILED"  # it failed more often than the bound allows; see `error`
    STOPPED = "STOPPED"  # stopped by the daemon


def after_exit(returncode: int, failures: int, max_restarts: int) -> tuple[ChildState, str]:
    """What follows a child's exit: `failures` counts this one. Pure: the supervisor and its tests
    call it alike."""
    if returncode == 0:
        return ChildState.EXITED, "exited with status 0"
    how = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with status {returncode}"
    if failures > max_restarts:
        return ChildState.FAILED, f"{how}; failed {failures} times, more than the {max_restarts} restarts allowed"
    return ChildState.RESTARTING, f"{how}; restart {failures} of {max_restarts}"


class Preloaded:
    """A child started ahead of its arguments: `program` (argv's first elements) plus PRELOAD_FLAG,
    waiting for the rest of argv on stdin. Taken once, by the Supervisor whose argv starts with
    `program`; close() ends it unused. Its stdin closed unread (the daemon gone), it exits."""

    def __init__(self, program: list[str], cwd: Path | None = None):
        self.program, self.cwd = program, cwd
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> "Preloaded":
        self.proc = await asyncio.create_subprocess_exec(
            *self.program,
            PRELOAD_FLAG,
            cwd=self.cwd,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        return self

    async def take(self, argv: list[str], cwd: Path | None) -> asyncio.subprocess.Process | None:
        """The process, given the rest of `argv`; None where it does not fit argv or has exited."""
        proc, self.proc = self.proc, None
        if proc is None or argv[: len(self.program)] != self.program or cwd != self.cwd or proc.returncode is not None:
            await _end(proc)
            return None
        try:
            proc.stdin.write(json.dumps(argv[len(self.program) :]).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # it exited meanwhile
            await _end(proc)
            return None
        except BaseException:  # cancelled: the supervisor stops
            proc.kill()
            raise
        return proc

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        await _end(proc)


async def _end(proc: asyncio.subprocess.Process | None) -> None:
    """End a preloaded process that was not given its arguments (it has nothing to save)."""
    if proc is None:
        return
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()
    with contextlib.suppress(Exception):  # its stderr, unread (the pipe is at its end)
        await proc.stderr.read()


class Supervisor:
    """Runs `argv` until it exits with status 0, restarting it after a failure (back-off doubling
    from `backoff` seconds) at most `max_restarts` times in a row: a child that ran `stable_after`
    seconds before it failed starts the count (and the back-off) anew, so a long run is not ended by
    failures days apart. `state`, `failures` (in a row), `restarts`, `pid` and `error` are for status
    and metrics; start() and stop() are called from the daemon's event loop."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        cwd: Path | None = None,
        max_restarts: int = 3,
        backoff: float = 1.0,
        stable_after: float = STABLE_AFTER,
        preloaded: Preloaded | None = None,
    ):
        self.name, self.argv, self.cwd = name, argv, cwd
        self._preloaded = preloaded  # the first start's process, if it fits (Preloaded.take)
        self.max_restarts, self.backoff, self.stable_after = max_restarts, backoff, stable_after
        self.state = ChildState.RUNNING
        self.failures = 0  # in a row: since the start, or since a failure after a stable run
        self._failed = 0  # over the supervisor's life
        self.pid = 0
        self.error = ""
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # the child's latest stderr lines
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def restarts(self) -> int:
        """Restarts after a failure so far, over the supervisor's life: every failure but one that ends FAILED."""
        return self._failed - (self.state is ChildState.FAILED)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"child:{self.name}")

    async def stop(self, grace: float = STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; the child is reaped before this returns."""
        self._stopping = True
        if self._task is not None:  # first: no restart may follow (it only waits on the child meanwhile)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._preloaded is not None:  # never started
            await self._preloaded.close()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(grace):
                    await proc.wait()
            except TimeoutError:
                logger.warning("%s: pid %d did not stop within %.0f s; killing it", self.name, proc.pid, grace)
                proc.kill()
                await proc.wait()
        if self.state not in (ChildState.EXITED, ChildState.FAILED):
            self.state = ChildState.STOPPED

    async def _run(self) -> None:
        delay = self.backoff
        while not self._stopping:
            self.state = ChildState.RUNNING
            preloaded, self._preloaded = self._preloaded, None
            self._proc = preloaded and await preloaded.take(self.argv, self.cwd)
            if self._proc is None:
                self._proc = await asyncio.create_subprocess_exec(
                    *self.argv,
                    cwd=self.cwd,
                    env={**os.environ, PARENT_ENV: str(os.getpid())},
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                )
            self.pid, began = self._proc.pid, time.monotonic()
            logger.info("%s: started (pid %d)", self.name, self.pid)
            async for line in self._proc.stderr:  # until the child closes it: it exits
                text = line.decode(errors="replace").rstrip()
                self.tail.append(text)
                logger.info("%s: %s", self.name, text)  # the child's log, in the daemon's
            returncode = await self._proc.wait()
            if self._stopping:
                return
            if returncode != 0 and time.monotonic() - began >= self.stable_after:
                self.failures, delay = 0, self.backoff  # a stable run: this failure starts the count anew
            failures = self.failures + (returncode != 0)
            state, reason = after_exit(returncode, failures, self.max_restarts)
            self.failures, self._failed = failures, self._failed + (returncode != 0)
            if state is ChildState.EXITED:
                self.state = state
                logger.info("%s: %s", self.name, reason)
                return
            last = self.tail[-1] if self.tail else ""
            self.error = f"{reason}: {last}" if last else reason
            logger.warning("%s: pid %d %s", self.name, self.pid, self.error)
            if state is ChildState.FAILED:
                self.state = state
                return
            self.state = state
            await asyncio.sleep(delay)
            delay = min(2 * delay, 30.0)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child started with PARENT_ENV: get `sig` when the process that started it dies (Linux;
    elsewhere a no-op): a training child when its daemon goes, a daemon (SIGTERM: it drains) when
    the test, demo or benchmark that started it goes (daemon/procs.py). Exits at once if the parent
    is already gone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != int(parent):  # the parent died before prctl: nobody will send the signal
        os._exit(1)
