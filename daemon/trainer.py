"""The trainer thread: trains a `state` run's task in a named worker thread owned by the daemon, for
a run with a DeAR local group between daemons (--local-group), whose hooks on the model run here
(docs/dear.md, "In the daemon"). Every other run trains in child processes (daemon/taskchild.py,
daemon/statechild.py; docs/your-loop.md); issue 26 moves this one there too.

Compute runs in the thread so the event loop stays free for the network. The loop reads the
trainer's counters (plain attributes, written by the thread only) for status and metrics.

The run's *state vector* is one flat float32 vector: the parameters, then each parameter's
floating-point optimizer state (momentum, Adam moments) in a fixed order, the same layout on every
peer. At every phase's end (peers/phases.py) the thread copies the state into it and hands it to
`average` (a Moshpit round run on the event loop, see peers/averaging.py); a COMPLETED round's result replaces
the state, a PARTIAL one (UDP engine) replaces it where its packets arrived (the engine has already
left this daemon's own values elsewhere), an ABORTED one leaves it as it was. The vector left after each round is published as this
daemon's snapshot, which peers that fell behind download (peers/statesync.py).

Steps: `global_step` is the step of the state this daemon holds: it counts the run's synchronous
steps (every peer takes the same local steps per round, and a round only groups
peers of the same round number), jumps forward when the state is downloaded from peers, and never
goes backwards. `local_step` counts the optimizer steps this daemon computed itself.
(docs/algorithms.md)
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from enum import Enum
from typing import Callable

import torch

from peerd.daemon.checkpoint import CheckpointStore, identity_of, passed_over_error
from peerd.daemon.flat import from_flat, state_tensors, to_flat
from peerd.daemon.straggler import catch_up_from
from peerd.peers.dear.backend import CollectiveError
from peerd.peers.dear.hierarchy import LaneExchange, delegated_mask, group_id, hierarchical_round, lane_bounds
from peerd.peers.dear.member import RETUNE_EVERY, LocalGroupMember
from peerd.peers.dear.schedule import DeAR, DeARSettings
from peerd.peers.averaging import Average, RoundResult
from peerd.peers.phases import Phases
from peerd.peers.sketch import HISTORY, ParamSketch, SketchPlan
from peerd.peers.statesync import FetchResult, Snapshot
from peerd.daemon.tasks import EvalResult, Hparams, Task

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 30.0  # seconds to wait for the thread: one step, one evaluation and one checkpoint
# Seconds beyond the run's round_timeout a member of a DeAR group waits at the all-gather after the
# WAN rounds, for the members whose lanes' rounds take longest (a timed-out round is cancelled and
# restores its lane within runs.CANCEL_GRACE; the rest is skew between the members' reduce-scatters).
HIERARCHY_SLACK = 15.0
CATCH_UP_PATIENCE = 10.0  # seconds a trainer behind its peers keeps trying to download their state


class TrainState(Enum):
    LOADING = "LOADING"  # building the model, loading a checkpoint
    TRAINING = "TRAINING"  # taking optimizer steps
    FINISHED = "FINISHED"  # reached max_steps; the model is kept
    STOPPED = "STOPPED"  # stopped by leave or drain
    FAILED = "FAILED"  # the task raised; see `error`


def seed_from(*parts: str) -> int:
    """A 63-bit seed every peer derives the same way from the same strings."""
    return int.from_bytes(hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest(), "little") >> 1


def lanes_to_put_back(results: list, lanes: int) -> list[int]:
    """The lanes a round run with restore=False may have left partly written: those whose result
    ran the engine without applying its outcome, was interrupted, or is missing (an interrupted
    round answers once for every lane). A lane alone or without a group was not touched."""
    by_lane = {r.lane: r for r in results}
    return [
        lane
        for lane in range(lanes)
        if (r := by_lane.get(lane)) is None or (not r.applied and (r.outcome is not None or r.interrupted))
    ]


@torch.no_grad()
def distance(flat: torch.Tensor, tensors: list[torch.Tensor]) -> float:
    """L2 distance between the tensors and their slices of flat (no allocation beyond one tensor)."""
    total, offset = 0.0, 0
    for t in tensors:
        total += float(torch.sub(t.view(-1), flat[offset : offset + t.numel()]).square_().sum())
        offset += t.numel()
    return math.sqrt(total)


class Trainer:
    """Trains one run. Callbacks, all blocking and called from the trainer thread:
    - average(vector, weight, round_t, lanes) -> [RoundResult]: one Moshpit round per lane of the
      run's state vector (peers/averaging.py; lanes None: every lane);
    - peer_steps() -> list[int]: the global steps live peers announced in their heartbeats;
    - sync(min_step, out) -> result with .ok, .step, .reason: download the run's state vector from
      peers into `out` (peers/statesync.py);
    - on_start(): called once, as the thread is about to wait for ready_to_train;
    - ready_to_train() -> bool: polled before the first step until true or `ready_timeout`.

    With `local_group` (a LocalGroupMember, --local-group), steps run under DeAR among the group's
    members while it holds (docs/dear.md, "In the daemon"): the group forms right after a completed
    round that all its members took part in, and is dropped on a CollectiveError or when this
    daemon downloads state; training goes on alone. While it holds, the group averages over the WAN
    as one peer, each member its own lanes (peers/dear/hierarchy.py).
    """

    fitted = None  # average_every=auto's decision (daemon/attached.py): none, a state run's phases are H
    session = None  # no process attaches: the task trains in this daemon (daemon/attached.py does)

    def __init__(
        self,
        *,
        run_id: str,
        task: Task,
        hparams: Hparams,
        init_seed: int,
        peer_seed: int,
        store: CheckpointStore,
        threads: int,
        checkpoint_every: int,
        eval_every: int,
        max_steps: int,
        phases: Phases | None = None,
        lanes: int = 1,
        round_timeout: float = 30.0,
        average: Average | None = None,
        on_round: Callable[[RoundResult], None] | None = None,
        peer_steps: Callable[[], list[int]] | None = None,
        sync: Callable[[int, torch.Tensor], FetchResult] | None = None,
        on_sync: Callable[[FetchResult], None] | None = None,
        ready_to_train: Callable[[], bool] | None = None,
        ready_timeout: float = 0.0,
        local_group: LocalGroupMember | None = None,
        announce: Callable[[], object] | None = None,
        on_start: Callable[[], object] | None = None,
    ):
        self.compute_seconds = 0.0  # forward, backward and optimizer time since training began
        self.compute_steps = 0  # the steps compute_seconds covers (the checkpoint's local_step does not count)
        self.parameters = 0  # the model's parameter count, once load() built it (RunStatus.parameters)
        self.train_seconds = 0.0  # wall time since training began (TRAINING state)
        self.train_wait_seconds = 0.0  # time compute waited for averaging rounds (not measured here)
        self.local_group = local_group
        self._dear: DeAR | None = None  # active while this daemon trains in a DeAR group
        self.dear_steps = 0  # steps taken under DeAR, over every group this trainer was in
        self.dear_buckets = 0  # buckets of the active group's plan; 0 when none
        self.dear_bucket_bytes = 0  # the fusion target that plan was cut for (tuned online); 0 when none
        self._last_overlap = math.nan  # overlap ratio of the latest DeAR group, once dropped
        self.ready_to_train, self.ready_timeout = ready_to_train, ready_timeout
        self.run_id, self.task, self.hparams = run_id, task, hparams
        self.phases, self.average = phases, average  # phases None: no rounds
        self.lanes, self.round_timeout = lanes, round_timeout
        self._exchange: LaneExchange | None = None  # the active DeAR group's buffers around its WAN rounds
        # Set by the trainer thread as a DeAR group forms and drops, each replaced as a whole; read by
        # the heartbeat (it tells peers to leave this daemon out of the lanes its group's other
        # members average for it), status and metrics.
        self.delegation: tuple[int, str] = (0, "")  # (delegated lanes as a bit mask, group_id); (0, "") alone
        self.wan_share = 1.0  # the fraction of the state vector this daemon averages over the WAN
        self.announce = announce or (lambda: None)  # heartbeat now (non-blocking): the delegation changed
        self.on_start = on_start or (lambda: None)  # announce "trainer" now (non-blocking)
        self.on_round = on_round or (lambda result: None)
        self.peer_steps, self.sync = peer_steps or (lambda: []), sync
        self.on_sync = on_sync or (lambda result: None)
        self.last_round = None  # the RoundResult of the latest averaging round
        self.param_distance_to_group_mean = math.nan  # at the last completed round, just before it
        # The parameters' sketches just before the latest rounds (peers/sketch.py), oldest first, at
        # most HISTORY, replaced as a whole: the heartbeat publishes the newest, and each is compared
        # with the peers' sketches of its step.
        self.sketches: tuple[ParamSketch, ...] = ()
        self._sketch_plan: SketchPlan | None = None
        self.snapshot: Snapshot | None = None  # the state vector served to peers; replaced, never changed
        self._flat: torch.Tensor | None = None  # reused by every round: no allocation per round
        self._tensors: list[torch.Tensor] = []
        self._n_params = 0  # the first _n_params state tensors are the parameters
        self._samples_since_round = 0
        self.init_seed, self.peer_seed = init_seed, peer_seed
        self.store = store
        self._identity: dict = {}  # what this run's checkpoints hold (daemon/checkpoint.py), set at load
        self._loaded: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None  # by load()
        self.threads, self.checkpoint_every, self.eval_every, self.max_steps = (
            threads,
            checkpoint_every,
            eval_every,
            max_steps,
        )
        self.state = TrainState.LOADING
        self.global_step = 0
        self.local_step = 0
        self.resumed_from = 0
        self.synced_from = 0  # global step of the last state downloaded from peers (0: never)
        self.loss = math.nan
        self.samples = 0
        self.samples_averaged = 0.0  # samples of phases a round with mates applied (RunStatus.samples_averaged)
        self.samples_per_second = 0.0
        self.eval: EvalResult | None = None
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"trainer:{run_id}", daemon=True)

    @property
    def dear_overlap_ratio(self) -> float:
        """Communication hidden behind compute in the active (else the latest) DeAR group; NaN before one."""
        dear = self._dear
        return dear.overlap_ratio if dear is not None else self._last_overlap

    @property
    def step(self) -> int:
        return self.global_step

    @property
    def live_step(self) -> int:
        """What the heartbeat announces: the thread's global step moves with every step."""
        return self.global_step

    @property
    def compute_fraction(self) -> float:
        """Compute time over wall time since training began; NaN before the first step."""
        return self.compute_seconds / self.train_seconds if self.train_seconds > 0 else math.nan

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Ask the thread to stop after its current step (it then checkpoints), and join it."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("run %s: trainer did not stop within %.0f s", self.run_id, timeout)

    def load(self) -> None:
        """Build the model and load the newest checkpoint of this run's identity (_resume). Blocking:
        the daemon runs it in a worker thread before start(), so that status and peerd_train_step
        show the restored step from their first answer; the trainer thread loads if it was not done.
        A failure is recorded (state FAILED, `error`), not raised."""
        if self._loaded is not None or self.state is TrainState.FAILED:
            return
        try:
            torch.set_num_threads(self.threads)
            model, optimizer = self._resume()
            self._tensors, self._n_params = state_tensors(optimizer)
            # What a round averages and what a download lands in: the state vector.
            self._flat = torch.empty(sum(t.numel() for t in self._tensors), dtype=torch.float32)
            self.parameters = sum(t.numel() for t in self._tensors[: self._n_params])
            self._sketch_plan = SketchPlan.for_run(self.run_id, self.parameters)
            self._loaded = (model, optimizer)
        except Exception as e:  # a task bug must not take the daemon down; it is shown in status
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        logger.exception("run %s: trainer failed", self.run_id)
        self.error = f"{type(e).__name__}: {e}"
        self.state = TrainState.FAILED

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # also in this thread, if another one loaded
        self.load()
        if self._loaded is None:
            return
        try:
            self._train(*self._loaded)
        except Exception as e:  # a task bug must not take the daemon down; it is shown in status
            self._failed(e)

    def _resume(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The task's model and optimizer, loaded from the newest checkpoint of this run's identity
        (run, task, hyper-parameters, model layout; whatever manifest wrote it). Newer checkpoints
        of another identity are left on disk and named in one log line and in status (`error`)."""
        model, optimizer = self.task.build(self.hparams, self.init_seed)
        hparams = {k: str(v) for k, v in self.hparams.to_dict().items()}  # as the manifest writes them
        self._identity = identity_of(self.run_id, self.task.name, hparams, model)
        checkpoint = self.store.load_latest(self._identity)
        passed = list(self.store.passed_over)
        if checkpoint is not None:
            try:
                # One without a model (a DiLoCo child's: the run ID reused) leaves the first state,
                # as daemon/statechild.py does.
                if "model" in checkpoint.state:
                    model.load_state_dict(checkpoint.state["model"])
                    optimizer.load_state_dict(checkpoint.state["optimizer"])
            except (KeyError, RuntimeError, ValueError) as e:  # a layout check passed, torch disagreed
                passed.append((checkpoint.path, f"{type(e).__name__}: {str(e)[:200]}"))
                checkpoint, (model, optimizer) = None, self.task.build(self.hparams, self.init_seed)
        if checkpoint is not None:
            self.global_step = self.resumed_from = checkpoint.step
            self.local_step = checkpoint.state.get("local_step", checkpoint.step)
            self.samples = checkpoint.state.get("samples", 0)
            old = "" if checkpoint.identity is not None else " (an older release's file: matched by model layout only)"
            logger.info("run %s: resumed from checkpoint at step %d%s", self.run_id, self.global_step, old)
        if passed:
            self.error = passed_over_error(passed, checkpoint)
            logger.warning("run %s: %s", self.run_id, self.error)
        return model, optimizer

    def _train(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        data = self.task.data(self.hparams, self.peer_seed)
        if self.local_group is not None:  # listening early: its address reaches the peers' tables meanwhile
            self.local_group.prepare()
        self.on_start()
        if self.ready_to_train is not None:  # e.g. enough peers: a lone creator would run ahead
            deadline = time.monotonic() + self.ready_timeout
            while not self.ready_to_train() and time.monotonic() < deadline and not self._stop.wait(0.2):
                pass
        self._catch_up()  # a late joiner or a restart whose checkpoint is older than the run
        self.state = TrainState.TRAINING
        window_start, window_samples = time.monotonic(), 0
        began = time.monotonic()
        while not self._stop.is_set():
            if self.max_steps and self.global_step >= self.max_steps:
                break
            step_began = time.monotonic()
            self.train_seconds = step_began - began
            batch = next(data)
            model.train()
            if self._dear is not None:
                try:  # the all-gathers of the previous step are awaited in the forward's pre-hooks
                    loss = self.task.loss(model, batch)
                    loss.backward()  # each bucket's reduce-scatter starts from the backward hooks
                    self._dear.step()  # every RETUNE_EVERY steps it also re-tunes the buckets (all members at once)
                except CollectiveError as e:  # the step is lost; the next one runs alone
                    self._leave_group(f"DeAR step failed: {e}")
                    continue
                self.dear_steps += 1
                self.dear_buckets, self.dear_bucket_bytes = (
                    len(self._dear.plan.buckets),
                    int(self._dear.plan.bucket_bytes),
                )
            else:
                loss = self.task.loss(model, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            self.compute_seconds += time.monotonic() - step_began
            self.compute_steps += 1
            self.global_step += 1
            self.local_step += 1
            self.samples += batch.samples
            self._samples_since_round += batch.samples
            window_samples += batch.samples
            self.loss = float(loss.detach())  # CPU tensors: no device sync to avoid
            elapsed = time.monotonic() - window_start
            if elapsed >= 2.0:
                self.samples_per_second = window_samples / elapsed
                window_start, window_samples = time.monotonic(), 0
            elif not self.samples_per_second and elapsed >= 0.25:  # a first figure before the first window ends
                self.samples_per_second = window_samples / elapsed
            if self.average is not None and self._at_boundary():
                self._flush()
                if self._catch_up():  # a round among peers far ahead would find nobody
                    self._leave_group("state downloaded from peers")
                else:
                    self._average_round(model, optimizer)
            if self.global_step % self.eval_every == 0:
                self._flush()
                self._evaluate(model)
            if self.global_step % self.checkpoint_every == 0:
                self._flush()
                self._checkpoint(model, optimizer)
        self._flush()
        self._leave_group("training ended", rearm=False)
        if self.eval is None or self.global_step % self.eval_every:  # the model as it ends
            self.eval = self.task.evaluate(model, self.hparams)
        if self.global_step > self.resumed_from:
            self._checkpoint(model, optimizer)
        # Last: a run resumed at max_steps is FINISHED only once its evaluation is in status too.
        self.state = (
            TrainState.FINISHED if self.max_steps and self.global_step >= self.max_steps else TrainState.STOPPED
        )

    def _evaluate(self, model: torch.nn.Module) -> None:
        self.eval = self.task.evaluate(model, self.hparams)

    def _flush(self) -> None:
        """Apply DeAR's pending updates before the state is read (a round, evaluation, checkpoint)."""
        if self._dear is not None:
            try:
                self._dear.flush()
            except CollectiveError as e:
                self._leave_group(f"DeAR flush failed: {e}")

    def _regroup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, results: list) -> None:
        """After a round this daemon averaged alone (every lane): form the DeAR group if every lane's
        round completed with every member of the local group in it, which leaves them all with the
        same state. (A group that holds is kept or dropped by its hierarchical round.)"""
        if self.local_group is None or self._dear is not None:
            return
        if len(results) != self.lanes or not all(r.completed for r in results):
            return
        round_members = set.intersection(*(set(r.outcome.members) for r in results))
        collective = self.local_group.try_form(round_members)
        if collective is not None:
            self._dear = DeAR(model, optimizer, collective, DeARSettings(retune_every=RETUNE_EVERY))
            self.dear_buckets, self.dear_bucket_bytes = len(self._dear.plan.buckets), int(self._dear.plan.bucket_bytes)
            lg = self.local_group
            self._exchange = LaneExchange(self._flat.numel(), self.lanes, lg.size)
            self.wan_share = self._exchange.share(lg.rank)
            self.delegation = (delegated_mask(self.lanes, lg.size, lg.rank), group_id(lg.members))
            self.announce()

    def _leave_group(self, reason: str, rearm: bool = True) -> None:
        """Stop training under DeAR (hooks removed, engine closed); with `rearm`, a fresh engine
        listens for a later formation, else the local group is closed for good."""
        if self._dear is not None:
            self._last_overlap = self._dear.overlap_ratio
            try:
                self._dear.close()  # flushes first unless it failed; the hooks go in any case
            except CollectiveError:
                pass
            self._dear, self.dear_buckets, self.dear_bucket_bytes, self._exchange = None, 0, 0, None
            self.delegation, self.wan_share = (0, ""), 1.0
            self.announce()
            logger.info("run %s: training on without the DeAR group: %s", self.run_id, reason)
        if self.local_group is None:
            return
        if rearm:
            self.local_group.drop(reason)
        else:
            self.local_group.close()

    def _catch_up(self) -> bool:
        """Download the run's state when live peers are two rounds ahead or more
        (daemon/straggler.catch_up_from); True if it did. A failed download is retried, once a
        second, for at most CATCH_UP_PATIENCE seconds."""
        if self.sync is None or self.phases is None:
            return False
        deadline = time.monotonic() + CATCH_UP_PATIENCE
        result = None
        while (min_step := catch_up_from(self.global_step, self.phases, self.peer_steps())) is not None:
            if result is None:
                logger.info(
                    "run %s: at step %d, peers at %d: downloading the run's state",
                    self.run_id,
                    self.global_step,
                    max(self.peer_steps()),
                )
            result = self.sync(min_step, self._flat)
            if result.ok and result.step >= min_step:
                from_flat(self._flat, self._tensors)
                self.snapshot = Snapshot(result.step, self._flat.clone())
                self.global_step = self.synced_from = result.step
                self._samples_since_round = 0
                logger.info(
                    "run %s: state downloaded (%s); now at step %d", self.run_id, result.reason, self.global_step
                )
                self.on_sync(result)
                return True
            if time.monotonic() > deadline or self._stop.wait(1.0):
                break
        if result is not None:
            logger.info("run %s: state download failed (%s); training on", self.run_id, result.reason)
            self.on_sync(result)
        return False

    @torch.no_grad()
    def _average_round(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """One averaging round: alone, every lane of the state vector in Moshpit rounds (one per
        lane); in a DeAR group, the group's hierarchical round (peers/dear/hierarchy.py): this
        daemon averages its own lanes for the whole group, between a reduce-scatter and an
        all-gather within it. Then form a DeAR group where the rounds allow it."""
        to_flat(self._tensors, self._flat)
        # Before the round, when peers have drifted furthest and all stand at this same step.
        sketch = self._sketch_plan.take(self._flat[: self._sketch_plan.size].numpy(), self.global_step)
        self.sketches = (*self.sketches[-(HISTORY - 1) :], sketch)
        round_t, weight = self.phases.round_of(self.global_step), float(self._samples_since_round)
        lg, gathered, broke = self.local_group, False, ""
        if self._dear is not None and lg is not None and self._exchange is not None:
            done = hierarchical_round(
                self._dear.collective,
                self._exchange,
                lg.rank,
                self._flat,
                weight,
                lambda vector, w, lanes: self.average(vector, w, round_t, lanes),
                gather_timeout=self.round_timeout + HIERARCHY_SLACK,
            )
            results, gathered, broke = done.results, done.gathered, done.error
        else:
            # restore=False: the engine keeps no backup of the vector (a copy of it per round); a
            # lane it may have left partly written is copied again from the model, which holds its
            # old value.
            results = self.average(self._flat, weight, round_t, None, restore=False)
            bounds = lane_bounds(self._flat.numel(), self.lanes)
            for lane in lanes_to_put_back(results, self.lanes):
                to_flat(self._tensors, self._flat, *bounds[lane])
        applied = gathered or any(r.applied for r in results)
        previous = self.last_round
        # Status shows the round of this daemon's first lane (or that its group averaged them all).
        self.last_round = (
            results[0]
            if results
            else RoundResult(
                round_t,
                lg.size if lg else 1,
                None,
                "every lane averaged by the local group's other members",
                delegated=True,
            )
        )
        self._log_incomplete(results, previous, round_t)
        if applied or broke:  # a broken hierarchical round may still have changed this member's lanes
            # Before the result replaces them: how far this member's parameters were from the mean.
            if applied:
                self.param_distance_to_group_mean = distance(self._flat, self._tensors[: self._n_params])
            from_flat(self._flat, self._tensors)
        if applied:
            self.samples_averaged += weight
            self._samples_since_round = 0  # otherwise they count toward the next round's weight
        # What peers download: the group's mean after a completed round (the same bytes on every
        # member, so several donors can serve it), else this daemon's own state (after a PARTIAL
        # round: the result where it arrived, its own values elsewhere).
        self.snapshot = Snapshot(self.global_step, self._flat.clone())
        for result in results:
            self.on_round(result)
        if broke:
            self._leave_group(f"local group's round {round_t}: {broke}")
        elif gathered and lg is not None and lg.outdated(lg.members):
            # Every member decides this from the same records: they drop the group together (one that
            # did not would fail its next DeAR op at once), and a later round forms the new one.
            self._leave_group(f"the local group's decision changed: {lg.last_reason}")
        else:
            self._regroup(model, optimizer, results)

    def _at_boundary(self) -> bool:
        """Whether the global step is at a phase's end (the thread's step counts one by one)."""
        return self.phases.end(self.phases.round_of(self.global_step)) == self.global_step

    def _log_incomplete(self, results: list, previous, round_t: int) -> None:
        """Say why a round did not complete. A peer alone runs a round every few milliseconds: the
        reason is logged when it changes, not every time."""
        if all(r.completed for r in results):
            return
        reason = "; ".join(f"lane {r.lane}: {r.reason}" if self.lanes > 1 else r.reason for r in results)
        same = previous is not None and previous.reason == self.last_round.reason
        (logger.debug if same else logger.info)(
            "run %s: round %d at step %d not completed: %s", self.run_id, round_t, self.global_step, reason
        )

    def _checkpoint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "samples": self.samples,
            "local_step": self.local_step,
        }
        self.store.save(self.global_step, state, self._identity)
