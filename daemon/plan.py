"""`peerd plan`: numbers to plan a run with, before it starts or from its daemon's figures. For a model's parameter count, a step
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

From a run's figures (`peerd plan --run RUN_ID`): the local daemon's status gives the model's
parameter count, the step time its training process measured in its latest phase, the run's H
and overlap, and the last round's group size (control.proto RunStatus); a flag given by hand
overrides each (`inputs`). The link stays by hand: the daemon measures links only for loss-tolerant
runs and local groups, and shows no figure per peer. Beside the plan, the run's measured round duration against
this model's for its payload (`compare`): how far the model is from the user's link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peerd.peers.collective import arctopk
from peerd.peers.collective.codec import Format
from peerd.peers.collective.wire import payload_size

DEFAULT_RTT_MS = 50.0  # --rtt-ms when not given
DEFAULT_EVERY = 50  # --every when neither given nor the run's: the default of new runs
DEFAULT_GROUP = 2  # --group when neither given nor the run's (its last round formed no group)
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


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFigures:
    """What the local daemon's status says of a run (control.proto RunStatus), for a plan."""

    run_id: str
    parameters: int  # 0: no model on this daemon
    step_seconds: float  # NaN: no phase has ended yet
    average_every: int  # 0: no manifest
    group_size: int  # of the last round (1: it formed no group; 0: no round yet)
    round_seconds: float  # the median of recent completed rounds; NaN: none yet
    payload: str  # "" without a manifest
    overlap: bool  # false without a manifest
    algorithm: str
    density: float = 0.0  # payload arctopk: the share of rows a round sends


@dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    """What a plan is made from, and which of it the daemon gave (`from_daemon`: the fields' names)."""

    params: int
    step_seconds: float
    mbit: float
    rtt_ms: float
    every: int
    group: int
    overlap: bool
    from_daemon: tuple[str, ...] = ()


class MissingInput(ValueError):
    """An input neither given nor known to the daemon; the message names the flag to give."""


def inputs(
    *,
    params: int | None = None,
    step_seconds: float | None = None,
    mbit: float,
    rtt_ms: float | None = None,
    every: int | None = None,
    group: int | None = None,
    overlap: bool | None = None,
    run: RunFigures | None = None,
) -> Inputs:
    """The plan's inputs: each flag given (not None) as given, else the run's figure where the daemon
    has one, else the default (--rtt-ms, --every, --group, --overlap). Raises MissingInput naming
    the flag for a parameter count or step time that is neither given nor known (no run, a
    discovery-only run, no phase ended yet). Values are checked by `plan`, not here."""
    taken: list[str] = []

    def pick(name: str, given, known, default=None):
        if given is not None:
            return given
        if known is not None:
            taken.append(name)
            return known
        if default is not None:
            return default
        raise MissingInput(_missing(name, run))

    known_params = run.parameters if run is not None and run.parameters > 0 else None
    known_step = run.step_seconds if run is not None and math.isfinite(run.step_seconds) else None
    manifest = run is not None and run.average_every > 0  # the run's settings are known
    known_every = run.average_every if manifest else None
    known_group = run.group_size if run is not None and run.group_size >= 2 else None
    return Inputs(
        params=pick("params", params, known_params),
        step_seconds=pick("step_seconds", step_seconds, known_step),
        mbit=mbit,
        rtt_ms=pick("rtt_ms", rtt_ms, None, DEFAULT_RTT_MS),
        every=pick("every", every, known_every, DEFAULT_EVERY),
        group=pick("group", group, known_group, DEFAULT_GROUP),
        overlap=pick("overlap", overlap, run.overlap if manifest else None, True),
        from_daemon=tuple(taken),
    )


def _missing(name: str, run: RunFigures | None) -> str:
    flag = "--" + name.replace("_", "-")
    if run is None:
        return f"{flag} is required (or --run RUN_ID, to take it from the local daemon)"
    if name == "params":
        return (
            f"run {run.run_id!r} has no model on this daemon (joined for discovery only, or its model is not "
            f"built yet): give {flag}"
        )
    return f"run {run.run_id!r} has no step time yet (no inner phase has ended on this daemon): give {flag}"


