"""Real daemons on loopback: discovery, leaving, restarts, metrics, and bad input over the control API."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.config import DaemonConfig, DiscoveryConfig
from peerd.daemon.procs import LocalDaemon
from peerd.peers.events import PeerEvents
from peerd.peers.node import NodeSettings, PeerNode
from peerd.peers.records import MemberRecord, MemberState, seal_record
from peerd.peers.run_ids import RunSecret, run_dht_key
from peerd.peers.clock import now
from peerd.protos import control_pb2
from tests.conftest import CLUSTER_RUN
from tests.helpers import ROOT, families, peer_ids, peerd, peers_json, scrape, wait_for

PEER_TTL = DiscoveryConfig().peer_ttl  # the daemons here run with the default


def session_pids(session_id: int) -> list[int]:
    """Live (non-zombie) processes of a session: the daemon and its p2pd share one."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == session_id and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def test_three_daemons_list_each_other(cluster):
    for d in cluster:
        assert peers_json(d, CLUSTER_RUN) == sorted(x.peer_id for x in cluster if x is not d)
        r = peerd("status", "--control", d.control)
        assert r.returncode == 0 and "READY" in r.stdout and d.peer_id in r.stdout, r


def test_metrics_show_two_peers_and_no_remote_ids(cluster):
    ids = {d.peer_id for d in cluster}
    for d in cluster:
        # A heartbeat's own record is readable from the local DHT storage before its store call
        # returns and is counted, so the table can list two peers a moment before the counter moves.
        ok = ("peerd_heartbeats_total", (("result", "ok"),))
        wait_for(
            lambda: scrape(d.metrics_url).get(ok, 0) >= 1,
            timeout=2 * DiscoveryConfig().heartbeat_interval + 5,
            what="a heartbeat counted ok",
        )
        m = scrape(d.metrics_url)
        assert m[("peerd_peers", (("run", CLUSTER_RUN),))] == 2
        assert m[("peerd_info", (("peer_id", d.peer_id), ("version", "0.1.0")))] == 1
        assert m[("peerd_state", (("state", "READY"),))] == 1
        assert m[ok] >= 1
        assert m[("process_resident_memory_bytes", ())] > 0
        # Counted from the process's start (as Prometheus's own process_start_time_seconds), not a later moment.
        assert abs(m[("peerd_uptime_seconds", ())] - (time.time() - m[("process_start_time_seconds", ())])) < 1.0
        for name, labels in m:
            for key, value in labels:
                if value in ids:
                    assert (name, key, value) == ("peerd_info", "peer_id", d.peer_id), "a remote peer ID in a label"


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """docs/metrics.md's rows: name -> (type, label names); a blank or "none" labels cell is none."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| (counter|gauge|info|histogram|summary) \|([^|]*)\|", text, re.M)
    return {name: (kind, frozenset(re.findall(r"`([a-z_]+)`", labels))) for name, kind, labels in rows}


def test_metrics_doc_and_endpoint_agree(cluster):
    live = families(cluster[0].metrics_url)
    documented = documented_metrics()
    assert documented, "no metric rows found in docs/metrics.md"
    assert set(live) == set(documented), (
        f"undocumented: {set(live) - set(documented)}; stale: {set(documented) - set(live)}"
    )
    assert {name: kind for name, (kind, _) in live.items()} == {name: kind for name, (kind, _) in documented.items()}
    # Label names show only on families with series (in a run without a task, not the training ones).
    seen = {name: labels for name, (_, labels) in live.items() if labels is not None}
    assert {"peerd_info", "peerd_peers", "peerd_dht_requests_total", "python_info"} <= set(seen)
    assert seen == {name: documented[name][1] for name in seen}


def test_health_service_reports_serving(cluster):
    r = peerd("health", "--control", cluster[0].control)
    assert r.returncode == 0 and r.stdout.strip() == "SERVING", r


def test_wrong_secret_sees_nobody_and_nobody_sees_it(spawn, cluster, tmp_path):
    wrong = tmp_path / "wrong.secret"
    wrong.write_text("not-the-secret-of-this-run-0123456789")
    intruder = spawn(
        "intruder", ["--run", CLUSTER_RUN, "--run-secret-file", str(wrong), "--initial-peers", cluster[0].maddrs[0]]
    )
    try:
        # Nothing should happen, so wait long enough for it to have happened: two heartbeats and refreshes.
        time.sleep(5)
        assert peer_ids(intruder, CLUSTER_RUN) == []
        for d in cluster:
            assert intruder.peer_id not in peer_ids(d, CLUSTER_RUN)
    finally:
        assert intruder.stop() == 0


def test_forged_and_malformed_dht_records_are_refused_and_counted(cluster, secret_file, tmp_path):
    victim = cluster[1]
    before = {d.peer_id: _rejected(d) for d in cluster}
    secret = RunSecret.from_file(secret_file, CLUSTER_RUN)
    key = run_dht_key(CLUSTER_RUN, secret)

    async def attack() -> list[bool]:
        node = await PeerNode.start(
            NodeSettings(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                identity_path=tmp_path / "mallory.key",
                initial_peers=[cluster[0].maddrs[0]],
            ),
            PeerEvents(),
        )
        try:
            mallory = node.identity
            expiration = now() + 60
            forged = MemberRecord(
                run_id=CLUSTER_RUN,
                peer_id=mallory.peer_id,
                maddrs=(),
                version="x",
                role="trainer",
                state=MemberState.LEFT,
                timestamp=now(),
            )
            wrong_seal = RunSecret.from_bytes(b"m" * 32, CLUSTER_RUN)
            return [
                # Garbage under the victim's slot, and a LEFT record for the victim signed by Mallory.
                await node.store(key, victim.peer_id, b"\x00garbage", expiration),
                await node.store(key, victim.peer_id, seal_record(forged, mallory, secret), expiration),
                # Mallory's own record sealed with the wrong secret, under her own slot.
                await node.store(key, mallory.peer_id, seal_record(forged, mallory, wrong_seal), expiration),
            ]
        finally:
            await node.shutdown()

    stores = asyncio.run(attack())
    assert stores[:2] == [False, False], "daemons must refuse records under another peer's slot"
    wait_for(lambda: sum(_rejected(d) for d in cluster) > sum(before.values()), timeout=10, what="rejections counted")
    time.sleep(2)  # two refresh cycles: the victim must still be listed everywhere
    for d in cluster:
        assert peer_ids(d, CLUSTER_RUN) == sorted(x.peer_id for x in cluster if x is not d)


def _rejected(d) -> float:
    return sum(
        v
        for (name, labels), v in scrape(d.metrics_url).items()
        if name == "peerd_rejected_total" and labels[0][1].startswith("record_")
    )


@pytest.mark.parametrize(
    "call,code",
    [
        (lambda c: c.list_peers(""), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.join("x" * 65), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.join("bad id!"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.leave("../etc"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.list_peers("never-joined"), grpc.StatusCode.NOT_FOUND),
        (lambda c: c.join("ok-id", "/nonexistent/secret"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.join("a" * 100_000), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over our 64 KiB limit
        (lambda c: c.join("a" * 2_000_000), grpc.StatusCode.RESOURCE_EXHAUSTED),  # over grpc's hard limit
    ],
)
def test_control_api_refuses_bad_input_and_changes_nothing(cluster, call, code):
    d = cluster[0]
    with ControlClient(d.control) as c:
        before = c.status()
        with pytest.raises(grpc.RpcError) as e:
            call(c)
        assert e.value.code() == code, e.value.details()
        assert e.value.details()  # a message a person can read
        after = c.status()
    assert [r.run_id for r in after.runs] == [r.run_id for r in before.runs]


def test_cli_reports_bad_run_id_in_one_line(cluster):
    r = peerd("join", "bad id!", "--control", cluster[0].control)
    assert r.returncode == 2 and "run ID" in r.stderr and "Traceback" not in r.stderr, r


def test_join_and_leave_an_open_run_over_the_cli(cluster):
    a, b = cluster[0], cluster[1]
    for d in (a, b):
        r = peerd("join", "beta", "--control", d.control)
        assert r.returncode == 0 and "joined beta" in r.stdout, r
    assert peerd("join", "beta", "--control", a.control).stdout.strip() == "already in beta"
    wait_for(lambda: peer_ids(a, "beta") == [b.peer_id], timeout=10, what="a sees b in beta")
    t0 = time.monotonic()
    assert peerd("leave", "beta", "--control", b.control).returncode == 0
    wait_for(lambda: peer_ids(a, "beta") == [], timeout=3, what="a drops b at once after it left")
    assert time.monotonic() - t0 < PEER_TTL / 2
    assert peerd("leave", "beta", "--control", a.control).returncode == 0
    assert peer_ids(a, CLUSTER_RUN) == sorted([cluster[1].peer_id, cluster[2].peer_id])


def _join_cluster(spawn, cluster, secret_file, name):
    d = spawn(
        name, ["--run", CLUSTER_RUN, "--run-secret-file", str(secret_file), "--initial-peers", cluster[0].maddrs[0]]
    )
    for other in cluster:
        wait_for(
            lambda: d.peer_id in peer_ids(other, CLUSTER_RUN), timeout=15, what=f"{other.data_dir.name} sees {name}"
        )
    return d


def test_sigterm_drains_leaves_at_once_and_leaves_no_child(spawn, cluster, secret_file):
    d = _join_cluster(spawn, cluster, secret_file, "leaver")
    assert len(session_pids(d.pid)) >= 2  # the daemon and its p2pd
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    t0 = time.monotonic()  # from its exit: by then it has said goodbye
    for other in cluster:
        wait_for(lambda: d.peer_id not in peer_ids(other, CLUSTER_RUN), timeout=3, what="peers drop it at once")
    assert time.monotonic() - t0 < PEER_TTL / 2, "dropped by goodbye, not by TTL"
    wait_for(lambda: session_pids(d.pid) == [], timeout=5, what="no process of the daemon's session left")
    assert not (d.data_dir / "ready.json").exists()
    assert not (d.data_dir / "control.sock").exists()


def test_sigkill_leaves_the_tables_within_the_ttl(spawn, cluster, secret_file):
    bound = DaemonConfig().peer_leave_bound  # every daemon here runs with the default discovery timing
    assert bound <= 15  # the ceiling for the default
    d = _join_cluster(spawn, cluster, secret_file, "victim")
    os.kill(d.pid, signal.SIGKILL)
    t0 = time.monotonic()
    for other in cluster:
        wait_for(
            lambda: d.peer_id not in peer_ids(other, CLUSTER_RUN),
            timeout=bound,
            what="the killed peer leaves",
            interval=0.2,
        )
    assert time.monotonic() - t0 <= bound
    # p2pd notices its parent is gone (its pipes close) and exits by itself.
    wait_for(lambda: session_pids(d.pid) == [], timeout=10, what="p2pd exits after its daemon is killed")


def test_draining_is_not_serving_and_a_second_signal_exits_at_once(spawn):
    """A run peer frozen with its p2pd holds the drain in its goodbye (--goodbye-timeout 60): health
    says NOT_SERVING, requests get UNAVAILABLE, and a second SIGTERM ends the daemon and its p2pd."""
    frozen = spawn("frozen", ["--run", "slow-bye"])
    d = spawn(
        "drainer",
        ["--run", "slow-bye", "--initial-peers", frozen.maddrs[0], "--goodbye-timeout", "60", "--drain-timeout", "90"],
    )
    wait_for(lambda: peer_ids(d, "slow-bye") == [frozen.peer_id], timeout=15, what="the drainer sees its peer")
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        with ControlClient(d.control) as c:
            assert c.health() == "SERVING"
            d.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: c.health() == "NOT_SERVING", timeout=10, what="health NOT_SERVING once draining")
            assert c.status().state == "DRAINING"  # the goodbye to the frozen peer cannot end for 60 s
            with pytest.raises(grpc.RpcError) as e:
                c.leave("slow-bye")
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(5) == 1
        # p2pd exits with its daemon (docs/operations.md); a bounded wait covers its reaping.
        wait_for(lambda: session_pids(d.pid) == [], timeout=2, what="p2pd gone after a forced exit")
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    assert frozen.stop() == 0


def p2pd_args(d) -> list[str]:
    (pid,) = [p for p in session_pids(d.pid) if p != d.pid]
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")


def test_upnp_and_autonat_are_off_by_default(cluster):
    args = p2pd_args(cluster[0])
    assert "-natPortMap=0" in args and "-autonat=0" in args, args


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
    reason="needs root, unshare and ip: the opted-in daemon runs in a network namespace of its own",
)
def test_upnp_and_autonat_are_on_when_asked_for(tmp_path):
    """UPnP discovery multicasts on the LAN: the daemon that opts in runs in a fresh network
    namespace whose only interface is loopback, so nothing it sends leaves this machine."""
    d = LocalDaemon(tmp_path / "natted", log_path=tmp_path / "natted.log")
    d.data_dir.mkdir()
    cmd = [
        "unshare",
        "--net",
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
        sys.executable,
        "-m",
        "peerd.daemon.cli",
        "start",
        "--data-dir",
        str(d.data_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        "0",
        "--nat-port-map",
        "--auto-nat",
    ]
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        d.wait_ready()  # exec: the daemon keeps the pid of the process started here
        args = p2pd_args(d)
        assert "-natPortMap=1" in args and "-autonat=1" in args, args
        assert os.readlink(f"/proc/{d.pid}/ns/net") != os.readlink("/proc/self/ns/net")  # it is contained
    finally:
        assert d.stop() == 0, d.log_tail()


def test_restart_with_the_same_data_dir_keeps_the_peer_id(spawn):
    d = spawn("restart")
    first = d.peer_id
    assert d.stop() == 0
    d.start()
    assert d.peer_id == first
    assert d.stop() == 0


def test_data_dir_in_use_by_a_live_daemon_is_refused(cluster):
    r = peerd(
        "start", "--data-dir", str(cluster[0].data_dir), "--port", "0", "--metrics-port", "0", "--host", "127.0.0.1"
    )
    assert r.returncode == 2 and "in use by a live daemon" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r
    assert (cluster[0].data_dir / "ready.json").exists()  # the live daemon's files are untouched


def test_unusable_data_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = peerd("start", "--data-dir", str(blocker / "data"), "--port", "0", "--metrics-port", "0", "--host", "127.0.0.1")
    assert r.returncode == 2 and "cannot create data dir" in r.stderr and "Traceback" not in r.stderr, r
    if os.geteuid() != 0:  # root can write anywhere, so only a non-root run can test permissions
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        r = peerd("start", "--data-dir", str(ro), "--port", "0", "--metrics-port", "0", "--host", "127.0.0.1")
        assert r.returncode == 2 and "not writable" in r.stderr, r


def test_status_json_has_the_runs(cluster):
    with ControlClient(cluster[0].control) as c:
        s = c.status()
    assert s.state == "READY" and s.pid == cluster[0].pid
    assert [(r.run_id, r.peers, r.secured) for r in s.runs] == [(CLUSTER_RUN, 2, True)]
    assert isinstance(s, control_pb2.StatusResponse)
