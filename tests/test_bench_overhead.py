"""bench.overhead without a lab: its arithmetic over two snapshots, and the counter it loads into
daemons (bench/overhead_hook) patching what it says, and nothing without PEERD_OVERHEAD_DIR."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.overhead import HEADER_BYTES, window

ROOT = Path(__file__).resolve().parent.parent


def snap(tx: int, packets: int, p2pd: tuple[int, int], engine: int, hook: dict) -> dict:
    return {
        "link": {"tx_bytes": tx, "tx_packets": packets},
        "tcp": {("10.0.0.2:1", "10.0.0.3:2"): {"proc": "p2pd", "bytes_sent": p2pd[0], "bytes_retrans": p2pd[1]}},
        "snmp": {},
        "metrics": {"peerd_sent_bytes_total{transport=tcp}": float(engine)},
        "hook": hook,
    }


def test_window_charges_calls_both_ways_and_names_the_residuals():
    a = snap(0, 0, (0, 0), 0, {})
    hook = {
        "call|refresh/get|DHTProtocol.rpc_find": [10, 1_000, 9_000],
        "call|heartbeat/store|DHTProtocol.rpc_store": [5, 3_000, 500],
        "serve||DHTProtocol.rpc_find": [10, 9_000, 1_000],
    }
    # 60 s, one host: p2pd sent 20,000 bytes (1,000 of them again), the engine 50,000; eth0 80,000 in 100 packets.
    b = snap(80_000, 100, (20_000, 1_000), 50_000, hook)
    w = window({"h0": a}, {"h0": b}, 60.0, 1)
    c = w["components"]
    assert c["dht/rpc: refresh"] == 10_000 and c["dht/rpc: heartbeat"] == 3_500
    unary = 1_000 + 3_000 + 9_000  # what this host sent: its requests and its answers
    assert c["libp2p's own (p2pd's fresh TCP payload - unary calls - engine over libp2p)"] == 20_000 - 1_000 - unary
    assert c["p2pd's retransmissions"] == 1_000
    headers = HEADER_BYTES * 100
    assert (
        c["rest (eth0 - TCP payload - headers: the engine's retransmissions, UDP)"]
        == 80_000 - 20_000 - 50_000 - headers
    )
    assert w["engine_payload (peerd_sent_bytes)"] == 50_000
    assert w["non_payload (eth0 - engine)"] == 30_000


def test_window_is_per_daemon_per_minute():
    a, b = snap(0, 0, (0, 0), 0, {}), snap(6_000, 0, (0, 0), 0, {})
    w = window({"h0": a, "h1": a}, {"h0": b, "h1": b}, 30.0, 2)
    assert w["non_payload (eth0 - engine)"] == 12_000  # 6,000 bytes a daemon in half a minute


def patched(env: dict) -> dict:
    code = (
        "import json, peerd.peers.membership as m, peerd.peers.node as n\n"
        "import hivemind.p2p.p2p_daemon_bindings.control as c\n"
        "print(json.dumps([m.RunMembership.refresh.__qualname__, n.PeerNode.store.__qualname__,"
        " c.ControlClient.call_unary_handler.__qualname__]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_the_hook_patches_only_where_asked(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT / "bench" / "overhead_hook"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PEERD_OVERHEAD_DIR", None)
    assert not any("wrapped" in q or "_patch" in q for q in patched(env))
    assert all("wrapped" in q or "_patch" in q for q in patched({**env, "PEERD_OVERHEAD_DIR": str(tmp_path)}))