@dataclass(frozen=True, slots=True)
class Comparison:
    """The run's measured round against the model's, for the run's payload and the plan's inputs."""

    payload: str
    measured_s: float  # NaN: no completed round yet
    model_s: float

    @property
    def ratio(self) -> float:
        """measured / model: above 1, the link (or the mates' pace) is slower than the model says."""
        return self.measured_s / self.model_s


def compare(run: RunFigures, given: Inputs) -> Comparison | None:
    """The run's measured round duration against the model's for its payload; None for a run
    without a manifest (no payload)."""
    if not run.payload:
        return None
    size = vector_bytes(run.payload, given.params, run.density)
    model = round_seconds(size, given.group, given.mbit, given.rtt_ms)
    return Comparison(run.payload, run.round_seconds, round(model, 3))


def vector_bytes(payload: str, params: int, density: float = arctopk.DENSITY) -> int:
    """Bytes of what a round all-reduces for `params` values in `payload` (arctopk: both its vectors,
    at `density`)."""
    if payload == arctopk.PAYLOAD:
        return arctopk.round_bytes(params, density)
    return payload_size(Format(payload).dtype, params)


def member_sends(vector_bytes: int, group: int) -> float:
    """Bytes one member sends in a round of `group` members on a payload of `vector_bytes`: (g - 1)/g
    of it, twice; not a whole number where g does not divide it (`plan` rounds it up)."""
    return 2 * (group - 1) / group * vector_bytes


def round_seconds(vector_bytes: int, group: int, mbit: float, rtt_ms: float) -> float:
    """The round's duration by the model above."""
    return FIXED_S + FIXED_RTTS * rtt_ms / 1000 + member_sends(vector_bytes, group) * 8 / (mbit * 1e6)


