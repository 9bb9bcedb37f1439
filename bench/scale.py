"""N real daemons on one machine: does Moshpit form full groups, and which part of what fails is CPU?

    python -m bench.scale [--daemons 8,16,32] [--seconds 90] [--idle-seconds 20] [--max-group-size 4]

For each N, one at a time: N `peerd start` subprocesses (peerd.daemon.procs.LocalDaemon) on
loopback, the daemons' own discovery settings (heartbeat 2 s, refresh 1 s, peer TTL 10 s).

1. **Idle.** They start in a run with no task (discovery only: heartbeats and table reads, no torch
   in the daemon, no training process). Reported: seconds from the last daemon ready until every
   daemon lists every other (ListPeers), then over `--idle-seconds` the CPU of each daemon tree
   (daemon + p2pd), its RSS and its DHT requests.
2. **Training.** Each daemon joins a second run (the first creates it: `--task`, by default
   paced-digits, `averaging.max_group_size`, `averaging.average_every` H, every phase H long), with
   `--min-peers N` so that the N training processes start together, and leaves the idle run. Once
   all N train, for `--seconds`: each daemon's status is polled every POLL s (round number, outcome,
   group size), and at the end /metrics gives the rounds by outcome, the round durations
   (peerd_round_duration_seconds), the local steps and the DHT requests (peerd_dht_requests_total),
   and /proc the CPU and RSS of each tree (daemon, p2pd, training process).

The load: paced-digits (bench/paced_task.py) is digits-mlp (0.04 M parameters, `--torch-threads 1`)
whose steps are paced to `--steps-per-second` (20): a step costs about 0.5 ms of a core, so the
steps of a training process cost about 1 % of a core, and its process about 3 % with its attachment
to the daemon (measured at N = 4); with H = 100 a round starts every 5 s. Unpaced (`--task
digits-mlp`) each training process steps as fast as its share of the cores allows (about 400
steps/s alone), which saturates 2 cores from a few daemons on, as in the issue's runs. Each line
says how busy the machine was (all cores, /proc/stat), how much of it the daemons and p2pd (the
protocol) and the training processes took, and what else ran (not ours): where the machine is
saturated, a failed round may be CPU; where it is not, it is the protocol.

A full group is the size the grid of N peers with groups of at most --max-group-size gives round t
(peers/moshpit.grid_shape(N, G).sides[t mod d]: 4 x 2 for 8, 4 x 4 for 16, 4 x 4 x 2 for 32, at
G = 4), the size every member's round would have if every view held all N peers and every mate met.
The headline: the share of rounds seen by the status polls that completed with a full group at the
largest N, against the issue's target 0.95 as the baseline (issue 28). Every process started here is
killed on exit, Ctrl-C or SIGTERM. Figures and what they mean: docs/benchmarks.md, "Scale".
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import math
import os
import resource
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import paced_task
from bench.common import emit, interrupt_on_signals, median, progress, result
from peerd.daemon.client import ControlClient
from peerd.daemon.procs import LocalDaemon
from peerd.peers.moshpit import grid_shape

BENCH = "scale"
IDLE_RUN, RUN = "scale-idle", "scale"
ROOT = Path(__file__).resolve().parent.parent
FULL_TARGET = 0.95  # issue 28: at 32 daemons, at least 95 % of rounds complete with a full group
IDLE_CPU_TARGET = 0.02  # issue 28: idle CPU per daemon under 2 % of a core
HEARTBEAT = 2.0  # seconds, the daemon's default --heartbeat-interval (not passed)
SEES_TARGET = 3 * HEARTBEAT  # issue 28: every daemon sees every other within 3 heartbeats
DAEMON_ARGS = ["--torch-threads", "1", "--eval-every", "1000", "--checkpoint-every", "1000", "--progress-interval", "0"]
CALL_TIMEOUT = 5.0  # seconds for one Status or ListPeers call (a loaded machine answers slowly)
JOIN_TIMEOUT = 60.0  # seconds for one JoinRun: a DHT read of the manifest, the first creates it; torch loads
DISCOVERY_TIMEOUT = 60.0  # seconds from the last ready to every daemon listing every other: 30 heartbeats
IDLE_SETTLE = 5.0  # seconds between every daemon listing every other and the idle window: starts settle
POLL = 0.5  # seconds between two sweeps of status calls while training (rounds are seconds apart)


def ready_timeout(n: int) -> float:
    """Seconds from spawning N daemons at once to every ready.json: each start costs about 3 s of
    CPU (imports, p2pd twice) on a machine of 2 cores, with margin."""
    return 60.0 + 5.0 * n


def train_timeout(n: int) -> float:
    """Seconds from the joins to all N daemons training: torch loads in N daemons and N training
    processes (about 4 s of CPU each), then the processes wait for each other (--min-peers)."""
    return 90.0 + 10.0 * n


# ---- process trees, machine ---------------------------------------------------------------------


def spread(xs: list[float]) -> dict[str, float]:
    """Median and largest of per-daemon figures, rounded for the JSON lines."""
    return {"median": round(median(xs), 4), "max": round(max(xs), 4)}


def tree(daemon: LocalDaemon) -> dict[str, list[psutil.Process]]:
    """The daemon's process and its descendants by part: daemon, p2pd, training (its Python child)."""
    parts: dict[str, list[psutil.Process]] = {"daemon": [], "p2pd": [], "training": []}
    try:
        root = psutil.Process(daemon.pid)
        parts["daemon"].append(root)
        for p in root.children(recursive=True):
            parts["p2pd" if p.name().startswith("p2pd") else "training"].append(p)
    except psutil.Error:
        pass
    return parts


