"""A run's `averaging.algorithm`, the strategy its trainer holds (daemon/attached.py AttachedTrainer):
what the shared vector holds, what peers download and checkpoints keep, and the round at a phase's
end. Every method is called under the trainer's lock; `round` is awaited on the daemon's loop.

    diloco  The vector holds the model's parameters, written by the process at each phase's end.
            This daemon keeps DiLoCo's outer state [θ; m] and the error feedback (daemon/diloco.py
            OuterLoop): peers download [θ; m], checkpoints keep it with the residual. The round
            averages the phase's pseudo-gradient and takes the outer step.
    state   The vector is the task's whole training state (the parameters, then the inner
            optimizer's floating-point state, in daemon/flat.py state_tensors' order, the same on
            every peer). The round averages it in place (a completed round leaves the group's
            mean, a partial one the mean where it arrived, a failed one or none the vector as it
            was); the process copies it back into its model and optimizer. No outer optimizer,
            no overlap. Peers download the vector; checkpoints are the task's model and optimizer
            ("model" and "optimizer" state dicts, as older releases' trainer thread wrote them),
            so this daemon keeps the task's model and optimizer (built once to know the layout).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import torch

from peerd.daemon.diloco import Applied, OuterLoop, OuterSettings, lanes_to_put_back
from peerd.daemon.flat import from_flat, state_tensors, to_flat
from peerd.peers.averaging import RoundResult
from peerd.peers.collective import arctopk
from peerd.peers.dear.hierarchy import lane_bounds
from peerd.peers.statesync import Snapshot

# The run's round (daemon/joining.bounded_round): (vector, weight, round_t, lanes, restore, payload).
Average = Callable[..., Awaitable[list[RoundResult]]]


class DiLoCo:
    """averaging.algorithm=diloco, with its outer settings."""

    def __init__(self, settings: OuterSettings):
        self.settings = settings
        self.overlap = settings.overlap
        # Whether the process's parameters differ from θ at a phase's end, so that the shared file
        # carries θ beside them (peerd.torch.Optimizer.run_parameters reads it; 4 bytes a value):
        # with overlap they hold its progress since, with ARC-Top-K the rows it did not send.
        self.theta_apart = settings.overlap or settings.payload == arctopk.PAYLOAD
        self.outer: OuterLoop | None = None  # once bound to the trainer's vector

    def numel(self, parameters: int) -> int:
        return parameters

    def bind(self, vector: torch.Tensor, average: Average, name: str, on_round_done, lanes: int) -> None:
        """Round on the trainer's `vector`; `on_round_done()` with overlap, on the loop, when a round ends."""

        async def round_in(payload: torch.Tensor, weight: float, round_t: int, fmt: str) -> list[RoundResult]:
            # restore=False: the outer loop writes again what a lane that did not apply held (from P
            # and the residual), so the engine backs up only this member's own shard.
            return await average(payload, weight, round_t, None, restore=False, payload=fmt)

        self.outer = OuterLoop([vector], self.settings, round_in, name, on_round_done if self.overlap else None)

    @property
    def distance(self) -> float:
        return self.outer.distance

    def sketched(self) -> torch.Tensor:
        """What the divergence sketches read (a prefix of it): θ."""
        return self.outer.theta

    def served(self) -> torch.Tensor:
        """What peers download and what a download lands in: [θ; m]."""
        return self.outer.outer

    def snapshot(self, step: int) -> Snapshot:
        """[θ; m] itself, no copy (OuterLoop.share: the loop moves its own to a copy before they
        next change, the snapshot keeps these values)."""
        return Snapshot(step, self.outer.share())

    def adopt(self, flat: torch.Tensor) -> None:
        """Take the state downloaded from peers."""
        self.outer.adopt(flat)

    def take_vector(self) -> None:
        """The process's parameters, in the vector, become θ (the run's first upload, or a spanning
        group's θ); m and the error feedback start over."""
        self.outer.reset_from_params()

    def drop_pending(self) -> None:
        self.outer.drop_pending()

    def resume(self, state: dict) -> None:
        """Take a checkpoint's state: the outer state [θ; m] and the error feedback."""
        self.outer.adopt(state["outer"])
        self.outer.residual.copy_(state["residual"])

    def checkpoint_state(self, layout, local_step: int) -> dict:
        """[θ; m], the error feedback, and the model's layout (`peerd export` cuts θ by it)."""
        model_layout = [[t.name, list(t.shape), t.dtype] for t in layout]
        return {"outer": self.outer.outer, "residual": self.outer.residual, "model_layout": model_layout}

    async def round(self, round_t: int, weight: float) -> Applied:
        """DiLoCo's outer step on the phase's pseudo-gradient (a repair every repair_every rounds)."""
        every = self.settings.repair_every
        return await self.outer.end_phase(round_t, weight, repair=bool(every and round_t % every == 0))

    def close(self) -> None:
        self.outer.close()


