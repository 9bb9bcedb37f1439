"""Run a scenario: build the hosts, start a real `peerd` in each, play the schedule, record what happens.

The runner only acts and observes; report.py turns the record into figures. A Collector thread
polls every live daemon every POLL_INTERVAL: its status and peer table over the control API (the
unix socket in its data dir, which any namespace can reach) and its /metrics over the bridge. A
frozen or killed daemon is not polled. Whatever happens, `run()` ends by destroying the network,
which kills every process left in the hosts' namespaces.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import grpc
from prometheus_client.parser import text_string_to_metric_families

from peerd.daemon import SOURCE_ROOT
from peerd.daemon.client import ControlClient
from peerd.daemon.lab.netns import Host, Network
from peerd.daemon.lab.scenario import Fault, Scenario
from peerd.daemon.procs import DaemonFailed, LocalDaemon

POLL_INTERVAL = 0.5  # seconds between two polls of every live daemon; the resolution of fault timings
POLL_TIMEOUT = 2.0  # seconds for one status, peers or /metrics request to a live daemon
STOP_TIMEOUT = 20.0  # seconds from SIGTERM to every daemon until the stragglers are killed
RTT_PROBES = 10  # TCP SYN/RST round trips per host measured when the lab is built and after an rtt_ms change
RTT_PROBE_TIMEOUT = 60.0  # seconds the end of a run waits for a measurement still under way
# Fast discovery, so that faults are noticed within seconds; a scenario's [run] args override them.
# The DHT timeout stays below the peer TTL: with the default 5 s, one frozen DHT node stalls every
# refresh past the 4 s TTL and the others drop each other, not only the frozen peer (seen here).
DAEMON_DEFAULTS = [
    "--torch-threads",
    "1",
    "--heartbeat-interval",
    "1",
    "--refresh-interval",
    "0.5",
    "--peer-ttl",
    "4",
    "--dht-timeout",
    "2",
]


@dataclass(frozen=True, slots=True)
class Sample:
    """One poll of one daemon."""

    t: float  # seconds since the start of the schedule
    host: str
    pid: int
    step: int  # global step
    local_step: int
    loss: float
    last_round: int
    outcome: str  # of the last round: completed, aborted, no_group, or ""
    group_size: int
    peers: frozenset[str]  # peer IDs in its table of the run
    divergence: (
        float  # peerd_param_divergence (largest pairwise, from sketches), NaN until two peers share a sketch step
    )
    eval_score: float
    metrics: dict[str, float]  # peerd_rounds_total by outcome and byte counters (this incarnation)
    # averaging.average_every=auto: the H in use and the round whose group pace it came from (0:
    # the daemon's own figures, or no auto: RunStatus.average_every_round)
    average_every: int = 0
    average_every_round: int = 0


@dataclass(slots=True)
class Event:
    """A join or a fault as it happened: when, and the lab's state just after it."""

    t: float
    fault: Fault
    running: frozenset[str]  # hosts whose daemon runs and is not frozen
    side: dict[str, int]  # partition side of each host (all 0 when healed)
    rtt: dict[str, dict] = field(default_factory=dict)  # a link fault that set rtt_ms: RTT measured after it, by host


@dataclass(slots=True)
class Record:
    scenario: Scenario
    lab_id: str
    congestion_control: dict[str, str] = field(default_factory=dict)
    peer_ids: dict[str, str] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    incarnations: dict[str, int] = field(default_factory=dict)
    final_state: dict[str, str] = field(default_factory=dict)  # running, frozen, killed, not started
    exit_codes: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    link_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    checkpoints: dict[str, dict] = field(default_factory=dict)
    rtt: dict[str, dict] = field(default_factory=dict)  # host: RTT measured to its neighbour when the lab was built
    delay_lines: dict[str, dict] = field(default_factory=dict)  # host: its delay line's counters at the end
    started_at: float = 0.0  # seconds from the lab's start to the schedule's start (hosts training)
    duration: float = 0.0


def spawn_in(host: Host, data_dir: Path, args: list[str]) -> LocalDaemon:
    """A `peerd start` in the host's namespace, listening on its address; not waited for."""
    d = LocalDaemon(data_dir, args)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "ready.json").unlink(missing_ok=True)
    d.log_path = data_dir.parent / f"{data_dir.name}.log"
    cmd = [
        *host.exec_prefix(),
        sys.executable,
        "-m",
        "peerd.daemon.cli",
        "start",
        "--data-dir",
        str(data_dir),
        "--host",
        host.ip,
        "--port",
        "0",
        "--metrics-host",
        host.ip,
        "--metrics-port",
        "0",
        *args,
    ]
    with open(d.log_path, "ab") as log:
        # Own session: the daemon and its p2pd are one process group, frozen and killed together.
        d.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=SOURCE_ROOT)
    return d