def cpu_seconds(daemon: LocalDaemon) -> dict[int, tuple[str, float]]:
    """pid -> (part, user + system CPU seconds so far), for every process of the daemon's tree."""
    out = {}
    for part, procs in tree(daemon).items():
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = (part, t.user + t.system)
            except psutil.Error:
                pass
    return out


def cpu_share(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Share of one core each part used between two cpu_seconds() readings; a process started
    in between counts from zero, one that ended in between is not counted."""
    share = {"daemon": 0.0, "p2pd": 0.0, "training": 0.0}
    for pid, (part, t) in after.items():
        share[part] += (t - before.get(pid, (part, 0.0))[1]) / seconds
    share["tree"] = sum(share.values())
    return {k: round(v, 4) for k, v in share.items()}


def rss_mib(daemon: LocalDaemon) -> dict[str, float]:
    out = {}
    for part, procs in tree(daemon).items():
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        out[part] = round(total / 2**20, 1)
    out["tree"] = round(sum(out.values()), 1)
    return out


def machine_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores since boot, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def own_cpu() -> float:
    """CPU seconds of this benchmark process (its status polls)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Window:
    """CPU of every tree, of the machine and of this process, and DHT requests, between two moments."""

    def __init__(self, daemons: list[LocalDaemon]):
        self.daemons = daemons
        self.t0 = time.monotonic()
        self.cpu0 = [cpu_seconds(d) for d in daemons]
        self.machine0 = machine_times()
        self.own0 = own_cpu()
        self.dht0 = [dht_requests(d) for d in daemons]

    def close(self) -> dict:
        seconds = time.monotonic() - self.t0
        shares = [cpu_share(b, cpu_seconds(d), seconds) for b, d in zip(self.cpu0, self.daemons)]
        (busy1, total1), (busy0, total0) = machine_times(), self.machine0
        cores = psutil.cpu_count()
        machine_busy = (busy1 - busy0) / (total1 - total0) * cores  # cores' worth of busy CPU
        ours = sum(s["tree"] for s in shares)
        own = (own_cpu() - self.own0) / seconds
        per_minute = [
            {op: round((n - b.get(op, 0)) * 60 / seconds, 1) for op, n in dht_requests(d).items()}
            for b, d in zip(self.dht0, self.daemons)
        ]
        totals = [sum(x.values()) for x in per_minute]
        return {
            "seconds": round(seconds, 1),
            "cpu_core_share_per_tree": {
                part: spread([s[part] for s in shares]) for part in ("daemon", "p2pd", "training", "tree")
            },
            "machine": {
                "cores": cores,
                "busy_cores": round(machine_busy, 2),
                "daemon_trees_cores": round(ours, 2),
                "protocol_cores": round(sum(s["daemon"] + s["p2pd"] for s in shares), 2),
                "training_cores": round(sum(s["training"] for s in shares), 2),
                "this_bench_cores": round(own, 3),
                "other_cores": round(machine_busy - ours - own, 2),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            },
            "dht_requests_per_daemon_per_minute": {
                **spread(totals),
                "by_op_median": {op: round(median([x[op] for x in per_minute]), 1) for op in sorted(per_minute[0])},
            },
        }


# ---- the daemons' own figures -------------------------------------------------------------------


def scrape(d: LocalDaemon) -> dict[tuple[str, tuple], float]:
    """One /metrics scrape as {(sample name, sorted label items): value}."""
    with urllib.request.urlopen(d.metrics_url, timeout=CALL_TIMEOUT) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def dht_requests(d: LocalDaemon) -> dict[str, float]:
    """op -> DHT requests this daemon made so far, every result (peerd_dht_requests_total)."""
    out: dict[str, float] = collections.Counter()
    for (name, labels), v in scrape(d).items():
        if name == "peerd_dht_requests_total":
            out[dict(labels)["op"]] += v
    return dict(out)


def histogram_quantiles(buckets: dict[float, float], qs=(0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """Quantiles of a cumulative Prometheus histogram (upper bound -> count), interpolated linearly
    inside a bucket as PromQL's histogram_quantile does; the top finite bound for the +Inf bucket."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    out: dict[str, float | None] = {}
    for q in qs:
        if not total:
            out[f"p{round(q * 100)}"] = None
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for b in bounds:
            if buckets[b] >= rank:
                if math.isinf(b):
                    value = lower
                else:
                    inside = buckets[b] - below
                    value = lower + (b - lower) * ((rank - below) / inside if inside else 1.0)
                break
            lower, below = b, buckets[b]
        out[f"p{round(q * 100)}"] = round(value, 3)
    return out


def round_metrics(metrics: list[dict]) -> dict:
    """Rounds by outcome per daemon, and the round durations of all daemons together, from /metrics."""
    outcomes, buckets, missed, steps = [], collections.Counter(), [], []
    for m in metrics:
        mine, counts = collections.Counter(), collections.Counter()  # a series not created yet reads 0
        for (name, labels), v in m.items():
            labels = dict(labels)
            if labels.get("run") != RUN:
                continue
            if name == "peerd_rounds_total":
                mine[labels["outcome"]] += v
            elif name == "peerd_round_duration_seconds_bucket":
                buckets[float(labels["le"])] += v
            elif name in ("peerd_rounds_missed_total", "peerd_local_steps_total"):
                counts[name] += v
        outcomes.append(dict(mine))
        missed.append(counts["peerd_rounds_missed_total"])
        steps.append(counts["peerd_local_steps_total"])
    return {"outcomes": outcomes, "duration": histogram_quantiles(dict(buckets)), "missed": missed, "steps": steps}


def register_paced_task(base: Path) -> Path:
    """A folder that, on a daemon's PYTHONPATH, installs bench/paced_task.py as the task
    paced-digits (the `peerd.tasks` entry point of a dist-info of its own); returns the folder."""
    folder = base / "plugins"
    info = folder / "peerd_bench_paced-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: peerd-bench-paced\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[peerd.tasks]\n{paced_task.ENTRY_POINT}\n")
    return folder


def full_size(shape, t: int) -> int:
    """The group size of round t on the grid `shape` when every view holds all peers: sides[t mod d]."""
    return shape.sides[t % shape.d]


def classify(seen: list[dict[int, tuple[str, int]]], shape) -> list[tuple[int, bool]]:
    """(grid dimension, completed with a full group) for every polled round of every daemon."""
    return [
        (t % shape.d, outcome == "completed" and size == full_size(shape, t))
        for s in seen
        for t, (outcome, size) in s.items()
    ]


# ---- one N ---------------------------------------------------------------------------------------


class Scale:
    def __init__(self, base: Path, args):
        self.base, self.args = base, args
        self.env = {"PYTHONPATH": os.pathsep.join([str(register_paced_task(base)), str(ROOT)])}
        self.daemons: list[LocalDaemon] = []  # of the running N, for the kill
        self.clients: list[ControlClient] = []

    def cleanup(self) -> None:
        for c in self.clients:
            c.__exit__()
        for d in self.daemons:
            d.kill_group()
        self.clients, self.daemons = [], []

    def start(self, n: int) -> None:
        """Start N daemons in the idle run, the others bootstrapped from the first, and wait (bounded)
        until all are ready."""
        args = ["--run", IDLE_RUN, "--min-peers", str(n), *DAEMON_ARGS]
        first = LocalDaemon(self.base / f"n{n}-0", args, env=self.env)
        self.daemons.append(first)
        first.start(wait=True)
        for i in range(1, n):
            d = LocalDaemon(self.base / f"n{n}-{i}", [*args, "--initial-peers", first.maddrs[0]], env=self.env)
            self.daemons.append(d)
            d.start(wait=False)
        deadline = time.monotonic() + ready_timeout(n)
        while not all(d.poll_ready() for d in self.daemons):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} daemons not ready within {ready_timeout(n):.0f} s")
            time.sleep(0.1)
        self.clients = [ControlClient(d.control, timeout=CALL_TIMEOUT) for d in self.daemons]

    def wait_mutual(self, run: str, timeout: float) -> float:
        """Seconds until each daemon lists exactly the others in `run`."""
        t0 = time.monotonic()
        want = [{o.peer_id for o in self.daemons if o is not d} for d in self.daemons]
        pending = set(range(len(self.daemons)))
        while pending:
            for i in sorted(pending):
                try:
                    listed = {p.peer_id for p in self.clients[i].list_peers(run).peers}
                except grpc.RpcError:  # a busy daemon missed one call: the next sweep asks again
                    continue
                if listed == want[i]:
                    pending.discard(i)  # tables only grow here: nobody leaves or goes silent
            if pending and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{len(pending)} of {len(self.daemons)} daemons miss peers after {timeout:.0f} s")
            if pending:
                time.sleep(0.1)
        return time.monotonic() - t0

    def join(self) -> float:
        """The first daemon creates the training run, then the others join it at once (threads: each
        join loads torch in its daemon); every daemon leaves the idle run. Returns the seconds the
        first join took."""
        settings = {
            "averaging.max_group_size": str(self.args.max_group_size),
            "averaging.average_every": str(self.args.average_every),
            "averaging.first_phase": "0",  # every phase is H: a steady round rate
        }
        if self.args.task == paced_task.NAME:
            settings["steps_per_second"] = str(self.args.steps_per_second)

        def join(c: ControlClient, task: str = "", settings: dict | None = None) -> None:
            c.timeout = JOIN_TIMEOUT
            c.join(RUN, task=task, settings=settings)
            c.leave(IDLE_RUN)
            c.timeout = CALL_TIMEOUT

        t0 = time.monotonic()
        join(self.clients[0], self.args.task, settings)  # before the others, so that they find its manifest
        first = time.monotonic() - t0
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            for f in [pool.submit(join, c) for c in self.clients[1:]]:
                f.result()
        return first

    def statuses(self) -> list:
        out = []
        for c in self.clients:
            try:
                out.append(next((r for r in c.status().runs if r.run_id == RUN), None))
            except grpc.RpcError:  # a busy daemon missed one poll: the next sweep reads it
                out.append(None)
        return out

    def wait_training(self, n: int) -> float:
        t0 = time.monotonic()
        while True:
            states = [r.train_state if r else "" for r in self.statuses()]
            if all(s == "TRAINING" for s in states):
                return time.monotonic() - t0
            if time.monotonic() - t0 > train_timeout(n):
                raise TimeoutError(f"not all {n} daemons training after {train_timeout(n):.0f} s: {states}")
            time.sleep(POLL)

    def poll_rounds(self, seconds: float) -> list[dict[int, tuple[str, int]]]:
        """Per daemon, round -> (outcome, group size) of every round its status showed as the last one,
        polled every POLL s for `seconds` (a round lasts seconds: a poll sees each)."""
        seen: list[dict[int, tuple[str, int]]] = [{} for _ in self.daemons]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for i, r in enumerate(self.statuses()):
                if r is not None and r.last_round_outcome:
                    seen[i][r.last_round] = (r.last_round_outcome, r.group_size)
            time.sleep(POLL)
        return seen

    def measure(self, n: int) -> list[dict]:
        shape = grid_shape(n, self.args.max_group_size)
        progress(BENCH, f"N = {n}: starting (grid {shape})")
        self.start(n)
        sees_s = self.wait_mutual(IDLE_RUN, DISCOVERY_TIMEOUT)
        progress(BENCH, f"N = {n}: every daemon lists every other {sees_s:.1f} s after the last was ready")
        time.sleep(IDLE_SETTLE)
        idle = Window(self.daemons)
        time.sleep(self.args.idle_seconds)
        idle_figures = idle.close()
        idle_rss = [rss_mib(d) for d in self.daemons]
        progress(BENCH, f"N = {n}: idle {idle_figures['cpu_core_share_per_tree']['tree']} of a core per tree")

        t_join = time.monotonic()
        first = self.join()
        joined = time.monotonic() - t_join
        to_train = self.wait_training(n)
        progress(
            BENCH,
            f"N = {n}: the first join took {first:.1f} s, all {joined:.1f} s; all training {to_train:.1f} s later",
        )
        before = [scrape(d) for d in self.daemons]
        training = Window(self.daemons)
        seen = self.poll_rounds(self.args.seconds)
        training_figures = training.close()
        train_rss = [rss_mib(d) for d in self.daemons]
        after = [scrape(d) for d in self.daemons]
        return self.lines(
            n, shape, sees_s, idle_figures, idle_rss, to_train, training_figures, train_rss, before, after, seen, joined
        )

    def lines(self, n, shape, sees_s, idle, idle_rss, to_train, training, train_rss, before, after, seen, joined):
        counted_before, counted_after = round_metrics(before), round_metrics(after)
        outcomes = [
            {k: v - b.get(k, 0) for k, v in a.items()}
            for a, b in zip(counted_after["outcomes"], counted_before["outcomes"])
        ]
        rounds = [sum(o.values()) for o in outcomes]
        completed = [o.get("completed", 0) for o in outcomes]
        polled = [(t, outcome, size) for s in seen for t, (outcome, size) in s.items()]
        full_rounds = sum(full for _, full in classify(seen, shape))
        share = round(full_rounds / len(polled), 3) if polled else None
        sizes: dict[int, dict[int, int]] = {}
        for t, _, size in polled:
            sizes.setdefault(full_size(shape, t), collections.Counter())[size] += 1
        # Durations from the end scrape alone: the counters start at the join, a few rounds before the window.
        duration = counted_after["duration"]
        common = {"n": n, "grid": str(shape), "max_group_size": self.args.max_group_size}
        return [
            result(
                BENCH,
                "sees_every_other_s",
                round(sees_s, 2),
                SEES_TARGET,
                "s",
                **common,
                heartbeat_s=HEARTBEAT,
                note="seconds from the last daemon ready to every daemon listing every other (ListPeers, "
                "swept every 0.1 s); baseline: the issue's target, 3 heartbeats; lower is better",
            ),
            result(
                BENCH,
                "idle_cpu_core_share_per_tree",
                idle["cpu_core_share_per_tree"]["tree"]["median"],
                IDLE_CPU_TARGET,
                "cores",
                **common,
                **idle,
                rss_mib={part: spread([r[part] for r in idle_rss]) for part in ("daemon", "p2pd", "tree")},
                note="median over daemons of the CPU of daemon + p2pd, as a share of one core, idle in a run "
                "with no task (heartbeats and table reads only); baseline: the issue's target 0.02; "
                "the machine's figures say what else ran",
            ),
            result(
                BENCH,
                "training_cpu_core_share_per_tree",
                training["cpu_core_share_per_tree"]["tree"]["median"],
                None,
                "cores",
                **common,
                **training,
                local_steps_per_second=median(
                    [
                        round((a - b) / training["seconds"], 1)
                        for a, b in zip(counted_after["steps"], counted_before["steps"])
                    ]
                ),
                seconds_to_join=round(joined, 1),
                seconds_to_train=round(to_train, 1),
                rss_mib={part: spread([r[part] for r in train_rss]) for part in ("daemon", "p2pd", "training", "tree")},
                note="median over daemons of the CPU of daemon + p2pd + training process while training, as "
                "a share of one core; no baseline; the task's steps are paced to steps_per_second "
                "(paced-digits), else take what the cores leave",
            ),
            result(
                BENCH,
                "full_group_share",
                share,
                FULL_TARGET,
                "fraction",
                **common,
                rounds_polled=len(polled),
                rounds_counted=sum(rounds),
                full_rounds=full_rounds,
                rounds_per_daemon={**spread(rounds), "min": min(rounds)},
                completed_share=round(sum(completed) / sum(rounds), 3) if sum(rounds) else None,
                outcomes={k: sum(o.get(k, 0) for o in outcomes) for k in sorted({k for o in outcomes for k in o})},
                missed=sum(a - b for a, b in zip(counted_after["missed"], counted_before["missed"])),
                group_sizes_by_full_size={str(k): dict(sorted(v.items())) for k, v in sorted(sizes.items())},
                round_duration_s=duration,
                seconds=self.args.seconds,
                average_every=self.args.average_every,
                task=self.args.task,
                steps_per_second=self.args.steps_per_second if self.args.task == paced_task.NAME else None,
                poll_s=POLL,
                note=f"share of the rounds seen by status polls (every daemon, every {POLL} s) that completed "
                f"with the grid's full group (grid {shape} of {n} peers: sides[t mod d] members in round t); "
                "rounds_counted: peerd_rounds_total over the window; round_duration_s: quantiles of "
                "peerd_round_duration_seconds (rounds that formed a group, matchmaking excluded), all "
                "daemons, from the join on; baseline: the issue's target 0.95",
            ),
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemons", default="8,16", help="comma-separated daemon counts, one run each (default 8,16)")
    parser.add_argument("--seconds", type=float, default=90.0, help="training window per N (default 90)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="idle window per N (default 20)")
    parser.add_argument("--max-group-size", type=int, default=4, help="averaging.max_group_size (default 4)")
    parser.add_argument("--average-every", type=int, default=100, help="averaging.average_every, H (default 100)")
    parser.add_argument(
        "--task",
        default=paced_task.NAME,
        help=f"{paced_task.NAME} (default: digits-mlp paced, see --steps-per-second) or an installed task, unpaced",
    )
    parser.add_argument("--steps-per-second", type=float, default=20.0, help=f"pace of {paced_task.NAME} (default 20)")
    args = parser.parse_args(argv)
    counts = sorted(int(x) for x in args.daemons.split(","))  # the largest last: its line is the headline
    interrupt_on_signals()
    base = Path(tempfile.mkdtemp(prefix="peerd-scale-"))
    scale = Scale(base, args)
    records: list[dict] = []
    try:
        for n in counts:
            try:
                lines = scale.measure(n)
            except (TimeoutError, RuntimeError, OSError, grpc.RpcError) as e:
                progress(BENCH, f"N = {n} failed: {type(e).__name__}: {e}")
                lines = [
                    result(
                        BENCH,
                        "full_group_share",
                        None,
                        FULL_TARGET,
                        "fraction",
                        n=n,
                        ok=False,
                        error=f"{type(e).__name__}: {e}",
                    )
                ]
            finally:
                scale.cleanup()
            for r in lines:  # each N's last line is its full-group share
                emit(r)
            records.append(lines)
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; killing every process started here")
        return 130
    finally:
        scale.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r.get("ok", True) for lines in records for r in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
