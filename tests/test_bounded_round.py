"""The trainer's round on the daemon's loop (daemon/joining.bounded_round): a round the run's stop
cancels, or one that times out, returns only once the engine has stopped writing into the vector,
and says which it was."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peerd.daemon.joining import RunHandle, bounded_round

RESTORE_TIME = 0.05  # seconds the fake engine takes to put the vector back once cancelled


def engine(started: asyncio.Event):
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
def test_an_interrupted_round_returns_after_the_vector_is_restored(how):
    async def main():
        handle, started = RunHandle("r", None, None), asyncio.Event()
        average = bounded_round(handle, engine(started), timeout=3600 if how == "stop" else 0.2)

        async def stop():  # the daemon's leave or drain cancels the round in flight (app._stop_run)
            await asyncio.wait_for(started.wait(), 10)
            handle.cancel()

        stopper = asyncio.ensure_future(stop()) if how == "stop" else None
        vector = torch.ones(4)
        [result] = await asyncio.wait_for(average(vector, 1.0, 7), 30)
        if stopper is not None:
            await stopper
        assert torch.equal(vector, torch.ones(4))  # the engine's restore happened before the return
        assert result.interrupted and result.round_t == 7
        assert result.cancelled == (how == "stop"), result.reason
        assert handle.round_task is None

    asyncio.run(main())


def test_no_round_starts_once_the_run_stops():
    """The daemon's leave or drain stops the run before it cancels the round in flight: a round the
    trainer asks for after that (its next phase's, in a drain that waits for the trainer) does not run."""

    async def main():
        handle, started = RunHandle("r", None, None), asyncio.Event()
        handle.cancel()
        average = bounded_round(handle, engine(started), timeout=3600)
        vector = torch.ones(4)
        [result] = await average(vector, 1.0, 8)
        assert result.cancelled and result.round_t == 8
        assert not started.is_set() and torch.equal(vector, torch.ones(4))

    asyncio.run(main())


def test_a_cancelled_caller_takes_its_round_with_it():
    """The daemon's loop ends with a round in flight: the round is cancelled (and restores), not left running."""

    async def main():
        handle, started = RunHandle("r", None, None), asyncio.Event()
        average = bounded_round(handle, engine(started), timeout=3600)
        vector = torch.ones(4)
        caller = asyncio.ensure_future(average(vector, 1.0, 9))
        await asyncio.wait_for(started.wait(), 10)
        round_task = handle.round_task
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait({round_task}, timeout=10)
        assert round_task.cancelled() and torch.equal(vector, torch.ones(4))

    asyncio.run(main())
