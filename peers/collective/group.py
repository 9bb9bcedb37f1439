"""Who is in a group, who owns which shard, and how long each phase of a round may wait."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from peerd.peers.collective.codec import Format
from peerd.peers.collective.wire import BLOCK, run_tag

PAYLOADS = tuple(f.value for f in Format)  # fp32, fp16, int8, int4, int2
MAX_GROUP = 64  # RESULT headers carry contributors as a 64-bit mask; Moshpit groups are far smaller


@dataclass(frozen=True, slots=True)
class Group:
    """An ordered group: member i owns shard i and listens at addresses[i] ("host:port")."""

    run_id: str
    members: tuple[str, ...]  # member IDs (e.g. libp2p peer IDs), in the order every member agreed on
    addresses: tuple[str, ...]
    me: int  # this member's index
    tag: bytes = field(init=False)  # run tag carried by every header

    def __post_init__(self):
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(self, "addresses", tuple(self.addresses))
        object.__setattr__(self, "tag", run_tag(self.run_id))
        if not 1 <= len(self.members) <= MAX_GROUP:
            raise ValueError(f"a group has 1 to {MAX_GROUP} members, not {len(self.members)}")
        if len(set(self.members)) != len(self.members):
            raise ValueError("member IDs must be unique")
        if len(self.addresses) != len(self.members):
            raise ValueError("one address per member")
        if not 0 <= self.me < len(self.members):
            raise ValueError(f"my index {self.me} is not in the group")

    @property
    def size(self) -> int:
        return len(self.members)


def chunk_bounds(start: int, end: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """[start, end) cut into pieces of `chunk` elements (the last may be shorter); at least one piece."""
    return tuple((a, min(a + chunk, end)) for a in range(start, end, chunk)) or ((start, end),)


def shard_bounds(numel: int, parts: int, align: int = 1) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, end) slices of whole blocks of `align` elements (the last block of the
    vector may be shorter), block counts differing by at most one (the first ones are longer)."""
    base, extra = divmod(-(-numel // align), parts)
    bounds, start = [], 0
    for i in range(parts):
        end = min(numel, start + (base + (i < extra)) * align)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


@dataclass(kw_only=True, slots=True)
class AllReduceSettings:
    """Every wait of a round, measured from the moment all_reduce() was called on this member.

    A round never takes longer than gather_timeout + verdict_timeout + drain_timeout; the defaults
    suit a LAN and tensors of up to a few hundred MiB. See allreduce.py for what each phase does.
    """

    connect_timeout: float = 2.0  # opening links to all other members at once (only those not open yet)
    contribute_timeout: float = 5.0  # an owner reduces what arrived by then; later contributions are dropped
    gather_timeout: float = 10.0  # a member gives up on reduced shards not arrived by then, and aborts;
    #                               the daemon's rounds take it as a ceiling (gather_timeout.py)
    verdict_timeout: float = 2.0  # after gather_timeout: waiting for others' verdicts; must exceed the
    #                               spread of members' start times plus one message delay
    drain_timeout: float = 1.0  # queued sends may take this long after the decision; then their link closes
    chunk_elements: int = 512 * 1024  # shards travel in chunks of this many elements (2 MiB): an owner
    #                                   reduces and forwards chunk c as soon as every sender's chunk c
    #                                   is in, so the all-gather overlaps the reduce-scatter. Part of the
    #                                   wire contract: every member of a group must use the same value.
    payload: str = "fp32"  # how values travel (codec.py): "fp32" (exact), "fp16" (IEEE half) or "int8"
    #                        (8-bit values with a float32 scale per block of 64; chunk_elements must then
    #                        be a multiple of 64). Part of the wire contract, like chunk_elements.

    def __post_init__(self):
        for name in ("connect_timeout", "contribute_timeout", "gather_timeout", "verdict_timeout", "drain_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if self.chunk_elements < 1:
            raise ValueError("chunk_elements must be at least 1")
        if self.payload not in PAYLOADS:
            raise ValueError(f"payload must be one of {', '.join(PAYLOADS)}, not {self.payload!r}")
        if Format(self.payload).alignment > 1 and self.chunk_elements % BLOCK:
            raise ValueError(f"with {self.payload} payloads chunk_elements must be a multiple of {BLOCK}")
        if self.connect_timeout > self.contribute_timeout:
            raise ValueError("connect_timeout must not exceed contribute_timeout: links open before owners reduce")
        if self.contribute_timeout >= self.gather_timeout:
            raise ValueError(
                "contribute_timeout must be shorter than gather_timeout: owners reduce before members give up"
            )

    @property
    def longest_round(self) -> float:
        return self.gather_timeout + self.verdict_timeout + self.drain_timeout
