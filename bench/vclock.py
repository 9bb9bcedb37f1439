"""An asyncio event loop whose clock is virtual: the injected clock of the engine's tests and of
bench.swarm_sim.

Halves and GroupAllReduce read every deadline from the loop's clock (`loop.time()`, through
`asyncio.timeout`, `sleep` and `call_later`). On this loop, time stands still while anything is ready
to run, and when nothing is, it jumps to the next timer at once (trio's autojump clock, for asyncio).
A test of a timeout then takes microseconds, and "the op failed at its limit, not before" is an
exact comparison instead of a wall-clock window that a busy machine can break.

    run(main())                 # as uvloop.run(main()), on virtual time from 0.0

Only for code whose messages travel in memory (a hand-driven transport): a real socket's bytes take
real time to arrive, and the clock would jump past them.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# A wait with no timer due and nothing to read is a deadlock on virtual time; the real selector is
# given this long (real seconds) for a thread's call_soon_threadsafe before the test is failed.
DEADLOCK_AFTER = 10.0


class _Jumping:
    """The loop's selector, but a wait for `timeout` seconds returns at once and advances the clock."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualTimeLoop):
        self._real, self._loop = real, loop

    def select(self, timeout: float | None = None):
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer at all: only another thread can wake the loop
            events = self._real.select(DEADLOCK_AFTER)
            if not events:
                raise RuntimeError(f"deadlock: nothing ready, no timer, no wake-up in {DEADLOCK_AFTER} s")
            return events
        self._loop.advance(timeout)
        return []

    def __getattr__(self, name: str):
        return getattr(self._real, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._selector = _Jumping(self._selector, self)

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time cannot go back ({seconds} s)")
        self._now += seconds


def run(coro: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