class Collector:
    """Polls every live daemon in a named thread until stopped; appends Samples to the record."""

    def __init__(self, record: Record, live: Callable[[], dict[str, LocalDaemon]], t0: float):
        self.record, self.live, self.t0 = record, live, t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lab-collector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(POLL_TIMEOUT * 3 + 5)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_INTERVAL):
            self.poll()

    def poll(self) -> None:
        for name, d in list(self.live().items()):
            sample = poll_daemon(name, d, self.record.scenario.run.id, time.monotonic() - self.t0)
            if sample is not None:
                self.record.samples.append(sample)


def poll_daemon(name: str, d: LocalDaemon, run_id: str, t: float) -> Sample | None:
    """One Sample, or None when the daemon does not answer (yet): start-up, a kill in progress."""
    try:
        with ControlClient(d.control, timeout=POLL_TIMEOUT) as c:
            run = next((r for r in c.status().runs if r.run_id == run_id), None)
            peers = frozenset(p.peer_id for p in c.list_peers(run_id).peers) if run else frozenset()
        metrics = scrape(d.metrics_url, run_id)
    except (grpc.RpcError, OSError, KeyError, ValueError):
        return None
    if run is None:
        return None
    return Sample(
        t=t,
        host=name,
        pid=d.pid,
        step=run.step,
        local_step=run.local_step,
        loss=run.loss,
        last_round=run.last_round,
        outcome=run.last_round_outcome,
        group_size=run.group_size,
        peers=peers,
        divergence=metrics.pop("divergence", math.nan),
        eval_score=run.eval_score,
        metrics=metrics,
        average_every=run.average_every,
        average_every_round=run.average_every_round,
    )


def scrape(url: str, run_id: str) -> dict[str, float]:
    """The run's round counts by outcome, its divergence, samples (trained, and averaged into the run's
    model), compute fraction, DeAR's overlap ratio and the engine's byte counters."""
    with urllib.request.urlopen(url, timeout=POLL_TIMEOUT) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("run", run_id) != run_id:
                continue
            if s.name == "peerd_rounds_total":
                out[f"rounds_{s.labels['outcome']}"] = s.value
            elif s.name == "peerd_param_divergence":
                out["divergence"] = s.value
            elif s.name == "peerd_train_compute_fraction":
                out["compute_fraction"] = s.value
            elif s.name == "peerd_dear_overlap_ratio":
                out["dear_overlap_ratio"] = s.value
            elif s.name == "peerd_samples_total":
                out["samples"] = s.value
            elif s.name == "peerd_samples_averaged_total":
                out["samples_averaged"] = s.value
            elif s.name in ("peerd_sent_bytes_total", "peerd_received_bytes_total", "peerd_state_sync_bytes_total"):
                key = s.name.removeprefix("peerd_").removesuffix("_total")
                out[key] = out.get(key, 0.0) + s.value
    return out


class LabAborted(RuntimeError):
    """Lab.abort() was called while the lab ran."""


