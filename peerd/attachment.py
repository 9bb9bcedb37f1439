"""One training process's attachment to its local daemon: the control calls, the shared vector, the
lease. Framework-free below the torch tensor over the shared file (peerd/torch.py builds on it).

The daemon's half is daemon/attached.py; the protocol is in protos/control.proto (Attach, EndPhase,
Renew, Detach). Every call is bounded: Attach by `attach_timeout` (it may download the run's state
from peers), EndPhase by the daemon's `phase_timeout` (a round, or a download, plus slack), Renew by
RENEW_TIMEOUT. A daemon that goes away (restart, crash) is waited for, re-reading its control
address from its data dir, for at most `reconnect_timeout` seconds; then PeerdError says so.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import tenacity
import torch

from peerd import PeerdError
from peerd.peers.phases import Phases
from peerd.protos import control_pb2, control_pb2_grpc
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

THETA_TRIES = 1000  # copies of θ begun before one is taken whole (a write takes milliseconds)
RENEW_TIMEOUT = 5.0  # seconds for one Renew
RETRY_EVERY = 1.0  # seconds between two tries to reach a daemon that is away
# Codes that mean "this attachment is gone, attach again": the daemon restarted or is restarting,
# or the lease lapsed. Anything else is the daemon's answer to what was asked, and is raised.
AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED)


class Lost(Exception):
    """The attachment ended (daemon restarted, lease lapsed): attach again."""


def control_address(daemon: str | os.PathLike | None, control: str | None) -> str:
    """`control` as given, else the address in the data dir's ready.json, else its unix socket."""
    if control:
        return control
    from peerd.daemon.client import control_address as from_data_dir

    if daemon is None:
        raise PeerdError("say which daemon: daemon=its --data-dir, or control=its control address")
    return from_data_dir(Path(daemon))


@dataclass(frozen=True, slots=True)
class Slot:
    """This process's place in its daemon's local group (control.proto LocalGroup)."""

    epoch: int
    rank: int  # -1: not placed in this epoch yet (regroup)
    size: int
    store: str  # the epoch's rendezvous: a torch.distributed.FileStore's file, or "tcp://host:port"
    host: str = "127.0.0.1"  # where this process's Gloo connections listen
    spans: bool = False  # the group's processes attach to several daemons (daemon/groupspan.py)
    hands_over: bool = True  # this process hands the group's phases to its own daemon

    @classmethod
    def of(cls, group: control_pb2.LocalGroup) -> "Slot":
        return cls(
            group.epoch,
            group.rank,
            max(group.size, 1),
            group.store,
            group.host or "127.0.0.1",
            group.spans,
            group.hands_over or group.rank == 0,
        )


@dataclass(frozen=True, slots=True)
class Attached:
    session: str
    vector: torch.Tensor  # float32, numel values in layout order, over the shared file
    theta: torch.Tensor | None  # format 2 (overlap, ARC-Top-K): the run's parameters θ, as the daemon last wrote them
    step: int
    phases: Phases  # where the run's phases end (its average_every and first_phase)
    lease_seconds: float
    phase_timeout: float
    upload: bool
    group: Slot
    phase_steps: int = 0  # average_every=auto: the steps the first phase takes (0: the schedule's)


