"""A run trained by a process attached to this daemon (peerd.torch.Optimizer; docs/your-loop.md).

The process keeps its loop, model, device and inner optimizer. This daemon keeps what DiLoCo's
outer loop holds and the network: the outer state [θ; m], error feedback, the rounds, checkpoints,
and the state peers download. The two share one file in shared memory: a HEADER, then the model's
parameters as one float32 vector in layout order (the *inner vector*; tensors never travel in
control messages). A state run's child hands over its whole state vector instead, and the daemon
averages it without an outer loop (daemon/algorithms.py, the run's algorithm).

    attach     The daemon puts the run's parameters in the vector: its checkpoint's, or the peers'
               when the run is ahead of it. For a run with no state anywhere yet, the response asks
               the process to `upload`: it writes its own parameters and calls EndPhase with 0
               steps, and they become θ (only the run's creator does; other daemons wait for its
               state and download it, so every peer starts from the same parameters).
    end phase  The process writes its parameters and calls EndPhase. The daemon runs the outer step
               (daemon/diloco.py OuterLoop.end_phase, on the vector in place: without overlap the
               vector holds θ afterwards; with overlap the phase's round starts in the background
               and the vector is left as written) and answers; the process copies the vector into
               its model.
    landing    With overlap the file holds a second vector: θ, the run's parameters. Between two
               EndPhases the vector holds s, where the averaged phase ended (what the process read
               back). When the round in flight ends, the daemon takes the outer step, writes θ and
               then LANDED, a count of landed rounds. The process reads LANDED at each step; on a
               new one it adds the move θ − s to its parameters and writes the count it took to
               APPLIED. An EndPhase settles a round the process did not take (one that ended while
               the process wrote its parameters): the daemon adds the move to the vector. So a round
               lands between two steps of the process, τ steps stale for a round of τ steps, not
               a whole phase late. θ there is also what the process
               evaluates (peerd.torch.Optimizer.run_parameters); THETA_SEQ is odd while the daemon
               writes it.
    lease      The process renews every lease/3 s. A lease that lapses, or a pid that exits, ends
               the attachment within LEASE_CHECK s: the daemon checkpoints, announces the role
               "idle" and takes no part in the run's rounds until a process attaches again.

    group      Several processes may attach to one run (torchrun's processes, one per GPU): they are the
               run's local group on this daemon, one WAN peer. The daemon forms the group and hands
               each process its place (epoch, rank, size, the rendezvous file of a torch.distributed
               FileStore); the processes average their gradients at every step among themselves
               (peerd/local_group.py), so that they hold the same parameters. The leader (rank 0)
               hands the phase's parameters over and its EndPhase runs the round; the others'
               EndPhase waits for the leader's of the same boundary and answers the same. A process
               that attaches later, exits, lapses or detaches moves the group's epoch (GROUP_EPOCH in
               the shared file): the members see it at their next step and Regroup, taking the
               leader's parameters and optimizer state. The first process of a group that expects
               others (AttachRequest.group_size) waits up to GROUP_FORM_WAIT s for them. With
               --local-group NAME the group takes in the processes of the label's other daemons:
               epochs and ranks come from its coordinator (daemon/groupspan.py, `placed`), and a
               daemon that does not lead follows (`_take_group`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Awaitable, Callable

import torch

from peerd.daemon.checkpoint import CheckpointStore, layout_digest, passed_over_error
from peerd.daemon.algorithms import DiLoCo, StateAveraging
from peerd.daemon.groupspan import TICK, GroupSpan, Placement
from peerd.daemon.plan import Fit, fit_every
from peerd.daemon.straggler import EarlyEnd, catch_up_from
from peerd.daemon.tasks import EvalResult
from peerd.peers.averaging import Average, RoundResult
from peerd.peers.dear.hierarchy import delegated_mask, group_id, owned_lanes
from peerd.peers.dear.member import AUTO
from peerd.peers.manifest import TensorSpec
from peerd.peers.pace import Pace
from peerd.peers.membership import FOLLOWER, IDLE, TRAINER
from peerd.peers.phases import Phases
from peerd.peers.sketch import HISTORY, SketchPlan
from peerd.peers.statesync import FetchResult, Snapshot
from peerd.shared_file import (
    APPLIED_OFFSET,
    COUNT,
    END_AT,
    END_AT_OFFSET,
    GROUP_EPOCH,
    GROUP_EPOCH_OFFSET,
    HEADER,
    HEADER_BYTES,
    LANDED_OFFSET,
    MAGIC,
    PHASE_STEPS_OFFSET,
    THETA_SEQ_OFFSET,
    file_size,
)

logger = logging.getLogger(__name__)

LEASE_SECONDS = 6.0  # an attachment ends this long after its last Renew (the process renews every 2 s)
LEASE_CHECK = 0.5  # seconds between two looks at the lease and the process's pid
ATTACH_PATIENCE = 60.0  # seconds an attach waits for a peer to serve the run's state (since the last chunk it got)
GROUP_FORM_WAIT = 30.0  # seconds the first of a group's expected processes waits for the others
PLACE_WAIT = 30.0  # seconds an attach or regroup waits for a spanning group's coordinator to place the process
ASSEMBLE_POLL = 0.2  # seconds between two looks at the label's daemons while a run's first step waits for them
LOCK_POLL = 0.01  # seconds between two tries of the loop at the trainer's lock while a worker thread holds it
# The shared file's layout (header, counts, θ) is peerd/shared_file.py's, the process's too. END_AT
# is written by the daemon only: the boundary step of the phase the straggler budget ends now (0:
# none). The process compares it with its own phase's boundary at each step, so a value left from an
# earlier phase never matches.
SHARED_PREFIX = "peerd-"


# Settings of a run that a script's first attach creates, unless the script gives its own: its
# rounds are waited for, so that a loop's model holds the run's parameters θ at each phase's end
# (with overlap it holds θ plus its own progress: Optimizer.run_parameters). The straggler budget
# (DropCompute) is the script's to ask for: an early phase end moves the run's step further than
# the loop's own count, which a loop that evaluates or stops every so many of its steps would not
# expect.
SCRIPT_RUN_DEFAULTS = {"averaging.overlap": "false", "averaging.inner_budget": "0"}


CATCH_UP_PATIENCE = 10.0  # seconds a trainer behind its peers keeps trying to download their state


class TrainState(Enum):
    LOADING = "LOADING"  # setting the run's state up, loading a checkpoint
    TRAINING = "TRAINING"  # a process is attached (or the task's child runs)
    FINISHED = "FINISHED"  # reached max_steps; the model is kept
    STOPPED = "STOPPED"  # stopped by leave or drain, or its process detached
    FAILED = "FAILED"  # the task's child failed past its restarts; see `error`


class AttachRefused(Exception):
    """The attach cannot be taken as asked (no state to start from, the daemon stops)."""


class SessionLost(Exception):
    """The session is not (or no longer) this run's attachment: its lease lapsed or the daemon restarted."""


@dataclass(slots=True)
class Session:
    token: str
    pid: int  # 0: not visible from this daemon (another pid namespace): the lease alone watches it
    device: str
    renewed: float  # time.monotonic() of the last Renew or EndPhase


