"""Online fusion tuning: fit the link's startup latency and per-byte cost, choose the bucket size.

    tuner = FusionTuner()
    tuner.observe(nbytes, seconds)            # every finished bucket transfer (both halves)
    tuner.observe_latency(seconds)            # an op of a few bytes: all startup latency (DeAR.retune's probes)
    size, reason = tuner.propose(model_bytes) # None while the fit is not trustworthy
    decision = tuner.decide(current, agreed)  # re-plan or keep, with the reason

**Model.** A transfer of b bytes takes t = alpha + beta * b. Each observation's weight halves every
`half_life` newer ones (exponential forgetting), so the fit follows a link whose rate changes.
* With latency probes (ops of a few bytes, `observe_latency`; at least `min_probe_weight` of them,
  forgotten every `probe_half_life`): alpha is their weighted mean, and beta the least-squares slope
  of the bucket transfers through that intercept, i.e. about (t - alpha) / b at the sizes the plan
  uses. On a link whose cost per byte grows with the transfer (TCP through a shallow rate limiter:
  bigger bursts meet drops), that is the cost at the current size, so bigger buckets see a higher
  beta and propose smaller ones, and the other way round: re-planning converges. A free intercept
  does not: measured in the lab (bench/dear_tuner.py), the local slope among near-equal buckets put
  the intercept below 0 at large buckets and above the probes at small ones, and the plan flapped
  between the bounds and three times the minimum.
* Without probes, or when the slope through their alpha is not positive (bucket transfers faster
  than the probes: peerd's engine receives an op's bytes before the op starts, so within a step
  its latency hides): weighted least squares over the bucket transfers, both alpha and beta. The two
  are separable only if the observed sizes differ (a plan's buckets do: parameters are never split,
  the last bucket is a remainder); with less spread than `min_spread` (coefficient of variation).
Too little weight, or beta <= 0: no proposal, and the plan stays as it is.

**Rule.** With buckets of b bytes, a step of M model bytes pays alpha for each of its M/b buckets,
and the transfers that cannot overlap any compute (the last bucket's reduce-scatter after backward,
the first bucket's all-gather before forward) grow with b, about 2 * beta * b. The sum
M * alpha / b + 2 * beta * b is smallest at

    b* = sqrt(M * alpha / (2 * beta))

bounded to [min_bytes, max_bytes] and to at most M / min_buckets (a pipeline needs depth). A link
that gets uniformly slower (alpha and beta both x k) keeps b*; one whose rate drops (beta up) gets
smaller buckets, one whose latency grows gets bigger ones.

**Re-tuning.** Ranks must use one plan, so they re-plan together (schedule.py: every rank proposes,
the group averages the proposals with one tiny all-reduce); `decide` re-plans only when the agreed
size differs from the current one by more than `hysteresis` (a ratio), which is how drift of the
fit (alpha, beta, or both) shows: re-planning costs one flushed step and a new buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KIB = 1024


@dataclass(kw_only=True, slots=True, frozen=True)
class TunerSettings:
    half_life: float = 64.0  # observations after which an observation counts half
    min_weight: float = 8.0  # effective observations (bucket transfers and probes) needed before a proposal
    min_spread: float = 0.05  # coefficient of variation of observed sizes needed to separate alpha from beta
    probe_half_life: float = 12.0  # latency probes after which a probe counts half
    min_probe_weight: float = 2.0  # effective probes needed to take alpha from them
    min_bytes: int = 64 * KIB  # smallest bucket proposed
    max_bytes: int = 64 * KIB * KIB  # largest bucket proposed
    min_buckets: int = 4  # a proposal leaves the model at least this many buckets (above min_bytes)
    hysteresis: float = 0.25  # re-plan when agreed / current (or its inverse) exceeds 1 + this

    def __post_init__(self) -> None:
        if not (self.half_life > 0 and self.min_weight > 0 and self.min_spread >= 0 and self.hysteresis >= 0):
            raise ValueError("half_life and min_weight must be positive, min_spread and hysteresis >= 0")
        if not (self.probe_half_life > 0 and self.min_probe_weight > 0):
            raise ValueError("probe_half_life and min_probe_weight must be positive")
        if not 0 < self.min_bytes <= self.max_bytes or self.min_buckets < 1:
            raise ValueError("need 0 < min_bytes <= max_bytes and min_buckets >= 1")


@dataclass(frozen=True, slots=True)
class Fit:
    alpha: float  # seconds of startup latency per transfer (clamped at 0)
    beta: float  # seconds per byte
    weight: float  # effective number of observations behind the fit

    @property
    def bytes_per_second(self) -> float:
        return 1.0 / self.beta


@dataclass(frozen=True, slots=True)
class Retune:
    bucket_bytes: float  # the size to use from now on
    replan: bool  # whether it differs enough from the current size to re-plan
    reason: str


class FusionTuner:
    """Pure state: observations in, fit and proposals out; no clock, no I/O."""

    def __init__(self, settings: TunerSettings | None = None):
        self.settings = settings or TunerSettings()
        self._decay = 0.5 ** (1.0 / self.settings.half_life)
        self._sums = [0.0] * 5  # weighted sums of 1, x, y, x*x, x*y (x: bytes, y: seconds)
        self._probe_decay = 0.5 ** (1.0 / self.settings.probe_half_life)
        self._probe_sums = [0.0, 0.0]  # weighted sums of 1 and y over latency probes

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        x, y = float(nbytes), float(seconds)
        self._sums = [v * self._decay + d for v, d in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def observe_latency(self, seconds: float) -> None:
        """An op of a few bytes: its time is all startup latency."""
        if math.isfinite(seconds) and seconds >= 0:
            self._probe_sums = [v * self._probe_decay + d for v, d in zip(self._probe_sums, (1.0, float(seconds)))]

    def fit(self) -> tuple[Fit | None, str]:
        """The current fit, or None and why not."""
        w, sx, sy, sxx, sxy = self._sums
        pw, psy = self._probe_sums
        probes = pw >= self.settings.min_probe_weight
        if w + (pw if probes else 0.0) < self.settings.min_weight or sxx <= 0:
            return None, f"{w:.1f} observations and {pw:.1f} probes, need {self.settings.min_weight:g}"
        if probes:
            alpha = psy / pw
            beta = (sxy - alpha * sx) / sxx  # least squares through (0, alpha)
            if beta > 0:
                return Fit(
                    alpha, beta, w
                ), f"alpha {alpha * 1e6:.0f} us (probes), {1e-6 / beta:.0f} MB/s over {w:.0f} observations"
            # Bucket transfers faster than the probes: a backend that receives an op's bytes before
            # the op starts (peerd's engine parks them) hides its latency within a step. Fit both.
        if w < self.settings.min_weight:
            return None, f"{w:.1f} observations, need {self.settings.min_weight:g}"
        mean_x = sx / w
        var_x = max(0.0, sxx / w - mean_x * mean_x)
        if var_x < (self.settings.min_spread * mean_x) ** 2:
            return (
                None,
                f"bucket sizes too alike to separate latency from bandwidth (cv {math.sqrt(var_x) / mean_x:.3f})",
            )
        beta = (sxy / w - mean_x * sy / w) / var_x
        if beta <= 0:
            return None, f"fitted per-byte cost {beta:.3g} s/B is not positive"
        alpha = max(0.0, sy / w - beta * mean_x)
        return Fit(alpha, beta, w), f"alpha {alpha * 1e6:.0f} us, {1e-6 / beta:.0f} MB/s over {w:.0f} observations"

    def propose(self, model_bytes: int) -> tuple[int | None, str]:
        """The bucket size for a model of `model_bytes` under the current fit (module docstring)."""
        fit, why = self.fit()
        if fit is None:
            return None, why
        s = self.settings
        best = math.sqrt(model_bytes * fit.alpha / (2 * fit.beta))
        upper = max(s.min_bytes, min(s.max_bytes, model_bytes / s.min_buckets))
        size = int(min(upper, max(s.min_bytes, best)) // KIB * KIB)
        return size, f"{why}: optimum {best / KIB:.0f} KiB, bounded to {size // KIB} KiB"

    def decide(self, current: float, agreed: float) -> Retune:
        """Whether the group re-plans from bucket size `current` to the `agreed` proposal."""
        if math.isnan(agreed):
            return Retune(current, False, "no proposal on some rank: keeping the plan")
        if current > 0 and math.isfinite(current):
            change = max(agreed / current, current / agreed) - 1.0
            if change <= self.settings.hysteresis:
                return Retune(
                    current,
                    False,
                    f"agreed {agreed / KIB:.0f} KiB within {self.settings.hysteresis:.0%} of current {current / KIB:.0f} KiB",
                )
        return Retune(agreed, True, f"re-planning from {_kib(current)} to {agreed / KIB:.0f} KiB buckets")


def _kib(size: float) -> str:
    return f"{size / KIB:.0f} KiB" if math.isfinite(size) else "one bucket"
