"""When an inner phase ends before its H steps, and when a peer behind takes the run's state:
the rules that keep every peer in the run's rounds (docs/algorithms.md, "Rounds").

* MateWait (always on): a peer behind its group mates ends its phase where it would otherwise reach
  the boundary after their rendezvous stopped waiting for it (a late joiner, a restart, a slow step).
* The straggler budget (DropCompute, `averaging.inner_budget`): a slow peer's phase ends once it
  has run `factor` times as long as half of its peers took.
* catch_up_from: a peer two rounds behind downloads the run's state instead of rounds that would
  find nobody.

For an attached process (daemon/attached.py) the daemon asks on its lease watch and, when a phase
ends, writes its boundary into the shared file's header; the process reads it at each step
(peerd/torch.py) and ends its phase there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peerd.peers.phases import Phases

RENDEZVOUS_PATIENCE = 10.0  # seconds a round waits for group mates still before its boundary


def rendezvous_patience(round_timeout: float) -> float:
    """How long a round waits for mates behind it (daemon/joining.rendezvous_for): at most a third
    of the round's timeout, so that the round itself still fits."""
    return min(RENDEZVOUS_PATIENCE, round_timeout / 3)


@dataclass(slots=True)
class MateWait:
    """A phase ends now where a live group mate is at (or past) this phase's boundary and this
    peer, at its own pace, would reach the boundary after that mate's rendezvous (`patience`
    seconds from when this peer first saw it there) stopped waiting: the round would go on without
    it, and every later one too, its phases ending a constant time after the others'. A peer that
    arrives within the wait keeps all its steps."""

    patience: float
    seen: float = math.nan  # when a mate was first seen at `seen_for`; NaN: none is there
    seen_for: int = -1

    def over(self, now: float, step: int, boundary: int, pace: float, peer_steps: list[int], lag: float) -> bool:
        """Whether the phase at `step`, which ends at `boundary`, ends now. `pace`: this phase's
        seconds per step so far (NaN before its first step); `lag`: seconds from this answer to
        the round's start (a look at the table, the process's next step)."""
        ahead = max(peer_steps, default=-1)
        if ahead < boundary:
            self.seen = math.nan
            return False
        if self.seen_for != boundary or math.isnan(self.seen):
            self.seen, self.seen_for = now, boundary
        if math.isnan(pace):  # no step taken yet: decide at the next look
            return False
        # A mate past the boundary is judged alike: in a fast run the steps peers announce are
        # seconds old, and a phase that arrives within the wait keeps its steps.
        return now + (boundary - step) * pace + lag > self.seen + self.patience


def catch_up_from(step: int, phases: Phases, peer_steps: list[int]) -> int | None:
    """The least step of the run's state to download now, or None: a live peer is two rounds or more
    ahead, so the rounds this peer could still meet are over for it. A peer less far ahead is met:
    it waits at its boundary (the rendezvous) or, past it, MateWait ends this peer's phase in time,
    and training on to that boundary costs less than a download (a peer exactly one round ahead has
    no newer state to give until its round ends, and its round waits for this one)."""
    return step + 1 if max(peer_steps, default=-1) >= phases.ahead(step, 2) else None


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


@dataclass(slots=True)
class EarlyEnd:
    """Whether a phase ends before its boundary, and why: MateWait first, then the straggler
    budget. daemon/attached.py asks it on its lease watch."""

    mates: MateWait
    budget: StragglerBudget

    @classmethod
    def for_run(cls, round_timeout: float, inner_budget: float) -> "EarlyEnd":
        return cls(MateWait(rendezvous_patience(round_timeout)), StragglerBudget(inner_budget))

    def why(
        self, now: float, began: float, step: int, boundary: int, pace: float, peer_steps: list[int], lag: float
    ) -> str:
        """The reason the phase that began at `began` and is at `step` ends now, or "" (see
        MateWait.over for `pace` and `lag`)."""
        if self.mates.over(now, step, boundary, pace, peer_steps, lag):
            return "a group mate is at the boundary and would stop waiting before this phase got there"
        if self.budget.over(now, began, peer_steps, boundary):
            return "its peers are at the boundary (straggler budget)"
        return ""
