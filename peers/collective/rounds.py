"""What one round has seen so far, and where it stands (and the two halves a round is made of):
plain bookkeeping, no I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator

from peerd.peers.collective.decision import Verdict


class Half(enum.Enum):
    """The two halves of a group all-reduce, as ops of their own (halves.py, and DeAR's backends)."""

    REDUCE_SCATTER = "reduce_scatter"  # the owner's shard becomes the weighted mean of every member's slice
    ALL_GATHER = "all_gather"  # every shard becomes its owner's bytes: the whole buffer agrees


class Phase(enum.Enum):
    IDLE = "idle"  # between rounds
    CONTRIBUTE = "contribute"  # contributions are out; this member's shard collects the others'
    GATHER = "gather"  # own shard reduced and sent; collecting the other owners' chunks
    DECIDE = "decide"  # result complete or given up on; exchanging verdicts


@dataclass(slots=True)
class RoundState:
    """What arrived for one round. Lists are indexed by member; `*_have`/`*_gone` are chunk bitmasks
    (arrived / refused, so never coming), `lost` a member bitmask."""

    number: int
    contrib_next: list[int]  # next chunk expected from each sender (they come in order)
    contrib_have: list[int]
    contrib_gone: list[int]
    weights: list[float]  # each sender's weight
    result_next: list[int]  # next chunk expected from each owner
    result_have: list[int]
    result_gone: list[int]
    result_mask: list[list[int]]  # per owner, per chunk: contributors included (member bitmask)
    result_weight: list[list[float]]  # per owner, per chunk: their total weight
    result_sum: list[list[int]]  # per owner, per chunk: sum64 of its bytes as held here
    backed: list[int]  # per shard: chunks of x copied to backup (restored if the round aborts)
    parked: list[int]  # per shard: result chunks that arrived between rounds, waiting in backup
    acc_mask: list[int] = field(default_factory=list)  # per chunk of my shard: contributions folded in
    acc_weight: list[float] = field(default_factory=list)  # ... and their total weight
    acc_started: int = 0  # chunks of my shard whose accumulator holds my own contribution
    reduced: int = 0  # chunks of this member's own shard reduced and sent
    lost: int = 0  # members whose connection closed, or whom this member could not reach
    bytes_sent: int = 0
    bytes_received: int = 0
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # the latest verdict of each member

    @classmethod
    def new(cls, number: int, chunks: tuple[int, ...], mine: int) -> "RoundState":
        """Nothing arrived yet, for member `mine` of a group whose shard j has chunks[j] chunks."""
        n = len(chunks)
        return cls(
            number=number,
            contrib_next=[0] * n,
            contrib_have=[0] * n,
            contrib_gone=[0] * n,
            weights=[0.0] * n,
            result_next=[0] * n,
            result_have=[0] * n,
            result_gone=[0] * n,
            result_mask=[[0] * c for c in chunks],
            result_weight=[[0.0] * c for c in chunks],
            result_sum=[[0] * c for c in chunks],
            backed=[0] * n,
            parked=[0] * n,
            acc_mask=[0] * chunks[mine],
            acc_weight=[0.0] * chunks[mine],
        )


def bits(mask: int) -> Iterator[int]:
    """Indices of the set bits of mask, lowest first."""
    i = 0
    while mask:
        if mask & 1:
            yield i
        mask, i = mask >> 1, i + 1
