"""How a member decides, from the verdicts it exchanged, whether to apply a round: a pure function.

Every member broadcasts one verdict after the all-gather: OK with the digest of the result it holds,
or ABORT with a code. A member that turns from OK to ABORT (it received someone's ABORT, or a digest
that differs from its own) broadcasts an ABORT of its own (an echo), so that an ABORT that reached
only some members before its sender died still reaches all of them. `decide` is then:

* ABORT if this member lacks part of the result, if any received verdict is ABORT, or if any
  received digest differs from this member's;
* COMPLETE if every other member's verdict arrived and all are OK with the same digest;
* COMPLETE at the verdict deadline if no verdict said otherwise: members that stayed silent that
  long are taken to have failed (their own outcome is theirs to report);
* WAIT otherwise.

Why this is consistent: a member aborts at once only for a reason it broadcasts (or echoes) to all,
and completes early only on holding every member's first verdict, which are the same for everyone;
a member that completes at the deadline has heard no ABORT, and any ABORT is sent before its
sender's gather deadline, i.e. within the verdict window of the others (see allreduce.py).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from peerd.peers.collective.wire import DIGEST_SIZE, AbortCode

NO_DIGEST = bytes(DIGEST_SIZE)


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    digest: bytes = NO_DIGEST  # of the result the sender holds; NO_DIGEST with an abort
    code: AbortCode = AbortCode.NONE  # why the sender aborts

    @classmethod
    def abort(cls, code: AbortCode) -> "Verdict":
        return cls(ok=False, code=code)

    def then(self, newer: "Verdict") -> "Verdict":
        """A member's verdicts in the order received: an abort is final, a later OK does not undo it."""
        return self if not self.ok else newer


class Decision(enum.Enum):
    WAIT = "wait"  # some verdicts are missing and the deadline has not passed
    COMPLETE = "complete"  # apply the result
    ABORT = "abort"  # keep the tensor as it was before the round


def decide(
    me: int, size: int, mine: Verdict, received: Mapping[int, Verdict], now: float, deadline: float
) -> tuple[Decision, str]:
    """The decision and a one-line reason; `now` and `deadline` are on the same (any) clock."""
    if not mine.ok:
        return Decision.ABORT, f"this member aborted: {mine.code.name.lower()}"
    for k in sorted(received):
        v = received[k]
        if not v.ok:
            return Decision.ABORT, f"member {k} aborted: {v.code.name.lower()}"
        if v.digest != mine.digest:
            return Decision.ABORT, f"member {k} holds a different result"
    silent = [k for k in range(size) if k != me and k not in received]
    if not silent:
        return Decision.COMPLETE, "every member holds the same result"
    if now >= deadline:
        return Decision.COMPLETE, f"members {silent} sent no verdict in time; the others hold the same result"
    return Decision.WAIT, f"waiting for verdicts of members {silent}"


def result_digest(
    tag: bytes,
    round_no: int,
    chunks: Sequence[Sequence[tuple[int, int]]],
    masks: Sequence[Sequence[int]],
    weights: Sequence[Sequence[float]],
    sums: Sequence[Sequence[int]],
) -> bytes:
    """A 16-byte fingerprint of a round's result: run, round, and for every chunk of every shard its
    contributors, their weight and a wrapping 64-bit sum of its bytes (`sum64`, as held here).

    Not cryptographic: it detects members holding different bytes by accident (a lost, stale or
    misplaced chunk), at memory speed, on data just received and still in cache. blake2b over the
    values costs ~57 ms per 64 MiB here, more than a third of a 4-member round; forged data must be
    stopped by authenticating members instead.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    h.update(tag + struct.pack("<QQ", round_no, len(chunks)))
    for bounds, ms, ws, ss in zip(chunks, masks, weights, sums):
        for (start, end), mask, weight, total in zip(bounds, ms, ws, ss):
            h.update(struct.pack("<QQdQ", end - start, mask, weight, total))
    return h.digest()


def sum64(values: np.ndarray) -> int:
    """Sum of the values' bytes read as little-endian 64-bit words (a last odd 32-bit word added alone), mod 2**64."""
    words = values.view(np.uint32)
    pairs = len(words) // 2 * 2
    total = int(np.add.reduce(words[:pairs].view(np.uint64))) if pairs else 0
    if pairs < len(words):
        total += int(words[-1])
    return total % (1 << 64)
