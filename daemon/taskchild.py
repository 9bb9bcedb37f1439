"""The daemon's half of a `--task` run trained by a child process (the default; DESIGN.md,
"Processes"): `python -m peerd.daemon.taskproc` trains the task as a client of peerd.torch.Optimizer, and
this daemon starts it, reaps it and restarts it a bounded number of times (daemon/supervisor.py).

The child attaches like a script (daemon/attached.py: the outer state, rounds, checkpoints and the
state peers download stay here; for a state run, daemon/algorithms.py StateAveraging: the vector is the whole
state vector, parameters and the inner optimizer's state), except that:
- its model is the task's, built from the run's manifest: the daemon builds it once to know its
  layout, and accepts an attach only from its own child with exactly that layout;
- its rounds follow the run's averaging.overlap, landing between two of its steps (daemon/attached.py,
  "landing"), and it evaluates θ (peerd.torch.Optimizer.run_parameters);
- every daemon of the run may start it from the manifest's seed (the same first parameters on
  every peer), so a joiner with no peer to download from is not refused;
- checkpoints have the task's identity (run, task, hyper-parameters, model layout), the one older
  releases' trainer thread wrote: their checkpoints resume here.

The inner optimizer's state is the child's, in the run's data dir (STATE_FILE; for a state run only
what the state vector does not hold, such as Adam's step count). Status: the child's
state and restarts (RunStatus.train_process_*); a child that failed more often than the bound makes
the run FAILED, with its last line of stderr, and the daemon's health NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

from peerd.daemon import SOURCE_ROOT
from peerd.daemon.attached import AttachedTrainer, TrainState
from peerd.daemon.joining import RunRefused
from peerd.daemon.supervisor import TASK_PROGRAM, ChildState, Preloaded, Supervisor
from peerd.peers.manifest import RunManifest, TensorSpec, layout_mismatch
from peerd.peers.membership import IDLE

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # restarts after a failure before the run is FAILED
TRAINERS_POLL = 0.2  # seconds between two looks at the peers' roles while a first attach waits
# Seconds the child has after SIGTERM: it saves its inner state and detaches (the daemon checkpoints
# whether it does or not); within the daemon's default 10 s drain, and its DHT goodbyes after.
CHILD_STOP_GRACE = 5.0
STATE_FILE = "taskproc.state"  # the child's inner optimizer state, in the run's data dir


def task_model(manifest: RunManifest, init_seed: int) -> tuple[tuple[TensorSpec, ...], dict, object, object]:
    """The layout of the run's task's model as the child's Optimizer sends it, the identity of the
    run's checkpoints, and the model and optimizer built for them (a state
    run's daemon keeps them: daemon/algorithms.py). Builds the model once (blocking)."""
    from peerd.daemon.checkpoint import identity_of
    from peerd.daemon.joining import hparams_from_text
    from peerd.daemon.tasks import get_task
    from peerd.torch import model_layout

    task = get_task(manifest.task)
    hparams = hparams_from_text(task, manifest.hparams)
    # It gives the parameters' order. Only a state run's daemon uses it further (daemon/algorithms.py):
    # its first step, which materializes its state, imports torch._dynamo all the same.
    with optimizer_without_dynamo():
        model, optimizer = task.build(hparams, init_seed)
    layout = tuple(TensorSpec(t.name, tuple(t.shape), t.dtype) for t in model_layout(optimizer, model))
    text = {k: str(v) for k, v in hparams.to_dict().items()}  # as the manifest writes them
    return layout, identity_of(manifest.run_id, task.name, text, model), model, optimizer


@contextlib.contextmanager
def optimizer_without_dynamo() -> Iterator[None]:
    """Build an optimizer without importing torch._dynamo. torch.optim.Optimizer's methods are
    wrapped by torch._compile._disable_dynamo, which imports torch._dynamo (with sympy and torch.fx:
    1.0 s of CPU here, a third of what a training daemon spends to start) at the first call, only to
    keep torch.compile from tracing them. The daemon never compiles, and the optimizer task_model
    builds is never stepped: in this block those wrappers call the method itself. The wrapper's
    shape is checked; under a torch whose wrapper differs nothing changes (the import happens)."""
    import torch

    patched = []
    for method in vars(torch.optim.Optimizer).values():
        fn, code = getattr(method, "__wrapped__", None), getattr(method, "__code__", None)
        if fn is None or code is None or code.co_qualname != "_disable_dynamo.<locals>.inner":
            continue
        if not hasattr(fn, "__dynamo_disable"):  # the wrapper's cache: set, it calls what it holds
            setattr(fn, "__dynamo_disable", fn)
            patched.append(fn)
    try:
        yield
    finally:
        for fn in patched:
            delattr(fn, "__dynamo_disable")


def child_argv(manifest: RunManifest, data_dir: Path, train, init_seed: int) -> list[str]:
    """The child's command line: the run's task, hyper-parameters and seed, this daemon's limits
    (each of --train-processes adds its --rank: TaskChild)."""
    argv = [*TASK_PROGRAM, "--run", manifest.run_id, "--task", manifest.task]
    argv += ["--daemon", str(data_dir), "--seed", str(init_seed)]
    argv += ["--average-every", str(manifest.averaging.average_every), "--max-steps", str(train.max_steps)]
    argv += ["--eval-every", str(train.eval_every), "--checkpoint-every", str(train.checkpoint_every)]
    argv += ["--torch-threads", str(train.torch_threads)]
    argv += ["--state", str(data_dir / "runs" / manifest.run_id / STATE_FILE)]
    if manifest.averaging.algorithm == "state":
        argv += ["--state-vector"]
    if train.train_processes > 1:
        argv += ["--group-size", str(train.train_processes)]
    if train.dear:  # used only while the process's local group has more than one (--train-processes, --local-group)
        argv += ["--dear"]
    for key, value in sorted(manifest.hparams.items()):
        argv += ["--set", f"{key}={value}"]
    return argv


