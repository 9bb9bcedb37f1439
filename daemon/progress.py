"""A short progress line per training run in the daemon's log, every `progress_interval` seconds.

For a person watching a foreground daemon or its journal; scripts read `peerd status --json` or
/metrics instead. Lines go to the `peerd.daemon.progress` logger at INFO; `--progress-interval 0` turns
them off.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable, Iterable

logger = logging.getLogger(__name__)


def progress_line(run) -> str:
    """One run's line, from its RunStatus (protos/control.proto), e.g.
    `run demo: TRAINING step 120 (local 120), loss 0.3412, 512 samples/s, last round 12 completed (group 3)`."""
    loss = "-" if math.isnan(run.loss) else f"{run.loss:.4f}"
    line = (
        f"run {run.run_id}: {run.train_state} step {run.step} (local {run.local_step}), loss {loss}, "
        f"{run.samples_per_second:.0f} samples/s, "
    )
    if run.last_round_outcome:
        line += f"last round {run.last_round} {run.last_round_outcome} (group {run.group_size})"
    else:
        line += "no round yet"
    return line + (f"; error: {run.error}" if run.error else "")


MIN_GAP = 0.6  # of the interval: the shortest time between two progress lines


class ProgressLog:
    """Logs progress_line for every run with a task, every `interval` seconds (0: never), from
    start() to stop(). Ticks keep to a fixed schedule; ticks missed while the loop was busy are skipped,
    and a late one delays the next to at least MIN_GAP intervals after it."""

    def __init__(self, runs: Callable[[], Iterable], interval: float):
        self.runs, self.interval = runs, interval
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="progress-log")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval
        while True:
            await asyncio.sleep(max(due - loop.time(), 0.0))
            # The next tick on the schedule, but never sooner than MIN_GAP intervals after this one:
            # a tick the busy loop ran late is not followed by another a moment later.
            due = max(due + self.interval, loop.time() + MIN_GAP * self.interval)
            try:
                for run in self.runs():
                    if run.task:
                        logger.info("%s", progress_line(run))
            except Exception:  # one failed tick must not end the loop
                logger.exception("progress line failed")
