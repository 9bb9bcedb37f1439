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
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import mmap
import time
import weakref
from typing import Any, Callable

import torch

from peerd import PeerdError
from peerd.attachment import Attachment, Lost
from peerd.protos import control_pb2

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT = 180.0  # seconds one Attach may take: it may download the run's state from peers
RECONNECT_TIMEOUT = 120.0  # seconds a daemon that went away (restart) is waited for


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
    ):
        # torch.optim.Optimizer.__init__ is not called: the inner optimizer holds the groups and state.
        self.inner = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        # What the shared vector holds: the parameters, or with `state_vector` (a built-in task's state
        # run, daemon/taskproc.py; a script's run is DiLoCo's) the parameters then the inner optimizer's
        # floating-point state, in the trainer thread's order (daemon/flat.py state_tensors).
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
        )
        self.run = run
        self.run_step = 0  # the run's step as the daemon last answered (DiLoCo: counts inner steps)
        self.local_step = 0  # steps this process took
        self.last_outcome = ""  # the latest round's outcome, as the daemon answered
        self._phase_steps, self._phase_samples = 0, 0.0
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        self._phase_began = time.monotonic()
        self._boundary = self._phase_length = 0  # set by _new_phase once attached
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
        run overlaps them). Returns what the inner optimizer's step returns."""
        if self._attachment.lost.is_set():
            self._reattach()
        result = self.inner.step(closure) if closure is not None else self.inner.step()
        self._land()
        self.local_step += 1
        self._phase_steps += 1
        self._phase_samples += 1.0 if samples is None else float(samples)
        if loss is not None:
            self._loss_sum = self._loss_sum + (loss.detach() if torch.is_tensor(loss) else float(loss))
            self._loss_count += 1
        # The daemon's status follows each step; the loss only where reading it needs no device sync.
        live_loss = (
            self._loss_sum / self._loss_count if self._loss_count and not torch.is_tensor(self._loss_sum) else math.nan
        )
        self._attachment.stepped(self._phase_steps, self._phase_samples, live_loss)
        # At the phase's length (peers/phases.py), or earlier where the daemon ends it (MateWait, the
        # straggler budget).
        if self._phase_steps >= self._phase_length or self._attachment.phase_ends_at() == self._boundary:
            self._end_phase()
        return result

    def _end_phase(self) -> None:
        compute = time.monotonic() - self._phase_began
        loss = float(self._loss_sum) / self._loss_count if self._loss_count else math.nan
        self._land()
        self._write()
        try:
            end = self._attachment.end_phase(self._phase_steps, self._phase_samples, loss, compute)
        except Lost:
            logger.warning(
                "peerd: run %s: the daemon went away at a phase's end; attaching again "
                "(this phase's %d steps of progress are dropped, the step count goes on)",
                self.run,
                self._phase_steps,
            )
            self._reattach()
            return
        self.run_step, self.last_outcome = end.step, end.outcome
        self._read()
        self._landed = self._attachment.held()
        self._new_phase()

    def _new_phase(self) -> None:
        self._phase_steps, self._phase_samples, self._loss_sum, self._loss_count = 0, 0.0, 0.0, 0
        phases = self._attached.phases
        self._boundary = phases.next_end(self.run_step)  # the run's step at this phase's end
        self._phase_length = phases.length(self.run_step)
        self._phase_began = time.monotonic()

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
        self._vector, self.run_step = a.vector, a.step
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
        logger.info(
            "peerd: attached to run %s at step %d (%s)",
            self.run,
            self.run_step,
            "this model starts the run" if a.upload else "the model holds the run's parameters",
        )

    def _reattach(self) -> None:
        self._attach()

    def _land(self) -> None:
        """If a round landed since the parameters last took one: x ← x + (θ − s). Between two
        EndPhases the daemon writes θ only when a round lands, and then LANDED: θ is whole here."""
        theta = self._attached.theta
        if theta is None:
            return
        landed = self._attachment.landed()
        if landed > self._landed:
            move_by(self.params, theta, self._vector, bool(self._pinned))
            self._landed = landed
            self._attachment.took(landed)

    @contextlib.contextmanager
    def run_parameters(self):
        """Within the block the model holds the run's parameters θ, as of the latest round that
        landed (to evaluate the run's model, as the daemon's checkpoints and `peerd export` hold it);
        then its own again. Right after a phase's end without overlap the model holds θ already;
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