class TaskChild(AttachedTrainer):
    """An AttachedTrainer whose process is this daemon's child. `state` and `error` add the child's
    to the attachment's: LOADING until it attaches (and while it restarts), FINISHED once it exited
    at --max-steps, FAILED once it failed more often than `max_restarts` allows."""

    FIRST_ALIKE = True  # creator=True on every daemon: each derives the run's first parameters

    def __init__(
        self,
        *,
        argv: list[str],
        max_steps: int,
        ready: Callable[[], bool] = lambda: True,
        trainers_ready: Callable[[], bool] = lambda: True,
        ready_timeout: float = 0.0,
        max_restarts: int = MAX_RESTARTS,
        processes: int = 1,
        preloaded: Preloaded | None = None,
        **attached,
    ):
        self.max_steps = max_steps
        # --min-peers, waited for twice: daemons before the child starts (`ready`), and
        # daemons with a training process before its first attach goes on (`trainers_ready`).
        self.ready, self.trainers_ready, self.ready_timeout = ready, trainers_ready, ready_timeout
        self._starter: asyncio.Task | None = None
        # --train-processes: one child per rank, each supervised on its own (a local group: daemon/attached.py).
        self.children = [
            Supervisor(
                f"run {attached['run_id']}: training process" + (f" {rank}" if processes > 1 else ""),
                argv + (["--rank", str(rank)] if processes > 1 else []),
                cwd=SOURCE_ROOT,
                max_restarts=max_restarts,
                preloaded=preloaded if rank == 0 else None,  # the daemon's, started with it
            )
            for rank in range(processes)
        ]
        self.child = self.children[0]  # status shows the first's state and restarts
        super().__init__(creator=True, **attached)  # every daemon derives the run's first parameters alike

    @property
    def state(self) -> TrainState:
        states = {c.state for c in self.children}
        if ChildState.FAILED in states:
            return TrainState.FAILED
        if states == {ChildState.EXITED}:
            done = self.max_steps and self.global_step >= self.max_steps
            return TrainState.FINISHED if done else TrainState.STOPPED
        if self._state is TrainState.STOPPED and states & {ChildState.RUNNING, ChildState.RESTARTING}:
            return TrainState.LOADING  # the child starts (again) and has not attached yet
        return self._state

    @state.setter
    def state(self, value: TrainState) -> None:
        self._state = value

    @property
    def error(self) -> str:
        for c in self.children:
            if c.state in (ChildState.FAILED, ChildState.RESTARTING):
                return f"training process {c.error}"
        return self._error

    @error.setter
    def error(self, value: str) -> None:
        self._error = value

    def start(self) -> None:
        """Watch the lease and start the child once `ready` (on the daemon's loop)."""
        super().start()
        self._starter = self._loop.create_task(self._start_child(), name=f"start-child:{self.run_id}")

    async def _start_child(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not self.ready() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        for c in self.children:
            c.start()

    async def _stop_child(self) -> None:
        if self._starter is not None:
            self._starter.cancel()  # no start after the stop
            await asyncio.gather(self._starter, return_exceptions=True)
        await asyncio.gather(*(c.stop(CHILD_STOP_GRACE) for c in self.children))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the child (SIGTERM, SIGKILL after CHILD_STOP_GRACE), then the attachment. Blocking:
        from a worker thread, as the daemon stops its trainers."""
        if self._loop is not None and not self._loop.is_closed():
            future = asyncio.run_coroutine_threadsafe(self._stop_child(), self._loop)
            try:
                future.result(CHILD_STOP_GRACE + 5.0)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                logger.error("run %s: the training process was not reaped in time", self.run_id)
        super().stop(timeout)

    def attach(self, pid: int, device: str, step: int, group_size: int = 1):
        """As a script's attach, except that the first one (no state yet) waits, announced as
        training, until --min-peers daemons of the run announce a training process (at most
        --min-peers-timeout): the thread's trainers start together once the peers are there, and
        children that start seconds apart (imports, a loaded machine) would train out of step, the
        first alone to --max-steps with every round no_group. Blocking, from a worker thread."""
        if not self._has_state and not self.trainers_ready():
            self.on_role(self.role)  # the others' children wait for this one too
            logger.info("run %s: the training process waits for --min-peers daemons training", self.run_id)
            deadline = time.monotonic() + self.ready_timeout
            while not self.trainers_ready() and time.monotonic() < deadline:
                if self._stopping.wait(TRAINERS_POLL):
                    break
        try:
            return super().attach(pid, device, step, group_size)
        except BaseException:
            self.on_role(IDLE if self.session is None else self.role)
            raise

    def check_child(self, pid: int, layout: tuple[TensorSpec, ...]) -> None:
        """Refuse (RunRefused) an attach that is not this daemon's child with the task's model."""
        if pid not in {c.pid for c in self.children}:
            raise RunRefused(
                f"run {self.run_id!r} trains task {self._identity['task']!r} in a process of its daemon "
                f"(pid {self.child.pid}); a script attaches to a run created by a script (another run ID)"
            )
        if why := layout_mismatch(self.layout, layout):
            raise RunRefused(f"the training process's model does not match the task's: {why}")