class Attachment:
    """Attach, end phases, renew the lease from a named background thread, detach."""

    def __init__(
        self,
        *,
        run: str,
        daemon,
        control: str | None,
        layout: list[control_pb2.TensorSpec],
        settings: dict[str, str],
        device: str,
        attach_timeout: float,
        reconnect_timeout: float,
        group_size: int = 1,
    ):
        self.run, self.daemon, self.control = run, daemon, control
        self.group_size = group_size  # processes of this machine expected in the local group
        self.layout, self.settings, self.device = layout, settings, device
        self.attach_timeout, self.reconnect_timeout = attach_timeout, reconnect_timeout
        self.current: Attached | None = None
        self.lost = threading.Event()  # set by the lease thread: attach again before the next hand-off
        self._channel: grpc.Channel | None = None
        self._stub = None
        self._map: mmap.mmap | None = None
        self._mapped: tuple[str, int, int] | None = None  # the shared file's path, device and inode
        self._stop = threading.Event()
        self.progress = (0.0, math.nan, 0)  # the phase's samples, mean loss so far and boundary (stepped), for Renew
        self._renewer: threading.Thread | None = None

    # -- attach --------------------------------------------------------------------------------

    def attach(self, step: int) -> Attached:
        """Attach, waiting for a daemon that is away for at most reconnect_timeout seconds."""
        retrying = tenacity.Retrying(
            # NOT_FOUND here is "not in that run": an answer, not an absence; only UNAVAILABLE is retried.
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, grpc.RpcError) and e.code() is grpc.StatusCode.UNAVAILABLE
            ),
            stop=tenacity.stop_after_delay(self.reconnect_timeout),
            wait=tenacity.wait_fixed(RETRY_EVERY),
            before_sleep=lambda state: logger.info(
                "peerd: daemon not reachable (%s); retrying for %.0f s more",
                state.outcome.exception().code().name,
                self.reconnect_timeout - state.seconds_since_start,
            ),
            reraise=True,
        )
        try:
            return retrying(self._attach_once, step)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _attach_once(self, step: int) -> Attached:
        self._connect()
        request = control_pb2.AttachRequest(
            run_id=self.run,
            pid=os.getpid(),
            device=self.device,
            layout=self.layout,
            settings=self.settings,
            step=step,
            group_size=self.group_size,
        )
        response = self._stub.Attach(request, timeout=self.attach_timeout)
        vector, theta = self._map_vector(response.shared_path, response.numel)
        self.current = Attached(
            response.session,
            vector,
            theta,
            response.step,
            Phases(response.average_every, response.first_phase),
            response.lease_seconds,
            response.phase_timeout,
            response.upload,
            Slot.of(response.group),
            response.phase_steps,
        )
        self.lost.clear()
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name=f"peerd-lease:{self.run}", daemon=True)
            self._renewer.start()
        return self.current

    def _connect(self) -> None:
        address = control_address(self.daemon, self.control)  # re-read: a restarted daemon has a new port
        if self._channel is not None:
            self._channel.close()
        self._channel = grpc.insecure_channel(address)
        self._stub = control_pb2_grpc.ControlStub(self._channel)

    def _map_vector(self, path: str, numel: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        with open(path, "r+b") as f:
            magic, version, n = HEADER.unpack(f.read(HEADER.size))
            if magic != MAGIC or version not in (1, 2) or n != numel:
                raise PeerdError(
                    f"{path} is not a peerd shared vector of {numel} values (a daemon of another release?)"
                )
            # Populated at once: the first hand-over then takes no page faults (about 100,000 at 100M values).
            mapped = mmap.mmap(
                f.fileno(), file_size(numel, version == 2), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
            st = os.fstat(f.fileno())
        self._unmap()
        self._map, self._mapped = mapped, (path, st.st_dev, st.st_ino)
        vector = torch.frombuffer(mapped, dtype=torch.float32, offset=HEADER_BYTES, count=numel)
        theta = (
            torch.frombuffer(mapped, dtype=torch.float32, offset=HEADER_BYTES + 4 * numel, count=numel)
            if version == 2
            else None
        )
        return vector, theta

    def _unmap(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor over it is still referenced; it goes with the process
                pass
            self._map = None

    # -- phases --------------------------------------------------------------------------------

    def phase_ends_at(self) -> int:
        """The boundary step of the phase the daemon asks to end now (the straggler budget); 0: none.
        A read from the shared file's header: cheap enough for every step."""
        return END_AT.unpack_from(self._map, END_AT_OFFSET)[0] if self._map is not None else 0

    def stepped(self, steps: int, samples: float, loss: float, boundary: int = 0) -> None:
        """The phase under way (ending at the run's step `boundary`) has taken `steps` steps
        (PHASE_STEPS): the daemon's local step (status, metrics) and the step it announces to its
        peers move with every step; a header write, no call. Its `samples` and mean `loss` so far
        (NaN: not known without a device sync) go with the next Renew."""
        self.progress = (samples, loss, boundary)
        if self._map is not None:
            COUNT.pack_into(self._map, PHASE_STEPS_OFFSET, steps)

    def group_epoch(self) -> int:
        """The epoch of the local group the daemon has formed (GROUP_EPOCH): another than this
        process's group's means regroup. A header read."""
        return GROUP_EPOCH.unpack_from(self._map, GROUP_EPOCH_OFFSET)[0] if self._map is not None else 0

    def replaced(self) -> bool:
        """Whether the shared file this process maps is no longer the daemon's (the daemon stopped or
        restarted: a new daemon starts its epochs over, so group_epoch() alone would not say)."""
        if self._mapped is None:
            return True
        path, dev, ino = self._mapped
        try:
            st = os.stat(path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != (dev, ino)

    def regroup(self, epoch: int) -> Slot:
        """This process's place in the local group after `epoch` (blocks while the daemon forms it).
        Raises Lost when the attachment ended (attach again), PeerdError for anything else."""
        request = control_pb2.RegroupRequest(session=self.current.session, epoch=epoch)
        try:
            return Slot.of(self._stub.Regroup(request, timeout=self.current.phase_timeout).group)
        except grpc.RpcError as e:
            if e.code() in AWAY:
                self.lost.set()
                raise Lost(e.details()) from None
            raise self._error(e) from None

    def landed(self) -> int:
        """How many rounds landed between EndPhases (LANDED); a header read, cheap enough for every step."""
        return COUNT.unpack_from(self._map, LANDED_OFFSET)[0] if self._map is not None else 0

    def held(self) -> int:
        """After an attach or EndPhase: how many landed rounds the vector it answered with holds."""
        return COUNT.unpack_from(self._map, APPLIED_OFFSET)[0] if self._map is not None else 0

    def took(self, count: int) -> None:
        """The parameters now hold `count` landed rounds (APPLIED: an EndPhase adds none twice)."""
        COUNT.pack_into(self._map, APPLIED_OFFSET, count)

    def copy_theta(self, copy) -> None:
        """Call `copy(theta)` until it ran while the daemon wrote nothing there (THETA_SEQ even and
        unchanged); PeerdError after THETA_TRIES tries."""
        theta = self.current.theta
        for _ in range(THETA_TRIES):
            before = COUNT.unpack_from(self._map, THETA_SEQ_OFFSET)[0]
            if before % 2 == 0:
                copy(theta)
                if COUNT.unpack_from(self._map, THETA_SEQ_OFFSET)[0] == before:
                    return
            time.sleep(0.001)
        raise PeerdError(f"run {self.run}: θ in the shared file kept changing for {THETA_TRIES} copies")

    def end_phase(
        self,
        steps: int,
        samples: float,
        loss: float,
        compute_seconds: float,
        boundary: int = 0,
        group_step: int = 0,
        dear_overlap_ratio: float = math.nan,
    ) -> control_pb2.EndPhaseResponse:
        """The parameters are in the vector (the leader's, in a local group): the run's outer step
        for the phase that ends at the run's step `boundary`; with `group_step`, the parameters a
        spanning group's leader reached that step with, for this daemon to follow;
        `dear_overlap_ratio` (NaN: not under DeAR) for the daemon's status. Raises Lost when the
        attachment ended (attach again), PeerdError for anything else."""
        a = self.current
        request = control_pb2.EndPhaseRequest(
            session=a.session,
            steps=steps,
            samples=samples,
            loss=loss,
            compute_seconds=compute_seconds,
            boundary=boundary,
            group_step=group_step,
        )
        if not math.isnan(dear_overlap_ratio):
            request.dear_overlap_ratio = dear_overlap_ratio
        try:
            return self._stub.EndPhase(request, timeout=a.phase_timeout)
        except grpc.RpcError as e:
            if e.code() in AWAY:
                self.lost.set()
                raise Lost(e.details()) from None
            raise self._error(e) from None

    def report_eval(self, metric: str, score: float, higher_is_better: bool, loss: float) -> None:
        """An evaluation of the run's model, shown by the daemon's status and metrics. Raises Lost
        when the attachment ended, PeerdError for anything else (a bad metric or score)."""
        a = self.current
        request = control_pb2.ReportEvalRequest(
            session=a.session, metric=metric, score=score, higher_is_better=higher_is_better, loss=loss
        )
        try:
            self._stub.ReportEval(request, timeout=RENEW_TIMEOUT)
        except grpc.RpcError as e:
            if e.code() in AWAY:
                self.lost.set()
                raise Lost(e.details()) from None
            raise self._error(e) from None

    def _renew_loop(self) -> None:
        while not self._stop.is_set():
            a = self.current
            if self._stop.wait(a.lease_seconds / 3 if a else 1.0):
                return
            if a is None or self.lost.is_set():
                continue
            try:
                samples, loss, boundary = self.progress  # one read: the loop replaces it as a whole
                request = control_pb2.RenewRequest(session=a.session, samples=samples, boundary=boundary)
                if not math.isnan(loss):
                    request.loss = loss
                self._stub.Renew(request, timeout=RENEW_TIMEOUT)
            except grpc.RpcError as e:
                if e.code() in AWAY and self.current is a:
                    logger.info(
                        "peerd: attachment to run %s lost (%s); attaching again at the next step",
                        self.run,
                        e.code().name,
                    )
                    self.lost.set()
            except ValueError:  # the channel was closed by a reconnect meanwhile
                pass

    def close(self) -> None:
        """Detach (the daemon checkpoints) and stop the lease thread. Idempotent; never raises."""
        self._stop.set()
        a, self.current = self.current, None
        if a is not None and self._stub is not None and not self.lost.is_set():
            try:
                # With overlap the daemon lands the round in flight before it checkpoints: a round's time.
                self._stub.Detach(control_pb2.DetachRequest(session=a.session), timeout=a.phase_timeout)
            except grpc.RpcError as e:
                logger.info("peerd: detach from run %s: %s", self.run, e.code().name)
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(RENEW_TIMEOUT)
        if self._channel is not None:
            self._channel.close()

    def _error(self, e: grpc.RpcError) -> PeerdError:
        where = f"daemon at {self.control or self.daemon}"
        if e.code() is grpc.StatusCode.UNAVAILABLE:
            return PeerdError(
                f"{where} did not answer within {self.reconnect_timeout:.0f} s: is `peerd start --run {self.run}` running?"
            )
        return PeerdError(f"{where}: {e.details()}")