class Lab:
    """One scenario run. `run()` returns the Record; the network is gone when it returns or raises."""

    def __init__(self, scenario: Scenario, progress: Callable[[str], None] = lambda m: None, logs: Path | None = None):
        self.scenario, self.progress, self.logs = scenario, progress, logs
        self.net = Network()
        self.record = Record(scenario, self.net.id)
        self.daemons: dict[str, LocalDaemon] = {}
        self.site_ips: dict[str, str] = {}  # a host of a site: its address on the site's link
        self.state: dict[str, str] = {h.name: "not started" for h in scenario.hosts}
        self.t0 = 0.0
        self.probes: list[threading.Thread] = []  # RTT measurements after link faults, joined at the end
        self.aborted = threading.Event()  # set by abort(): run() stops waiting and removes the lab

    def run(self) -> Record:
        collector = None
        try:
            self._build()
            begin = time.monotonic()
            for h in self.scenario.first_hosts:
                run = self.scenario.run
                self._start(h.name, min_peers=1 if run.isolated else run.min_peers or len(self.scenario.first_hosts))
            self._wait_training([h.name for h in self.scenario.first_hosts])
            self.t0 = time.monotonic()
            self.record.started_at = self.t0 - begin
            self.progress(f"every first host trains after {self.record.started_at:.1f} s; schedule starts")
            collector = Collector(self.record, self._live, self.t0)
            collector.start()
            joins = [Fault(at=h.join_at, action="join", hosts=(h.name,)) for h in self.scenario.hosts if h.join_at > 0]
            for fault in sorted(
                [*joins, *self.scenario.faults], key=lambda f: f.at
            ):  # stable: joins first at equal times
                self._sleep_until(fault.at)
                self._apply(fault)
            self._sleep_until(self.scenario.duration)
            collector.stop()
            collector.poll()  # the final state, at the end of the schedule
            self.record.peer_ids = {n: d.peer_id for n, d in self.daemons.items() if d.ready}  # kept across restarts
            self.record.duration = time.monotonic() - self.t0
            self.record.dropped = self.net.dropped()
            self.record.link_stats = {name: self.net.link_stats(name) for name in self.net.hosts}
            for t in self.probes:
                t.join(RTT_PROBE_TIMEOUT)
            self.record.delay_lines = self.net.delay_stats()
            self._stop_all()
            self._check_checkpoints()
            return self.record
        finally:
            if collector is not None:
                collector.stop()
            for d in self.daemons.values():
                d.kill_group()
            self._keep_logs()
            removed = self.net.destroy()
            self.progress(f"lab {self.net.name} removed ({len(removed)} items)")

    # ---- building and starting --------------------------------------------------------------------

    def _build(self) -> None:
        self.progress(
            f"building lab {self.net.name}: {len(self.scenario.hosts)} hosts, TCP {self.scenario.congestion_control}"
        )
        self.net.create()
        for h in self.scenario.hosts:
            host = self.net.add_host(h.name, h.link, self.scenario.congestion_control)
            self.record.congestion_control[h.name] = self.net.congestion_control(host)
            if h.site:  # its daemon trains in the site's local group, over the site's link
                self.site_ips[h.name] = self.net.add_site_link(h.name, self.scenario.sites.index(h.site))
        self.record.rtt = self._measure_rtt([h.name for h in self.scenario.hosts])
        delayed = {
            n: m
            for n, m in self.record.rtt.items()
            if self.scenario.host(n).link.rtt_ms or self.scenario.host(m["to"]).link.rtt_ms
        }
        if delayed:
            self.progress(
                "RTT measured: "
                + ", ".join(f"{n}->{m['to']} {m['median_ms']} ms (set {m['set_ms']:g})" for n, m in delayed.items())
            )

    def _measure_rtt(self, names: list[str]) -> dict[str, dict]:
        """Each named host's RTT to the next host of the scenario (a ring), measured now, with what
        the settings give: {host: {"to", "set_ms", "median_ms", "min_ms", "max_ms", "probes"}}."""
        order = [h.name for h in self.scenario.hosts]
        if len(order) < 2:
            return {}
        pairs = [(n, order[(order.index(n) + 1) % len(order)]) for n in names]
        shapes = {n: h.shape for n, h in self.net.hosts.items()}
        measured = self.net.measure_rtt(pairs, probes=RTT_PROBES)
        return {a: {"to": b, "set_ms": (shapes[a].rtt_ms + shapes[b].rtt_ms) / 2, **measured[(a, b)]} for a, b in pairs}

    def _data_dir(self, name: str) -> Path:
        return self.net.dir / "hosts" / name

    def _start(self, name: str, min_peers: int = 1) -> LocalDaemon:
        run = self.scenario.run
        args = ["--run", run.id, "--checkpoint-every", str(run.checkpoint_every), "--min-peers", str(min_peers)]
        if run.max_steps:
            args += ["--max-steps", str(run.max_steps)]
        seeds = [] if run.isolated else [d.maddrs[0] for d in self._live().values()]
        if seeds:
            args += ["--initial-peers", *seeds]
        # The creator of the run (a restart passes the same, harmlessly); isolated, every host.
        if run.isolated or name == self.scenario.hosts[0].name:
            args += ["--task", run.task, *(a for k, v in run.settings.items() for a in ("--set", f"{k}={v}"))]
        if name in self.site_ips:
            args += ["--local-group", self.scenario.host(name).site, "--local-group-host", self.site_ips[name]]
        d = spawn_in(self.net.hosts[name], self._data_dir(name), [*DAEMON_DEFAULTS, *args, *run.args])
        self.daemons[name] = d
        self.state[name] = "running"
        self.record.incarnations[name] = self.record.incarnations.get(name, 0) + 1
        if name == self.scenario.hosts[0].name and not seeds:
            d.wait_ready()  # the others bootstrap from it
        return d

    def _wait_training(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.scenario.start_timeout
        waiting = set(names)
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"hosts {', '.join(sorted(waiting))} not training after {self.scenario.start_timeout:.0f} s"
                )
            for name in names:
                d = self.daemons[name]
                if d.proc.poll() is not None:
                    raise DaemonFailed(f"host {name}: daemon exited with {d.proc.returncode}; log:\n{d.log_tail()}")
            for name, d in self._live().items():
                sample = poll_daemon(name, d, self.scenario.run.id, 0.0)
                if sample is not None and sample.local_step > 0:  # moves with every step, mid-phase too
                    waiting.discard(name)
            self._wait(POLL_INTERVAL)

    def _live(self) -> dict[str, LocalDaemon]:
        """Running, unfrozen daemons that are ready (a daemon that is starting is checked, not waited for)."""
        live = {}
        for name, d in list(self.daemons.items()):
            if self.state[name] != "running":
                continue
            if not d.ready and (d.data_dir / "ready.json").exists():
                try:
                    d.wait_ready(POLL_TIMEOUT)
                except DaemonFailed:
                    continue
            if d.ready:
                live[name] = d
        return live

    def abort(self) -> None:
        """From another thread: run() raises LabAborted at its next wait and removes the lab."""
        self.aborted.set()

    def _sleep_until(self, at: float) -> None:
        # The schedule's clock, not synchronization: faults happen at their times whatever the daemons do.
        while (left := self.t0 + at - time.monotonic()) > 0:
            self._wait(min(left, 1.0))

    def _wait(self, seconds: float) -> None:
        if self.aborted.wait(seconds):
            raise LabAborted("the lab was aborted")

    # ---- the schedule -----------------------------------------------------------------------------

    def _apply(self, f: Fault) -> None:
        self.progress(f"t={time.monotonic() - self.t0:5.1f} s  {f.describe()}")
        for name in f.hosts:
            d = self.daemons.get(name)
            # The collector skips a host that is not "running": set before a freeze, after a thaw.
            if f.action == "kill":
                self.state[name] = "killed"
                d.kill_group()  # SIGKILL works on a frozen process too
                self.record.exit_codes.setdefault(name, []).append(d.proc.returncode)
            elif f.action == "freeze":
                self.state[name] = "frozen"
                os.killpg(d.pid, signal.SIGSTOP)
            elif f.action == "thaw":
                os.killpg(d.pid, signal.SIGCONT)
                self.state[name] = "running"
            elif f.action in ("join", "restart"):
                self._start(name)  # not waited for: the schedule keeps its times; the collector sees it when ready
            elif f.action == "link":
                self.net.shape(name, replace(self.net.hosts[name].shape, **f.link))
        if f.action == "partition":
            self.net.partition([set(f.hosts)])
        elif f.action == "heal":
            self.net.heal()
        running = frozenset(n for n, s in self.state.items() if s == "running")
        side = {n: self.net.side.get(n, 0) for n in self.state}
        event = Event(time.monotonic() - self.t0, f, running, side)
        self.record.events.append(event)
        if f.action == "link" and "rtt_ms" in f.link:  # measured aside: the schedule keeps its times
            probe = threading.Thread(
                target=lambda: event.rtt.update(self._measure_rtt(list(f.hosts))), name="lab-rtt", daemon=True
            )
            probe.start()
            self.probes.append(probe)

    # ---- the end ----------------------------------------------------------------------------------

    def _stop_all(self) -> None:
        """SIGTERM to every daemon at once (thawing the frozen first), then wait: a clean drain
        writes a last checkpoint, which _check_checkpoints then reads."""
        for name, d in self.daemons.items():
            if self.state[name] == "frozen":
                os.killpg(d.pid, signal.SIGCONT)
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for name, d in self.daemons.items():
            self.record.final_state[name] = self.state[name]
            if self.state[name] == "killed":
                continue
            try:
                code = d.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                d.kill_group()
                code = d.proc.returncode
            self.record.exit_codes.setdefault(name, []).append(code)
        for name, state in self.state.items():
            self.record.final_state.setdefault(name, state)

    def _check_checkpoints(self) -> None:
        from peerd.daemon.checkpoint import NAME, CheckpointStore, CorruptCheckpoint

        for name in self.daemons:
            directory = self._data_dir(name) / "runs" / self.scenario.run.id / "checkpoints"
            steps, torn = [], []
            for path in sorted(directory.glob("*")) if directory.is_dir() else []:
                if not NAME.fullmatch(path.name):
                    continue
                try:
                    steps.append(CheckpointStore.read(path).step)
                except CorruptCheckpoint as e:
                    torn.append(f"{path.name}: {e}")
            self.record.checkpoints[name] = {"steps": steps, "torn": torn}

    def _keep_logs(self) -> None:
        if self.logs is None:
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        for d in self.daemons.values():
            if d.log_path and d.log_path.exists():
                shutil.copy(d.log_path, self.logs / d.log_path.name)