def plan(
    params: int,
    step_s: float,
    mbit: float,
    rtt_ms: float,
    every: int,
    group: int = 2,
    overlap: bool = True,
    density: float = arctopk.DENSITY,
) -> list[PayloadPlan]:
    """One PayloadPlan per payload of the codec and arctopk at `density`, smallest bytes first.
    arctopk's round is modelled as one round of its two vectors' bytes: its second all-reduce's
    exchanges (a few RTTs) are not in the model."""
    for name, value, low in (("params", params, 1), ("every", every, 1), ("group", group, 2)):
        if value < low:
            raise ValueError(f"{name} must be at least {low}, not {value}")
    for name, value in (("step_s", step_s), ("mbit", mbit)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, not {value}")
    if not (math.isfinite(rtt_ms) and rtt_ms >= 0):
        raise ValueError(f"rtt_ms must be 0 or more, not {rtt_ms}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], not {density}")
    out = []
    for payload in (*(f.value for f in Format), arctopk.PAYLOAD):
        size = vector_bytes(payload, params, density)
        took = round_seconds(size, group, mbit, rtt_ms)
        phase = every * step_s
        fraction = phase / max(phase, took) if overlap else phase / (phase + took)
        sent = math.ceil(member_sends(size, group))
        out.append(PayloadPlan(payload, sent, round(took, 3), round(fraction, 4), hiding_every(took, step_s)))
    return sorted(out, key=lambda p: p.bytes_per_outer_step)


def hiding_every(round_s: float, step_s: float) -> int:
    """The smallest H whose phase of `step_s` steps lasts MARGIN x a round of `round_s` (at least 1)."""
    return max(1, math.ceil(MARGIN * round_s / step_s))


@dataclass(frozen=True, slots=True)
class Fit:
    """What `averaging.average_every=auto` decided: the phase length, and why, in words."""

    every: int
    reason: str


def fit_every(step_s: float, round_s: float, low: int, high: int) -> Fit:
    """The phase length of a run under `averaging.average_every=auto`: the smallest H on the ladder
    low, 2 low, 4 low, ... (and `high`, its top) whose phase hides a round of `round_s` behind steps
    of `step_s` with the plan's MARGIN (`hiding_every`), within [low, high]. A pure function of its
    four figures, so members that hold the same figures pick the same H; the ladder keeps figures a
    little apart (two members' clocks, one noisy round) on the same rung, and H from moving at every
    round. Without both figures (NaN: no phase ended, no round completed yet) it is `high`, the
    phases of the run's schedule. Raises ValueError for bounds that are not 1 <= low <= high."""
    if not 1 <= low <= high:
        raise ValueError(f"auto's bounds need 1 <= low <= high, got {low} and {high}")
    if not (math.isfinite(step_s) and step_s > 0):
        return Fit(high, "no step time yet: the schedule's phases")
    if not (math.isfinite(round_s) and round_s >= 0):
        return Fit(high, "no completed round yet: the schedule's phases")
    need = hiding_every(round_s, step_s)
    rung = low
    while rung < need and rung < high:
        rung = min(rung * 2, high)
    figures = f"{MARGIN:g} x a {round_s:.3g} s round over {step_s:.3g} s steps needs H >= {need}"
    if need > high:
        return Fit(high, f"{figures}: the largest H, average_every_max={high}; compute waits for the rest")
    if need <= low:
        return Fit(low, f"{figures}: the smallest H, average_every_min={low}")
    return Fit(rung, f"{figures}: {rung} on the ladder {low}, {2 * low}, ... {high}")


def table(plans: list[PayloadPlan], every: int, overlap: bool, density: float = arctopk.DENSITY) -> str:
    """The plans as the CLI prints them (`density`: arctopk's, for the note under them)."""
    head = f"{'PAYLOAD':<8}  {'BYTES/OUTER STEP':>16}  {'ROUND':>9}  {f'COMPUTE AT H={every}':>16}  H THAT HIDES IT"
    lines = [head]
    for p in plans:
        lines.append(
            f"{p.payload:<8}  {_bytes(p.bytes_per_outer_step):>16}  {p.round_s:>8.1f}s  "
            f"{p.compute_fraction:>16.2f}  {p.hiding_every}"
        )
    lines.append(
        f"(overlap {'on' if overlap else 'off'}; arctopk at density {density:g}; "
        "the round's duration is a model: `peerd plan --help`)"
    )
    return "\n".join(lines)


def header(given: Inputs, run: RunFigures) -> str:
    """The line the CLI prints above a run's plan: each input, and where it came from."""
    shown = {
        "params": f"{given.params:,} parameters",
        "step_seconds": f"{given.step_seconds:.3g} s a step",
        "every": f"H={given.every}",
        "group": f"group {given.group}",
        "mbit": f"{given.mbit:g} Mbit/s",
        "rtt_ms": f"{given.rtt_ms:g} ms RTT",
        "overlap": f"overlap {'on' if given.overlap else 'off'}",
    }
    daemon = [text for name, text in shown.items() if name in given.from_daemon]
    rest = [text for name, text in shown.items() if name not in given.from_daemon]
    parts = [f"from the daemon: {', '.join(daemon)}"] if daemon else []
    parts.append(f"given or default: {', '.join(rest)}")
    return f"run {run.run_id}: " + "; ".join(parts)


def comparison_line(c: Comparison, given: Inputs, algorithm: str) -> str:
    """The line the CLI prints under a run's plan: the measured round against the model's."""
    model = f"the model says {c.model_s:.3g} s for {c.payload} in a group of {given.group} on this link"
    if math.isnan(c.measured_s):
        line = f"measured round: none completed yet; {model}"
    else:
        line = (
            f"measured round: {c.measured_s:.3g} s (median of its last completed rounds, up to 16); "
            f"{model} (measured/model {c.ratio:.2f})"
        )
    if algorithm == "state":  # its rounds average the parameters and the optimizer's moments
        line += "; a state run's rounds carry its optimizer's state too, more than the model's bytes"
    return line


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
