"""How long a round's members wait for its all-gather (`gather_timeout`): from the rounds they
measured, agreed by the group.

A mate frozen (SIGSTOP) or cut off in the middle of a round sends nothing and closes nothing: its
mates wait until their gather_timeout, then abort. A fixed 10 s, sized for a few hundred MiB, held
them 13 s (gather, verdicts, drain) at every such fault in the middle of a round, where a small
model's rounds take a fraction of a second. So each member proposes a timeout from the durations
of its own latest completed rounds (`GatherTimeout`): FACTOR times the longest of the last WINDOW,
within [FLOOR, ceiling], where the ceiling is the engine's configured gather_timeout, also
proposed before any round completed. The proposal travels in the member's signed matchmaking entry,
and every member of a group uses the largest proposal of the group (`agreed`): the members' verdict
windows must line up (allreduce.py), so they all wait the same. An early abort costs a delay, not samples: the trainer
owes the phase to its next round (daemon/diloco.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from peerd.peers.collective.group import AllReduceSettings

FLOOR = 3.0  # seconds: never less, whatever the rounds measured (a busy 2-core machine, a loop's lag)
FACTOR = 4.0  # times the longest recent round: room for a slower round than any of the last WINDOW
WINDOW = 16  # completed rounds remembered
MAX_PROPOSAL = 3600.0  # seconds: a proposal read from the network above this is refused


@dataclass(slots=True)
class GatherTimeout:
    """One member's proposal, from the durations (seconds) of its completed rounds."""

    ceiling: float  # the configured gather_timeout: the longest proposal, and the one before any round
    floor: float = FLOOR
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.ceiling:
            raise ValueError(f"need 0 < floor ({self.floor}) <= ceiling ({self.ceiling})")

    def observe(self, duration: float, gather_timeout: float) -> None:
        """A completed round took `duration` seconds under `gather_timeout`. One that lasted that
        long waited out a silent member (decision.py completes at the verdict deadline) and says
        nothing of the pace; nor does an aborted round, which the caller does not pass."""
        if math.isfinite(duration) and 0 <= duration < gather_timeout:
            self.recent.append(duration)

    def proposal(self) -> float:
        if not self.recent:
            return self.ceiling
        return min(self.ceiling, max(self.floor, FACTOR * max(self.recent)))


def agreed(proposals: Iterable[float], ceiling: float) -> float:
    """The group's gather_timeout: the largest of its members' proposals. A member that proposed
    none (0: a peer from before proposals) counts as `ceiling`, the engine's configured value."""
    return max((p if p > 0 else ceiling for p in proposals), default=ceiling)


def with_gather_timeout(settings: AllReduceSettings, gather_timeout: float) -> AllReduceSettings:
    """`settings` with this gather_timeout; the contribute and connect timeouts shrink with it where
    they must (owners reduce before members give up, links open before owners reduce)."""
    contribute = min(settings.contribute_timeout, gather_timeout / 2)
    return dataclasses.replace(
        settings,
        gather_timeout=gather_timeout,
        contribute_timeout=contribute,
        connect_timeout=min(settings.connect_timeout, contribute),
    )
