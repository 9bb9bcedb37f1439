"""The control API server: gRPC on a unix socket (or TCP), plus the standard health service
(SERVING while the daemon is READY and none of the runs it trains has FAILED).

Protobuf stops here: handlers convert requests to plain values, call the Daemon, and convert back.
Errors map to gRPC codes: bad input (a request that does not parse included) INVALID_ARGUMENT, unknown
run NOT_FOUND, too large a request or one run too many RESOURCE_EXHAUSTED, not READY yet UNAVAILABLE.
Messages are for people: they never name a gRPC code.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peerd.daemon.joining import RunRefused
from peerd.peers.run_ids import InvalidRunId, InvalidSecret
from peerd.protos import control_pb2, control_pb2_grpc

if TYPE_CHECKING:
    from peerd.daemon.app import Daemon

logger = logging.getLogger(__name__)

GRPC_HARD_LIMIT = 1024 * 1024  # grpc refuses larger messages before any handler runs
MALFORMED_LOG_INTERVAL = 60.0  # seconds between two log lines about requests that do not parse
MAX_GROUP_SIZE = 1024  # processes an attach may say its local group expects


class UnknownRun(KeyError):
    pass


class TooManyRuns(Exception):
    """A join beyond max_runs; the message says so, in one line."""


class Malformed:
    """What a request that does not parse becomes: its handler answers it, where grpc would log a
    traceback per request and answer UNKNOWN."""

    __slots__ = ("message", "error")

    def __init__(self, message: str, error: str):
        self.message, self.error = message, error


def _lenient(message_class):
    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return Malformed(message_class.DESCRIPTOR.name, str(e))

    return deserialize


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, daemon: "Daemon", max_request_bytes: int):
        self.daemon = daemon
        self.max_request_bytes = max_request_bytes
        self._malformed_unlogged = 0  # refused since the last log line
        self._malformed_logged_at = -MALFORMED_LOG_INTERVAL

    async def _check(self, request, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Malformed):
            self.daemon.reject("control_malformed")
            self._log_malformed(request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse as a {request.message}")
        size = request.ByteSize()
        if size > self.max_request_bytes:
            self.daemon.reject("control_oversized")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"request is {size} bytes; the limit is {self.max_request_bytes}"
            )

    def _log_malformed(self, request: Malformed) -> None:
        """One line per MALFORMED_LOG_INTERVAL at most: a flood of garbage must not flood the log."""
        self._malformed_unlogged += 1
        now = time.monotonic()
        if now - self._malformed_logged_at >= MALFORMED_LOG_INTERVAL:
            logger.warning(
                "refused %d control request(s) that do not parse (last: %s: %s)",
                self._malformed_unlogged,
                request.message,
                request.error,
            )
            self._malformed_unlogged, self._malformed_logged_at = 0, now

    async def _run_id(self, run_id: str, context) -> str:
        try:
            return self.daemon.check_run_id(run_id)
        except InvalidRunId as e:
            self.daemon.reject("control_invalid_run_id")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Status(self, request, context):
        await self._check(request, context)
        return self.daemon.status()

    async def ListPeers(self, request, context):
        await self._check(request, context)
        run_id = await self._run_id(request.run_id, context)
        try:
            peers = self.daemon.list_peers(run_id)
        except UnknownRun:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this daemon is not in run {run_id!r}")
        return control_pb2.ListPeersResponse(
            run_id=run_id,
            peers=[
                control_pb2.PeerEntry(
                    peer_id=p.peer_id,
                    maddrs=p.maddrs,
                    last_seen_seconds=p.last_seen_seconds,
                    version=p.version,
                    role=p.role,
                    delegated_lanes=p.delegated_lanes,
                )
                for p in peers
            ],
        )

    async def JoinRun(self, request, context):
        await self._check(request, context)
        run_id = await self._run_id(request.run_id, context)
        try:
            joined = await self.daemon.join_run(
                run_id, request.secret_file or None, request.task, dict(request.settings)
            )
        except RunRefused as e:
            self.daemon.reject("control_run_refused")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TooManyRuns as e:
            self.daemon.reject("control_too_many_runs")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidSecret as e:
            self.daemon.reject("control_invalid_secret")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:  # not READY
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return control_pb2.JoinRunResponse(joined=joined)

    async def LeaveRun(self, request, context):
        await self._check(request, context)
        run_id = await self._run_id(request.run_id, context)
        try:
            await self.daemon.leave_run(run_id)  # a run this daemon is not in is left already
        except RuntimeError as e:  # not READY
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return control_pb2.LeaveRunResponse()

    async def Shutdown(self, request, context):
        await self._check(request, context)
        self.daemon.request_shutdown("Shutdown RPC")
        return control_pb2.ShutdownResponse()

    async def Attach(self, request, context):
        from peerd.daemon.attached import AttachRefused
        from peerd.peers.manifest import TensorSpec

        await self._check(request, context)
        run_id = await self._run_id(request.run_id, context)
        layout = tuple(TensorSpec(t.name, tuple(t.shape), t.dtype) for t in request.layout)
        try:
            info = await self.daemon.attach(
                run_id,
                request.pid,
                request.device[:64],
                layout,
                dict(request.settings),
                request.step,
                min(request.group_size, MAX_GROUP_SIZE),
            )
        except UnknownRun as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        except (RunRefused, ValueError) as e:  # ValueError: a layout no run can hold (peers/manifest.py)
            self.daemon.reject("control_run_refused")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except AttachRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RuntimeError as e:  # not READY
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return control_pb2.AttachResponse(
            session=info.session,
            shared_path=info.shared_path,
            numel=info.numel,
            step=info.step,
            average_every=info.phases.every,
            first_phase=info.phases.first,
            lease_seconds=info.lease_seconds,
            phase_timeout=info.phase_timeout,
            upload=info.upload,
            group=_group(info.group),
            phase_steps=info.phase_steps,
        )

    async def EndPhase(self, request, context):
        from peerd.daemon.attached import SessionLost

        await self._check(request, context)
        overlap = request.dear_overlap_ratio if request.HasField("dear_overlap_ratio") else math.nan
        if request.HasField("dear_overlap_ratio") and not 0.0 <= overlap <= 1.0:
            self.daemon.reject("control_invalid_field")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dear_overlap_ratio {overlap} is not in [0, 1]")
        trainer = await self._session_trainer(request.session, context)
        trainer.dear_overlap_ratio = overlap  # NaN: the phase was not under DeAR
        # The phase's end (its round) goes on if this call is cancelled (the process gone): it is the
        # run's, and the trainer's state must not stop half-way.
        ending = asyncio.ensure_future(
            trainer.end_phase(
                request.session,
                request.steps,
                max(request.samples, 0.0),
                request.loss,
                max(request.compute_seconds, 0.0),
                request.boundary,
                request.group_step,
            )
        )
        ending.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved, if not here
        try:
            end = await asyncio.shield(ending)
        except SessionLost as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return control_pb2.EndPhaseResponse(
            step=end.step,
            round=end.round_t,
            outcome=end.outcome,
            waited_seconds=end.waited,
            downloaded=end.downloaded,
            group_epoch=end.group_epoch,
            phase_steps=trainer.fitted_steps,
        )

    async def Regroup(self, request, context):
        from peerd.daemon.attached import SessionLost

        await self._check(request, context)
        trainer = await self._session_trainer(request.session, context)
        try:
            slot = await asyncio.to_thread(trainer.regroup, request.session, request.epoch)
        except SessionLost as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return control_pb2.RegroupResponse(group=_group(slot))

    async def ReportEval(self, request, context):
        from peerd.daemon.attached import SessionLost
        from peerd.daemon.tasks import EvalResult

        await self._check(request, context)
        if not 0 < len(request.metric) <= 64 or not math.isfinite(request.score):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "an evaluation needs a metric name (at most 64 characters) and a finite score",
            )
        trainer = await self._session_trainer(request.session, context)
        try:
            trainer.report_eval(
                request.session, EvalResult(request.score, request.metric, request.higher_is_better, request.loss)
            )
        except SessionLost as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return control_pb2.ReportEvalResponse()

    async def Renew(self, request, context):
        from peerd.daemon.attached import SessionLost

        await self._check(request, context)
        trainer = await self._session_trainer(request.session, context)
        try:
            trainer.renew(
                request.session,
                request.samples,
                request.loss if request.HasField("loss") else math.nan,
                request.boundary,
            )
        except SessionLost as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return control_pb2.RenewResponse()

    async def Detach(self, request, context):
        await self._check(request, context)
        for trainer in self.daemon.attached_trainers():
            await asyncio.to_thread(trainer.detach, request.session)
        return control_pb2.DetachResponse()

    async def _session_trainer(self, session: str, context):
        for trainer in self.daemon.attached_trainers():
            if any(m.token == session for m in trainer.members):
                return trainer
        await context.abort(
            grpc.StatusCode.NOT_FOUND, "no such attachment: its lease lapsed or the daemon restarted; attach again"
        )


def _group(slot) -> control_pb2.LocalGroup:
    return control_pb2.LocalGroup(
        epoch=slot.epoch,
        rank=slot.rank,
        size=slot.size,
        store=slot.store,
        host=slot.host,
        spans=slot.spans,
        hands_over=slot.hands_over,
    )


class HealthServicer(health_async.HealthServicer):
    """The standard health service, whose status each Check reads afresh from `serving()` (a trainer
    fails in its own thread, and nothing else would tell the service). Watch streams see a change
    at the next set_serving or Check."""

    def __init__(self, serving: Callable[[], bool]):
        super().__init__()
        self.serving = serving
        self.enabled = False  # the lifecycle's say (set_serving); serving() is asked only while it is True

    async def set_serving(self, serving: bool) -> None:
        self.enabled = serving
        await self._publish()

    async def _publish(self) -> None:
        ok = self.enabled and self.serving()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", control_pb2.DESCRIPTOR.services_by_name["Control"].full_name):
            await self.set(service, status)  # a Watch stream writes only a changed status

    async def Check(self, request, context):
        await self._publish()
        return await super().Check(request, context)


class ControlServer:
    def __init__(self, daemon: "Daemon", address: str, max_request_bytes: int):
        self.address = address
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", GRPC_HARD_LIMIT), ("grpc.so_reuseport", 0)]
        )
        _add_control_servicer(ControlServicer(daemon, max_request_bytes), self.server)
        self.health = HealthServicer(daemon.serving)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    async def start(self) -> int:
        """Listen and serve (health NOT_SERVING until set_serving(True)); returns the bound TCP port."""
        try:
            port = self.server.add_insecure_port(self.address)
        except RuntimeError as e:  # grpc raises RuntimeError when it cannot bind
            raise OSError(f"cannot listen on control address {self.address}: {e}") from None
        await self.server.start()
        await self.set_serving(False)
        return port

    async def set_serving(self, serving: bool) -> None:
        """Serving or not by the lifecycle; while serving, Check also asks the daemon (Daemon.serving)."""
        await self.health.set_serving(serving)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def _add_control_servicer(servicer: ControlServicer, server: grpc.aio.Server) -> None:
    """As control_pb2_grpc.add_ControlServicer_to_server, with requests parsed by _lenient."""
    service = control_pb2.DESCRIPTOR.services_by_name["Control"]
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(control_pb2, m.input_type.name)),
            response_serializer=getattr(control_pb2, m.output_type.name).SerializeToString,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
