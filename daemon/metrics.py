"""Prometheus metrics of one daemon, and the small asyncio HTTP server that serves /metrics.

Every metric here is listed in docs/metrics.md; tests/test_daemon.py checks that the two agree.
No label carries a remote peer's ID (only this daemon's own, in peerd_info).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import psutil
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from peerd.daemon.supervisor import ChildState
from peerd.peers.events import PeerEvents

if TYPE_CHECKING:  # only for the annotations: the metrics module loads without torch
    from peerd.peers.averaging import RoundResult
    from peerd.peers.statesync import FetchResult

logger = logging.getLogger(__name__)

disable_created_metrics()  # the *_created series double every counter for no use here

REQUEST_HEAD_LIMIT = 8192  # bytes of request line + headers we read before giving up
REQUEST_READ_TIMEOUT = 5.0  # seconds a client may take to send its request head
# peerd.daemon.attached.TrainState's values, named here so that metrics never import torch
# (tests/test_health.py checks that the two agree).
TRAIN_STATES = ("LOADING", "TRAINING", "FINISHED", "STOPPED", "FAILED")
RECENT_ROUNDS = 16  # completed rounds whose median duration status shows (RunStatus.round_seconds)


class _WeightedHistogram(Collector):
    """A histogram whose observations carry a count: one call stands for `n` equal observations
    (prometheus_client's Histogram takes one at a time, and a round has thousands of packets)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation, self.bounds = name, documentation, (*buckets, math.inf)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, n: int = 1) -> None:
        with self._lock:
            self.counts[next(i for i, b in enumerate(self.bounds) if value <= b)] += n
            self.total += value * n

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            cumulative, running = [], 0
            for bound, count in zip(self.bounds, self.counts):
                running += count
                cumulative.append(("+Inf" if math.isinf(bound) else str(bound), running))
            total = self.total
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=total)


class _RunPeersCollector(Collector):
    """peerd_peers{run}, read from the live tables at scrape time so it is never stale."""

    def __init__(self, peers_by_run: Callable[[], Mapping[str, int]]):
        self.peers_by_run = peers_by_run

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "peerd_peers", "Live peers in the run's table, this daemon excluded.", labels=["run"]
        )
        for run_id, count in sorted(self.peers_by_run().items()):
            family.add_metric([run_id], count)
        yield family


