"""The control API under abuse (issue 14): requests that do not parse, more runs than --max-runs, and
join/leave repeated. Real daemons; each test reads its daemon's log, metrics and exit codes."""

from __future__ import annotations

import grpc
import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.config import ConfigError, load_config
from tests.helpers import peerd, scrape, wait_for


METHODS = ("Status", "ListPeers", "JoinRun", "LeaveRun")
GARBAGE = (b"\xff" * 8, b"garbage payload", bytes(range(256)), b"\x08")  # none parses as any request


def _rejected(d, reason: str) -> float:
    return scrape(d.metrics_url).get(("peerd_rejected_total", (("reason", reason),)), 0.0)


def _log_lines(d) -> list[str]:
    return d.log_path.read_text(errors="replace").splitlines()


def test_garbage_requests_are_invalid_argument_counted_and_not_logged_each(spawn):
    d = spawn("garbage")
    # The ready printout reaches the log just after ready.json (its last line names that file).
    wait_for(lambda: any("ready file:" in line for line in _log_lines(d)), timeout=10, what="the ready printout")
    before = len(_log_lines(d))
    sent = 0
    with grpc.insecure_channel(d.control) as channel:
        for method in METHODS:
            # No serializers: the bytes go out as they are, as a fuzzer's would.
            call = channel.unary_unary(f"/peerd.control.v1.Control/{method}")
            for i in range(100):
                with pytest.raises(grpc.RpcError) as e:
                    call(GARBAGE[i % len(GARBAGE)], timeout=10)
                sent += 1
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
                assert "does not parse" in e.value.details() and "Unexpected" not in e.value.details()
    assert _rejected(d, "control_malformed") == sent == 400
    added = _log_lines(d)[before:]
    assert len(added) <= 2 and not any("Traceback" in line or "ERROR" in line for line in added), added
    with ControlClient(d.control) as c:  # and it still serves
        assert c.status().state == "READY" and c.health() == "SERVING"


def test_a_join_beyond_max_runs_is_refused_and_the_daemon_keeps_serving(spawn):
    d = spawn("limited", ["--max-runs", "3", "--run", "one"])
    for run in ("two", "three"):
        r = peerd("join", run, "--control", d.control)
        assert r.returncode == 0 and f"joined {run}" in r.stdout, r
    r = peerd("join", "four", "--control", d.control)
    assert r.returncode == 1, r  # the daemon cannot do it now; the request itself is fine
    assert len(r.stderr.splitlines()) == 1 and "max_runs" in r.stderr and "--max-runs" in r.stderr, r
    assert "RESOURCE_EXHAUSTED" not in r.stderr and "Traceback" not in r.stderr, r
    with ControlClient(d.control) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.join("five")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.join("one").joined is False  # one it is in already is no new run
        status = c.status()
        assert status.state == "READY" and c.health() == "SERVING"
        assert sorted(r.run_id for r in status.runs) == ["one", "three", "two"]
    assert _rejected(d, "control_too_many_runs") == 2
    assert peerd("leave", "three", "--control", d.control).returncode == 0
    r = peerd("join", "four", "--control", d.control)  # room again
    assert r.returncode == 0 and "joined four" in r.stdout, r


def test_an_end_phase_with_a_ratio_out_of_range_is_refused_and_counted(spawn):
    """EndPhase's dear_overlap_ratio is a share in [0, 1] (peerd.torch sends it clamped): any other
    value is refused before the call reaches a session, and counted."""
    from peerd.protos import control_pb2, control_pb2_grpc

    d = spawn("ratio")
    with grpc.insecure_channel(d.control) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        for bad in (1.5, -0.1, float("nan")):
            with pytest.raises(grpc.RpcError) as e:
                stub.EndPhase(control_pb2.EndPhaseRequest(session="none", steps=1, dear_overlap_ratio=bad), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dear_overlap_ratio" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # a ratio in range goes on to the session, unknown here
            stub.EndPhase(control_pb2.EndPhaseRequest(session="none", steps=1, dear_overlap_ratio=0.5), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert _rejected(d, "control_invalid_field") == 3


def test_leave_twice_succeeds_and_says_so(spawn):
    d = spawn("leaver", ["--run", "gone"])
    r = peerd("leave", "gone", "--control", d.control)
    assert r.returncode == 0 and r.stdout.strip() == "left gone", r
    r = peerd("leave", "gone", "--control", d.control)
    assert r.returncode == 0 and r.stdout.strip() == "not in gone", r
    r = peerd("leave", "never-joined", "--control", d.control, "--json")
    assert r.returncode == 0 and '"left": false' in r.stdout, r
    r = peerd("join", "bad id!", "--control", d.control)
    assert r.returncode == 2 and "run ID" in r.stderr and "INVALID_ARGUMENT" not in r.stderr, r
    with ControlClient(d.control) as c:
        c.leave("gone")  # no error
        assert [r.run_id for r in c.status().runs] == []


def test_max_runs_is_a_setting_with_bounds():
    assert load_config({}, environ={}).max_runs == 16
    assert load_config({}, environ={"PEERD_MAX_RUNS": "4"}).max_runs == 4
    assert load_config({"max_runs": "2", "run": ["a", "b"]}, environ={}).max_runs == 2
    for bad in ({"max_runs": "0"}, {"max_runs": "2", "run": ["a", "b", "c"]}):
        with pytest.raises(ConfigError, match="max_runs"):
            load_config(bad, environ={})
