"""The judge: peerd against hivemind, torchft and the hosts alone, on the same lab, model, data and time.

    sudo .venv/bin/python -m bench.vs_peers [--quick] [--hosts 3] [--rate-mbit 100] [--rtt-ms 50]
                                            [--loss-pct 1] [--seconds 120] [--every 50]
                                            [--restart-every N] [--systems peerd,hivemind,torchft,alone]
                                            [--peerd-settings KEY=VALUE,... [--peerd-settings ...]]
                                            [--plot FILE.png]

Each system trains the charlm task's model (the same initial parameters on every host, each host its
own data order, the task's AdamW as the inner optimizer, H = --every) on --hosts hosts of a fresh
`peerd lab` network (daemon/lab/netns.py: every link --rate-mbit Mbit/s both ways, --loss-pct % of
the packets delivered to a host dropped, --rtt-ms between hosts from the delay lines, TCP BBR), for
--seconds of training, one system after the other:

  peerd     a daemon per host and the plain script's peerd.torch.Optimizer (the run's defaults, H,
            overlap on, which a run a script creates must ask for, and --peerd-settings over them).
            --peerd-settings given more than once runs peerd once per value, one after the other
            in --systems' place of peerd: the first is the line "peerd", the others its variants,
            "peerd:" and their settings (peerd:payload=int2); the headline is the first's
  hivemind  hivemind.Optimizer, use_local_updates=True, target_batch_size = hosts x batch x H (a
            round when the hosts took about H steps each), DHT on the host's address, no UPnP/AutoNAT
  torchft   torchft's DiLoCo (torchft.local_sgd), a Manager per host over gloo, its Lighthouse on the
            first host, set up as torchft's own tests do (the `bench` extra installs it)
  alone     the same loop, no communication: what the hosts' compute gives without peers

The loop is bench/vs_peers_host.py, one process per host in its namespace; training starts at one
moment on every host once all are set up (at the links' RTT and loss, their rate unlimited: the rate
applies from the start of training), and ends at the deadline. Per system: steps per host,
MB sent per host per 1,000 samples (the host's eth0 transmit counter over the training time, the
same count for every system), the eval (charlm's held-out bits per character, lower is better) of
the model each host holds at the end, and its curve: every host's model is saved every
--snapshot-every seconds and evaluated after the run; and where the time went: each loop's seconds
in forward + backward, in the system's step and on the CPU, the cores each kind of process used
(cpu_split), peerd's daemons' compute fraction and rounds. With --restart-every N the last host is
killed (every process of it) and restarted every N s. A system whose set-up takes over
SETUP_TIMEOUT, whose process exits with an error, or that is still running GRACE seconds after the
deadline is reported failed (with the reason), and every process is killed when its lab is removed.

JSON lines: one per system, then the headline: the time peerd takes to reach the best competitor's
final eval over the time that competitor takes to reach it (peerd's variants are not competitors;
each line has its own time to that eval). Raw lines are appended to bench/results/vs_peers.jsonl (not
with --quick); --plot draws every system's curve. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.common import emit, interrupt_on_signals, progress as _progress, result
from peerd.daemon import SOURCE_ROOT
from peerd.daemon.lab.netns import Host, LinkShape, Network, environment_problem
from peerd.daemon.lab.runner import spawn_in

BENCH = "vs_peers"
RUN = "vs-peers"  # peerd's run ID (the loops' default --run)
SYSTEMS = ("peerd", "hivemind", "torchft", "alone")
RESULTS = Path(__file__).parent / "results" / "vs_peers.jsonl"
SETUP_TIMEOUT = 150.0  # seconds for every host of a system to be ready to train (daemons, DHT, attach)
GRACE = 30.0  # seconds after the deadline for a host to report its last snapshot
EXIT_GRACE = 5.0  # seconds after that for its processes to exit on their own, before they are killed
START_AHEAD = 1.0  # seconds between writing go.json and the shared start
POLL = 0.2  # seconds between two looks at the hosts' event files
# peerd's run settings beyond H, under --peerd-settings: overlap, the default of every run but one a
# script creates (which waits for its rounds unless it asks: docs/your-loop.md), and the design's
# (docs/benchmarks.md).
PEERD_SETTINGS = {"overlap": "true"}


def progress(message: str) -> None:
    _progress(BENCH, message)


@dataclass(slots=True)
class HostRun:
    """One host's processes (the training loop; peerd: its daemon too) and what became of them."""

    host: Host
    incarnation: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    daemon: object = None  # peerd: the LocalDaemon
    exits: list[int | None] = field(default_factory=list)  # exit codes of processes that ended or were killed

    def kill(self) -> None:
        """SIGKILL every process group of this host (the loop and, for peerd, the daemon and its p2pd)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
            self.exits.append(p.returncode)
        self.procs = []


class SystemFailed(RuntimeError):
    """The system could not be set up or run in its bounds; the message says why."""


@dataclass(frozen=True, slots=True)
class Entrant:
    """One line of the comparison: a system, and for peerd the run's settings beyond H."""

    name: str  # the line's "system": peerd, hivemind, ..., or a peerd variant, "peerd:payload=int2"
    system: str  # one of SYSTEMS: what runs
    peerd_settings: str = ""  # peerd: KEY=VALUE,... as the loop passes them to peerd.torch.Optimizer