class StateAveraging:
    """averaging.algorithm=state: `model` and `optimizer` are the task's, as built from the run's
    manifest (daemon/taskchild.py task_model)."""

    overlap = theta_apart = False

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self._model, self._optimizer = model, optimizer
        self._tensors, n_params = state_tensors(optimizer)
        self._numel = sum(t.numel() for t in self._tensors)
        self._params_numel = sum(t.numel() for t in self._tensors[:n_params])
        self.distance = math.nan
        self._carried = 0.0  # samples of rounds that applied nothing: they count toward the next one
        self._vector: torch.Tensor | None = None
        self._before: torch.Tensor | None = None  # the vector before its round (written every round)
        self._average: Average | None = None
        self._lanes = 1

    def numel(self, parameters: int) -> int:
        return self._numel

    def bind(self, vector: torch.Tensor, average: Average, name: str, on_round_done, lanes: int) -> None:
        """Round on the trainer's `vector` of the run's `lanes` (no overlap: `on_round_done` unused)."""
        self._vector, self._average, self._lanes = vector, average, lanes
        self._before = torch.empty(self._numel)

    def sketched(self) -> torch.Tensor:
        """What the divergence sketches read (a prefix of it): the vector, the parameters first."""
        return self._vector

    def served(self) -> torch.Tensor:
        return self._vector

    def snapshot(self, step: int) -> Snapshot:
        """A copy: the process writes the vector at its next phase's end."""
        return Snapshot(step, self._vector.clone())

    def adopt(self, flat: torch.Tensor) -> None:
        """Peers' or a checkpoint's state replaces this member's: the samples its rounds that applied
        nothing carried are not in it any more, and do not weigh on its next round (as DiLoCo's adopt)."""
        self._vector.copy_(flat)
        self._carried = 0.0

    def take_vector(self) -> None:
        """The vector is the state itself: nothing to take."""

    def drop_pending(self) -> None:
        """No round outlives its phase's end."""

    def resume(self, state: dict) -> None:
        """A checkpoint of this run's identity: the thread's or this class's, the same format. One
        without a model (a DiLoCo child's, the run ID reused) leaves the first state, as the thread."""
        if "model" in state:
            self._model.load_state_dict(state["model"])
            self._optimizer.load_state_dict(state["optimizer"])
            self._tensors, _ = state_tensors(self._optimizer)  # load_state_dict replaced them
        to_flat(self._tensors, self._vector)

    def checkpoint_state(self, layout, local_step: int) -> dict:
        """The task's model and optimizer (`layout` unused: the state dicts name their tensors)."""
        from_flat(self._vector, self._tensors)
        # Adam's step count is not in the vector (it stays in the child): the checkpoint counts the
        # steps this daemon's processes took, as the thread's counts its own.
        for per_param in self._optimizer.state.values():
            if torch.is_tensor(per_param.get("step")):
                per_param["step"].fill_(local_step)
        return {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict()}

    async def round(self, round_t: int, weight: float) -> Applied:
        """The state round on the vector in place. restore=False: a lane the round may have left
        partly written is put back from the vector before it."""
        began, weight, self._carried = time.monotonic(), weight + self._carried, 0.0
        await asyncio.to_thread(self._before.copy_, self._vector)
        results = await self._average(self._vector, weight, round_t, None, restore=False)
        if not await asyncio.to_thread(self._settle, results):
            self._carried = weight
        return Applied(round_t, results, time.monotonic() - began, weight=weight)

    @torch.no_grad()
    def _settle(self, results: list[RoundResult]) -> bool:
        """The lanes the round may have left partly written put back, and the distance to the group's
        mean where it applied. Whether any lane applied."""
        vector, before = self._vector, self._before
        bounds = lane_bounds(self._numel, self._lanes)
        for lane in lanes_to_put_back(results, self._lanes):
            a, b = bounds[lane]
            vector[a:b].copy_(before[a:b])
        if not any(r.applied for r in results):
            return False
        n = self._params_numel
        self.distance = math.sqrt(float(torch.sub(vector[:n], before[:n]).square_().sum()))
        return True

    def close(self) -> None:
        """Nothing in flight: a state round ends with its phase."""
