"""`peerd.torch.Optimizer`: wrap your optimizer, keep your loop (docs/your-loop.md).

Every `opt.step()` is an inner step of your own optimizer, on your model, on its device. After a
phase's steps (the run's H; the first phases shorter, peers/phases.py) the phase ends: the
parameters are copied to the daemon's shared vector (one host copy; pinned in place where CUDA is
present), the daemon averages the phase's pseudo-gradient with its peers and takes the outer step
(DiLoCo), and the run's parameters are copied back into the model. Nothing else crosses: the inner optimizer's state stays here (but
for a built-in task's state run, whose child hands it over too: `state_vector`).
With overlap (the run's `averaging.overlap`), the phase's end does not wait for its round: the
round runs while the next phase computes; when it ends the daemon writes the new θ to the shared
file, and the next `step()` moves the parameters by θ − s (s: where the averaged phase ended, which
the shared vector holds until the next phase's end). `run_parameters()` puts θ in the model for
an evaluation.

Several processes of one machine (torchrun's, one per GPU) that attach to one daemon for one run
are its local group, one WAN peer (docs/your-loop.md, "Several processes per machine"): at every
step they average their gradients in one Gloo all-reduce (peerd/local_group.py) before the inner
step, so that they hold the same parameters; the leader (rank 0) hands the phase over, the others
take the run's parameters when its EndPhase answers. A digest of the parameters at each phase's
end checks that they are the same (a mismatch raises: the group breaks loudly). A member that
comes or goes moves the group's epoch; the members regroup at the same step and take the leader's
parameters, optimizer state and counters.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import mmap
import os
import time
import weakref
from typing import Any, Callable

import torch

from peerd import PeerdError
from peerd.attachment import Attachment, Lost, Slot
from peerd.protos import control_pb2

logger = logging.getLogger(__name__)

GROUP_EXTRAS = 4  # values after the gradients in a group's all-reduce: samples, epoch, end now, landed
DEAR_BUCKET_BYTES = 1 << 20  # DeAR's first fusion target; its tuner moves it (docs/dear.md)
DEAR_RETUNE_EVERY = 100  # steps between two of DeAR's fusion re-tunings (all members at the same step)

ATTACH_TIMEOUT = 180.0  # seconds one Attach may take: it may download the run's state from peers
RECONNECT_TIMEOUT = 120.0  # seconds a daemon that went away (restart) is waited for
GROUP_TIMEOUT = 60.0  # seconds one collective of the local group may take (a stalled member breaks it)
REGROUP_TRIES = 5  # epochs a process tries to form before it gives up (PeerdError)


class Optimizer(torch.optim.Optimizer):
    """Wraps `optimizer` (the inner one: AdamW, ...) for run `run` of the daemon whose data dir is
    `daemon` (or whose control address is `control`).

    Construction attaches (blocking): the model's parameters become the run's (from the daemon's
    checkpoint or the peers'), or, for a run this attach creates, become the run's first ones.
    `model`, when given, names the parameters in the run's layout (else "group.index"); `settings`
    are averaging settings of a new run ({"average_every": "100"}: "averaging." may be left out).

    `step(closure=None, samples=None, loss=None)`: `samples` in the step (the phase's weight in the
    round; 1 per step when not given), `loss` its training loss (a tensor is fine: it is read once
    per phase, never synchronizing the device per step). `param_groups`, `state` and `zero_grad`
    are the inner optimizer's: LR schedulers, gradient clipping and GradScaler work as without peerd.

    `group_size`: processes of this machine that attach to the run together (torchrun's
    LOCAL_WORLD_SIZE, the default where it is set, else 1); the first waits a bounded time for the
    others so that they start as one local group. `group_timeout` bounds each of the group's
    collectives. In a group, a step's `closure` is called once, before the gradients are averaged.
    `dear=True` (needs `model`): in a group, the gradients' all-reduce runs under DeAR, overlapped
    with backward and the next forward (docs/dear.md), instead of one all-reduce after backward;
    then gradients are not in `p.grad` after backward (whole-model clipping sees none), and each
    bucket's update is applied in the next forward. `nccl=True`: the gradients' all-reduce runs
    on the GPUs through NCCL where every member of the group trains on a GPU of its own (else Gloo
    through host memory, as by default; a log line says which). Off by default: it has not yet been
    tried with more than one GPU (docs/your-loop.md).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run: str,
        daemon=None,
        control: str | None = None,
        model: torch.nn.Module | None = None,
        settings: dict[str, Any] | None = None,
        attach_timeout: float = ATTACH_TIMEOUT,
        reconnect_timeout: float = RECONNECT_TIMEOUT,
        state_vector: bool = False,
        group_size: int | None = None,
        group_timeout: float = GROUP_TIMEOUT,
        dear: bool = False,
        dear_bucket_bytes: float = DEAR_BUCKET_BYTES,
        nccl: bool = False,
    ):
        # torch.optim.Optimizer.__init__ is not called: the inner optimizer holds the groups and state.
        self.inner = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        # What the shared vector holds: the parameters, or with `state_vector` (a built-in task's state
        # run, daemon/taskproc.py; a script's run is DiLoCo's) the parameters then the inner optimizer's
        # floating-point state, in the state run's order (daemon/flat.py state_tensors).
        self._state_vector = state_vector
        self._tensors = self._vector_tensors()
        self.layout = model_layout(optimizer, model)
        self.device = str(self.params[0].device)
        settings = {
            (k if k.startswith("averaging.") else f"averaging.{k}"): str(v) for k, v in (settings or {}).items()
        }
        self._attachment = Attachment(
            run=run,
            daemon=daemon,
            control=control,
            layout=self.layout,
            settings=settings,
            device=self.device,
            attach_timeout=attach_timeout,
            reconnect_timeout=reconnect_timeout,
            group_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if group_size is None else group_size,
        )
        self.group_timeout = group_timeout
        if dear and model is None:
            raise ValueError("dear=True needs model=: DeAR's hooks go on the model's modules")
        self.model, self._use_dear, self.dear_bucket_bytes, self.nccl = model, dear, dear_bucket_bytes, nccl
        self._dear = None  # peerd.peers.dear.schedule.DeAR while a group of more than one trains with it
        self._slot = Slot(0, 0, 1, "")  # this process's place in the local group (the daemon's answer)
        self._collective = None  # peerd.local_group.Collective where the group has more than one process
        self._grads: torch.Tensor | None = None  # the all-reduce's buffer: gradients, then GROUP_EXTRAS values
        self.run = run
        self.run_step = 0  # the run's step as the daemon last answered (DiLoCo: counts inner steps)
        self.local_step = 0  # steps this process took
        self.last_outcome = ""  # the latest round's outcome, as the daemon answered
        self._phase_steps, self._phase_samples = 0, 0.0
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        self._phase_began = time.monotonic()
        self._boundary = self._phase_length = 0  # set by _new_phase once attached
        self._fitted = 0  # average_every=auto: the steps the daemon gave this phase (0: its length)
        self._vector: torch.Tensor | None = None
        self._landed = 0  # the landed rounds the parameters hold (daemon/attached.py, "landing")
        self._pinned = 0  # the page-locked address of the shared vector (CUDA models); 0: pageable
        self._attach()
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- torch.optim.Optimizer's surface, forwarded ------------------------------------------

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise PeerdError("a run's model is fixed when it is created: parameters cannot be added")

    def __repr__(self) -> str:
        return f"peerd.torch.Optimizer(run={self.run!r}, step={self.run_step}, inner={self.inner!r})"

    # -- steps ----------------------------------------------------------------------------------

    def step(self, closure: Callable | None = None, samples: float | None = None, loss=None):
        """One inner step; at the phase's end, the run's outer step (blocks for the round unless the
        run overlaps them). Returns what the inner optimizer's step returns. A step that attaches
        again (the daemon restarted, or dropped this process) takes the run's parameters into the
        model: the gradient computed before, at the parameters it held, is not applied to them
        (without a closure, which computes it after the attach; in a local group the group's step
        decides), and the step is not counted."""
        if self._attachment.lost.is_set():
            self._reattach()
            if closure is None and self._collective is None and not self._attached.upload:
                logger.info(
                    "peerd: run %s: attached again; this step's gradient, of the parameters held before, is dropped",
                    self.run,
                )
                self.inner.zero_grad()
                return None
        samples = 1.0 if samples is None else float(samples)
        a = self._attachment
        if self._collective is None:
            result = self.inner.step(closure) if closure is not None else self.inner.step()
            epoch, end_now, landed = a.group_epoch(), self._ends_now(), a.landed()
        else:
            result = closure() if closure is not None else None
            shared = self._group_step(samples)
            if shared is None:  # the group broke: no member takes this step; the group re-formed
                return result
            samples, epoch, end_now, landed = shared
        self._land(landed)
        self.local_step += 1
        self._phase_steps += 1
        self._phase_samples += samples  # in a group: the group's
        if loss is not None:
            self._loss_sum = self._loss_sum + (loss.detach() if torch.is_tensor(loss) else float(loss))
            self._loss_count += 1
        # The daemon's status follows each step; the loss only where reading it needs no device sync.
        live_loss = (
            self._loss_sum / self._loss_count if self._loss_count and not torch.is_tensor(self._loss_sum) else math.nan
        )
        if self._slot.hands_over:
            a.stepped(self._phase_steps, self._phase_samples, live_loss, self._boundary)
        # At the phase's length (peers/phases.py), or earlier where the daemon ends it (MateWait, the
        # straggler budget, average_every=auto's H).
        if self._phase_steps >= self._phase_length or end_now:
            self._end_phase()
        # A member came or went: every member of the group sees it at this step (the leader's view),
        # after the phase's end, so that a process joining takes the counters of the phase under way.
        if epoch > self._slot.epoch:
            self._regroup()
        return result

    def _group_step(self, samples: float) -> tuple[float, int, bool, int] | None:
        """The local group's step: the members' mean gradient, and the inner step on it (with DeAR,
        the all-gathers queued, each bucket's update applied in the next forward); then what every
        member must act on alike, in one all-reduce: the step's samples (summed: the group's) and
        the leader's view of the shared file (the group's epoch, an early end of the phase, the
        landed rounds). Without DeAR the gradients ride in that all-reduce. None: the group broke
        (a member exited or stalled): no member takes the step, and the group is formed again."""
        from peerd.local_group import GroupBroke
        from peerd.peers.dear.backend import CollectiveError

        a, leader = self._attachment, self._slot.rank == 0
        extras = [samples, a.group_epoch(), self._ends_now(), a.landed()]
        if not leader:
            extras[1:] = [0.0, 0.0, 0.0]
        n, device = 0 if self._dear is not None else self._vector.numel(), self._collective.device
        if self._grads is None or self._grads.numel() != n + GROUP_EXTRAS or self._grads.device != device:
            self._grads = torch.empty(n + GROUP_EXTRAS, dtype=torch.float32, device=device)
        buffer = self._grads
        try:
            with torch.no_grad():
                if self._dear is not None:
                    self._dear.step()
                else:
                    self._gather_gradients(buffer)
                buffer[n:] = torch.tensor(extras)
                self._collective.sum_(buffer)
                samples, epoch, end_now, landed = buffer[n:].tolist()
                if self._dear is None:
                    buffer[:n] /= self._slot.size
                    self._scatter_gradients(buffer)
                    self.inner.step()
                elif int(landed) > self._landed:  # the round's move is added to the updated parameters
                    self._dear.flush()
                if self._slot.spans and int(landed) > self._landed:
                    self._land_spanning(int(landed))
        except (GroupBroke, CollectiveError) as e:
            broke = str(e)
        else:
            return samples, int(epoch), end_now > 0, int(landed)
        # Outside the handler: the error's traceback holds the failed op, and the op the epoch's
        # connections; a member still inside that op (a send to this process) must see them close
        # now, not wait out its timeout while this process forms the next epoch (_close_group).
        logger.warning("peerd: run %s: the local group broke (%s); forming it again", self.run, broke)
        self._regroup()
        return None

    def _ends_now(self) -> bool:
        """The step under way ends the phase before its boundary: the daemon ended it (END_AT), or it
        is the last of the H steps average_every=auto gave it. In a local group the leader's view
        decides for every member (it rides the step's all-reduce)."""
        a = self._attachment
        return a.phase_ends_at() == self._boundary or 0 < self._fitted <= self._phase_steps + 1

    def _land_spanning(self, landed: int) -> None:
        """A group that spans daemons: the leader lands the round from its daemon's file, and every
        member takes the leader's parameters (the others' daemons hold no θ of the round)."""
        if self._collective.leader:
            self._land(landed)
        flat = self._flat()
        self._collective.broadcast_(flat)
        if not self._collective.leader:
            from_vector(flat, self._tensors, False)
        self._landed = landed

    def _flat(self) -> torch.Tensor:
        """The leader's vector (parameters, or a state run's whole state) to broadcast; a buffer
        elsewhere."""
        flat = torch.empty(self._vector.numel(), dtype=torch.float32)
        if self._collective.leader:
            to_vector(self._tensors, flat, False)
        return flat

    def _gather_gradients(self, buffer: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            k = p.numel()
            if p.grad is None:
                buffer[offset : offset + k].zero_()
            else:
                buffer[offset : offset + k].view_as(p).copy_(p.grad)
            offset += k

    def _scatter_gradients(self, buffer: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            k = p.numel()
            mean = buffer[offset : offset + k].view_as(p)
            if p.grad is None:
                p.grad = mean.to(device=p.device, dtype=p.dtype)
            else:
                p.grad.copy_(mean)
            offset += k

    def _end_phase(self) -> None:
        compute = time.monotonic() - self._phase_began
        loss = float(self._loss_sum) / self._loss_count if self._loss_count else math.nan
        if self._dear is not None:  # every bucket's update applied: the parameters are the phase's
            from peerd.peers.dear.backend import CollectiveError

            broke = None
            try:
                self._dear.flush()
            except CollectiveError as e:
                broke = str(e)
            if broke is not None:  # regrouped outside the handler (_group_step says why)
                logger.warning("peerd: run %s: the local group broke at a phase's end (%s)", self.run, broke)
                self._regroup()
        if self._collective is not None:
            self._check_same()
        lost = False
        for _ in range(REGROUP_TRIES):
            if self._collective is not None and self._slot.spans:
                from peerd.local_group import GroupBroke

                boundary, broke = self._boundary, None
                try:
                    self._end_spanning(loss, compute)
                except GroupBroke as e:
                    broke = str(e)
                except Lost:
                    lost = True
                if broke is None:
                    break
                logger.warning("peerd: run %s: the local group broke at a phase's end (%s)", self.run, broke)
                self._regroup()  # outside the handler (_group_step says why)
                if self.run_step >= boundary:  # the new epoch's leader ended it: its counters are taken
                    return
                continue
            if self._slot.rank == 0:  # the leader hands the phase's parameters over (the others hold the same)
                self._land(self._attachment.landed())
                self._write()
            try:
                end = self._hand_over(loss, compute)
            except Lost:
                lost = True
                break
            self._fitted = end.phase_steps
            if end.step >= self._boundary:
                break
            # The group's leader left (or did not end the phase within the daemon's phase timeout):
            # regroup; the group's leader then ends it.
            self._regroup()
        else:
            raise PeerdError(f"run {self.run}: the local group changed {REGROUP_TRIES} times at one phase's end")
        if lost:
            logger.warning(
                "peerd: run %s: the daemon went away at a phase's end; attaching again "
                "(this phase's %d steps of progress are dropped, the step count goes on)",
                self.run,
                self._phase_steps,
            )
            self._reattach()
            return
        if not self._slot.spans:
            self.run_step, self.last_outcome = end.step, end.outcome
            self._read()
            self._landed = self._attachment.held()
        self._new_phase()

    def _hand_over(self, loss: float, compute: float, group_step: int = 0):
        """The phase's EndPhase to this process's daemon (peerd.attachment.Attachment.end_phase)."""
        return self._attachment.end_phase(
            self._phase_steps,
            self._phase_samples,
            loss,
            compute,
            boundary=self._boundary,
            group_step=group_step,
            dear_overlap_ratio=self.dear_overlap_ratio,
        )

    def _end_spanning(self, loss: float, compute: float) -> None:
        """The phase's end in a group that spans daemons: the leader ends it on its daemon (the round)
        and broadcasts the run's step, its vector and (with overlap, where θ is not the vector) the
        run's θ; the first process on each other daemon hands θ over, and its daemon follows
        (daemon/groupspan.py). Raises GroupBroke, or Lost (the leader's daemon went away)."""
        c, key = self._collective, f"end/{self._boundary}"
        header = torch.zeros(3, dtype=torch.float64)  # the run's step, the landed rounds held, the round
        if c.leader:
            self._land(self._attachment.landed())
            self._write()
            end = self._hand_over(loss, compute)
            self._read()
            self._fitted = end.phase_steps
            header[:] = torch.tensor([end.step, self._attachment.held(), end.round], dtype=torch.float64)
            self.last_outcome = end.outcome
            c.signal(key)
        else:
            epoch = self._slot.epoch
            c.await_signal(
                key,
                self._attached.phase_timeout,
                lambda: self._attachment.group_epoch() > epoch or self._attachment.replaced(),
            )
        c.broadcast_(header)
        flat = self._flat()
        c.broadcast_(flat)
        theta = None
        if self._attached.theta is not None:  # with overlap the run's θ is not the vector: it too
            theta = torch.empty(self._vector.numel(), dtype=torch.float32)
            if c.leader:
                self._attachment.copy_theta(theta.copy_)
            c.broadcast_(theta)
        step, held = int(header[0]), int(header[1])
        if not c.leader:
            from_vector(flat, self._tensors, False)
            self.last_outcome = "the group's leader ended the phase"
            if self._slot.hands_over:  # this daemon takes the run's θ (its checkpoints, export, evaluations)
                self._vector.copy_(flat if theta is None else theta)
                self._hand_over(loss, compute, group_step=step)
        self.run_step, self._landed = step, held

    def _new_phase(self) -> None:
        self._phase_steps, self._phase_samples, self._loss_sum, self._loss_count = 0, 0.0, 0.0, 0
        self._phase_bounds()
        self._phase_began = time.monotonic()

    def _phase_bounds(self) -> None:
        phases = self._attached.phases
        self._boundary = phases.next_end(self.run_step)  # the run's step at this phase's end
        self._phase_length = phases.length(self.run_step)

    @property
    def live_step(self) -> int:
        """The run's step this process's parameters are at: `run_step` plus the phase's steps so far.
        The same on every member of a local group (a member that joins takes the leader's count):
        a learning-rate schedule that reads it agrees across the group, one that counts its own
        calls does not for a member that joined late."""
        return self.run_step + self._phase_steps

    # -- the local group ------------------------------------------------------------------------

    @property
    def group_rank(self) -> int:
        """This process's rank in its local group (0: the leader; 0 alone)."""
        return self._slot.rank

    @property
    def local_leader(self) -> bool:
        """Whether this process speaks for its local group to its own daemon (the first of the
        group's processes on that daemon: the group's leader, or in a group that spans daemons the
        first on each other daemon): evaluate and save there."""
        return self._slot.hands_over

    @property
    def group_size(self) -> int:
        """Processes in this process's local group (1: alone)."""
        return self._slot.size

    def _regroup(self) -> None:
        """The group changed or broke: this process's place in the daemon's next epoch."""
        if (slot := self._after(self._slot.epoch)) is not None:
            self._join(slot)

    def _join(self, slot: Slot) -> None:
        """Form the group of `slot` and take its leader's parameters, optimizer state and counters."""
        from peerd.local_group import Collective, GroupBroke

        for _ in range(REGROUP_TRIES):
            self._close_group()
            self._slot = slot
            if slot.rank < 0:  # a spanning group's coordinator has not placed it yet: the next epoch
                if (slot := self._after(slot.epoch)) is None:
                    return
                continue
            if slot.size == 1:
                return
            try:
                self._collective = Collective(
                    slot,
                    self.group_timeout,
                    self._attached.phase_timeout,
                    superseded=lambda: self._attachment.group_epoch() > slot.epoch or self._attachment.replaced(),
                    data=self._use_dear,
                    device=self.params[0].device,
                    nccl=self.nccl,
                )
                self._take_leaders()
                if self._use_dear:
                    self._dear = self._start_dear()
            except GroupBroke as e:
                broke = str(e)
            else:
                broke = None
            if broke is not None:  # the next epoch waited for outside the handler (_group_step says why)
                logger.warning("peerd: run %s: local group epoch %d: %s; forming it again", self.run, slot.epoch, broke)
                if (slot := self._after(slot.epoch)) is None:
                    return
                continue
            logger.info(
                "peerd: run %s: local group epoch %d: rank %d of %d, gradients over %s (%s)",
                self.run,
                slot.epoch,
                slot.rank,
                slot.size,
                self._collective.backend,
                self._collective.why,
            )
            return
        raise PeerdError(f"run {self.run}: the local group did not form in {REGROUP_TRIES} epochs")

    def _after(self, epoch: int) -> Slot | None:
        """This process's place in an epoch after `epoch`; None where the attachment was lost and
        this process attached again (its place comes with the new attachment)."""
        try:
            return self._attachment.regroup(epoch)
        except Lost:
            self._reattach()
            return None

    def _start_dear(self):
        """DeAR over the group's data backend: bucketed reduce-scatters from backward hooks, each
        bucket's all-gather awaited (and its update applied) in the next forward (docs/dear.md)."""
        from peerd.peers.dear.gloo import GlooCollective
        from peerd.peers.dear.schedule import DeAR, DeARSettings

        gloo = GlooCollective(timeout=self.group_timeout, backend=self._collective.data)
        settings = DeARSettings(bucket_bytes=self.dear_bucket_bytes, retune_every=DEAR_RETUNE_EVERY, hooks_raise=False)
        return DeAR(self.model, self.inner, gloo, settings)

    def _close_group(self) -> None:
        """Leave this epoch's group: DeAR's pending updates applied where it is healthy, hooks off."""
        if self._dear is not None:
            dear, self._dear = self._dear, None
            try:
                dear.close()
            except Exception as e:  # a broken group's last flush: the next epoch re-syncs
                logger.info("peerd: run %s: DeAR's last flush: %s", self.run, e)
            dear.collective.close()
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    @property
    def group_backend(self) -> str:
        """What the local group's gradients are all-reduced over ("gloo" or "nccl"); "" alone."""
        return self._collective.backend if self._collective is not None else ""

    @property
    def dear_overlap_ratio(self) -> float:
        """With DeAR: the share of the group's communication hidden behind compute; NaN without."""
        return self._dear.overlap_ratio if self._dear is not None else math.nan

    def _take_leaders(self) -> None:
        """A new epoch's start: every member takes the parameters, optimizer state and counters of
        the member furthest on in the run (the leader where they are level: a process restarted on
        the leading daemon must not take the group back to its daemon's older θ), and the count of
        landed rounds the leader's daemon says its parameters hold (APPLIED: a daemon that led
        before or never counts its own). Where that member is on another daemon, the leader hands
        them to its daemon, which takes them as θ (daemon/attached.py `end_phase`, group_step)."""
        c = self._collective
        source = c.furthest(self.run_step)
        counters = torch.tensor([self.run_step, self._phase_steps, self._phase_samples], dtype=torch.float64)
        c.broadcast_(counters, source)
        landed = torch.tensor([self._attachment.held() if c.leader else 0], dtype=torch.int64)
        c.broadcast_(landed)
        flat = torch.empty(self._vector.numel(), dtype=torch.float32)
        mine = c.slot.rank == source
        if mine:
            to_vector(self.params, flat, False)
        c.broadcast_(flat, source)
        state = c.broadcast_state(self.inner.state_dict() if mine else None, source)
        self._landed = int(landed)
        if mine:
            return
        from_vector(flat, self.params, False)
        self.inner.load_state_dict(state)
        if self._state_vector:  # load_state_dict replaced the state's tensors: hand over the new ones
            self._tensors = self._vector_tensors()
        run_step, self._phase_steps, self._phase_samples = counters.tolist()
        behind, self.run_step, self._phase_steps = self.run_step, int(run_step), int(self._phase_steps)
        self._phase_bounds()
        if c.leader and self._slot.spans and self.run_step > behind:  # further on than this daemon's θ
            self._write()
            with contextlib.suppress(Lost):  # the next step attaches again (Attachment.lost)
                self._attachment.end_phase(0, 0.0, math.nan, 0.0, group_step=self.run_step)

    def _check_same(self) -> None:
        """At a phase's end: every member of the group holds the same parameters, or PeerdError."""
        from peerd.local_group import GroupBroke

        try:
            same, digest = self._collective.same(self.params)
        except GroupBroke:
            return  # the leader's EndPhase goes on; the next step's collective regroups
        if not same:
            raise PeerdError(
                f"run {self.run}: the local group's processes hold different parameters at the phase's end "
                f"(rank {self._slot.rank}'s digest {digest:016x}): every member must step on the same "
                "gradients (a step skipped on one member, e.g. by a GradScaler that found inf, breaks that)"
            )

    @property
    def landed_rounds(self) -> int:
        """With overlap: how many of the run's rounds have landed between two phase ends on this
        daemon (its count, which the parameters hold); 0 without overlap."""
        return self._landed

    def report_eval(self, metric: str, score: float, *, higher_is_better: bool = True, loss: float = math.nan) -> None:
        """Report an evaluation of the run's model (e.g. after a phase's end, when the model holds
        the run's parameters): `peerd status` and `peerd_eval_score{run}` show it until the next.
        One call to the daemon; with the attachment lost (the daemon restarts), the evaluation is
        dropped and the next step attaches again."""
        if self._attachment.lost.is_set():
            return
        try:
            self._attachment.report_eval(metric, float(score), higher_is_better, float(loss))
        except Lost:
            logger.info("peerd: run %s: the daemon went away; this evaluation is not reported", self.run)

    # -- attach, and the copies -----------------------------------------------------------------

    def _attach(self) -> None:
        self._attached = a = self._attachment.attach(max(self.run_step, 0))
        self._vector, self.run_step, self._fitted = a.vector, a.step, a.phase_steps
        if (n := sum(t.numel() for t in self._tensors)) != a.vector.numel():
            what = "state vector" if self._state_vector else "parameters"
            self._attachment.close()
            raise PeerdError(
                f"run {self.run}: the daemon's vector has {a.vector.numel()} values, this model's {what} {n} "
                "(a state run's vector holds the optimizer's state too: only a built-in task's process hands it over)"
            )
        self._pin()
        if a.upload:  # this run's first parameters are this model's
            self._write()
            try:
                self._attachment.end_phase(0, 0.0, math.nan, 0.0)
            except Lost:
                raise PeerdError(
                    f"run {self.run}: the daemon went away while taking the run's first parameters"
                ) from None
        else:
            self._read()
        self._landed = self._attachment.held()
        self._new_phase()
        self._join(a.group)
        logger.info(
            "peerd: attached to run %s at step %d (%s)",
            self.run,
            self.run_step,
            "this model starts the run" if a.upload else "the model holds the run's parameters",
        )

    def _reattach(self) -> None:
        self._attach()

    def _land(self, landed: int) -> None:
        """If a round landed since the parameters last took one (`landed`: LANDED as read, by the
        leader in a group): x ← x + (θ − s). Between two EndPhases the daemon writes θ only when a
        round lands, and then LANDED: θ is whole here."""
        theta = self._attached.theta
        if theta is None:
            return
        if landed > self._landed:
            move_by(self.params, theta, self._vector, bool(self._pinned))
            self._landed = landed
            if self._slot.rank == 0:
                self._attachment.took(landed)

    @contextlib.contextmanager
    def run_parameters(self):
        """Within the block the model holds the run's parameters θ, as of the latest round that
        landed (to evaluate the run's model, as the daemon's checkpoints and `peerd export` hold it);
        then its own again. Right after a phase's end without overlap the model holds θ already
        (but with ARC-Top-K: θ minus the rows it did not send, which its later rounds send);
        otherwise it holds θ plus its own progress since. Costs a copy of the parameters on their
        device and a copy of θ into them."""
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            if self._attached.theta is None:  # θ is the vector, which the daemon writes only in a call
                from_vector(self._vector, self.params, bool(self._pinned))  # its parameters, not the optimizer's state
            else:
                self._attachment.copy_theta(lambda theta: from_vector(theta, self.params, bool(self._pinned)))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self.params, own):
                    p.copy_(saved)

    def _write(self) -> None:
        to_vector(self._tensors, self._vector, bool(self._pinned))

    def _read(self) -> None:
        from_vector(self._vector, self._tensors, bool(self._pinned))

    def _vector_tensors(self) -> list[torch.Tensor]:
        if not self._state_vector:
            return self.params
        from peerd.daemon.flat import state_tensors

        return state_tensors(self.inner)[0]

    def _pin(self) -> None:
        unpin(self._pinned)  # the previous attachment's mapping
        last = self._attached.theta if self._attached.theta is not None else self._vector  # θ follows the vector
        self._pinned = pin(self._vector, last) if self.params[0].device.type == "cuda" else 0

    # -- checkpoints of the user's own --------------------------------------------------------

    def state_dict(self) -> dict:
        """The inner optimizer's state and this process's counters (the run's parameters and outer
        state are the daemon's: its checkpoints and the peers hold them)."""
        return {
            "inner": self.inner.state_dict(),
            "peerd": {"run": self.run, "run_step": self.run_step, "local_step": self.local_step},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        if self._state_vector:
            # load_state_dict replaced the state's tensors; their values are the run's, in the vector
            # (the file adds what it does not hold: Adam's step count).
            self._tensors = self._vector_tensors()
            self._read()
        counters = state_dict.get("peerd", {})
        self.local_step = int(counters.get("local_step", self.local_step))
        self.run_step = max(self.run_step, int(counters.get("run_step", 0)))

    def close(self) -> None:
        """Detach: the daemon checkpoints and stops taking part in rounds for this process. The
        steps of an unfinished phase are not averaged. Idempotent."""
        self._close_group()
        self._attachment.close()
        unpin(self._pinned)
        self._pinned = 0

    def __enter__(self) -> "Optimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def to_vector(params: list[torch.Tensor], vector: torch.Tensor, pinned: bool) -> None:
    """Parameters (any device, any float dtype) -> the float32 vector, in order."""
    offset = 0
    for p in params:
        n = p.numel()
        vector[offset : offset + n].view_as(p).copy_(p.detach(), non_blocking=pinned)
        offset += n
    if pinned:  # the daemon reads the vector next: the device-to-host copies must be done
        torch.cuda.synchronize(params[0].device)


@torch.no_grad()
def from_vector(vector: torch.Tensor, params: list[torch.Tensor], pinned: bool) -> None:
    """The float32 vector -> parameters, cast to each one's dtype, on its device."""
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(vector[offset : offset + n].view_as(p), non_blocking=pinned)
        offset += n
    if pinned:  # the vector may change under the next hand-off: the host-to-device copies must be done
        torch.cuda.synchronize(params[0].device)


@torch.no_grad()
def move_by(params: list[torch.Tensor], theta: torch.Tensor, start: torch.Tensor, pinned: bool) -> None:
    """params += θ − s (float32 vectors, in order), on each one's device and in its dtype."""
    offset = 0
    for p in params:
        n = p.numel()
        move = torch.sub(theta[offset : offset + n], start[offset : offset + n])
        p.add_(move.view_as(p).to(p.device, non_blocking=pinned))
        offset += n
    if pinned:  # the host-side moves are temporaries: the copies must be done before they go
        torch.cuda.synchronize(params[0].device)


def pin(vector: torch.Tensor, last: torch.Tensor | None = None) -> int:
    """Page-lock a host tensor in place (the shared mapping: no staging copy), through the end of
    `last` where given (a tensor after it in the same mapping), so that copies to and from a GPU run
    at the bus's speed and may be asynchronous. Returns the registered address (the tensor's first
    page) for unpin; 0 where CUDA refuses (pageable, slower: a warning says so)."""
    last = vector if last is None else last
    page = mmap.PAGESIZE
    start = vector.data_ptr() & ~(page - 1)  # whole pages: the mapping's own (its start is page-aligned)
    size = -(-(last.data_ptr() + last.numel() * last.element_size() - start) // page) * page
    code = torch.cuda.cudart().cudaHostRegister(start, size, 0)
    if int(code) != 0:
        logger.warning("peerd: could not pin the shared vector (cudaHostRegister: %s); copies are pageable", code)
        return 0
    return start


def unpin(address: int) -> None:
    if address:
        torch.cuda.cudart().cudaHostUnregister(address)


def model_layout(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> list[control_pb2.TensorSpec]:
    """The run's layout of this model: its parameters in the optimizer's order, named by `model`."""
    names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
    specs = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if not p.is_floating_point():
                raise ValueError(f"parameter {names.get(id(p), f'{g}.{i}')} is {p.dtype}: a run trains floating point")
            specs.append(
                control_pb2.TensorSpec(name=names.get(id(p), f"{g}.{i}"), shape=list(p.shape), dtype=str(p.dtype))
            )
    return specs


def _close_at_exit(ref: weakref.ref) -> None:
    opt = ref()
    if opt is not None:
        opt.close()