def entrants(systems: list[str], peerd_settings: list[str]) -> list[Entrant]:
    """--systems in order, peerd once per --peerd-settings (PEERD_SETTINGS under each): the first is
    "peerd", the others "peerd:" and the settings as given."""
    out = []
    for system in systems:
        if system != "peerd":
            out.append(Entrant(system, system))
            continue
        for i, given in enumerate(peerd_settings):
            settings = {**PEERD_SETTINGS, **dict(kv.split("=", 1) for kv in given.split(",") if kv)}
            joined = ",".join(f"{k}={v}" for k, v in settings.items())
            out.append(Entrant("peerd" if i == 0 else f"peerd:{given}", "peerd", joined))
    if len({e.name for e in out}) < len(out):
        raise ValueError("two lines of the same name: give each --peerd-settings once")
    return out


class SystemRun:
    """One system in one lab: build, set up, train until the deadline, collect; the lab always removed."""

    def __init__(self, entrant: Entrant, args, out: Path):
        self.entrant, self.system, self.args, self.out = entrant, entrant.system, args, out
        self.net = Network()
        self.hosts: list[HostRun] = []
        self.lighthouse: subprocess.Popen | None = None
        self.bytes: dict[str, int] = {}
        self.restarts = 0
        self.setup_s = 0.0
        self.start = 0.0  # wall-clock time training starts on every host
        self.cpu: dict[str, float] = {}  # process kind: cores used over the training time (cpu_split)
        self.daemon_metrics: dict[str, dict[str, float]] = {}  # peerd: host: its daemon's figures at the deadline

    def run(self) -> None:
        try:
            self.net.create()
            shape = LinkShape(rate_mbit=self.args.rate_mbit, loss_pct=self.args.loss_pct, rtt_ms=self.args.rtt_ms)
            # Set up at any rate, trained at --rate-mbit: the budget starts with every host of every
            # system ready (a peerd joiner first downloads the run's state, 8 bytes a parameter: 3.8 MB
            # for charlm, about a minute at 1 Mbit/s for two joiners; its attach waits on while the
            # download makes progress, daemon/attached.py ATTACH_PATIENCE).
            unlimited = dataclasses.replace(shape, rate_mbit=0.0)
            for i in range(self.args.hosts):
                self.hosts.append(HostRun(self.net.add_host(f"h{i}", unlimited, congestion_control="bbr")))
            began = time.monotonic()
            self._set_up()
            self.setup_s = time.monotonic() - began
            for h in self.hosts:
                self.net.shape(h.host.name, shape)
            progress(
                f"{self.entrant.name}: every host ready after {self.setup_s:.1f} s; {self.args.seconds:.0f} s of training"
            )
            before = {h.host.name: self.net.link_stats(h.host.name)["tx_bytes"] for h in self.hosts}
            self.start = start = time.time() + START_AHEAD
            deadline = start + self.args.seconds
            tmp = self.out / "go.tmp"
            tmp.write_text(json.dumps({"start": start, "deadline": deadline}))
            os.replace(tmp, self.out / "go.json")
            self._train_until(start, deadline)
            after = {h.host.name: self.net.link_stats(h.host.name)["tx_bytes"] for h in self.hosts}
            self.bytes = {name: after[name] - before[name] for name in before}
            self._let_exit()
        finally:
            for h in self.hosts:
                h.kill()
            if self.lighthouse is not None:
                self.lighthouse.kill()
                self.lighthouse.wait(10)
            if self.args.logs:
                self._keep_logs()
            removed = self.net.destroy()
            progress(f"{self.entrant.name}: lab {self.net.name} removed ({len(removed)} items)")

    # ---- set-up ---------------------------------------------------------------------------------

    def _set_up(self) -> None:
        deadline = time.monotonic() + SETUP_TIMEOUT
        if self.system == "torchft":
            address = self.out / "lighthouse.json"
            self.lighthouse = self._popen(
                self.hosts[0].host,
                ["lighthouse", "--out", str(address), "--ip", self.hosts[0].host.ip],
                self.out / "lighthouse.log",
            )
            self._wait(lambda: address.exists(), deadline, "torchft's lighthouse", [self.lighthouse])
        if self.system == "peerd":
            for h in self.hosts:
                self._start_daemon(h)
        # The first host first: it creates peerd's run and starts hivemind's DHT; then the others.
        self._start_loop(self.hosts[0])
        self._wait(lambda: self._ready(self.hosts[0]), deadline, "h0 to be ready", self.hosts[0].procs)
        for h in self.hosts[1:]:
            self._start_loop(h)
        for h in self.hosts[1:]:
            self._wait(lambda: self._ready(h), deadline, f"{h.host.name} to be ready", h.procs)

    def _start_daemon(self, h: HostRun) -> None:
        # The daemon's own defaults (not the lab's faster discovery, DAEMON_DEFAULTS, which costs CPU
        # the hosts share here), but one torch thread, as every loop has.
        args = ["--torch-threads", "1", "--run", RUN]
        if h.host.index:
            args += ["--initial-peers", *self.hosts[0].daemon.maddrs]
        data_dir = self.net.dir / "hosts" / h.host.name
        h.daemon = spawn_in(h.host, data_dir, args)
        h.procs.append(h.daemon.proc)
        h.daemon.wait_ready(SETUP_TIMEOUT)

    def _start_loop(self, h: HostRun) -> None:
        a = self.args
        argv = ["train", "--system", self.system, "--out", str(self.out), "--index", str(h.host.index)]
        argv += ["--ip", h.host.ip, "--hosts", str(a.hosts), "--every", str(a.every)]
        argv += ["--incarnation", str(h.incarnation), "--snapshot-every", str(a.snapshot_every)]
        if self.system == "peerd":
            argv += ["--daemon", str(h.daemon.data_dir), "--settings", self.entrant.peerd_settings]
        elif self.system == "hivemind":
            argv += ["--initial-peers", str(self.out / "h0.maddrs")]
        elif self.system == "torchft":
            argv += ["--lighthouse", json.loads((self.out / "lighthouse.json").read_text())["address"]]
        h.procs.append(self._popen(h.host, argv, self.out / f"{h.host.name}-{h.incarnation}.log"))

    def _popen(self, host: Host, argv: list[str], log: Path) -> subprocess.Popen:
        cmd = [*host.exec_prefix(), sys.executable, "-m", "bench.vs_peers_host", *argv]
        with open(log, "ab") as f:
            # Own session: killed with its children (hivemind's p2pd, torchft's threads) as one group.
            return subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=SOURCE_ROOT,
            )

    def _wait(self, ok, deadline: float, what: str, procs: list[subprocess.Popen]) -> None:
        while not ok():
            if dead := [p for p in procs if p.poll() is not None]:
                raise SystemFailed(f"set-up: a process exited ({dead[0].returncode}) waiting for {what}")
            if time.monotonic() > deadline:
                raise SystemFailed(f"set-up: no {what} after {SETUP_TIMEOUT:.0f} s")
            time.sleep(POLL)  # other processes' files: nothing to wait on across namespaces

    # ---- training ---------------------------------------------------------------------------------

    def events(self, h: HostRun) -> list[dict]:
        try:
            text = (self.out / f"{h.host.name}.jsonl").read_text()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written as this reads: the next look has it
                pass
        return out

    def _ready(self, h: HostRun) -> bool:
        return any(e["event"] == "ready" and e["incarnation"] == h.incarnation for e in self.events(h))

    def _done(self, h: HostRun) -> bool:
        return any(e["event"] == "done" and e["incarnation"] == h.incarnation for e in self.events(h))

    def _train_until(self, start: float, deadline: float) -> None:
        every = self.args.restart_every
        next_restart = start + every if every else math.inf
        victim = self.hosts[-1]
        time.sleep(max(start - time.time(), 0.0))
        cpu_before = cpu_seconds(self)
        while time.time() < deadline:
            if time.time() >= next_restart:
                self._restart(victim)
                next_restart += every
            for h in self.hosts:
                if h.procs and h.procs[-1].poll() not in (None, 0):
                    raise SystemFailed(f"{h.host.name}'s loop exited with {h.procs[-1].returncode} while training")
            time.sleep(min(POLL, max(deadline - time.time(), 0.0)))
        self.cpu = cpu_split(cpu_before, cpu_seconds(self), self.args.seconds)
        if self.system == "peerd":
            self.daemon_metrics = {h.host.name: daemon_figures(h.daemon) for h in self.hosts}
        while time.time() < deadline + GRACE and not all(self._done(h) for h in self.hosts):
            time.sleep(POLL)
        if late := [h.host.name for h in self.hosts if not self._done(h)]:
            raise SystemFailed(f"{', '.join(late)} still training {GRACE:.0f} s after the deadline (hung)")

    def _let_exit(self) -> None:
        """The loops' own exit (they close their system), for EXIT_GRACE; what is left is killed after."""
        end = time.monotonic() + EXIT_GRACE
        for p in [h.procs[-1] for h in self.hosts if h.procs]:  # the loops; peerd's daemons are killed
            try:
                p.wait(max(end - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass

    def _restart(self, h: HostRun) -> None:
        """Kill every process of the host, then start them again: not waited for, it trains when ready."""
        progress(f"{self.entrant.name}: t={time.time() - self.start:.0f} s  restart {h.host.name}")
        h.kill()
        h.incarnation += 1
        self.restarts += 1
        if self.system == "peerd":
            self._start_daemon(h)  # the same data dir: its checkpoint, its peer identity
        self._start_loop(h)

    def _keep_logs(self) -> None:
        dest = Path(self.args.logs) / self.entrant.name
        dest.mkdir(parents=True, exist_ok=True)
        for log in [*(self.net.dir / "hosts").glob("*.log"), *self.out.glob("*.log")]:  # daemons', loops'
            shutil.copy(log, dest / log.name)


# ---- where the CPU goes ------------------------------------------------------------------------------


def cpu_seconds(run: SystemRun) -> dict:
    """CPU seconds (user + system) so far of every process of the system, by (kind, pid, start time),
    and the machine's busy seconds (every core, every process, the kernel's packet work included).
    Kinds: loop (the training process, all its threads), loop_children (hivemind's averager and DHT
    processes), daemon (peerd's, all its threads), p2pd (peerd's and hivemind's), delay_lines (the
    lab's, a process per host), lighthouse (torchft's)."""
    roots = []
    for h in run.hosts:
        roots += [(p.pid, "daemon" if h.daemon is not None and p is h.daemon.proc else "loop") for p in h.procs]
    roots += [(p.pid, "delay_lines") for p in run.net.delay_lines.values()]
    if run.lighthouse is not None:
        roots.append((run.lighthouse.pid, "lighthouse"))
    out: dict = {}
    for pid, kind in roots:
        try:
            root = psutil.Process(pid)
            procs = [(root, kind)] + [
                (c, "p2pd" if c.name() == "p2pd" else f"{kind}_children" if kind == "loop" else kind)
                for c in root.children(recursive=True)
            ]
        except psutil.Error:  # exited (a restart): its seconds are not counted
            continue
        for proc, k in procs:
            try:
                t = proc.cpu_times()
                out[(k, proc.pid, proc.create_time())] = t.user + t.system
            except psutil.Error:
                pass
    t = psutil.cpu_times()
    out["machine"] = t.user + t.nice + t.system + t.irq + t.softirq + t.steal
    return out


def cpu_split(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores used by each kind of process over `seconds` (a process that started meanwhile counts from
    0; one that exited is not counted), and by everything else on the machine ("other": the kernel's
    link emulation, other users' jobs). The machine has psutil.cpu_count() cores in all."""
    cores: dict[str, float] = {}
    for key, cpu in after.items():
        if key != "machine":
            cores[key[0]] = cores.get(key[0], 0.0) + (cpu - before.get(key, 0.0)) / seconds
    machine = (after["machine"] - before["machine"]) / seconds
    cores = {k: round(v, 3) for k, v in sorted(cores.items())}
    cores["other"] = round(machine - sum(cores.values()), 3)
    cores["machine"] = round(machine, 3)
    return cores


def daemon_figures(daemon) -> dict[str, float]:
    """peerd: the daemon's own account at the deadline (docs/metrics.md): compute fraction, seconds
    its process waited in EndPhase, rounds and their mean duration; {} where it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(daemon.metrics_url, timeout=5) as r:
            text = r.read().decode()
    except (OSError, KeyError):
        return {}
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in WANTED_METRICS:
                got[s.name] = got.get(s.name, 0.0) + s.value
    out = {
        "overlap": run_overlap(daemon.data_dir),
        "compute_fraction": got.get("peerd_train_compute_fraction"),
        "wait_s": got.get("peerd_train_wait_seconds_total"),
        "rounds": got.get("peerd_round_duration_seconds_count"),
    }
    if got.get("peerd_round_duration_seconds_count"):
        out["round_mean_s"] = got["peerd_round_duration_seconds_sum"] / got["peerd_round_duration_seconds_count"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items() if v is not None}


def run_overlap(data_dir: Path) -> bool | None:
    """Whether the run the daemon keeps overlaps its rounds (its manifest); None where it has none."""
    from peerd.peers.manifest import decode_manifest

    try:
        kept = (data_dir / "runs" / RUN / "manifest").read_bytes()
    except OSError:
        return None
    return decode_manifest(kept, run_id=RUN, secret=None, subkey=None).averaging.overlap


WANTED_METRICS = {
    "peerd_train_compute_fraction",
    "peerd_train_wait_seconds_total",
    "peerd_round_duration_seconds_count",
    "peerd_round_duration_seconds_sum",
}


# ---- evaluation and the report ----------------------------------------------------------------------


class Evaluator:
    """charlm's held-out eval of a saved state dict: the same function for every system."""

    def __init__(self):
        import torch

        from peerd.daemon.tasks import get_task

        self.torch = torch
        self.task = get_task("charlm")
        self.hparams = self.task.parse_hparams({})
        self.model, _ = self.task.build(self.hparams, 0)
        self.untrained = self.task.evaluate(self.model, self.hparams).score

    def __call__(self, path: Path) -> float:
        self.model.load_state_dict(self.torch.load(path, map_location="cpu", weights_only=True))
        return self.task.evaluate(self.model, self.hparams).score


def collect(run: SystemRun, evaluate: Evaluator, failure: str | None) -> dict:
    """The system's line: per host its steps, samples, bytes and final eval; the curve of the mean eval."""
    hosts, ticks = {}, {}
    for h in run.hosts:
        events = run.events(h)
        snaps = [e for e in events if e["event"] == "snapshot"]
        # A killed incarnation's steps: those of its last snapshot.
        last = {e["incarnation"]: e["step"] for e in snaps}
        last.update({e["incarnation"]: e["steps"] for e in events if e["event"] == "done"})
        steps = sum(last.values())
        samples = steps * evaluate.hparams.batch_size
        final = next((e for e in reversed(snaps) if e["tick"] == "final"), None)
        for e in snaps:
            if e["tick"] != "final":
                ticks.setdefault(int(e["tick"]), {})[h.host.name] = (e["t"], evaluate(run.out / e["file"]))
        sent = run.bytes.get(h.host.name)
        hosts[h.host.name] = {
            "steps": steps,
            "samples": samples,
            "tx_bytes": sent,
            "mb_per_1000_samples": round(sent / 1e6 / samples * 1000, 4) if sent is not None and samples else None,
            "eval": round(evaluate(run.out / final["file"]), 4) if final else None,
            "incarnations": h.incarnation + 1,
            "exit_codes": h.exits,
        }
        if done := next((e for e in reversed(events) if e["event"] == "done"), None):
            hosts[h.host.name].update({k: done[k] for k in LOOP_FIGURES if k in done})
        if h.host.name in run.daemon_metrics:
            hosts[h.host.name]["daemon"] = run.daemon_metrics[h.host.name]
    finals = [x["eval"] for x in hosts.values() if x["eval"] is not None]
    curve = curve_of(ticks, finals, float(run.args.seconds))
    return {
        "bench": BENCH,
        "system": run.entrant.name,
        "failed": failure,
        "steps": round(statistics.fmean(x["steps"] for x in hosts.values()), 1) if hosts else None,
        "mb_per_host_per_1000_samples": _mean([x["mb_per_1000_samples"] for x in hosts.values()]),
        "eval": round(statistics.fmean(finals), 4) if finals else None,
        "hosts": hosts,
        "curve": curve,
        "setup_s": round(run.setup_s, 1),
        "restarts": run.restarts,
        "cpu_cores": run.cpu,
    }


# The loop's account of its time (bench/vs_peers_host.py, its "done" event), per host.
LOOP_FIGURES = ("compute_s", "step_s", "cpu_loop_thread_s", "cpu_loop_process_s")


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.fmean(xs), 4) if xs else None


def curve_of(ticks: dict[int, dict[str, tuple[float, float]]], finals: list[float], seconds: float) -> list:
    """The hosts' mean eval against time from their snapshots (`ticks`: tick -> host -> (t, eval)):
    a tick's point at the time its last host's snapshot was taken (a host whose long round delayed
    its snapshot is not credited early; the hosts' mean time put ticks out of order in four of the
    committed runs), the points in order of time, and the mean final eval at the budget's end."""
    curve = [
        (round(max(t for t, _ in points.values()), 1), round(statistics.fmean(e for _, e in points.values()), 4))
        for points in ticks.values()
    ]
    if finals:
        curve.append((seconds, round(statistics.fmean(finals), 4)))
    return sorted(curve)


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first time the curve (mean eval over the hosts, lower is better) is at or below target."""
    return next((t for t, e in curve if e <= target), None)


def headline(lines: dict[str, dict]) -> dict:
    """peerd's time to the best competitor's final eval, over the time that competitor took to reach it."""
    metric = "time to the best competitor's final eval, peerd vs that competitor"
    others = {s: x for s, x in lines.items() if not s.startswith("peerd") and x["eval"] is not None and not x["failed"]}
    if not others or "peerd" not in lines:
        return result(BENCH, metric, None, None, "s", note="needs peerd and a competitor that finished")
    best = min(others, key=lambda s: others[s]["eval"])
    target = others[best]["eval"]
    ours, theirs = time_to(lines["peerd"]["curve"], target), time_to(others[best]["curve"], target)
    return result(BENCH, metric, ours, theirs, "s", competitor=best, target_eval=target)


def plot(lines: dict[str, dict], args) -> None:
    """Each system's curve (the mean eval over its hosts) against time (matplotlib: the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, line in lines.items():
        if line["curve"]:
            ts, evals = zip(*line["curve"])
            ax.plot(ts, evals, marker=".", label=f"{name} ({line['mb_per_host_per_1000_samples']} MB/1k samples)")
    ax.set_xlabel("seconds of training (wall clock)")
    ax.set_ylabel("charlm eval, mean over the hosts (bits/char, lower is better)")
    ax.set_title(
        f"bench.vs_peers: {args.hosts} hosts, {args.rate_mbit:g} Mbit/s, {args.rtt_ms:g} ms RTT, "
        f"{args.loss_pct:g} % loss, H = {args.every}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    progress(f"plot: {args.plot}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vs_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 hosts, 8 s per system: a smoke run (about 90 s)")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="Mbit/s of every host's link, both directions")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="RTT between two hosts")
    p.add_argument("--loss-pct", type=float, default=1.0, help="%% of the packets delivered to a host dropped")
    p.add_argument("--seconds", type=float, default=120.0, help="training time of each system")
    p.add_argument("--every", type=int, default=50, help="H: inner steps per round, for every system")
    p.add_argument("--restart-every", type=float, default=0.0, help="kill and restart the last host every N s")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--snapshot-every", type=float, default=0.0, help="seconds between two evals (--seconds / 12)")
    p.add_argument("--logs", default=None, help="keep the hosts' logs under this directory")
    p.add_argument(
        "--peerd-settings",
        action="append",
        help="peerd's run settings beyond H, KEY=VALUE,..., over overlap=true (every run's default but a "
        "script's); again: one more peerd line, a variant (peerd:payload=int2)",
    )
    p.add_argument("--plot", default=None, help="draw each system's eval against time into this PNG file")
    args = p.parse_args(argv)
    if args.quick:
        args.hosts, args.seconds = 2, min(args.seconds, 8.0)
    args.snapshot_every = args.snapshot_every or args.seconds / (4 if args.quick else 12)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        p.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    try:
        runs = entrants(systems, args.peerd_settings or [""])
    except ValueError as e:
        p.error(str(e))
    if problem := environment_problem():
        print(f"bench.vs_peers: {problem}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    evaluate = Evaluator()
    link = {"hosts": args.hosts, "rate_mbit": args.rate_mbit, "rtt_ms": args.rtt_ms, "loss_pct": args.loss_pct}
    settings = {"every": args.every, "seconds": args.seconds, "restart_every": args.restart_every}
    lines = {}
    scratch = Path(tempfile.mkdtemp(prefix="peerd-vs-peers-"))
    try:
        for i, entrant in enumerate(runs):
            system = entrant.name
            out = scratch / f"{i}-{entrant.system}"
            out.mkdir()
            run, failure, load = SystemRun(entrant, args, out), None, os.getloadavg()[0]
            if entrant.system == "torchft" and importlib.util.find_spec("torchft") is None:
                failure = "torchft is not installed (pip install '.[bench]')"
            else:
                try:
                    run.run()
                except (SystemFailed, OSError, RuntimeError) as e:  # DaemonFailed and LabError are RuntimeErrors
                    failure = f"{type(e).__name__}: {e}"
                    progress(f"{system} FAILED: {failure}")
            lines[system] = {**collect(run, evaluate, failure), "link": link, **settings}
            if entrant.system == "peerd":
                lines[system]["peerd_settings"] = entrant.peerd_settings
            # The machine's 1-minute load average before and after: other jobs share its cores.
            lines[system]["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            progress(
                f"{system}: {lines[system]['steps']} steps per host, eval {lines[system]['eval']}, "
                f"{lines[system]['mb_per_host_per_1000_samples']} MB per host per 1,000 samples"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    head = headline(lines)
    target = head.get("target_eval")
    records = []
    for line in lines.values():
        line["time_to_target_s"] = time_to(line["curve"], target) if target is not None else None
        if line["system"] != "peerd" and line["eval"] is not None and "peerd" in lines:
            # Against each competitor, not only the best: peerd's time to its final eval.
            line["peerd_time_to_this_eval_s"] = time_to(lines["peerd"]["curve"], line["eval"])
        line["untrained_eval"] = round(evaluate.untrained, 4)
        records.append(line)
        print(json.dumps(line), flush=True)
    emit(head)
    if args.plot:
        plot(lines, args)
    if not args.quick:
        with open(RESULTS, "a") as f:
            for r in [*records, head]:
                f.write(json.dumps({**r, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
