"""`peerd plan`: numbers to plan a run with, before it starts. For a model's parameter count, a step
time, a link's rate and RTT and a group size, each payload's bytes per outer step, the round's
duration on that link, and the compute fraction at a phase of H steps, with and without overlap;
and the smallest H whose phase hides each payload's round.

The round's duration is a model, written from measurements, not a measurement:

    round = fixed + 2 (g - 1) / g x bytes / rate

`bytes` is the payload's size for the whole vector (peers/collective/wire.payload_size); in a
reduce-scatter then all-gather among g members each member sends (g - 1)/g of it twice and
receives as much (peers/collective/allreduce.py). `fixed` is the round's cost on the network besides
its bytes: rendezvous, matchmaking and the engine's exchanges, FIXED_S + FIXED_RTTS x RTT, fitted to
`bench.round_cost` in the lab (0.34 s at 0 ms, 0.65 s at 50 ms and 1.61 s at 200 ms RTT, 3 lab hosts;
docs/benchmarks.md). Loss, a slower member and a busy CPU make a real round longer: the lab's
`bench.wan_training` measures those.

Compute fraction: the share of wall time compute is busy. Without overlap a phase waits for its
round: H s / (H s + round). With overlap (the default) a round runs while the next phase computes,
and compute waits only when the round takes longer than a phase: H s / max(H s, round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peerd.peers.collective.codec import Format
from peerd.peers.collective.wire import payload_size

FIXED_S = 0.34  # a round's fixed cost at 0 ms RTT (bench.round_cost, 3 lab hosts)
FIXED_RTTS = 6.3  # and per RTT beyond it (6.1-6.3 measured at 50 and 200 ms)
MARGIN = 1.2  # the phase that "hides" a round is this much longer than it


@dataclass(frozen=True, slots=True)
class PayloadPlan:
    payload: str
    bytes_per_outer_step: int  # what one member sends in one round
    round_s: float
    compute_fraction: float  # at the given H, with the given overlap
    hiding_every: int  # the smallest H whose phase is MARGIN x the round (with overlap)


def member_sends(vector_bytes: int, group: int) -> float:
    """Bytes one member sends in a round of `group` members on a payload of `vector_bytes`: (g - 1)/g
    of it, twice; not a whole number where g does not divide it (`plan` rounds it up)."""
    return 2 * (group - 1) / group * vector_bytes


def round_seconds(vector_bytes: int, group: int, mbit: float, rtt_ms: float) -> float:
    """The round's duration by the model above."""
    return FIXED_S + FIXED_RTTS * rtt_ms / 1000 + member_sends(vector_bytes, group) * 8 / (mbit * 1e6)


def plan(
    params: int, step_s: float, mbit: float, rtt_ms: float, every: int, group: int = 2, overlap: bool = True
) -> list[PayloadPlan]:
    """One PayloadPlan per payload of the codec, smallest bytes first."""
    for name, value, low in (("params", params, 1), ("every", every, 1), ("group", group, 2)):
        if value < low:
            raise ValueError(f"{name} must be at least {low}, not {value}")
    for name, value in (("step_s", step_s), ("mbit", mbit)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, not {value}")
    if not (math.isfinite(rtt_ms) and rtt_ms >= 0):
        raise ValueError(f"rtt_ms must be 0 or more, not {rtt_ms}")
    out = []
    for fmt in Format:
        size = payload_size(fmt.dtype, params)
        took = round_seconds(size, group, mbit, rtt_ms)
        phase = every * step_s
        fraction = phase / max(phase, took) if overlap else phase / (phase + took)
        sent = math.ceil(member_sends(size, group))
        hiding = max(1, math.ceil(MARGIN * took / step_s))
        out.append(PayloadPlan(fmt.value, sent, round(took, 3), round(fraction, 4), hiding))
    return sorted(out, key=lambda p: p.bytes_per_outer_step)


def table(plans: list[PayloadPlan], every: int, overlap: bool) -> str:
    """The plans as the CLI prints them."""
    head = f"{'PAYLOAD':<8}  {'BYTES/OUTER STEP':>16}  {'ROUND':>9}  {f'COMPUTE AT H={every}':>16}  H THAT HIDES IT"
    lines = [head]
    for p in plans:
        lines.append(
            f"{p.payload:<8}  {_bytes(p.bytes_per_outer_step):>16}  {p.round_s:>8.1f}s  "
            f"{p.compute_fraction:>16.2f}  {p.hiding_every}"
        )
    lines.append(f"(overlap {'on' if overlap else 'off'}; the round's duration is a model: `peerd plan --help`)")
    return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
