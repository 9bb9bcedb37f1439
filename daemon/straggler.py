"""The straggler budget (DropCompute, `averaging.inner_budget`; docs/algorithms.md): when a slow
peer's inner phase ends before its H steps.

One decision for both ways of training: the daemon's own trainer thread asks it between two steps
(daemon/trainer.py), and for an attached process (daemon/attached.py) the daemon asks it on its
lease watch and, when it says so, writes the phase's boundary into the shared file's header; the
process reads it at each step (peerd/torch.py) and ends its phase there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class StragglerBudget:
    """A phase ends early once at least half of the other live peers announce its boundary step and
    it has run `factor` times as long as they took (from the phase's start to when this peer first
    saw them there). `factor` 0: never early."""

    factor: float
    others_done: float = math.nan  # when half of the peers were first seen at the boundary; NaN: not yet

    def over(self, now: float, began: float, peer_steps: list[int], boundary: int) -> bool:
        """Whether the phase that began at `began` (same clock as `now`) and ends at step `boundary`
        ends now. Resets itself once it said so, for the next phase."""
        if not self.factor:
            return False
        if not peer_steps or 2 * sum(s >= boundary for s in peer_steps) < len(peer_steps):
            self.others_done = math.nan
            return False
        if math.isnan(self.others_done):
            self.others_done = now
        if now - began < self.factor * (self.others_done - began):
            return False
        self.others_done = math.nan
        return True