@dataclass(frozen=True, slots=True)
class GroupSlot:
    """A process's place in its local group (control.proto LocalGroup)."""

    epoch: int
    rank: int  # -1: not placed in the epoch yet (a group that spans daemons): regroup
    size: int
    store: str
    host: str = "127.0.0.1"
    spans: bool = False
    hands_over: bool = False


@dataclass(frozen=True, slots=True)
class SpanView:
    """A spanning group as status shows it: its label, processes, this daemon's first rank, why."""

    label: str
    size: int
    rank: int
    last_reason: str


@dataclass(frozen=True, slots=True)
class AttachInfo:
    session: str
    shared_path: str
    numel: int
    step: int
    phases: Phases
    lease_seconds: float
    phase_timeout: float
    upload: bool  # the process writes its parameters and calls EndPhase with 0 steps: they become θ
    group: GroupSlot
    phase_steps: int = 0  # average_every=auto: the steps the process's next phase takes (0: the schedule's)


@dataclass(frozen=True, slots=True)
class PhaseEnd:
    step: int
    round_t: int  # the round whose result the vector holds; -1: none (overlap's first, or an upload)
    outcome: str
    waited: float
    downloaded: bool
    group_epoch: int = 0


class SharedVector:
    """A float32 vector in a file under `directory` (tmpfs: /dev/shm), mapped by the daemon and the
    process. The file is named after the daemon's pid, so that a start removes what a killed
    daemon left (remove_stale)."""

    def __init__(self, directory: Path, numel: int, theta: bool = False):
        """`theta`: with θ and the landing counts (format 2: a run whose process's parameters are
        not θ at a phase's end, daemon/algorithms.py `theta_apart`): 4 bytes more per value."""
        self.path = directory / f"{SHARED_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        size = file_size(numel, theta)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._map[: HEADER.size] = HEADER.pack(MAGIC, 2 if theta else 1, numel)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32, offset=HEADER_BYTES, count=numel)
        self.theta = (
            torch.frombuffer(self._map, dtype=torch.float32, offset=HEADER_BYTES + 4 * numel, count=numel)
            if theta
            else None
        )

    def count(self, offset: int) -> int:
        """A header count; 0 once the file is closed (the status or the lease watch may read it
        while the daemon stops)."""
        return 0 if self._map.closed else COUNT.unpack_from(self._map, offset)[0]

    def set_count(self, offset: int, value: int) -> None:
        COUNT.pack_into(self._map, offset, value)

    def write_theta(self, theta: torch.Tensor) -> None:
        seq = self.count(THETA_SEQ_OFFSET)
        self.set_count(THETA_SEQ_OFFSET, seq + 1)  # odd: a reader copies again
        self.theta.copy_(theta)
        self.set_count(THETA_SEQ_OFFSET, seq + 2)

    def set_group_epoch(self, epoch: int) -> None:
        if not self._map.closed:
            GROUP_EPOCH.pack_into(self._map, GROUP_EPOCH_OFFSET, epoch)

    def store(self, epoch: int) -> Path:
        """The rendezvous file of the local group's `epoch` (beside the vector: remove_stale takes it)."""
        return self.path.with_name(f"{self.path.name}.group-{epoch}")

    def end_phase_at(self, boundary: int) -> None:
        """Ask the process to end the phase whose boundary is `boundary` at its next step."""
        if not self._map.closed:  # closed: the daemon stops
            END_AT.pack_into(self._map, END_AT_OFFSET, boundary)

    def close(self) -> None:
        self.tensor = self.theta = None
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere; the unlink frees it with the process
            pass
        self.path.unlink(missing_ok=True)
        for store in self.path.parent.glob(f"{self.path.name}.group-*"):
            store.unlink(missing_ok=True)


