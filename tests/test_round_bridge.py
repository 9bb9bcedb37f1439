"""The trainer's blocking round (daemon/joining.round_bridge): a round the run's stop cancels, or one that
times out, returns only once the engine has stopped writing into the vector, and says which it was."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from peerd.daemon.joining import RunHandle, round_bridge

RESTORE_TIME = 0.05  # seconds the fake engine takes to put the vector back once cancelled


class Handle(RunHandle):
    """A run's handle that says when the bridge has published the future of the round in flight."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "round_future" and value is not None:
            self.published.set()


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop")
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def engine(started: threading.Event):
    """A round that runs until cancelled, then restores the vector (as MoshpitAverager does), late."""

    async def run_round(vector, weight, round_t, lanes, restore, payload):
        saved = vector.clone()
        vector.fill_(99.0)  # partly written
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(RESTORE_TIME)
            vector.copy_(saved)

    return run_round


@pytest.mark.parametrize("how", ["stop", "timeout"])
def test_an_interrupted_round_returns_after_the_vector_is_restored(loop, how):
    handle, started = Handle("r", None, None), threading.Event()
    handle.published = threading.Event()
    average = round_bridge(handle, loop, engine(started), timeout=3600 if how == "stop" else 0.2)

    def stop():  # the daemon's leave or drain cancels the round the trainer waits for (app._stop_run)
        if started.wait(10) and handle.published.wait(10):
            handle.round_future.cancel()

    if how == "stop":
        threading.Thread(target=stop, name="stopper").start()
    vector = torch.ones(4)
    [result] = average(vector, 1.0, 7)
    assert torch.equal(vector, torch.ones(4))  # the engine's restore happened before the return
    assert result.interrupted and result.round_t == 7
    assert result.cancelled == (how == "stop"), result.reason


def test_no_round_starts_once_the_run_stops(loop):
    """The daemon's leave or drain sets `stopping` before it cancels the round in flight: a round the
    trainer asks for after that (its next phase's, in a drain that waits for the trainer) does not run."""
    handle, started = Handle("r", None, None), threading.Event()
    handle.stopping = True
    average = round_bridge(handle, loop, engine(started), timeout=3600)
    vector = torch.ones(4)
    [result] = average(vector, 1.0, 8)
    assert result.cancelled and result.round_t == 8
    assert not started.is_set() and torch.equal(vector, torch.ones(4))