class _TrainingCollector(Collector):
    """Per-run training figures, read from the trainers at scrape time (no work on the hot path)."""

    def __init__(self, runs: Callable[[], Iterable]):
        self.runs = runs

    def collect(self) -> Iterable:
        state = GaugeMetricFamily(
            "peerd_train_state", "1 for the run's current training state, 0 for the others.", labels=["run", "state"]
        )
        step = GaugeMetricFamily(
            "peerd_train_step", "Global step of the run's state this daemon holds.", labels=["run"]
        )
        every = GaugeMetricFamily(
            "peerd_average_every",
            "Inner steps per phase the run takes now: averaging.average_every, or under average_every=auto "
            "the H fitted to its round and step times.",
            labels=["run"],
        )
        local = CounterMetricFamily(
            "peerd_local_steps", "Optimizer steps this daemon computed in the run.", labels=["run"]
        )
        divergence = GaugeMetricFamily(
            "peerd_param_divergence",
            "Largest estimated L2 parameter distance between two live peers of the run, from sketches.",
            labels=["run"],
        )
        to_mean = GaugeMetricFamily(
            "peerd_param_distance_to_group_mean",
            "L2 distance of the parameters from the group mean at the last completed round.",
            labels=["run"],
        )
        loss = GaugeMetricFamily("peerd_train_loss", "Training loss of the run's last step.", labels=["run"])
        samples = CounterMetricFamily(
            "peerd_samples", "Training samples this daemon processed in the run.", labels=["run"]
        )
        averaged = CounterMetricFamily(
            "peerd_samples_averaged",
            "Samples of phases whose round with at least one mate applied: what reached the run's shared model.",
            labels=["run"],
        )
        score = GaugeMetricFamily(
            "peerd_eval_score", "Latest evaluation score of the run (see docs/metrics.md).", labels=["run"]
        )
        group = GaugeMetricFamily(
            "peerd_local_group_size",
            "Training processes of the run's local group (--local-group: of its daemons); 0 while not placed.",
            labels=["run"],
        )
        wan_share = GaugeMetricFamily(
            "peerd_wan_share",
            "Fraction of the run's vector this daemon averages over the WAN (1 outside a local group).",
            labels=["run"],
        )
        compute = GaugeMetricFamily(
            "peerd_train_compute_fraction",
            "Forward, backward and optimizer time over wall time since training began.",
            labels=["run"],
        )
        dear = GaugeMetricFamily(
            "peerd_dear_overlap_ratio",
            "Share of the run's local group's gradient communication that DeAR hid behind compute, as its "
            "training process counted it at its latest phase's end; absent while the group does not run DeAR.",
            labels=["run"],
        )
        waited = CounterMetricFamily(
            "peerd_train_wait_seconds", "Seconds the trainer waited for averaging rounds in the run.", labels=["run"]
        )
        attached = GaugeMetricFamily(
            "peerd_train_attached",
            "Training processes attached to the run (peerd.torch; several: its local group), 0 while none; "
            "only for runs trained by scripts.",
            labels=["run"],
        )
        epochs = CounterMetricFamily(
            "peerd_train_group_epochs",
            "Epochs of the run's local group of attached processes: each attach, join, exit, lapsed lease, "
            "detach or broken collective begins one (the daemon's log says why); only for runs trained by scripts.",
            labels=["run"],
        )
        process_state = GaugeMetricFamily(
            "peerd_train_process_state",
            "1 for the current state of the run's training process (a --task run), 0 for the others.",
            labels=["run", "state"],
        )
        restarts = CounterMetricFamily(
            "peerd_train_process_restarts",
            "Restarts of the run's training process after it failed (a --task run).",
            labels=["run"],
        )
        for r in self.runs():
            if not r.train_state:  # discovery only: nothing trains
                continue
            if not r.task:
                attached.add_metric([r.run_id], r.attached_processes)
                epochs.add_metric([r.run_id], r.attached_group_epoch)
            if r.train_process_state:
                for child in ChildState:
                    process_state.add_metric([r.run_id, child.value], 1 if r.train_process_state == child.value else 0)
                restarts.add_metric([r.run_id], r.train_process_restarts)
            for name in TRAIN_STATES:
                state.add_metric([r.run_id, name], 1 if r.train_state == name else 0)
            step.add_metric([r.run_id], r.step)
            every.add_metric([r.run_id], r.average_every)
            if not math.isnan(r.compute_fraction):
                compute.add_metric([r.run_id], r.compute_fraction)
            if not math.isnan(r.dear_overlap_ratio):
                dear.add_metric([r.run_id], r.dear_overlap_ratio)
            waited.add_metric([r.run_id], r.train_wait_seconds)
            local.add_metric([r.run_id], r.local_step)
            if not math.isnan(r.param_divergence):
                divergence.add_metric([r.run_id], r.param_divergence)
            if not math.isnan(r.param_distance_to_group_mean):
                to_mean.add_metric([r.run_id], r.param_distance_to_group_mean)
            loss.add_metric([r.run_id], r.loss)
            samples.add_metric([r.run_id], r.samples)
            averaged.add_metric([r.run_id], r.samples_averaged)
            if r.eval_metric:
                score.add_metric([r.run_id], r.eval_score)
            wan_share.add_metric([r.run_id], r.wan_share)
            if r.local_group:
                group.add_metric([r.run_id], r.local_group_size)
        yield state
        yield from (
            step,
            every,
            local,
            loss,
            samples,
            averaged,
            score,
            divergence,
            to_mean,
            group,
            wan_share,
            compute,
            dear,
            waited,
            attached,
            epochs,
            process_state,
            restarts,
        )


def process_started() -> float:
    """The time.monotonic() value at which this process started (psutil's create time, against the
    wall clock now); now where the system does not say."""
    try:
        created = psutil.Process().create_time()
    except psutil.Error:
        return time.monotonic()
    return time.monotonic() - max(time.time() - created, 0.0)


