"""What one round of the collective engine did: always a value, never a silent partial success."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(enum.Enum):
    COMPLETED = "completed"  # the tensor now holds the round's result, the same bytes as every other completer's
    ABORTED = "aborted"  # the tensor is unchanged (restored to its value before the round)
    PARTIAL = "partial"  # loss-tolerant rounds: the owners' result where its packets arrived, this member's
    #                      own values elsewhere (`held` says how much); no claim that members agree


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Status
    reason: str  # one human-readable line: why it completed or aborted
    round: int
    members: tuple[str, ...]  # members whose contribution is in every chunk of every shard of the result
    coverage: tuple[float, ...]  # per shard: share of (member, element) pairs included; 0.0 if missing
    bytes_sent: int  # headers and payloads this member queued for the round
    bytes_received: int  # headers and payloads of the round this member accepted
    duration: float  # seconds from the call to the return
    digest: bytes  # identifies the result (equal on every member that completed); b"" otherwise
    held: tuple[float, ...] = ()  # per shard: share of its elements where the tensor now holds the owner's result

    @property
    def completed(self) -> bool:
        return self.status is Status.COMPLETED

    @property
    def applied(self) -> bool:
        """The tensor changed: COMPLETED, or PARTIAL (apply the round's bookkeeping, e.g. samples counted)."""
        return self.status is not Status.ABORTED

    def as_dict(self) -> dict:
        """JSON-ready form, for logs, status RPCs and benchmarks."""
        return {
            "status": self.status.value,
            "reason": self.reason,
            "round": self.round,
            "members": list(self.members),
            "coverage": [round(c, 4) for c in self.coverage],
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "duration": round(self.duration, 6),
            "digest": self.digest.hex(),
            "held": [round(h, 4) for h in self.held],
        }