def shared_directory(fallback: Path) -> Path:
    """/dev/shm where it is a writable directory (memory, never written back to a disk), else `fallback`."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else fallback


def remove_stale(directory: Path) -> int:
    """Remove the shared files of daemons that are gone; returns how many."""
    removed = 0
    for path in directory.glob(f"{SHARED_PREFIX}*-*"):
        pid = path.name.removeprefix(SHARED_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def layout_identity(run_id: str, layout: tuple[TensorSpec, ...]) -> dict:
    """The identity of this run's checkpoints (daemon/checkpoint.py): task "" and the model's layout."""
    digest = layout_digest([(t.name, list(t.shape), t.dtype) for t in layout])
    return {"run_id": run_id, "task": "", "hparams": {}, "layout": digest}


def _alone(result: RoundResult) -> bool:
    """A round with no mate planned and none met: this daemon alone in the run."""
    return result.planned == 0 and result.group_size == 1


class AttachedTrainer:
    """The daemon's half of a run trained by an attached process (status, metrics and the membership
    read its attributes; the steps are taken in the process).

    Callbacks: `average` (the run's round, a coroutine: daemon/joining.bounded_round), `on_round`,
    `peer_steps`, `sync` (download [θ; m] from peers; blocking), `on_sync`; `on_role(role)`
    announces whether a process trains here (peers/membership.py TRAINER, FOLLOWER, IDLE).
    `end_phase` is awaited on the daemon's loop, where its round runs; the arithmetic, downloads
    and checkpoints around the round go to worker threads. attach/renew/detach/regroup block (a
    download, a checkpoint, a group that forms): the control server calls them in worker threads.
    One lock orders them all (`_held` takes it from the loop)."""

    # Whether every daemon of the run derives the run's first parameters alike (a task's children):
    # no daemon's attach waits for another's upload at the start (_assemble may hold any of them).
    FIRST_ALIKE = False

    def __init__(
        self,
        *,
        run_id: str,
        layout: tuple[TensorSpec, ...],
        creator: bool,
        store: CheckpointStore,
        algorithm: DiLoCo | StateAveraging,
        phases: Phases,
        round_timeout: float,
        checkpoint_every: int,
        shared_dir: Path,
        average: Average,
        on_round: Callable[[RoundResult], None] = lambda result: None,
        peer_steps: Callable[[], list[int]] = list,
        sync: Callable[[int, torch.Tensor], FetchResult] | None = None,
        on_sync: Callable[[FetchResult], None] = lambda result: None,
        on_role: Callable[[str], None] = lambda role: None,
        lease_seconds: float = LEASE_SECONDS,
        inner_budget: float = 0.0,
        auto_every: tuple[int, int] | None = None,
        round_seconds: Callable[[], float] = lambda: math.nan,
        identity: dict | None = None,
        lanes: int = 1,
    ):
        self.run_id, self.layout, self.creator, self.store = run_id, layout, creator, store
        self.phases, self.round_timeout, self.checkpoint_every = phases, round_timeout, checkpoint_every
        self.average, self.on_round, self.peer_steps, self.sync, self.on_sync = (
            average,
            on_round,
            peer_steps,
            sync,
            on_sync,
        )
        self.on_role, self.lease_seconds = on_role, lease_seconds
        self._announced = IDLE  # the role last handed to on_role: what the peers see
        # Announcements one at a time, each of the role this daemon has when it is made: an attach
        # (its thread) and a placement (the span's beat) each announce, and the later must not hand
        # on_role a role read before the other changed it (`_announce`).
        self._roles = threading.Lock()
        self.lanes = lanes  # the run's averaging.lanes
        # The run's averaging.algorithm (daemon/algorithms.py): what the vector holds (the parameters,
        # or a whole state vector), what peers download and checkpoints keep, and the round.
        self.algorithm = algorithm
        self.parameters = sum(t.numel for t in layout)  # the model's (RunStatus.parameters)
        self.numel = algorithm.numel(self.parameters)
        # What this run's checkpoints hold (daemon/checkpoint.py): a script's model, or a task's (its
        # own child's, daemon/taskchild.py: the identity older releases' trainer thread wrote too).
        self._identity = identity if identity is not None else layout_identity(run_id, layout)
        overlap = algorithm.overlap
        self._shared = SharedVector(shared_dir, self.numel, theta=algorithm.theta_apart)
        algorithm.bind(self._shared.tensor, average, run_id, self._round_done, lanes)
        # Rounds landed between EndPhases (LANDED), how many of them the vector accounts for, and the
        # latest one's move θ − s (for an EndPhase to add where the process did not).
        self._moves = self._settled = 0
        self._move = torch.empty(self.numel) if overlap else None
        self._sketch_plan = SketchPlan.for_run(run_id, self.parameters)  # of the parameters (the vector's start)
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # stop() was called: downloads stop retrying
        self._has_state = False  # θ is the run's: from a checkpoint, from peers, or uploaded
        # The local group: the attached processes in rank order (members[0], the leader, is `session`),
        # its epoch, and the latest phase end (its boundary and answer) for the others' EndPhase.
        # Guarded by _group, taken after _lock where both are (never the other way round).
        self.members: list[Session] = []
        self.group_epoch = 0
        self._group = threading.Condition()
        self._founding = False  # an attach is setting the run's state up for a first process
        self._forming_until = 0.0  # the group's first processes are still expected until then
        self._expected = 1
        # A group that spans daemons (--local-group NAME, daemon/groupspan.py): its coordinator numbers
        # the epochs and places this daemon's processes; `_after` is the epoch this daemon asks it to
        # move past.
        self.span: GroupSpan | None = None
        self._placement: Placement | None = None
        self._after = 0
        self._ended: tuple[int, PhaseEnd] = (-1, PhaseEnd(0, -1, "", 0.0, False))
        self._watcher: asyncio.Task | None = None
        self._spanning: asyncio.Task | None = None
        # The span's lane requests (daemon/groupspan.serve_lanes), set by the daemon for a run of
        # several lanes, and their task.
        self.lanes_served: Callable[[], Awaitable[None]] | None = None
        self._lanes_step = 0  # the boundary of the latest round whose lanes this daemon averaged for its leader
        self._serving: asyncio.Task | None = None
        self._landing: asyncio.Task | None = None  # with overlap: the landing of the round that ended last
        self._loop: asyncio.AbstractEventLoop | None = None
        self.state = TrainState.LOADING
        # global_step: the run's step at the latest attach or EndPhase (a phase's start); the steps of
        # the phase under way are in the shared file (PHASE_STEPS): `step` and `local_step` add them.
        self.global_step = self._local_done = self.resumed_from = self.synced_from = 0
        self._samples_done = 0
        self.samples_averaged = 0.0  # samples of phases a round with mates applied (RunStatus.samples_averaged)
        self._live = (0.0, math.nan)  # the phase under way's samples and mean loss, from the latest Renew
        self._samples_since_round = 0.0
        self._loss_done = math.nan  # the latest phase's mean loss, from its EndPhase
        self.samples_per_second = 0.0
        self.compute_seconds = self.train_wait_seconds = 0.0
        # Seconds of one inner step in the latest phase that took steps (RunStatus.step_seconds, the
        # pace average_every=auto fits H with): that phase's compute seconds over its steps. The latest
        # phase, not the mean since the start: the first phase's compute also holds what the script did
        # between its attach and its first step (data, warm-up), seconds a mean would carry for long.
        self.step_seconds = math.nan
        self.error = self._passed_over = ""  # _passed_over: checkpoints load() left on disk
        self.last_round: RoundResult | None = None
        self.param_distance_to_group_mean = math.nan
        # DeAR's overlap ratio in the latest EndPhase that carried one (RunStatus.dear_overlap_ratio);
        # NaN once a process ends a phase without DeAR.
        self.dear_overlap_ratio = math.nan
        self.sketches: tuple = ()
        self.snapshot: Snapshot | None = None
        self._checkpointed = 0
        self.eval: EvalResult | None = None  # the latest evaluation the process reported (ReportEval)
        # DropCompute (daemon/straggler.py): the lease watch ends a slow process's phase through the
        # shared file's header; the phase begins when its attach or previous EndPhase answers.
        self._early = EarlyEnd.for_run(round_timeout, inner_budget)
        self._phase_began = time.monotonic()
        # averaging.average_every=auto: its bounds (None: off), the run's recent round duration
        # (DaemonMetrics.round_seconds, the figure `peerd plan` compares), the group paces of the
        # latest rounds by round number (peers/pace.py), and the latest decision, taken again at each
        # phase's end and handed to the process with the EndPhase's answer.
        self._auto_every, self._round_seconds = auto_every, round_seconds
        self._paces: dict[int, Pace] = {}
        self.fitted: Fit | None = None
        self.fitted_round = 0  # the round whose group pace `fitted` came from; 0: own figures

    # -- the surface the daemon uses ----------------------------------------------------------

    @property
    def session(self) -> Session | None:
        """The attached process that hands the phases over (the local group's leader); None: none."""
        members = self.members
        return members[0] if members else None

    @property
    def phase_steps(self) -> int:
        """Steps the attached process has taken in the phase under way (PHASE_STEPS)."""
        shared = self._shared
        return shared.count(PHASE_STEPS_OFFSET) if shared.tensor is not None and self.session is not None else 0

    @property
    def step(self) -> int:
        """The step of the run's state this daemon holds (status, peerd_train_step): it moves at
        phase ends and never goes back."""
        return self.global_step

    @property
    def live_step(self) -> int:
        """The run's step as the process takes it, what the peers see announced (MateWait tells a
        peer waiting at a boundary from one past it): the phase's steps count up to one before its
        boundary, which the EndPhase takes."""
        g = self.global_step
        # A follower averaging its lanes of round r for its leader is at r's boundary, before its
        # EndPhase takes the group's step (after the round): mates wait for none of it.
        return max(min(g + self.phase_steps, self.phases.next_end(g) - 1), self._lanes_step)

    @property
    def local_step(self) -> int:
        """Steps this daemon's processes took, the phase under way's included."""
        return self._local_done + self.phase_steps

    @property
    def samples(self) -> int:
        """Samples this daemon's processes trained on, the phase under way's as of its latest Renew."""
        return self._samples_done + int(self._live[0] if self.session is not None else 0)

    @property
    def loss(self) -> float:
        """The phase under way's mean loss so far where the process can tell it without a device sync
        (it passed floats), else the latest phase's."""
        live = self._live[1] if self.session is not None else math.nan
        return self._loss_done if math.isnan(live) else live

    @property
    def compute_fraction(self) -> float:
        total = self.compute_seconds + self.train_wait_seconds
        return self.compute_seconds / total if total > 0 else math.nan

    @property
    def attached(self) -> Session | None:
        return self.session

    def load(self) -> None:
        """Restore the outer state from the newest checkpoint of this run's model (blocking)."""
        checkpoint = self.store.load_latest(self._identity)
        # Checkpoints of another identity (a run ID reused for another model) stay named in status
        # for the run's life (an attach clears other errors).
        self.error = self._passed_over = passed_over_error(self.store.passed_over, checkpoint)
        if self._passed_over:
            logger.warning("run %s: %s", self.run_id, self._passed_over)
        if checkpoint is not None:
            state = checkpoint.state
            self.algorithm.resume(state)
            self.global_step = self.resumed_from = self._checkpointed = checkpoint.step
            self._local_done, self._samples_done = int(state.get("local_step", 0)), int(state.get("samples", 0))
            self._snapshot(self.global_step)
            self._has_state = True
            logger.info("run %s: resumed from checkpoint at step %d", self.run_id, self.global_step)
        self.state = TrainState.STOPPED  # until a process attaches

    def start(self) -> None:
        """Watch the lease (on the daemon's loop: call from it)."""
        self._loop = asyncio.get_running_loop()
        self._watcher = self._loop.create_task(self._watch(), name=f"lease:{self.run_id}")
        if self.span is not None:
            self._spanning = self._loop.create_task(self._beat(), name=f"span:{self.run_id}")
            if self.lanes_served is not None:
                self._serving = self._loop.create_task(self.lanes_served(), name=f"lanes:{self.run_id}")

    def stop(self, timeout: float = 30.0) -> None:
        """Leave or drain: end the attachment (the process sees NOT_FOUND and re-attaches to the
        daemon that comes next), checkpoint, remove the shared file. Blocking. A phase that holds the
        lock ends soon: the daemon has cancelled its round or download (RunHandle.stopping), and a
        download does not try again."""
        self._stopping.set()
        if self._watcher is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._watcher.cancel)
            for task in (self._spanning, self._serving):
                if task is not None:
                    self._loop.call_soon_threadsafe(task.cancel)
        if not self._lock.acquire(timeout=timeout):
            logger.error("run %s: a phase still runs after %.0f s; stopping without a checkpoint", self.run_id, timeout)
            return
        try:
            self._end_session("the daemon stops")
            self.algorithm.close()
            self._shared.close()
            if self.span is not None:  # its store (its beat was cancelled above)
                self.span.close()
        finally:
            self._lock.release()

    # -- the attached process -----------------------------------------------------------------

    def attach(self, pid: int, device: str, step: int, group_size: int = 1) -> AttachInfo:
        """A process attaches (blocking: may download the run's state from peers first). The first
        (no live process attached) sets the run's state up; the next ones join its local group."""
        s = Session(secrets.token_hex(16), pid if pid and pid_alive(pid) else 0, device, time.monotonic())
        deadline = time.monotonic() + ATTACH_PATIENCE + GROUP_FORM_WAIT
        with self._group:
            while self._founding:  # another attach sets the state up: join the group it founds
                if self._stopping.is_set() or not self._group.wait(max(deadline - time.monotonic(), 0.0)):
                    raise AttachRefused(f"run {self.run_id!r}: the first process's attach did not end; try again")
            gone = self._drop_gone()
            founder = not self.members
            self._founding = founder
            starts = founder and not self._has_state  # the run's first step is taken here
            if not founder:
                self.members.append(s)
                if time.monotonic() < self._forming_until:
                    self._group.notify_all()  # the group forms: its epoch takes this process too
                else:
                    self._new_epoch(f"process {pid} joins")
        if founder:
            try:
                upload = self._found(s, step, gone, group_size)
            finally:
                with self._group:
                    self._founding = False
                    self._group.notify_all()
        else:
            upload = False
            logger.info(
                "run %s: process %d (%s) joins the local group at step %d", self.run_id, pid, device, self.global_step
            )
        with self._group:  # the group's first processes: until all expected are here, or the wait's end
            self._group.wait_for(
                lambda: time.monotonic() >= self._forming_until or len(self.members) >= self._expected,
                timeout=max(self._forming_until - time.monotonic(), 0.0),
            )
            if self._forming_until:  # formed: the leases run from now (the processes renew once answered)
                self._forming_until = 0.0
                for m in self.members:
                    m.renewed = time.monotonic()
                self._group.notify_all()
            if self.span is not None:
                self._group.wait_for(lambda: self._placed(s) or s not in self.members, timeout=PLACE_WAIT)
                # Not a script run's creator uploading: the others' attaches wait for its upload.
                if starts and self.global_step == 0 and (not upload or self.FIRST_ALIKE):
                    self._assemble(s)
            if s not in self.members:
                raise AttachRefused(f"run {self.run_id!r}: the attachment ended while it formed; attach again")
            self._refit()
            return AttachInfo(
                s.token,
                str(self._shared.path),
                self.numel,
                self.global_step,
                self.phases,
                self.lease_seconds,
                self.phase_timeout,
                upload,
                self._slot(s),
                self.fitted_steps,
            )

    def _found(self, s: Session, step: int, gone: list[Session], group_size: int) -> bool:
        """The run's first live process: the run's state for it (and its group). Returns `upload`."""
        with self._lock:
            if gone:  # the last processes went without the watch seeing it
                self._end_session("another process attaches", gone[0])
            # The vector holds what the last process wrote at its last EndPhase: a move since then is
            # added, whether that process took it into its own parameters or not.
            self._settle(taken=0)
            upload = False
            if not self._has_state:
                if not self._download(0, ATTACH_PATIENCE if not self.creator else 0.0):
                    if not self.creator:
                        raise AttachRefused(
                            f"no peer served run {self.run_id!r}'s state within {ATTACH_PATIENCE:.0f} s, and this daemon did "
                            "not create the run: the process must start from the run's parameters; try again"
                        )
                    upload = True
            else:
                self._catch_up()
            if step > self.global_step:  # a restart from an older checkpoint: the run's step goes on
                self.global_step = step
            self._shared.set_count(PHASE_STEPS_OFFSET, 0)
            with self._group:
                # Its lease runs from now: the download above held its attach (10 s from a frozen
                # donor in bench.churn), and the watch would end the session as soon as it joined.
                s.renewed = time.monotonic()
                self.members = [s]
                self._expected = max(group_size, 1)
                self._forming_until = time.monotonic() + GROUP_FORM_WAIT if group_size > 1 else 0.0
                self._new_epoch(f"process {s.pid} attaches")
            self.state = TrainState.TRAINING
            self.error = self._passed_over
            self._publish_theta()
        self._phase_began = time.monotonic()
        self._announce()
        logger.info(
            "run %s: process %d attached (%s) at step %d%s",
            self.run_id,
            s.pid,
            s.device,
            self.global_step,
            "; it uploads the run's first parameters" if upload else "",
        )
        return upload

    # -- the local group (under _group) ---------------------------------------------------------

    def _slot(self, s: Session) -> GroupSlot:
        i, p = self.members.index(s), self._placement
        if self.span is None:
            store = str(self._shared.store(self.group_epoch))
            return GroupSlot(self.group_epoch, i, len(self.members), store, hands_over=i == 0)
        if p is None or p.epoch <= self._after:  # none yet, or one this daemon asked to move past
            return GroupSlot(self.group_epoch, -1, 0, "")
        rank = p.base + i if i < p.procs else -1
        if not p.spans:  # this daemon's processes alone: they meet on a file, as without a span
            return GroupSlot(p.epoch, rank, p.size, str(self._shared.store(p.epoch)), hands_over=i == 0)
        return GroupSlot(p.epoch, rank, p.size, p.store, self.span.host, True, hands_over=i == 0)

    def _assemble(self, s: Session) -> None:
        """The run's first step in a spanning group under --min-peers waits (at most PLACE_WAIT s)
        until the group's epoch holds every daemon of the label that announces training
        (`span.awaited`): daemons whose processes attach a beat apart would otherwise train apart,
        the first alone, until the next phase's regroup. The process waits in its attach meanwhile,
        so its lease is renewed here while it lives. Under _group."""
        deadline = time.monotonic() + PLACE_WAIT
        while s in self.members and (left := deadline - time.monotonic()) > 0:
            p = self._placement
            if self._placed(s) and len(p.daemons) > self.span.awaited():
                return
            if not s.pid or pid_alive(s.pid):
                s.renewed = time.monotonic()
            self._group.wait(min(left, ASSEMBLE_POLL))
        if s in self.members:
            logger.info("run %s: the local group's first epoch did not take every daemon training", self.run_id)

    def _placed(self, s: Session) -> bool:
        """Whether member `s` has a rank in the spanning group's current epoch (one after the epoch
        this daemon last asked to move past: the one before holds members that are gone)."""
        p = self._placement
        return p is not None and self._after < p.epoch == self.group_epoch and s in self.members[: p.procs]

    @property
    def follows(self) -> bool:
        """In a spanning group another daemon leads: it averages on the WAN, this one takes its θ.
        Before the first placement: whether another daemon coordinates (it leads once it has a
        process), so that the peers never plan rounds with a daemon about to follow."""
        if self._placement is not None:
            return self._placement.base > 0
        return self.span is not None and self.span.coordinator not in ("", self.span.peer_id)

    @property
    def role(self) -> str:
        """The role this daemon announces for the run while a process is attached."""
        return FOLLOWER if self.follows else TRAINER

    @property
    def local_group(self) -> SpanView | None:
        """What status shows of a spanning group (None: no --local-group)."""
        p = self._placement
        if self.span is None:
            return None
        if p is None:
            return SpanView(self.span.label, 0, -1, "not placed by the group's coordinator yet")
        why = "leads: averages the group on the WAN" if p.base == 0 else f"follows {p.daemons[0]}"
        how = "by links, " if self.span.label == AUTO else ""
        return SpanView(self.span.label, p.size, p.base, f"{how}epoch {p.epoch}: {len(p.daemons)} daemon(s); {why}")

    def _lane_place(self) -> tuple[int, tuple[str, ...]] | None:
        """In a spanning group whose run has lanes (peers/dear/delegate.py): this daemon's index in the
        epoch's daemons (the leading one first), and those daemons; None otherwise. One place for
        what lane_owners, owned and delegation derive."""
        p = self._placement
        if p is None or not p.spans or self.lanes < 2 or self.span is None or self.span.peer_id not in p.daemons:
            return None
        return p.daemons.index(self.span.peer_id), tuple(p.daemons)

    def lane_owners(self) -> list[tuple[str, tuple[int, ...]]]:
        """(peer ID, the lanes it averages) of each daemon of the spanning group this daemon leads;
        [] where it leads none or the run has one lane (the leader averages everything)."""
        if (place := self._lane_place()) is None or self._placement.base > 0:
            return []
        daemons = place[1]
        return [(peer, owned_lanes(self.lanes, len(daemons), j)) for j, peer in enumerate(daemons)]

    def owned(self) -> tuple[int, ...]:
        """The lanes this daemon averages for its spanning group ((): none, or no such group)."""
        if (place := self._lane_place()) is None:
            return ()
        j, daemons = place
        return owned_lanes(self.lanes, len(daemons), j)

    @property
    def delegation(self) -> tuple[int, str]:
        """What the heartbeat announces of the lanes: those the group's other daemons average for this
        one (a bit mask), and the group's ID; (0, "") where this daemon averages every lane it
        averages at all (no spanning group with lanes, or one that gives this daemon none)."""
        if (place := self._lane_place()) is None or not self.owned():
            return 0, ""
        j, daemons = place
        return delegated_mask(self.lanes, len(daemons), j), group_id(daemons)

    @property
    def wan_share(self) -> float:
        """The share of the run's vector this daemon averages on the WAN: all of it alone or leading a
        group of one lane, none following one, its lanes' share in a group of several lanes."""
        if self.owned():
            return len(self.owned()) / self.lanes
        return 0.0 if self.follows else 1.0

    def serving(self, round_t: int) -> None:
        """The group's leader asked this daemon to average its lanes of round `round_t`: the group
        has reached that round's boundary (live_step says so to the lanes' mates)."""
        self._lanes_step = max(self._lanes_step, self.phases.end(round_t))

    def served(self, result: RoundResult) -> None:
        """A round of a lane this daemon averaged for its group's leader (daemon/groupspan.serve_lanes):
        counted here, and what status shows of a follower's rounds."""
        self.last_round = result
        self.on_round(result)

    def spanned(self) -> tuple[int, int]:
        """For the span's beat: the attached processes, and the epoch to move past."""
        return len(self.members), self._after

    def placed(self, p: Placement) -> None:
        """The span's coordinator placed this daemon in epoch `p` (from the span's thread)."""
        with self._group:
            lanes = self.delegation
            self._placement, self.group_epoch = p, p.epoch
            self._shared.set_group_epoch(p.epoch)
            self._shared.store(p.epoch - 2).unlink(missing_ok=True)
            self._group.notify_all()
            active = bool(self.members)
        if self.follows:
            self.snapshot = None  # a follower holds θ without the run's momentum: not served to joiners
        # Against the role announced, not the one `follows` gave a moment ago: before the first
        # placement that follows the coordinator, which may have changed since the attach announced
        # (a group whose first epoch holds two daemons at once: the follower stayed a "trainer" to
        # its peers, who planned it as a mate at every round and waited for it).
        if active and (self.role != self._announced or self.delegation != lanes):
            self._announce()  # announced now: peers plan this round's lanes from it
        logger.info(
            "run %s: local group epoch %d: ranks %d..%d of %d, %s",
            self.run_id,
            p.epoch,
            p.base,
            p.base + p.procs - 1,
            p.size,
            "led by this daemon" if p.base == 0 else f"led by {p.daemons[0][-8:]}",
        )

    def _member(self, token: str) -> Session:
        for m in self.members:
            if m.token == token:
                return m
        raise SessionLost(
            f"no attachment {token[:8]}… to run {self.run_id!r}: its lease lapsed or the daemon restarted"
        )

    def _gone(self, m: Session) -> str:
        """Why member `m` is gone ("" while it lives; its lease waits while the group forms)."""
        now = time.monotonic()
        if now - m.renewed > self.lease_seconds and now >= self._forming_until:
            return "its lease lapsed"
        if m.pid and not pid_alive(m.pid):
            return f"process {m.pid} exited"
        return ""

    def _drop_gone(self) -> list[Session]:
        """Take the members that are gone out of the group (a new epoch where some remain)."""
        gone = [m for m in self.members if self._gone(m)]
        if gone:
            self.members = [m for m in self.members if m not in gone]
            if self.members:
                self._new_epoch(f"{len(gone)} process(es) gone")
        return gone

    def _new_epoch(self, why: str) -> None:
        if self.span is not None:  # the span's coordinator numbers the epochs: ask it for the next
            self._after = self.group_epoch
            logger.info("run %s: local group: %d process(es) here (%s)", self.run_id, len(self.members), why)
            return
        self.group_epoch += 1
        self._shared.set_group_epoch(self.group_epoch)
        # The epoch before last is over: its members have formed the last one or given it up.
        self._shared.store(self.group_epoch - 2).unlink(missing_ok=True)
        self._group.notify_all()
        logger.info(
            "run %s: local group epoch %d: %d process(es) %s (%s)",
            self.run_id,
            self.group_epoch,
            len(self.members),
            [m.pid for m in self.members],
            why,
        )

    def regroup(self, token: str, epoch: int) -> GroupSlot:
        """A member's group broke (a collective failed) or changed: its place in an epoch after
        `epoch`. Where the daemon's epoch is still `epoch`, the members gone are taken out and a new
        epoch begins with the rest (a member alive but stuck is taken out when its lease lapses)."""
        with self._group:
            s = self._member(token)
            if self.group_epoch <= epoch:
                self._drop_gone()
                if self.group_epoch <= epoch:
                    self._new_epoch(f"process {s.pid}'s group broke")
            if self.span is not None:  # bounded: a slot not placed makes the process ask again
                self._group.wait_for(
                    lambda: (self.group_epoch > epoch and self._placed(s)) or s not in self.members,
                    timeout=PLACE_WAIT,
                )
            return self._slot(s)

    @property
    def phase_timeout(self) -> float:
        """What one EndPhase may take: a round (or the previous one, with overlap) and a download."""
        return 2 * self.round_timeout + CATCH_UP_PATIENCE + 30.0

    def renew(self, token: str, samples: float | None = None, loss: float = math.nan, boundary: int = 0) -> None:
        """The process is alive; with `samples`, a Renew's progress of the phase ending at the run's
        step `boundary` (0: not said), taken if that is the phase under way. Raises ValueError
        (nothing changes, the lease included) for samples that are not a count."""
        if samples is not None and not (math.isfinite(samples) and samples >= 0):
            raise ValueError(f"samples must be a finite count, 0 or more; got {samples}")
        with self._group:
            s = self._member(token)
            s.renewed = time.monotonic()
            leader = s is self.members[0]
        # The leader's progress is the group's (its steps and samples are the group's; a follower's
        # samples are counted by the leading daemon); a Renew during an EndPhase is the old phase's.
        under_way = not boundary or boundary == self.phases.next_end(self.global_step)
        if samples is not None and leader and under_way and not self._lock.locked():
            self._live = (0.0 if self.follows else samples, loss)

    def detach(self, token: str) -> None:
        with self._lock:
            with self._group:
                s = next((m for m in self.members if m.token == token), None)
                if s is None:
                    return
                if len(self.members) > 1:
                    self.members.remove(s)
                    self._new_epoch(f"process {s.pid} detached")
                    return
            self._end_session("the process detached")

    async def end_phase(
        self,
        token: str,
        steps: int,
        samples: float,
        loss: float,
        compute_seconds: float,
        boundary: int = 0,
        group_step: int = 0,
    ) -> PhaseEnd:
        """The process ended an inner phase of `steps` steps whose end is the run's step `boundary`
        (0: not said); the leader's parameters are in the vector. Another member of the local group
        waits for the leader's EndPhase of that boundary and gets its answer. `group_step`: a spanning
        group's leader (on another daemon) reached that step; the vector holds the run's θ there.
        On the daemon's loop: the round is awaited here."""
        followed = await asyncio.to_thread(self._follower_end, token, boundary)
        if followed is not None:
            return followed
        if group_step:
            return await asyncio.to_thread(self._take_group, group_step, steps, loss, compute_seconds)
        began = time.monotonic()
        async with self._held():
            early, end = await asyncio.to_thread(
                self._phase_ends, token, steps, samples, loss, boundary, compute_seconds
            )
            if early:
                return end
            if end is None:
                end = await self._round()
            end = await asyncio.to_thread(self._phase_closed, end)
        self._phase_began = time.monotonic()
        wall = self._phase_began - began
        self.compute_seconds += compute_seconds
        self.train_wait_seconds += wall
        self.samples_per_second = samples / max(compute_seconds + wall, 1e-9)
        self._refit()
        return end

    @contextlib.asynccontextmanager
    async def _held(self):
        """The trainer's lock, taken on the loop without blocking it: its other holders (attach,
        detach, a lease's end, a stop) run in worker threads, for bounded work."""
        while not self._lock.acquire(blocking=False):
            await asyncio.sleep(LOCK_POLL)
        try:
            yield
        finally:
            self._lock.release()

    def _follower_end(self, token: str, boundary: int) -> PhaseEnd | None:
        """A member other than the leader: the leader's answer for `boundary` (waited for). None for
        the leader."""
        with self._group:
            s = self._member(token)
            s.renewed = time.monotonic()
            if s is not self.members[0]:
                return self._follow(s, boundary)
        return None

    def _phase_ends(
        self, token: str, steps: int, samples: float, loss: float, boundary: int, compute_seconds: float
    ) -> tuple[bool, PhaseEnd | None]:
        """Under the lock, the leader's phase end up to its round: (True, the answer) where the
        phase ended already or was the upload; (False, the answer) where the run's state was
        downloaded instead of a round; (False, None) where the round is to run (the phase's step
        time is this daemon's pace in it)."""
        self.renew(token)
        done, last = self._ended
        if boundary and boundary <= done:  # ended already (by a leader that left since): the same answer
            return True, replace(last, group_epoch=self.group_epoch)
        if not self._has_state:  # the upload asked at attach: the process's parameters become θ
            self.algorithm.take_vector()
            self._has_state = True
            self._snapshot(self.global_step)
            self._publish_theta()
            return True, PhaseEnd(self.global_step, -1, "", 0.0, False)
        self._settle(taken=self._shared.count(APPLIED_OFFSET))
        self._shared.set_count(PHASE_STEPS_OFFSET, 0)  # the phase's steps are in global_step now
        self._count_steps(steps, compute_seconds)
        self._local_done += steps
        self._samples_done += int(samples)
        self._live = (0.0, math.nan)
        self._samples_since_round += samples
        if not math.isnan(loss):
            self._loss_done = loss
        self.global_step = self.phases.next_end(self.global_step)
        if self._catch_up():
            return False, PhaseEnd(self.global_step, -1, "state downloaded from peers", 0.0, True)
        return False, None

    def _phase_closed(self, end: PhaseEnd) -> PhaseEnd:
        """Under the lock, after the phase's round: a checkpoint when due, θ for the process, and the
        answer for the group's other members."""
        if self.global_step - self._checkpointed >= self.checkpoint_every:
            self._checkpoint()
        self._publish_theta()
        with self._group:
            self._ended = (self.global_step, end)
            self._group.notify_all()
            return replace(end, group_epoch=self.group_epoch)

    @property
    def fitted_steps(self) -> int:
        """average_every=auto: the steps the process's next phase takes (EndPhaseResponse.phase_steps),
        or fewer where the schedule's boundary comes first; 0 without auto."""
        return self.fitted.every if self.fitted is not None else 0

    def _count_steps(self, steps: int, compute_seconds: float) -> None:
        if steps > 0:
            self.step_seconds = compute_seconds / steps

    def _refit(self) -> None:
        """average_every=auto: decide H for the phase that begins now (daemon/plan.py fit_every). A
        phase ending at round r's boundary takes the pace its group agreed in round r - 1 (peers/pace.py),
        the last round every member holds by then, with or without overlap: the members of that group
        give the next phase the same H. Without it (no group in that round) the decision stays; the
        first one comes from this daemon's own figures."""
        if self._auto_every is None:
            return
        source = self.phases.round_of(self.global_step) - 1
        pace = self._paces.get(source)
        if pace is not None:
            fit = fit_every(pace.step_seconds, pace.round_seconds, *self._auto_every)
            fit = Fit(fit.every, f"round {source}'s group of {pace.members}: {fit.reason}")
        elif self.fitted is None:
            fit, source = fit_every(self.step_seconds, self._round_seconds(), *self._auto_every), 0
            fit = Fit(fit.every, f"this daemon's figures: {fit.reason}")
        else:
            return
        if self.fitted is None or fit.every != self.fitted.every:
            logger.info("run %s: average_every=auto: H=%d (%s)", self.run_id, fit.every, fit.reason)
        self.fitted, self.fitted_round = fit, source

    def _take_group(self, step: int, steps: int, loss: float, compute_seconds: float) -> PhaseEnd:
        """A follower's phase end: the run's θ the leader broadcast (in the vector) becomes this
        daemon's θ at the leader's step, with no round; momentum and error feedback start over (the leader holds the group's).
        The group's samples are counted once, by the leading daemon: not here. Compute waited for
        the leader's phase end for whatever of the phase's wall time it did not compute."""
        if steps:  # not an adoption at a regroup (peerd/torch.py _take_leaders)
            self.compute_seconds += compute_seconds
            self._count_steps(steps, compute_seconds)
            self.train_wait_seconds += max(time.monotonic() - self._phase_began - compute_seconds, 0.0)
        with self._lock:
            self._shared.set_count(PHASE_STEPS_OFFSET, 0)
            self._local_done += steps
            self._live = (0.0, math.nan)
            if not math.isnan(loss):
                self._loss_done = loss
            self.global_step = max(self.global_step, step)
            self.algorithm.drop_pending()
            self.algorithm.take_vector()
            self._has_state = True
            if self.global_step - self._checkpointed >= self.checkpoint_every:
                self._checkpoint()
            self._publish_theta()
            with self._group:
                end = PhaseEnd(self.global_step, -1, "follows the local group's leader", 0.0, False, self.group_epoch)
                self._ended = (self.global_step, end)
                self._group.notify_all()
        self._phase_began = time.monotonic()
        return end

    def _follow(self, s: Session, boundary: int) -> PhaseEnd:
        """Under _group: a member other than the leader at its phase's end waits for the leader's
        EndPhase of `boundary` (bounded by phase_timeout) and answers the same. Where the leader
        leaves first, the answer's step is the phase's start: regroup and end the phase again."""
        leader = self.members[0]
        ok = self._group.wait_for(
            lambda: self._ended[0] >= boundary or not self.members or self.members[0] is not leader,
            timeout=self.phase_timeout,
        )
        if s not in self.members:
            raise SessionLost(f"run {self.run_id!r}: this process left the local group (its lease lapsed)")
        if self._ended[0] >= boundary:
            return replace(self._ended[1], group_epoch=self.group_epoch)
        why = "the local group's leader left" if ok else f"no EndPhase of the leader in {self.phase_timeout:.0f} s"
        return PhaseEnd(self.global_step, -1, why, 0.0, False, self.group_epoch)

    def report_eval(self, token: str, result: EvalResult) -> None:
        """The process evaluated the run's model: status and peerd_eval_score show it."""
        self.renew(token)
        self.eval = result

    # -- rounds, downloads, checkpoints (under the lock) --------------------------------------

    def _snapshot(self, step: int) -> None:
        self.snapshot = self.algorithm.snapshot(step)

    async def _round(self) -> PhaseEnd:
        """The phase's round on the vector in the shared file, the run's algorithm's: DiLoCo's outer
        step, or the state's mean."""
        round_t = self.phases.round_of(self.global_step)
        sketched = self.algorithm.sketched()[: self._sketch_plan.size]
        self.sketches = (*self.sketches[-(HISTORY - 1) :], self._sketch_plan.take(sketched.numpy(), self.global_step))
        applied = await self.algorithm.round(round_t, self._samples_since_round)
        self._samples_since_round = 0.0  # sent (a round that raised sends them with the next)
        if applied.round_t is None:  # overlap: no round landed now (the first, or it landed as a move)
            last = self.last_round.outcome_name if self.last_round is not None else ""
            return PhaseEnd(self.global_step, -1, last, applied.waited, False)
        self._record(applied)
        return PhaseEnd(self.global_step, applied.round_t, applied.results[0].outcome_name, applied.waited, False)

    def _record(self, applied) -> None:
        results = applied.results
        alone_before = self.last_round is not None and _alone(self.last_round)
        self.last_round = first = results[0]
        # A round whose result was not applied (no group, aborted, cancelled) at INFO, with why; the
        # applied ones and a streak of rounds alone in the run (a tiny task's, many a second) at DEBUG.
        logger.log(
            logging.DEBUG if first.applied or (alone_before and _alone(first)) else logging.INFO,
            "run %s: round %d at step %d: %s, group of %d (%d planned), %.2f s, waited %.2f s%s: %s",
            self.run_id,
            first.round_t,
            self.global_step,
            first.outcome_name,
            first.group_size,
            first.planned,
            first.seconds,
            applied.waited,
            ", owed to the next" if applied.deferred else "",
            first.reason,
        )
        if results[0].pace is not None:  # the first lane's group's (with lanes, each lane has a group)
            self._paces[results[0].round_t] = results[0].pace
            for old in [r for r in self._paces if r < results[0].round_t - 2]:
                del self._paces[old]
        if any(r.applied for r in results):
            self.param_distance_to_group_mean = self.algorithm.distance
            self.samples_averaged += applied.weight
        self._snapshot(self.global_step)
        for result in results:
            if not result.delegated:  # another daemon of the group averaged it and counts it
                self.on_round(result)

    # -- landing (overlap): a round that ends between two EndPhases -----------------------------

    def _round_done(self) -> None:
        """On the loop, the round in flight ended: it lands as soon as the lock is free."""
        self._landing = asyncio.get_running_loop().create_task(self._land(), name=f"land:{self.run_id}")

    async def _land(self) -> None:
        """The round in flight ended: the outer step now, and its move to the process (LANDED). An
        EndPhase, a detach or a stop that took the lock first has landed it already: nothing to do."""
        async with self._held():
            if self._shared.theta is None:  # the daemon stopped meanwhile
                return
            try:
                await asyncio.to_thread(self._land_locked, False)
            except Exception:  # dropped: θ stays, and the process's progress counts from s as before
                logger.warning("run %s: a round in flight failed", self.run_id, exc_info=True)

    def _land_locked(self, wait: bool) -> None:
        applied = self.algorithm.outer.land_into(self._move, wait=wait)
        if applied is None:
            return
        if applied.moved:
            self._shared.write_theta(self.algorithm.outer.theta)
            self._moves += 1
            self._shared.set_count(LANDED_OFFSET, self._moves)
        self._record(applied)

    def _publish_theta(self) -> None:
        """Under the lock, the process blocked in a call: θ as it is now (a round that landed in the
        call, a download, a checkpoint loaded)."""
        if self._shared.theta is not None:  # DiLoCo's, where the parameters are not θ (`theta_apart`)
            self._shared.write_theta(self.algorithm.outer.theta)

    def _settle(self, taken: int) -> None:
        """Under the lock, the process blocked in a call: the vector it wrote accounts for `taken`
        moves; add the latest one if it did not take it. APPLIED then tells the process how many
        moves the vector it reads next holds."""
        if self._move is None:
            return
        if self._moves > self._settled and taken < self._moves:
            self._shared.tensor.add_(self._move)
        self._settled = self._moves
        self._shared.set_count(APPLIED_OFFSET, self._moves)

    def _catch_up(self) -> bool:
        """Download the run's state when live peers are two rounds ahead or more
        (daemon/straggler.catch_up_from)."""
        min_step = catch_up_from(self.global_step, self.phases, self.peer_steps())
        if min_step is None:
            return False
        logger.info(
            "run %s: at step %d, peers at %d: downloading the run's state",
            self.run_id,
            self.global_step,
            max(self.peer_steps(), default=0),
        )
        return self._download(min_step, CATCH_UP_PATIENCE)

    def _download(self, min_step: int, patience: float) -> bool:
        """Take the run's state from peers (retried once a second for `patience` s while peers are live;
        a try that brought verified chunks, resumed by the next, starts the patience again: a slow link
        is not an absent donor, and the state's size bounds the tries)."""
        if self.sync is None:
            return False
        deadline = time.monotonic() + patience
        # Where a download lands (what peers serve: 4 or 8 bytes a parameter), only while downloading.
        flat = torch.empty(len(self.algorithm.served()))
        while True:
            if self.peer_steps():
                result = self.sync(min_step, flat)
                if not result.ok and result.bytes:
                    deadline = max(deadline, time.monotonic() + patience)
                if result.ok and result.step >= min_step:
                    self.algorithm.adopt(flat)
                    self._snapshot(result.step)
                    self.global_step = max(self.global_step, result.step)
                    self.synced_from = result.step
                    self._samples_since_round, self._has_state = 0.0, True
                    logger.info(
                        "run %s: state downloaded (%s); now at step %d", self.run_id, result.reason, self.global_step
                    )
                    self.on_sync(result)
                    return True
            if time.monotonic() >= deadline or self._stopping.wait(1.0):
                return False

    def _checkpoint(self) -> None:
        state = {
            **self.algorithm.checkpoint_state(self.layout, self.local_step),
            "samples": self._samples_done,
            "local_step": self._local_done,
        }
        self.store.save(self.global_step, state, self._identity)
        self._checkpointed = self.global_step

    def _end_session(self, why: str, last: Session | None = None) -> None:
        """Under _lock: the run's last process is gone (`last`, where the group let it go already),
        or the daemon stops: land, checkpoint, announce idle."""
        if self.session is not None:  # steps computed in a phase that never ended still count (counters)
            self._local_done, self._samples_done = self.local_step, self.samples
            self._live = (0.0, math.nan)
        with self._group:
            s = self.session or last
            self.members = []
            self._group.notify_all()
        if s is None:
            return
        moves = self._moves
        if self._move is not None:
            # The round of the process's last phase lands in the checkpoint (waited for; its bridge
            # bounds it); the next attach takes its move.
            try:
                self._land_locked(wait=True)
            except Exception:
                logger.warning("run %s: the round in flight at the detach failed", self.run_id, exc_info=True)
        if self._has_state and (self.global_step > self._checkpointed or self._moves != moves):
            self._checkpoint()
        self.state = TrainState.STOPPED
        logger.info("run %s: process %d detached (%s) at step %d", self.run_id, s.pid, why, self.global_step)
        self._announce(IDLE)

    def _announce(self, role: str | None = None) -> None:
        """Hand the peers `role`, or (None) this daemon's role now, read under the lock that orders
        the announcements: nothing while no process is attached (a detach announces IDLE itself)."""
        with self._roles:
            if role is None:
                if not self.members:
                    return
                role = self.role
            self._announced = role
            self.on_role(role)

    async def _beat(self) -> None:
        """The span's beat, every groupspan.TICK s (its store operations block: in a worker thread)."""
        while True:
            try:
                await asyncio.to_thread(self.span.tick)
            except Exception:  # one failed beat must not end them
                logger.exception("run %s: the local group's beat failed", self.run_id)
            await asyncio.sleep(TICK)

    async def _watch(self) -> None:
        """End the attachment whose lease lapsed or whose process exited."""
        while True:
            await asyncio.sleep(LEASE_CHECK)
            gone = [(m, why) for m in list(self.members) if (why := self._gone(m))]
            if gone:
                await asyncio.to_thread(self._expire, gone)
            else:
                self._check_budget()

    def _check_budget(self) -> None:
        """End the attached process's phase now where its mates would otherwise round without it
        (MateWait) or the straggler budget says so (a phase that is ending already, under the lock,
        is left alone)."""
        if not self._has_state or self.session is None or self._lock.locked() or self.follows:
            return
        now, steps, done = time.monotonic(), self.peer_steps(), self.phase_steps
        boundary = self.phases.next_end(self.global_step)
        pace = (now - self._phase_began) / done if done else math.nan
        lag = LEASE_CHECK + (0.0 if math.isnan(pace) else pace)  # the next look, then the process's next step
        why = self._early.why(now, self._phase_began, self.global_step + done, boundary, pace, steps, lag)
        if not why:
            return
        if self._shared.count(END_AT_OFFSET) == boundary:  # asked already
            return
        self._shared.end_phase_at(boundary)
        logger.info(
            "run %s: the process's phase ends at step %d of %d, before step %d: %s",
            self.run_id,
            done,
            self.phases.length(self.global_step),
            boundary,
            why,
        )

    def _expire(self, gone: list[tuple[Session, str]]) -> None:
        """Members gone: the group goes on without them, or the attachment ends with the last."""
        tokens = {m.token for m, _ in gone}
        with self._group:
            if any(m.token not in tokens for m in self.members):
                before = len(self.members)
                self.members = [m for m in self.members if m.token not in tokens]
                if len(self.members) < before:
                    self._new_epoch("; ".join(f"process {m.pid}: {why}" for m, why in gone))
                return
        with self._lock:
            with self._group:  # an attach may have come meanwhile
                if not self.members or any(m.token not in tokens for m in self.members):
                    return
            self._end_session(gone[0][1])
