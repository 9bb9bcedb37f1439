"""Local groups across machines in the network lab: two sites of two hosts, each site one local group
(one WAN peer), against the same four hosts as four DiLoCo peers and against the hosts alone, with
the same wall-clock budget.

    sudo .venv/bin/python -m bench.local_groups [--quick] [--seconds 150] [--rate 100] [--rtt-ms 50]
                                                [--loss 1] [--every 50] [--task charlm]

Every host's link to the others (the lab's bridge) is limited to --rate Mbit/s, --rtt-ms and --loss %
(the WAN). The hosts of a site also share a second link, unshaped and apart (the lab's `site`: a
rack's fast network): their daemons run with `--local-group SITE --local-group-host <their address
there>`, so the group's processes average gradients over it at every step and its leader averages
the group's pseudo-gradient over the WAN (docs/algorithms.md, "With a local group of processes").

  (a) sites      h0, h1 in site s0 and h2, h3 in site s1: two local groups under DiLoCo
  (b) peers      the same four hosts, each its own DiLoCo peer (the run's defaults)
  (c) alone      the same hosts, each its own run (the lab's `isolated`)

Per host, as bench.wan_training reports it (bench/wan_training.py `run_setup`): steps, compute
fraction, MB the round engine sent per 1,000 samples, and the eval loss of the host's final
checkpoint. WAN bytes are what the round engine sends (the sites' own links carry the group's
gradients and are not counted); a setup's WAN bytes per sample are its hosts' bytes over its
samples, each group's counted once (by its leading daemon). Headline: WAN bytes per sample, (a) over
(b). `--lanes 2`: each group's two hosts average one lane each over their own WAN links
(peers/dear/delegate.py); the summary lists each host's WAN MB. Needs root (namespaces). The hosts share this machine's cores: every setup has the same four
hosts training, so the comparison is within one CPU budget.

    sudo .venv/bin/python -m bench.local_groups --same-host [--seconds 150] [--every 50] [--task charlm]

One machine's two training processes, in turn, as (a) one daemon's local group (`--train-processes
2`: a Gloo all-reduce of the gradients every step, one peer) against (b) two daemons of one process
each (two peers under DiLoCo), every daemon in one lab host (one network namespace: what the
processes and daemons send each other goes over its loopback, unshaped). Per setup: steps,
samples, MB the round engines sent per 1,000 samples, MB over the loopback per 1,000 samples (all
of it: the group's all-reduce, the daemons' rounds, DHT and state sync), eval, compute fraction,
the peak memory (RSS and PSS) of every daemon, p2pd and training process, the cores the lab's
processes and the whole machine kept busy while the setup trained (what else ran shows as their
difference), and the samples trained per CPU second the setup's processes got (comparable across
runs on a shared machine). Headline: samples per CPU second, (a) over (b).

    sudo .venv/bin/python -m bench.local_groups --same-host --against no-dear [--seconds 150]

The same host's one daemon of two processes, in turn, (a) `--dear`: its group's gradients averaged
under DeAR (docs/dear.md) against (b) `--no-dear` (the default: one Gloo all-reduce after
backward), the same figures per setup, with DeAR's overlap ratio (peerd_dear_overlap_ratio) and
the samples per second of the schedule (wall clock). Headline: samples per CPU second, (a) over (b).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path

import psutil

from bench.common import emit, progress as _progress, result
from bench.wan_training import ALONE_EVERY, TrainingLab, line, run_setup, scenario, untrained
from peerd.daemon.lab.netns import sh

BENCH = "local_groups"
SITES = {"h0": "s0", "h1": "s0", "h2": "s1", "h3": "s1"}
MEMORY_EVERY = 2.0  # seconds between two readings of every process's memory (--same-host)
TWO_DAEMONS, NO_DEAR = "two-daemons", "no-dear"  # --same-host's baselines (--against)


def progress(message: str) -> None:
    _progress(BENCH, message)


def wan_mb(host: dict) -> float:
    """MB a host's round engine sent (bench.wan_training reports it per 1,000 samples)."""
    return host["mb_per_1000_samples"] * max(host["samples"], 1) / 1000


def wan_bytes_per_1000(setup: dict) -> float:
    """MB the round engines of a setup's hosts sent per 1,000 samples its hosts trained on."""
    hosts = setup["hosts"].values()
    mb = sum(wan_mb(h) for h in hosts)
    samples = sum(h["samples"] for h in hosts)
    return mb / max(samples, 1) * 1000


