"""The daemon's half of a state run (averaging.algorithm=state) trained by its child process: a
TaskChild whose shared vector is the run's *state vector* (the parameters, then the inner
optimizer's floating-point state, in daemon/flat.py state_tensors' order, the same on every peer),
not the parameters alone.

At each phase's end the child writes its state vector; the daemon runs the round on it in place (a
completed round leaves the group's mean, a partial one the mean where it arrived, a failed one or
none the vector as it was); the child copies the vector back into its model and its optimizer. No
outer optimizer, no overlap. Peers download the vector. With a local group (--local-group), the
group's leader runs the round (each of its daemons its own lanes, peers/dear/delegate.py) and the
others take the group's vector (daemon/groupspan.py).

Checkpoints are the task's model and optimizer ("model" and "optimizer" state dicts, as older
releases' trainer thread wrote them): the daemon keeps the task's model and optimizer (built once
to know the layout) to convert the vector to them and back.
"""

from __future__ import annotations

import asyncio
import math
import time

import torch

from peerd.daemon.attached import PhaseEnd
from peerd.daemon.diloco import lanes_to_put_back
from peerd.daemon.flat import from_flat, state_tensors, to_flat
from peerd.daemon.taskchild import TaskChild
from peerd.peers.dear.hierarchy import lane_bounds
from peerd.peers.sketch import HISTORY, SketchPlan
from peerd.peers.statesync import Snapshot


class StateChild(TaskChild):
    """A TaskChild of a state run. `model` and `optimizer`: the task's, as built from the run's
    manifest (daemon/taskchild.py task_model)."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **child):
        self._model, self._optimizer = model, optimizer
        self._tensors, self._n_params = state_tensors(optimizer)
        super().__init__(numel=sum(t.numel() for t in self._tensors), **child)  # its `outer`: None
        self._params_numel = sum(t.numel() for t in self._tensors[: self._n_params])
        self._sketch_plan = SketchPlan.for_run(self.run_id, self._params_numel)  # of the parameters, as the thread's
        self._before = torch.empty(self.numel)  # the vector before its round (written every round)

    def _served(self) -> torch.Tensor:
        return self._shared.tensor

    def _snapshot(self, step: int) -> None:
        """A copy: the process writes the vector at its next phase's end."""
        self.snapshot = Snapshot(step, self._shared.tensor.clone())

    def _adopt(self, flat: torch.Tensor) -> None:
        self._shared.tensor.copy_(flat)

    def _resume(self, state: dict) -> None:
        """A checkpoint of this run's identity: the thread's or this class's, the same format. One
        without a model (a DiLoCo child's, the run ID reused) leaves the first state, as the thread."""
        if "model" in state:
            self._model.load_state_dict(state["model"])
            self._optimizer.load_state_dict(state["optimizer"])
            self._tensors, _ = state_tensors(self._optimizer)  # load_state_dict replaced them
        to_flat(self._tensors, self._shared.tensor)

    def _checkpoint_state(self) -> dict:
        from_flat(self._shared.tensor, self._tensors)
        # Adam's step count is not in the vector (it stays in the child): the checkpoint counts the
        # steps this daemon's processes took, as the thread's counts its own.
        for per_param in self._optimizer.state.values():
            if torch.is_tensor(per_param.get("step")):
                per_param["step"].fill_(self.local_step)
        return {"model": self._model.state_dict(), "optimizer": self._optimizer.state_dict()}

    def _after_round(self, results: list) -> None:
        """The lanes the round may have left partly written put back, the distance to the group's
        mean, and the snapshot peers download: the group's mean after a completed round, else this
        daemon's own state (as the thread's)."""
        vector, before = self._shared.tensor, self._before
        bounds = lane_bounds(self.numel, self.lanes)
        for lane in lanes_to_put_back(results, self.lanes):
            a, b = bounds[lane]
            vector[a:b].copy_(before[a:b])
        self.last_round = results[0]
        if any(r.applied for r in results):
            n = self._params_numel
            self.param_distance_to_group_mean = math.sqrt(float(torch.sub(vector[:n], before[:n]).square_().sum()))
            self.samples_averaged += self._samples_since_round
            self._samples_since_round = 0.0  # otherwise they count toward the next round's weight
        self.snapshot = Snapshot(self.global_step, vector.clone())

    async def _round(self) -> PhaseEnd:
        """The state round of the phase's end, on the vector in place, awaited on the daemon's loop."""
        vector, began = self._shared.tensor, time.monotonic()
        round_t = self.phases.round_of(self.global_step)
        sketch = self._sketch_plan.take(vector[: self._sketch_plan.size].numpy(), self.global_step)
        self.sketches = (*self.sketches[-(HISTORY - 1) :], sketch)
        # The vector before its round: restore=False, as the thread, and a lane the round may have left
        # partly written is put back from there.
        await asyncio.to_thread(self._before.copy_, vector)
        results = await self.average(vector, float(self._samples_since_round), round_t, None, restore=False)
        await asyncio.to_thread(self._after_round, results)
        for result in results:
            self.on_round(result)
        return PhaseEnd(self.global_step, round_t, results[0].outcome_name, time.monotonic() - began, False)
