"""A round's pace: the figures from which a run under `averaging.average_every=auto` fits its H
(daemon/plan.py fit_every), agreed by the round's group.

Each member puts its own pace in its signed matchmaking entry (peers/matchmaking.py): its inner
step time in its latest phase and the median duration of its recent completed rounds, 0 where it
has not measured one.
Every member of a decided group receives the same members with the same entries (the matchmaking
contract), so `group_pace` of them is the same on every member: the round's RoundResult.pace. The
group's pace is the slowest member's step and the longest member's round: a phase long enough for
them hides the round for every member.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MAX_PACE_SECONDS = 86_400.0  # a step or round figure read from the network above this is refused


@dataclass(frozen=True, slots=True)
class Pace:
    step_seconds: float = math.nan  # NaN: not measured (no phase ended)
    round_seconds: float = math.nan  # NaN: not measured (no round completed)
    members: int = 0  # how many members' figures the group's pace was taken from (0: a member's own)


def pace_ok(seconds: float) -> bool:
    """A figure a member may send: 0 (none) to MAX_PACE_SECONDS; False for NaN and infinities."""
    return 0 <= seconds <= MAX_PACE_SECONDS


def on_the_wire(seconds: float) -> float:
    """A figure as an entry carries it: 0 for none (NaN, or out of range)."""
    return seconds if math.isfinite(seconds) and 0 < seconds <= MAX_PACE_SECONDS else 0.0


def group_pace(figures: Iterable[tuple[float, float]]) -> Pace:
    """The group's pace from its members' (step_seconds, round_seconds), 0 meaning none: the largest
    of each that some member measured, NaN where none did."""
    figures = list(figures)
    steps = [s for s, _ in figures if s > 0]
    rounds = [r for _, r in figures if r > 0]
    return Pace(max(steps, default=math.nan), max(rounds, default=math.nan), len(figures))
