"""A small synchronous client of one daemon's control API, for the CLI and for tests."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from peerd.daemon.datadir import read_ready
from peerd.protos import control_pb2, control_pb2_grpc

CALL_TIMEOUT = 15.0  # seconds for one control call; JoinRun includes a first DHT round trip


def control_address(data_dir: Path, explicit: str | None = None) -> str:
    """The daemon's control address: explicit, else from its ready.json, else its default socket."""
    if explicit:
        return explicit
    ready = read_ready(data_dir)
    if ready and isinstance(ready.get("control"), str):
        return ready["control"]
    return f"unix:{data_dir / 'control.sock'}"


def as_dict(message) -> dict:
    """A control message as plain JSON-ready values, field by field from its schema: ints stay
    ints (protobuf's JSON mapping writes 64-bit ones as strings), NaN becomes None."""

    def plain(value):
        if hasattr(value, "DESCRIPTOR"):
            return {f.name: plain(getattr(value, f.name)) for f in value.DESCRIPTOR.fields}
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, (str, bytes, int, float, bool)):
            return value
        return [plain(v) for v in value]  # a repeated field

    return plain(message)


class ControlClient:
    def __init__(self, address: str, timeout: float = CALL_TIMEOUT):
        self.address = address
        self.timeout = timeout
        self.channel = grpc.insecure_channel(address)
        self.stub = control_pb2_grpc.ControlStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()

    def status(self) -> control_pb2.StatusResponse:
        return self.stub.Status(control_pb2.StatusRequest(), timeout=self.timeout)

    def list_peers(self, run_id: str) -> control_pb2.ListPeersResponse:
        return self.stub.ListPeers(control_pb2.ListPeersRequest(run_id=run_id), timeout=self.timeout)

    def join(
        self, run_id: str, secret_file: str = "", task: str = "", settings: dict[str, str] | None = None
    ) -> control_pb2.JoinRunResponse:
        request = control_pb2.JoinRunRequest(run_id=run_id, secret_file=secret_file, task=task, settings=settings or {})
        return self.stub.JoinRun(request, timeout=self.timeout)

    def leave(self, run_id: str) -> control_pb2.LeaveRunResponse:
        return self.stub.LeaveRun(control_pb2.LeaveRunRequest(run_id=run_id), timeout=self.timeout)

    def shutdown(self) -> control_pb2.ShutdownResponse:
        return self.stub.Shutdown(control_pb2.ShutdownRequest(), timeout=self.timeout)

    def health(self) -> str:
        """SERVING, NOT_SERVING, ...; raises grpc.RpcError when nothing answers."""
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