class OneHostLab(TrainingLab):
    """Every daemon of the scenario in its first host's namespace: one machine, whose daemons and
    processes reach each other over its loopback. Reads the peak memory of every process of every
    daemon while it runs, the CPU seconds its processes and the whole machine spent while it trained
    (from the schedule's start to its end), and the loopback's bytes when the daemons have stopped."""

    memory: dict[int, dict]
    loopback_bytes: int = 0
    window: list[tuple[float, float, float]]  # at the schedule's start and end: (time, machine busy, lab CPU s)

    def run(self):
        self.memory, self.window, stop = {}, [], threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), name="memory", daemon=True)
        sampler.start()
        try:
            return super().run()
        finally:
            stop.set()
            sampler.join(30)

    def _build(self) -> None:
        self.net.create()
        first = self.scenario.hosts[0]
        host = self.net.add_host(first.name, first.link, self.scenario.congestion_control)
        for h in self.scenario.hosts[1:]:
            self.net.hosts[h.name] = host  # its daemon starts in the first host's namespace, at its address

    def _processes(self):
        """(host, role, process) of every process of every daemon: the daemon, its p2pd, its training processes."""
        for name, d in list(self.daemons.items()):
            try:
                root = psutil.Process(d.proc.pid)  # `ip netns exec` execs: the daemon itself
                children = root.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            yield name, "daemon", root
            for p in children:
                try:
                    yield name, "train" if "taskproc" in " ".join(p.cmdline()) else p.name(), p  # else p2pd
                except psutil.NoSuchProcess:
                    pass

    def _mark(self) -> None:
        cpu = 0.0
        for _, _, p in self._processes():
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            cpu += t.user + t.system
        self.window.append((time.monotonic(), _busy(), cpu))

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(MEMORY_EVERY):
            if self.t0 and not self.window:
                self._mark()  # the schedule began (every host trains) up to MEMORY_EVERY s ago
            for name, role, p in self._processes():
                try:
                    m = p.memory_full_info()  # PSS too: torch's pages are shared between the processes
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                peak = self.memory.setdefault(p.pid, {"host": name, "role": role, "rss_mb": 0.0, "pss_mb": 0.0})
                peak["rss_mb"] = round(max(peak["rss_mb"], m.rss / 2**20), 1)
                peak["pss_mb"] = round(max(peak["pss_mb"], m.pss / 2**20), 1)

    def _stop_all(self) -> None:
        self._mark()  # the schedule's end, before the daemons stop
        super()._stop_all()

    def _check_checkpoints(self) -> None:
        super()._check_checkpoints()
        ns = self.net.hosts[self.scenario.hosts[0].name].netns
        link = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", "lo"))[0]
        self.loopback_bytes = link["stats64"]["tx"]["bytes"]

    def extras(self) -> dict:
        memory = sorted(self.memory.values(), key=lambda m: (m["host"], m["role"]))
        (t0, busy0, cpu0), (t1, busy1, cpu1) = self.window[0], self.window[-1]
        cores = {"lab": round((cpu1 - cpu0) / (t1 - t0), 2), "machine": round((busy1 - busy0) / (t1 - t0), 2)}
        trained = 0.0  # samples from the schedule's start (the collector's first poll) to its end
        overlap = {}  # each host's DeAR overlap ratio at its last poll that had one
        for host in {s.host for s in self.record.samples}:
            polls = [s.metrics.get("samples", 0.0) for s in self.record.samples if s.host == host]
            trained += polls[-1] - polls[0]
            ratios = [
                s.metrics["dear_overlap_ratio"]
                for s in self.record.samples
                if s.host == host and "dear_overlap_ratio" in s.metrics
            ]
            overlap[host] = round(ratios[-1], 3) if ratios else None
        return {
            "samples_in_schedule": trained,
            "schedule_seconds": round(t1 - t0, 1),
            "dear_overlap_ratio": overlap,
            "memory": memory,
            "loopback_bytes": self.loopback_bytes,
            "cpu_seconds": round(cpu1 - cpu0, 1),  # the lab's processes, while they trained
            "cores_busy": {**cores, "of": psutil.cpu_count()},
        }


