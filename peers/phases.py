"""Where a run's inner phases end: the one schedule every peer derives from its manifest.

A run's first H steps (H: `average_every`) are cut into phases of `first`, 2·first, 4·first, ...
steps, the last of them taking the rest up to H; after that every phase is H, so the boundaries
from step H on are the multiples of H, as without the short phases (`averaging.first_phase`; 0:
every phase is H). Round r is the round at the end of the r-th phase, at step `end(r)`; a peer's
round number is the number of boundaries at or before its step. Short first phases give the run an
averaged model early, when the bytes of a round are cheap against what the model learns from them
(docs/algorithms.md, "Training: DiLoCo").

Every peer computes the same boundaries from the same two numbers, so the rounds of peers that
start apart still line up: the daemon (rendezvous, MateWait, catch-up, its rounds) and the
training process (peerd/torch.py, told both numbers when it attaches) ask this module alone.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Phases:
    every: int  # H: the length of every phase after the first ones
    first: int = 0  # the first phase's length; 0 (or at least H): every phase is H
    _ends: tuple[int, ...] = field(init=False, repr=False, compare=False)  # 0 and the boundaries below H

    def __post_init__(self) -> None:
        if self.every < 1 or self.first < 0:
            raise ValueError(f"phases need H >= 1 and a first phase >= 0, got H={self.every}, first={self.first}")
        ends, length = [0], self.first
        while 0 < length and ends[-1] + length < self.every:
            ends.append(ends[-1] + length)
            length *= 2
        object.__setattr__(self, "_ends", tuple(ends))

    def end(self, r: int) -> int:
        """The step of round r's boundary (end(0) = 0). Before the run's start (r < 0: only the
        rendezvous' floor asks), phases of the first length."""
        ends = self._ends
        if r < 0:
            return r * (self.first or self.every)
        if r < len(ends):
            return ends[r]
        return (r - len(ends) + 1) * self.every

    def round_of(self, step: int) -> int:
        """The number of boundaries after the start at or before `step`: the round a phase that
        ends at `step` belongs to, or the last round before a step within a phase."""
        ends = self._ends
        if step >= self.every:
            return len(ends) - 1 + step // self.every
        return max(bisect.bisect_right(ends, step) - 1, 0)

    def next_end(self, step: int) -> int:
        """The first boundary after `step`: where the phase that `step` is in ends."""
        return self.end(self.round_of(step) + 1)

    def length(self, step: int) -> int:
        """The length of the phase that `step` is in."""
        r = self.round_of(step)
        return self.end(r + 1) - self.end(r)

    def ahead(self, step: int, rounds: int) -> int:
        """The step `rounds` rounds after `step`, at the same number of steps into its phase."""
        r = self.round_of(step)
        return self.end(r + rounds) + step - self.end(r)