class DaemonMetrics:
    def __init__(
        self,
        *,
        version: str,
        states: Iterable[str],
        peers_by_run: Callable[[], Mapping[str, int]],
        runs: Callable[[], Iterable] = lambda: (),
    ):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.version = version
        self.started = process_started()  # peerd_uptime_seconds and `peerd status` count from here
        # Per run, the durations of its latest completed rounds (RoundResult.seconds), for status.
        self._recent_rounds: dict[str, collections.deque[float]] = {}
        self._recent_lock = threading.Lock()
        r = self.registry
        self.info = Gauge(
            "peerd_info", "Always 1; labels give this daemon's version and peer ID.", ["version", "peer_id"], registry=r
        )
        self.state = Gauge(
            "peerd_state", "1 for the daemon's current lifecycle state, 0 for the others.", ["state"], registry=r
        )
        self.uptime = Gauge("peerd_uptime_seconds", "Seconds since the daemon process started.", registry=r)
        self.uptime.set_function(lambda: time.monotonic() - self.started)
        self.dht_requests = Counter(
            "peerd_dht_requests", "DHT requests made by this daemon.", ["op", "result"], registry=r
        )
        self.heartbeats = Counter(
            "peerd_heartbeats", "Heartbeats this daemon tried to store, by result.", ["result"], registry=r
        )
        self.rejected = Counter(
            "peerd_rejected", "Inputs refused, by reason (see docs/metrics.md).", ["reason"], registry=r
        )
        self.rounds = Counter(
            "peerd_rounds",
            "Averaging rounds by outcome: completed, partial, aborted, no_group.",
            ["run", "outcome"],
            registry=r,
        )
        self.round_duration = Histogram(
            "peerd_round_duration_seconds",
            "Duration of averaging rounds that formed a group (matchmaking excluded).",
            ["run"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.round_wait = Histogram(
            "peerd_round_wait_seconds",
            "Time before each round's matchmaking spent waiting for group mates still behind it (up to two rounds).",
            ["run"],
            buckets=(0.01, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.missed = Counter(
            "peerd_rounds_missed",
            "Rounds (per lane) that formed no group although the grid gave this daemon live group mates.",
            ["run"],
            registry=r,
        )
        self.stragglers = Counter(
            "peerd_round_stragglers", "Group mates a round stopped waiting for (still behind it).", ["run"], registry=r
        )
        self.matchmaking_skipped = Counter(
            "peerd_matchmaking_skipped",
            "Rounds (per lane) that ran no matchmaking: the rendezvous found every planned group mate behind or gone.",
            ["run"],
            registry=r,
        )
        self.link_probes = Counter(
            "peerd_link_probes",
            "Link probes sent to peers, by result: answered, lost, late (echoed after its measurement counted it lost).",
            ["result"],
            registry=r,
        )
        self.link_rtt = Histogram(
            "peerd_link_rtt_seconds",
            "Median round-trip time of each link measurement (UDP probes).",
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
            registry=r,
        )
        self.link_bandwidth = Histogram(
            "peerd_link_bandwidth_bytes_per_second",
            "Bandwidth of each link measurement by packet trains (--local-group auto); 0 when unmeasurable.",
            buckets=(0, 1.25e6, 1.25e7, 2.5e7, 5e7, 1.25e8, 2.5e8, 1.25e9),
            registry=r,
        )
        self.link_trains = Counter(
            "peerd_link_trains",
            "Packet trains of bandwidth measurements, by result: counted, paused, unanswered (peers/linkprobe.py).",
            ["result"],
            registry=r,
        )
        self.state_syncs = Counter(
            "peerd_state_syncs",
            "Downloads of the run's state from peers, by result: ok, failed.",
            ["run", "result"],
            registry=r,
        )
        self.state_sync_bytes = Counter(
            "peerd_state_sync_bytes", "Bytes of run state downloaded from peers.", ["run"], registry=r
        )
        self.state_sync_seconds = Counter(
            "peerd_state_sync_seconds",
            "Seconds spent downloading the run's state from peers (bytes over seconds: the download's rate).",
            ["run"],
            registry=r,
        )
        self.group_size = Gauge(
            "peerd_group_size",
            "Members of the run's latest averaging group, this daemon included.",
            ["run"],
            registry=r,
        )
        self.local_group_store_failures = Counter(
            "peerd_local_group_store_failures",
            "Ticks of a spanning local group whose connection to its coordinator's store, or an operation on it, failed.",
            ["run"],
            registry=r,
        )
        self.sent_bytes = Counter(
            "peerd_sent_bytes", "Bytes the collective engine sent, by transport.", ["transport"], registry=r
        )
        self.received_bytes = Counter(
            "peerd_received_bytes", "Bytes the collective engine received, by transport.", ["transport"], registry=r
        )
        self.packets_sent = Counter("peerd_packets_sent", "UDP datagrams the loss-tolerant engine sent.", registry=r)
        self.packets_lost = Counter(
            "peerd_packets_lost",
            "UDP datagrams expected in a round that never arrived (gaps in the packet grid).",
            registry=r,
        )
        self.rejected_packets = Counter(
            "peerd_rejected_packets",
            "UDP datagrams dropped unread, by reason (see docs/loss-tolerance.md).",
            ["reason"],
            registry=r,
        )
        self.shard_coverage = _WeightedHistogram(
            "peerd_shard_coverage",
            "Per packet an owner reduced: the fraction of the group's contributions that arrived (UDP engine).",
            buckets=(0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
        )
        r.register(self.shard_coverage)
        self.links = Counter(
            "peerd_links", "Links to group members opened by averaging rounds, by transport.", ["transport"], registry=r
        )
        r.register(_RunPeersCollector(peers_by_run))
        r.register(_TrainingCollector(runs))
        self._states = tuple(states)
        for state in self._states:
            self.state.labels(state).set(0)
        for op in ("get", "store", "ping"):
            for result in ("ok", "error", "timeout"):
                self.dht_requests.labels(op, result)
        for result in ("ok", "error"):
            self.heartbeats.labels(result)
        for transport in ("tcp", "libp2p", "udp"):
            for counter in (self.sent_bytes, self.received_bytes, self.links):
                counter.labels(transport)

    def observe_round(self, run_id: str, result: RoundResult) -> None:
        """Record one averaging round (called from the trainer's worker threads; the client is thread-safe)."""
        outcome = result.outcome
        self.rounds.labels(run_id, result.outcome_name).inc()
        if outcome is not None:
            self.round_duration.labels(run_id).observe(outcome.duration)
        if not math.isnan(result.waited):  # NaN: a round's other lanes, whose wait the first lane counted
            self.round_wait.labels(run_id).observe(result.waited)
        if result.stragglers:
            self.stragglers.labels(run_id).inc(result.stragglers)
        if result.planned and result.group_size == 1 and not result.cancelled:
            self.missed.labels(run_id).inc()
        if result.skipped:
            self.matchmaking_skipped.labels(run_id).inc()
        for transport, (sent, received) in result.bytes_by_transport.items():
            self.sent_bytes.labels(transport).inc(sent)
            self.received_bytes.labels(transport).inc(received)
        for transport in result.links.values():
            self.links.labels(transport).inc()
        self.group_size.labels(run_id).set(result.group_size)
        if result.completed and not math.isnan(result.seconds):
            with self._recent_lock:
                self._recent_rounds.setdefault(run_id, collections.deque(maxlen=RECENT_ROUNDS)).append(result.seconds)

    def round_seconds(self, run_id: str) -> float:
        """The median duration of the run's last RECENT_ROUNDS completed rounds; NaN before the first."""
        with self._recent_lock:
            recent = list(self._recent_rounds.get(run_id, ()))
        return statistics.median(recent) if recent else math.nan

    def observe_sync(self, run_id: str, result: FetchResult) -> None:
        """Record one state download (called from the trainer's worker threads)."""
        self.state_syncs.labels(run_id, "ok" if result.ok else "failed").inc()
        self.state_sync_bytes.labels(run_id).inc(result.bytes)
        self.state_sync_seconds.labels(run_id).inc(result.duration)

    def set_state(self, state: str) -> None:
        for name in self._states:
            self.state.labels(name).set(1 if name == state else 0)

    def set_peer_id(self, peer_id: str) -> None:
        self.info.labels(self.version, peer_id).set(1)

    def peer_events(self) -> PeerEvents:
        return PeerEvents(
            dht_request=lambda op, result: self.dht_requests.labels(op, result).inc(),
            heartbeat=lambda result: self.heartbeats.labels(result).inc(),
            rejected=lambda reason: self.rejected.labels(reason).inc(),
            packet_rejected=lambda reason: self.rejected_packets.labels(reason).inc(),
            packets_sent=self.packets_sent.inc,
            packets_lost=self.packets_lost.inc,
            shard_coverage=self.shard_coverage.observe,
            link_probes=self._link_probes,
            link_probe_late=self.link_probes.labels("late").inc,
            link_rtt=self.link_rtt.observe,
            link_bandwidth=self.link_bandwidth.observe,
            link_train=lambda result: self.link_trains.labels(result).inc(),
        )

    def _link_probes(self, answered: int, lost: int) -> None:
        self.link_probes.labels("answered").inc(answered)
        self.link_probes.labels("lost").inc(lost)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """GET /metrics over HTTP/1.x; one response per connection. start() binds, stop() closes."""

    def __init__(self, metrics: DaemonMetrics, host: str, port: int):
        self.metrics, self.host, self.port = metrics, host, port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("::1" if self.host == "::" else self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > REQUEST_HEAD_LIMIT:
                raise ValueError("request head too large")
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"only GET\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.metrics.render()
            elif path == "/":
                status, ctype, body = "200 OK", "text/html", b'<a href="/metrics">/metrics</a>\n'
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            header = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(header.encode() + (body if method == "GET" else b""))
            await writer.drain()
        except (TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a broken or slow client gets no answer; nothing to count
        finally:
            writer.close()