def _busy() -> float:
    """CPU seconds this machine's cores have spent busy since boot (nice included: the lab's processes)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq  # guest time is in user already


def same_host_setups(args) -> list[tuple[str, dict]]:
    """--same-host's lab scenarios: (a) one daemon of two processes, (b) two daemons of one; with
    --against no-dear, (a) one daemon of two processes under DeAR, (b) the same without."""
    args.curve, args.rate, args.rtt_ms, args.loss = 0.0, 0.0, 0.0, 0.0  # unshaped: one machine's loopback
    diloco = {"averaging.average_every": args.every}
    group = ("--train-processes", "2")
    if args.against == NO_DEAR:
        return [
            ("a_dear", scenario("a_dear", args, diloco, daemon_args=(*group, "--dear"), hosts=1)),
            ("b_no_dear", scenario("b_no_dear", args, diloco, daemon_args=(*group, "--no-dear"), hosts=1)),
        ]
    return [
        ("a_one_daemon", scenario("a_one_daemon", args, diloco, daemon_args=group, hosts=1)),
        ("b_two_daemons", scenario("b_two_daemons", args, diloco, hosts=2)),
    ]


def same_host(args) -> int:
    """--same-host: its two setups in turn, every daemon in one namespace (OneHostLab)."""
    setups = same_host_setups(args)
    lines = {name: run_setup(name, data, logs=args.logs, lab_class=OneHostLab) for name, data in setups}
    if failed := untrained(lines, args.task):
        for why in failed:
            progress(f"FAILED: {why}")
        return 1
    summary: dict = {"bench": BENCH, "setup": "summary_same_host"}
    for name, out in lines.items():
        hosts = out["hosts"].values()
        samples = sum(h["samples"] for h in hosts)
        memory = out["memory"]
        summary[name] = {
            "steps": [h["steps"] for h in hosts],
            "samples": samples,
            "samples_in_schedule": out["samples_in_schedule"],
            "wan_mb_per_1000_samples": round(wan_bytes_per_1000(out), 4),
            "loopback_mb_per_1000_samples": round(out["loopback_bytes"] / 1e6 / max(samples, 1) * 1000, 3),
            "eval": [h["eval"] for h in hosts],
            "compute_fraction": [h["compute_fraction"] for h in hosts],
            **{
                f"{role}_rss_mb": [m["rss_mb"] for m in memory if m["role"] == role]
                for role in sorted({m["role"] for m in memory})
            },
            "cores_busy": out["cores_busy"],
            # Comparable between runs on a shared machine: what the setup trained for the CPU it got.
            "samples_per_cpu_second": round(out["samples_in_schedule"] / max(out["cpu_seconds"], 1e-9), 1),
            "samples_per_second": round(out["samples_in_schedule"] / max(out["schedule_seconds"], 1e-9), 1),
            "dear_overlap_ratio": list(out["dear_overlap_ratio"].values()),
            "rss_mb_all": round(sum(m["rss_mb"] for m in memory), 1),
            "pss_mb_all": round(sum(m["pss_mb"] for m in memory), 1),
        }
    line(summary)
    # Per CPU second, not per wall-clock second: on a shared machine what each setup trains in its
    # --seconds follows the cores the other tenants leave it (runs 3-7 and 11 in bench/results/local_groups.jsonl).
    a, b = (summary[name]["samples_per_cpu_second"] for name in lines)
    setups = "with DeAR over without" if args.against == NO_DEAR else "over two daemons of one"
    metric = f"samples per CPU second of the setup's processes, one daemon of two processes {setups}"
    emit(result(BENCH, metric, a, b, "samples/CPU s"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.local_groups", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short check: 60 s per setup, no (c)")
    p.add_argument("--seconds", type=float, default=150.0, help="training per setup (default 150)")
    p.add_argument("--rate", type=float, default=100.0, help="each host's WAN link, Mbit/s (default 100)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="added round-trip time on the WAN (default 50)")
    p.add_argument("--loss", type=float, default=1.0, help="%% of the WAN's packets dropped (default 1)")
    p.add_argument("--every", type=int, default=50, help="H, inner steps per phase (default 50)")
    p.add_argument("--task", default="charlm")
    p.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="averaging.lanes of (a) and (b): with 2, each of a group's hosts averages one",
    )
    p.add_argument("--logs", type=Path, default=None, help="keep each host's daemon log under this directory")
    p.add_argument(
        "--same-host",
        action="store_true",
        help="one host's two processes: one daemon's local group against two daemons (no WAN shaping)",
    )
    p.add_argument(
        "--against",
        choices=(TWO_DAEMONS, NO_DEAR),
        default=TWO_DAEMONS,
        help="--same-host's baseline: two daemons of one process, or the one daemon without DeAR (--no-dear)",
    )
    args = p.parse_args(argv)
    if args.same_host:
        return same_host(args)
    if args.quick:
        args.seconds = 60.0
    # What bench.wan_training's scenario() reads.
    args.hosts, args.curve = len(SITES), 0.0
    diloco = {"averaging.average_every": args.every, "averaging.lanes": args.lanes}
    sites = scenario("a_sites", args, diloco)
    for host in sites["host"]:
        host["site"] = SITES[host["name"]]
    setups = [("a_sites", sites), ("b_peers", scenario("b_peers", args, diloco))]
    if not args.quick:
        alone = {"averaging.algorithm": "state", "averaging.average_every": ALONE_EVERY, "averaging.first_phase": 0}
        setups.append(("c_alone", scenario("c_alone", args, alone, isolated=True)))  # as bench.wan_training's (c)
    lines = {name: run_setup(name, data, logs=args.logs) for name, data in setups}
    if failed := untrained(lines, args.task):
        for why in failed:
            progress(f"FAILED: {why}")
        return 1
    a, b = lines["a_sites"], lines["b_peers"]
    ours, base = wan_bytes_per_1000(a), wan_bytes_per_1000(b)
    summary = {
        "bench": BENCH,
        "setup": "summary",
        "wan_mb_per_1000_samples": {"a": round(ours, 4), "b": round(base, 4)},
        "lanes": args.lanes,
        # How (a)'s WAN bytes spread over its hosts' links: with lanes, each group's hosts share them.
        "wan_mb_by_host_a": {name: round(wan_mb(h), 3) for name, h in a["hosts"].items()},
    }
    for name, out in lines.items():  # means over the hosts
        for key in ("eval", "compute_fraction", "steps"):
            values = [h[key] for h in out["hosts"].values() if not math.isnan(h[key])]
            summary[f"{key}_{name}"] = round(sum(values) / max(len(values), 1), 4)
    line(summary)
    emit(result(BENCH, "WAN bytes per sample, two sites' local groups over four peers", ours, base, "MB/1000 samples"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
