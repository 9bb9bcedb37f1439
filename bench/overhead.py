"""What a peerd host sends beyond its rounds' payload (issue 27), by component, on real daemons.

    sudo .venv/bin/python -m bench.overhead [--settings payload=int2] [--idle-seconds 60] [--train-seconds 90]
    sudo .venv/bin/python -m bench.overhead --idle-only [--daemon-env PEERD_REFRESH_INTERVAL=3 ...]

bench.vs_peers' set-up (3 hosts of a network lab, charlm, H = 50, one daemon each, the loops
attached, links shaped as --rate-mbit / --rtt-ms / --loss-pct after set-up), then two windows:

* idle: the run joined and the loops attached, waiting for the start (heartbeats, reads, p2pd);
* training: the loops train; the rounds' payload is the daemons' own peerd_sent_bytes.

--idle-only starts the daemons alone, in the run without its manifest (no loops: light on CPU),
and measures the idle window only; --daemon-env sets a daemon setting by its variable, to measure
what a setting would save without changing a default.

Each host's bytes in a window come from four counters: eth0's transmit bytes and packets (the
lab's link_stats); TCP's payload per connection and process (ss -ti in the host's namespace:
bytes_sent, bytes_retrans; p2pd's connections carry every libp2p byte); the daemon's metrics (the
collective engine's bytes by transport, state-sync bytes); and a counter loaded into the daemons
through PYTHONPATH (bench/overhead_hook/sitecustomize.py) that counts each unary p2pd call's request
and answer bytes by protocol and by what asked for it (heartbeat, refresh, rendezvous, matchmaking,
manifest, ...). A component's figure is bytes per daemon per minute: the bytes of the calls a
daemon made for it, both ways, summed over the daemons and divided by their number (every daemon
does the same, so this is what each sends for it). What the counters do not split is named as a
residual: libp2p's own bytes (noise, yamux, multistream, identify, ...) = p2pd's TCP payload - the
unary calls' bytes; headers and acknowledgements = eth0's bytes - TCP's payload.

JSON lines on stdout: one per window and component, then the headline: the non-payload bytes per
daemon per minute while training (ours) against the idle daemon's (baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from bench.common import emit, interrupt_on_signals, progress as _progress, result
from bench.vs_peers import PEERD_SETTINGS, Entrant, HostRun, SystemFailed, SystemRun, environment_problem
from peerd.daemon.lab.netns import LinkShape

BENCH = "overhead"
HOOK = Path(__file__).resolve().parent / "overhead_hook"
RESULTS = Path(__file__).resolve().parent / "results" / "overhead.jsonl"
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12
SS_FIELD = re.compile(r"\b(bytes_sent|bytes_retrans|bytes_received):(\d+)")


def progress(message: str) -> None:
    _progress(BENCH, message)


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


def tcp_connections(netns: str) -> dict[tuple[str, str], dict]:
    """Every TCP connection of the namespace that is not loopback: (local, peer): process, counters."""
    out: dict[tuple[str, str], dict] = {}
    lines = sh("ip", "netns", "exec", netns, "ss", "-tinpH").splitlines()
    i = 0
    while i < len(lines):
        head = lines[i].split()
        info = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t")) else ""
        i += 2 if info else 1
        if len(head) < 5 or head[3].startswith(("127.", "[::1]")) or head[4].startswith(("127.", "[::1]")):
            continue
        proc = re.search(r'users:\(\("([^"]+)"', " ".join(head))
        counters = {k: int(v) for k, v in SS_FIELD.findall(info)}
        out[(head[3], head[4])] = {"proc": proc.group(1) if proc else "?", **counters}
    return out


def snmp(netns: str) -> dict[str, int]:
    got: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        rows = [line.split() for line in sh("ip", "netns", "exec", netns, "cat", path).splitlines()]
        for names, values in zip(rows[::2], rows[1::2]):
            proto = names[0].rstrip(":")
            for n, v in zip(names[1:], values[1:]):
                if proto in ("Tcp", "Udp", "IpExt"):
                    got[f"{proto}.{n}"] = int(v)
    return got


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "bytes" in s.name or s.name.startswith("peerd_round_duration_seconds_count"):
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "run")
                got[key] = got.get(key, 0.0) + s.value
    return got


def hook_counts(directory: Path) -> dict[str, dict[str, list[int]]]:
    """Host name: the summed counts of its processes (a daemon's --data-dir ends in hosts/<name>)."""
    per_host: dict[str, dict[str, list[int]]] = defaultdict(dict)
    for f in directory.glob("*.json"):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        m = re.search(r"/hosts/(h\d+)", " ".join(d["argv"]))
        if not m:
            continue
        into = per_host[m.group(1)]
        for k, v in d["counts"].items():
            into[k] = [a + b for a, b in zip(into.get(k, [0, 0, 0]), v)]
    return per_host


class OverheadRun(SystemRun):
    """bench.vs_peers' peerd system with an idle window before the training and counters around both."""

    def __init__(self, entrant: Entrant, args, out: Path, hook_dir: Path):
        super().__init__(entrant, args, out)
        self.hook_dir = hook_dir
        self.snaps: list[tuple[float, dict]] = []

    def snapshot(self) -> None:
        time.sleep(1.2)  # the hook writes its counts every second
        t = time.time()
        hooks = hook_counts(self.hook_dir)
        snap = {}
        for h in self.hosts:
            name = h.host.name
            snap[name] = {
                "link": self.net.link_stats(name),
                "tcp": tcp_connections(h.host.netns),
                "snmp": snmp(h.host.netns),
                "metrics": metrics(h.daemon.metrics_url),
                "hook": hooks.get(name, {}),
            }
        self.snaps.append((t, snap))

    def run(self) -> None:
        try:
            self.net.create()
            shape = LinkShape(rate_mbit=self.args.rate_mbit, loss_pct=self.args.loss_pct, rtt_ms=self.args.rtt_ms)
            unlimited = LinkShape(rate_mbit=0.0, loss_pct=shape.loss_pct, rtt_ms=shape.rtt_ms)
            for i in range(self.args.hosts):
                self.hosts.append(HostRun(self.net.add_host(f"h{i}", unlimited, congestion_control="bbr")))
            if self.args.idle_only:  # daemons in the run without its manifest: no loops, no training
                for h in self.hosts:
                    self._start_daemon(h)
            else:
                self._set_up()
            for h in self.hosts:
                self.net.shape(h.host.name, shape)
            progress(f"every host ready; {self.args.idle_seconds:.0f} s idle, then {self.args.seconds:.0f} s training")
            time.sleep(5.0)  # the links shaped, the first reads after set-up settled
            self.snapshot()
            time.sleep(self.args.idle_seconds)
            self.snapshot()
            if self.args.idle_only:
                return
            self.start = start = time.time() + 1.0
            deadline = start + self.args.seconds
            (self.out / "go.tmp").write_text(json.dumps({"start": start, "deadline": deadline}))
            os.replace(self.out / "go.tmp", self.out / "go.json")
            self._train_until(start, deadline)
            self.snapshot()
        finally:
            for h in self.hosts:
                h.kill()
            removed = self.net.destroy()
            progress(f"lab {self.net.name} removed ({len(removed)} items)")


def window(a: dict, b: dict, seconds: float, hosts: int) -> dict[str, float]:
    """Bytes per daemon per minute by component between two snapshots."""
    per_min = 60.0 / seconds / hosts
    sums: dict[str, float] = defaultdict(float)
    for name in b:
        x, y = a[name], b[name]
        sums["eth0_tx"] += y["link"]["tx_bytes"] - x["link"]["tx_bytes"]
        sums["eth0_tx_packets"] += y["link"]["tx_packets"] - x["link"]["tx_packets"]
        for key, c in y["tcp"].items():
            old = x["tcp"].get(key, {})
            kind = "p2pd" if c["proc"] == "p2pd" else "python"
            sums[f"tcp_payload_{kind}"] += c.get("bytes_sent", 0) - old.get("bytes_sent", 0)
            sums[f"tcp_retrans_{kind}"] += c.get("bytes_retrans", 0) - old.get("bytes_retrans", 0)
        for k in ("Udp.OutDatagrams", "Tcp.OutSegs", "Tcp.RetransSegs", "IpExt.OutOctets"):
            sums[k] += y["snmp"].get(k, 0) - x["snmp"].get(k, 0)
        for k, v in y["metrics"].items():
            sums[f"metric:{k}"] += v - x["metrics"].get(k, 0.0)
        for k, v in y["hook"].items():
            old = x["hook"].get(k, [0, 0, 0])
            kind, cause, proto = k.split("|", 2)
            calls, out, inn = (v[i] - old[i] for i in range(3))
            proto = proto.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
            if kind == "call":  # both ways: the request this daemon sent and the answer it caused
                sums[f"rpc:{cause or '-'}:{proto}"] += out + inn
                sums[f"calls:{cause or '-'}:{proto}"] += calls
                sums["rpc_sent_by_callers"] += out
            elif kind == "serve":
                sums["rpc_sent_by_servers"] += out
            else:
                sums[f"{kind}:{cause or '-'}:{proto}"] += calls
    out = {k: round(v * per_min) for k, v in sums.items()}
    rpc_by: dict[str, float] = defaultdict(float)  # component: the unary calls' bytes, both ways
    for k, v in sums.items():
        if k.startswith("rpc:"):
            _, cause, proto = k.split(":", 2)
            first = cause.split("/")[0]
            if first in ("heartbeat", "refresh", "rendezvous") or first.startswith(("matchmaking", "manifest")):
                rpc_by[first.split("_")[0]] += v
            else:
                rpc_by[f"other rpc ({proto})"] += v
    rpc = sums["rpc_sent_by_callers"] + sums["rpc_sent_by_servers"]
    engine_tcp = sums["metric:peerd_sent_bytes_total{transport=tcp}"]
    engine_libp2p = sums["metric:peerd_sent_bytes_total{transport=libp2p}"]
    engine = engine_tcp + engine_libp2p + sums["metric:peerd_sent_bytes_total{transport=udp}"]
    p2pd_fresh = sums["tcp_payload_p2pd"] - sums["tcp_retrans_p2pd"]
    # The engine's TCP connections of a round are mostly closed by the next look: ss misses them.
    python_tcp = max(sums["tcp_payload_python"], engine_tcp)
    headers = HEADER_BYTES * sums["eth0_tx_packets"]
    components = {
        **{f"dht/rpc: {k}": v for k, v in sorted(rpc_by.items())},
        "libp2p's own (p2pd's fresh TCP payload - unary calls - engine over libp2p)": p2pd_fresh - rpc - engine_libp2p,
        "p2pd's retransmissions": sums["tcp_retrans_p2pd"],
        "headers (66 bytes a packet, acknowledgements included)": headers,
        "rest (eth0 - TCP payload - headers: the engine's retransmissions, UDP)": sums["eth0_tx"]
        - sums["tcp_payload_p2pd"]
        - python_tcp
        - headers,
    }
    out["components"] = {k: round(v * per_min) for k, v in components.items()}
    out["engine_payload (peerd_sent_bytes)"] = round(engine * per_min)
    out["non_payload (eth0 - engine)"] = round((sums["eth0_tx"] - engine) * per_min)
    out["rounds_per_daemon_per_min"] = round(sums["metric:peerd_round_duration_seconds_count"] * per_min, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=1.0)
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--loss-pct", type=float, default=1.0)
    p.add_argument("--every", type=int, default=50, help="H")
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--train-seconds", dest="seconds", type=float, default=90.0)
    p.add_argument("--settings", default="payload=int2", help="the run's settings beyond H (KEY=VALUE,...)")
    p.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="PEERD_X=VALUE",
        help="a daemon setting by its variable (PEERD_REFRESH_INTERVAL=3): what a setting would save; repeatable",
    )
    p.add_argument("--raw", default=None, help="write the raw snapshots (JSON) to this file")
    p.add_argument(
        "--idle-only",
        action="store_true",
        help="daemons only, in the run without its manifest (no loops): the idle window alone, light on CPU",
    )
    p.add_argument("--no-results", action="store_true", help="do not append to bench/results/overhead.jsonl")
    args = p.parse_args()
    args.restart_every, args.snapshot_every, args.logs = 0.0, args.seconds / 3, None
    if problem := environment_problem():
        print(f"bench.overhead: {problem}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    settings = {**PEERD_SETTINGS, **dict(kv.split("=", 1) for kv in args.settings.split(",") if kv)}
    entrant = Entrant("peerd", "peerd", ",".join(f"{k}={v}" for k, v in settings.items()))
    scratch = Path(tempfile.mkdtemp(prefix="peerd-overhead-"))
    hook_dir = scratch / "hook"
    hook_dir.mkdir()
    os.environ["PEERD_OVERHEAD_DIR"] = str(hook_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")]))
    daemon_env = dict(kv.split("=", 1) for kv in args.daemon_env)
    os.environ.update(daemon_env)
    (scratch / "run").mkdir()
    run = OverheadRun(entrant, args, scratch / "run", hook_dir)
    try:
        run.run()
    except (SystemFailed, OSError, RuntimeError) as e:
        progress(f"FAILED: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if len(run.snaps) < 2:
        return 1
    if args.raw:
        raw = [
            (t, {h: {**v, "tcp": {" ".join(k): c for k, c in v["tcp"].items()}} for h, v in snap.items()})
            for t, snap in run.snaps
        ]
        Path(args.raw).write_text(json.dumps(raw))
    link = {"hosts": args.hosts, "rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "loss_pct": args.loss_pct}
    lines = []
    names = ["idle, no loops" if args.idle_only else "idle", "training"]
    for i in range(len(run.snaps) - 1):
        (t0, a), (t1, b) = run.snaps[i], run.snaps[i + 1]
        w = window(a, b, t1 - t0, len(b))
        line = {"bench": BENCH, "window": names[i], "seconds": round(t1 - t0, 1), "unit": "bytes/daemon/min", **w}
        lines.append(line)
        print(
            json.dumps({**line, "link": link, "settings": entrant.peerd_settings, "daemon_env": daemon_env}), flush=True
        )
    idle = lines[0]["non_payload (eth0 - engine)"]
    if args.idle_only:
        metric = "non-payload bytes per daemon per minute, daemons only in the run (no baseline)"
        head = result(BENCH, metric, idle, None, "bytes/daemon/min")
    else:
        train = lines[-1]["non_payload (eth0 - engine)"] if len(lines) > 1 else None
        metric = "non-payload bytes per daemon per minute, training (baseline: idle)"
        head = result(BENCH, metric, train, idle, "bytes/daemon/min")
    emit(head)
    if not args.no_results:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(RESULTS, "a") as f:
            for r in [*lines, head]:
                f.write(
                    json.dumps(
                        {**r, "link": link, "settings": entrant.peerd_settings, "daemon_env": daemon_env, "at": at}
                    )
                    + "\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
