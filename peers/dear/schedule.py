"""DeAR: the all-reduce of gradients split in two and overlapped with backward and the next forward.

    dear = DeAR(model, optimizer, collective, DeARSettings(bucket_bytes=1 << 20))
    for batch in data:
        loss = task.loss(model, batch)    # pre-hooks: wait for bucket g's all-gather, update g's parameters
        loss.backward()                   # hooks: each bucket's reduce-scatter starts once its gradients are in
        dear.step()                       # instead of optimizer.step(): queue the all-gathers, return at once
    dear.flush()                          # before evaluating, checkpointing, averaging state or stopping
    dear.close()

**Modes** (one machinery: the same buckets, hooks and collective; only the schedule differs):
* DEAR: a parameter's post-accumulate-grad hook copies its gradient into its bucket; once every
  gradient of bucket g (and of the buckets before it) is in, g's reduce-scatter is queued. `step()`
  queues the all-gathers in forward order (last bucket first) and returns. In the next forward the
  pre-hook of each module that owns parameters of g waits for g's all-gather, hands the averaged
  gradients to the optimizer and steps it for g's parameters only, so g is updated just before it is
  used, while the all-gathers of later layers still move. The update of step k happens during the
  forward of step k+1 (or in `flush()`): the parameters after it are exactly those of an optimizer
  step on the all-reduced gradient, as in plain data parallelism.
* DDP: as torch DDP: each bucket's reduce-scatter and all-gather are queued from the backward hook;
  `step()` waits for all and steps the optimizer once.
* AFTER_BACKWARD: `step()` queues every bucket after backward, waits for all and steps once (one
  bucket of the whole model, `bucket_bytes=math.inf`, is "backward, then one all-reduce").
DeAR without fusion is DEAR with `bucket_bytes=0`.

**What the model and optimizer must allow.** One backward per `step()` (no gradient accumulation),
and every trainable parameter gets a gradient in every backward (otherwise `step()` raises rather
than wait forever). A parameter is used only inside the forward of the module that registers it
(its pre-hook is where it gets updated). The optimizer updates each parameter from its own
gradient and state only (SGD, Adam, AdamW: parameters whose `.grad` is None are skipped, which is
how one `optimizer.step()` updates one bucket). An LR scheduler counts `dear.steps`, not optimizer
calls, and must step only once the update it governs was applied (in DEAR mode, after the next
forward or `flush()`). Gradients live in the buckets: `p.grad` is None outside the optimizer's step.

**Failure.** A CollectiveError (a peer died or froze, see collective.py) is raised from the hook,
`step()` or `flush()` that met it (so from `model(...)` or `loss.backward()`), recorded in `error`,
and raised again by every later call: the group is broken, and the replicas may differ by the
buckets that were updated before the failure. The caller falls back (localgroup.py) and re-syncs
state before training on.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from peerd.peers.dear.buckets import BucketPlan, plan_buckets
from peerd.peers.dear.backend import Collective, CollectiveError, Handle
from peerd.peers.dear.overlap import StepLedger, StepStats
from peerd.peers.dear.tuner import KIB, FusionTuner, Retune

logger = logging.getLogger(__name__)

NO_PROPOSAL = -1e30  # retune(): what a rank without a proposal puts into the agreement (finite in float32)


class Mode(enum.Enum):
    DEAR = "dear"  # reduce-scatter from backward hooks, all-gather awaited in the next forward's pre-hooks
    DDP = "ddp"  # whole all-reduce of each bucket from backward hooks; step() waits for all
    AFTER_BACKWARD = "after_backward"  # step() all-reduces every bucket after backward and waits


@dataclass(kw_only=True, slots=True, frozen=True)
class DeARSettings:
    mode: Mode = Mode.DEAR
    bucket_bytes: float = 1 << 20  # fusion target (buckets.py); 0: one parameter per bucket; inf: one bucket
    retune_every: int = 0  # steps between automatic retune() calls (every rank at the same steps); 0: never
    # False: a CollectiveError met in a hook (inside the model's forward or backward) is recorded in
    # `error` and the hook returns; step() or flush() raises it (a caller that cannot catch inside
    # its user's forward: peerd.torch's local group, which regroups and re-syncs then).
    hooks_raise: bool = True

    def __post_init__(self) -> None:
        if not self.bucket_bytes >= 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {self.bucket_bytes}")
        if self.retune_every < 0:
            raise ValueError(f"retune_every must be >= 0, got {self.retune_every}")


class DeAR:
    """Schedules one model's gradient all-reduce over a Collective; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        collective: Collective,
        settings: DeARSettings | None = None,
        *,
        tuner: FusionTuner | None = None,
    ):
        self.model, self.optimizer, self.collective = model, optimizer, collective
        self.settings = settings or DeARSettings()
        self.mode = self.settings.mode
        self.tuner = tuner or FusionTuner()
        self.steps = 0  # step() calls that completed
        self.error = ""  # the CollectiveError that broke the group; "" while healthy
        self.last: StepStats | None = None  # the latest step whose communication finished
        self.last_retune: Retune | None = None
        self.comm_seconds_total = 0.0  # over every finished step (for overlap over a window)
        self.exposed_seconds_total = 0.0
        self._agree = torch.zeros(collective.world)  # retune(): one proposal per rank
        self._hooks: list = []
        self._install(plan_buckets(model, self.settings.bucket_bytes, collective.world))

    # ---- the three entry points of a training loop ---------------------------------------------

    def step(self) -> None:
        """After backward: queue what is left of the step's communication; DDP / AFTER_BACKWARD
        also wait for it and step the optimizer. Raises CollectiveError if the group broke, and
        RuntimeError if a bucket is missing gradients."""
        self._check()
        missing = [b.names[0] for b in self.plan.buckets if self._arrived[b.index] < len(b.params)]
        if missing:
            raise RuntimeError(
                f"no gradient this step for buckets starting at {missing}: every trainable parameter must get one"
            )
        n = len(self.plan.buckets)
        if self.mode is Mode.AFTER_BACKWARD:
            for g in range(n):
                self._launch(g)
        if self.mode is Mode.DEAR:
            for g in reversed(range(n)):  # forward order: the first layers' bucket is needed first
                self._ag[g] = self._queue_gather(self._rs[g])
                self._pending[g] = True
            self._applying = self._ledger
        else:
            self._apply(range(n), self._ledger)
            self._finish(self._ledger)
        self._ledger = StepLedger(self.steps + 1)
        self._arrived = [0] * n
        self._next = 0
        self.steps += 1
        if self.settings.retune_every and self.steps % self.settings.retune_every == 0:
            self.retune()

    def flush(self) -> None:
        """Apply every pending update now (DEAR): the parameters are then those of `steps` steps."""
        self._check()
        pending = [g for g in reversed(range(len(self.plan.buckets))) if self._pending[g]]
        if pending:
            self._apply(pending, self._applying)

    def close(self) -> None:
        """Flush (unless the group broke) and remove every hook: the model trains plainly again."""
        try:
            if not self.error:
                self.flush()
        finally:
            self._remove_hooks()

    # ---- fusion tuning -----------------------------------------------------------------------------

    def retune(self) -> Retune:
        """Every rank, at the same step: flush, average the ranks' proposed bucket sizes with one
        small all-reduce, and re-plan the buckets if the tuner's rule says so (tuner.py)."""
        self.flush()
        self._probe_latency()
        proposal, why = self.tuner.propose(self.plan.nbytes)
        # KiB: exact in float32. A rank without a proposal sends a huge negative number, so the mean is
        # negative and nobody re-plans; not NaN, which peerd's engine refuses as a corrupt shard.
        self._agree.fill_(NO_PROPOSAL if proposal is None else proposal / KIB)
        self._all_reduce(self._agree)
        agreed = float(self._agree[0])
        decision = self.tuner.decide(self.plan.bucket_bytes, agreed * KIB if agreed > 0 else math.nan)
        decision = dataclasses.replace(decision, reason=f"{decision.reason} (rank {self.collective.rank}: {why})")
        logger.info("retune at step %d: %s", self.steps, decision.reason)
        if decision.replan:
            self._remove_hooks()
            self._install(plan_buckets(self.model, decision.bucket_bytes, self.collective.world))
        self.last_retune = decision
        return decision

    @property
    def overlap_ratio(self) -> float:
        """Communication hidden behind compute over every finished step (overlap.py)."""
        if self.comm_seconds_total <= 0:
            return 0.0
        return max(0.0, 1.0 - self.exposed_seconds_total / self.comm_seconds_total)

    # ---- hooks -------------------------------------------------------------------------------------

    def _install(self, plan: BucketPlan) -> None:
        self.plan = plan
        n = len(plan.buckets)
        self._arrived = [0] * n  # gradients copied into each bucket this step
        self._next = 0  # the next bucket to launch: buckets launch in index order on every rank
        self._rs: list[Handle | None] = [None] * n
        self._ag: list[Handle | None] = [None] * n
        self._pending = [False] * n  # DEAR: all-gather queued, update not applied yet
        self._ledger = StepLedger(self.steps)  # the step whose backward is next or running
        self._applying: StepLedger | None = None  # DEAR: the step whose updates are pending
        self._views = [b.grad_views() for b in plan.buckets]
        for b in plan.buckets:
            for p, view in zip(b.params, self._views[b.index]):
                self._hooks.append(
                    p.register_post_accumulate_grad_hook(self._guard(functools.partial(self._on_grad, b.index, view)))
                )
        if self.mode is Mode.DEAR:
            owned: dict[nn.Module, list[int]] = {}
            for b in plan.buckets:
                for m in b.modules:
                    owned.setdefault(m, []).append(b.index)
            for m, indices in owned.items():
                self._hooks.append(
                    m.register_forward_pre_hook(self._guard(functools.partial(self._before_forward, tuple(indices))))
                )

    def _guard(self, hook):
        """`hook`, or with hooks_raise off, `hook` that records a CollectiveError and returns."""
        if self.settings.hooks_raise:
            return hook

        def guarded(*args):
            try:
                return hook(*args)
            except CollectiveError as e:
                self.error = self.error or str(e)
                return None

        return guarded

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _on_grad(self, g: int, view: torch.Tensor, param: nn.Parameter) -> None:
        self._check()
        if self._pending[g]:
            raise RuntimeError(
                f"bucket {g} got gradients before its update was applied: did its modules run in this forward?"
            )
        bucket = self.plan.buckets[g]
        if self._arrived[g] == len(bucket.params):
            raise RuntimeError(
                f"a second gradient for {bucket.names[0]}'s bucket in one step: accumulation is not supported"
            )
        view.copy_(param.grad)
        param.grad = None
        self._arrived[g] += 1
        if self.mode is Mode.AFTER_BACKWARD:
            return
        while self._next < len(self.plan.buckets) and self._arrived[self._next] == len(
            self.plan.buckets[self._next].params
        ):
            self._launch(self._next)
            self._next += 1

    def _before_forward(self, indices: tuple[int, ...], module: nn.Module, args) -> None:
        pending = [g for g in indices if self._pending[g]]
        if pending:
            self._check()
            self._apply(pending, self._applying)

    # ---- communication and updates -----------------------------------------------------------------

    def _launch(self, g: int) -> None:
        bucket = self.plan.buckets[g]
        self._rs[g] = self._call(self.collective.reduce_scatter, bucket.buffer)
        self._ledger.handles.append(self._rs[g])
        self._ledger.buckets += 1
        self._ledger.bytes += bucket.nbytes
        if self.mode is not Mode.DEAR:
            self._ag[g] = self._queue_gather(self._rs[g])

    def _queue_gather(self, rs: Handle) -> Handle:
        ag = self._call(self.collective.all_gather, rs)
        self._ledger.handles.append(ag)
        return ag

    def _apply(self, indices, ledger: StepLedger) -> None:
        """Wait for the buckets' all-gathers, then one optimizer step over their parameters."""
        indices = list(indices)
        for g in indices:
            self._wait(self._ag[g], ledger)
        for g in indices:
            for p, view in zip(self.plan.buckets[g].params, self._views[g]):
                # The buckets are in host memory (Gloo): a GPU's parameter takes a copy on its device.
                p.grad = view if view.device == p.device else view.to(p.device)
        try:
            self.optimizer.step()
        finally:
            for g in indices:
                for p in self.plan.buckets[g].params:
                    p.grad = None
                self._pending[g] = False
        if ledger is self._applying and not any(self._pending):
            self._finish(ledger)
            self._applying = None

    def _all_reduce(self, flat: torch.Tensor) -> None:
        """Outside any step: reduce-scatter + all-gather, waited for."""
        self._wait(self._call(self.collective.all_gather, self._call(self.collective.reduce_scatter, flat)), None)

    def _probe_latency(self, repeats: int = 4) -> None:
        """Time all-reduces of a few bytes, which are all latency: the tuner takes alpha from them
        (tuner.py), which also separates it from beta when every bucket has the same size. An op's time includes waiting for the last rank to join
        it, so they are queued back to back and the first is not observed: each later one starts
        when every rank finished the one before."""
        handles = []
        for _ in range(repeats):
            rs = self._call(self.collective.reduce_scatter, self._agree)
            handles += [rs, self._call(self.collective.all_gather, rs)]
        self._wait(handles[-1], None)
        for h in handles[2:]:
            self.tuner.observe_latency(h.seconds)

    def _finish(self, ledger: StepLedger) -> None:
        self.last = ledger.stats()
        self.comm_seconds_total += self.last.comm_seconds
        self.exposed_seconds_total += self.last.exposed_seconds
        for h in ledger.handles:
            self.tuner.observe(h.nbytes, h.seconds)

    def _wait(self, handle: Handle, ledger: StepLedger | None) -> None:
        start = time.monotonic()
        try:
            self.collective.wait(handle)
        except CollectiveError as e:
            self.error = self.error or str(e)
            raise
        finally:
            if ledger is not None:
                ledger.exposed += time.monotonic() - start

    def _call(self, op, arg) -> Handle:
        try:
            return op(arg)
        except CollectiveError as e:
            self.error = self.error or str(e)
            raise

    def _check(self) -> None:
        if self.error:
            raise CollectiveError(f"the group is broken: {self.error}")
