"""The Daemon: owns the data dir, the peer node, the runs, and the control and metrics servers.

start() brings everything up in order and ends in READY; run() waits for a stop request and drains.
A drain leaves every run (peers drop us at once), stops the servers, leaves the DHT and stops p2pd,
all within `drain_timeout`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from peerd.daemon import SOURCE_ROOT, __version__
from peerd.daemon.config import DaemonConfig
from peerd.daemon.control import ControlServer, TooManyRuns, UnknownRun
from peerd.daemon.datadir import DataDir
from peerd.daemon.lifecycle import ALLOWED, DaemonState
from peerd.daemon.metrics import DaemonMetrics, MetricsServer
from peerd.daemon.progress import ProgressLog
from peerd.daemon.supervisor import TASK_PROGRAM, Preloaded
from peerd.daemon import joining as run_setup
from peerd.daemon.joining import RunHandle
from peerd.peers.collective.group import MAX_GROUP
from peerd.peers.dear.localgroup import LocalGroupRules
from peerd.peers.dear.member import AUTO, GroupPeer, plan_group
from peerd.peers.linkprobe import LinkProber
from peerd.peers.matchmaking import Matchmaker, MatchmakingSettings
from peerd.peers.membership import FOLLOWER, IDLE, TRAINER, Announcement, DiscoverySettings, Memberships
from peerd.peers.node import NodeSettings, PeerNode
from peerd.peers.pace import Pace
from peerd.peers.clock import now as dht_now
from peerd.peers.run_ids import RunSecret, validate_run_id
from peerd.peers.statesync import StateServer
from peerd.protos import control_pb2

logger = logging.getLogger(__name__)

PROBE_TICK = 2.0  # seconds between two looks for links to measure (a new peer waits at most this)
PROBE_INTERVAL = 15.0  # seconds between two measurements of one link
PROBE_BATCH = 8  # links measured at once
# Seconds between two bandwidth measurements of one link (--local-group auto only, one link at a time):
# a report stays fresh for LocalGroupRules.max_age (60 s), so a live link's is never near that.
BANDWIDTH_INTERVAL = 30.0
# --local-group auto: the daemon measures each link from one side per record, so a pair needs both sides'.
AUTO_RULES = LocalGroupRules(both_directions=True)
MANIFEST_POLL = 5.0  # seconds between two looks for the manifest of a run joined without one
UNIX_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
# The daemon's blocking work runs in its loop's default executor (asyncio.to_thread). Most calls
# are short, but some wait: a local group's followers for their leader's EndPhase, a group's first
# processes at attach for the others, a lane's question to another daemon of a spanning group.
# asyncio's own default, min(32, cores + 4) threads, 6 on 2 cores, let seven followers (torchrun
# --nproc-per-node 8) hold every thread the leader's EndPhase needed until the phase timeout.
# The pool starts a thread only when a call finds none idle: this is a ceiling, not a cost.
WORKER_THREADS = 256


def worker_threads() -> ThreadPoolExecutor:
    """The default executor of the daemon's loop (daemon/cli.py sets it)."""
    return ThreadPoolExecutor(max_workers=WORKER_THREADS, thread_name_prefix="peerd-worker")


@dataclass(slots=True)
class RunTraining:
    """What one run's heartbeat says of its training on this daemon (peers/membership.py asks at each
    heartbeat): the trainer's step, sketches and lanes, its spanning group's store, and the link
    reports peers decide an automatic local group from."""

    trainer: object  # peerd.daemon.attached.AttachedTrainer (a script's) or a TaskChild (a task's)
    prober: LinkProber | None = None  # with --local-group auto

    def announcement(self) -> Announcement:
        sketches = self.trainer.sketches  # before the step: see Announcement
        delegated, group = self.trainer.delegation  # one read: from the same placement
        span = self.trainer.span  # a local group of processes that spans daemons
        address = span.address if span is not None else ""
        return Announcement(
            step=self.trainer.live_step,  # an attached process's phase counts up (PHASE_STEPS)
            sketches=sketches,
            dear_address=address,
            delegated_lanes=delegated,
            dear_group=group,
            links=self.prober.reports() if self.prober is not None else (),
        )


@dataclass(frozen=True, slots=True)
class PeerView:
    peer_id: str
    maddrs: list[str]
    last_seen_seconds: float
    version: str
    role: str
    delegated_lanes: int = 0


class Daemon:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.state = DaemonState.STARTING
        self.data_dir = DataDir(config.data_dir)
        self.metrics = DaemonMetrics(
            version=__version__,
            states=[s.value for s in DaemonState],
            peers_by_run=self._peer_counts,
            runs=lambda: self.status().runs,
        )
        self.runs: dict[str, RunHandle] = {}
        self._run_changes = asyncio.Lock()  # one join or leave at a time: max_runs holds, no half-left run
        self.metrics.set_state(self.state.value)
        self.metrics_server = MetricsServer(self.metrics, config.metrics_host, config.metrics_port)
        self.progress = ProgressLog(lambda: self.status().runs, config.progress_interval)
        self.node: PeerNode | None = None
        self.memberships: Memberships | None = None
        self.matchmaker: Matchmaker | None = None
        self.state_server: StateServer | None = None
        self.prober: LinkProber | None = None
        self._probing: asyncio.Task | None = None
        self.control: ControlServer | None = None
        self.control_address = config.control_address
        self.maddrs: list[str] = []
        self._stop = asyncio.Event()
        self._stop_reason = ""
        # A --task run's training process, started with the daemon so that it imports torch while the
        # daemon starts (a restart's, too); its first Supervisor takes it (daemon/supervisor.py).
        self._preloaded: Preloaded | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def _set_state(self, new: DaemonState) -> None:
        if new not in ALLOWED[self.state]:
            raise RuntimeError(f"bad lifecycle transition {self.state.value} -> {new.value}")
        logger.info("state %s -> %s", self.state.value, new.value)
        self.state = new
        self.metrics.set_state(new.value)

    async def start(self) -> None:
        """Bring the daemon to READY. Raises DataDirError/OSError/P2PDaemonError on failure,
        after undoing whatever had started."""
        cfg = self.config
        if self.control_address.startswith("unix:") and len(self.control_address) - 5 > UNIX_SOCKET_PATH_MAX:
            raise OSError(
                f"control socket path {self.control_address[5:]} is too long for a unix socket; pass --control"
            )
        secret = self._secret_for_start()
        self.data_dir.open()
        try:
            if cfg.train.task and cfg.run:
                try:
                    self._preloaded = await Preloaded(TASK_PROGRAM, SOURCE_ROOT).start()
                except OSError as e:  # the child is started the usual way, once the run is set up
                    logger.warning("could not start the training process ahead of the run: %s", e)
            await self.metrics_server.start()
            events = self.metrics.peer_events()
            self.node = await PeerNode.start(
                NodeSettings(
                    host_maddrs=[_listen_maddr(cfg.network.host, cfg.network.port)],
                    identity_path=self.data_dir.identity_path,
                    initial_peers=cfg.network.initial_peers,
                    announce_maddrs=cfg.network.announce,
                    nat_port_map=cfg.network.nat_port_map,
                    auto_nat=cfg.network.auto_nat,
                    startup_timeout=cfg.network.startup_timeout,
                    request_timeout=cfg.network.dht_timeout,
                ),
                events,
            )
            self.metrics.set_peer_id(self.node.peer_id)
            self.maddrs = await self.node.visible_maddrs()
            d = cfg.discovery
            self.memberships = Memberships(
                self.node,
                DiscoverySettings(
                    heartbeat_interval=d.heartbeat_interval,
                    refresh_interval=d.refresh_interval,
                    peer_ttl=d.peer_ttl,
                    goodbye_timeout=d.goodbye_timeout,
                ),
                version=__version__,
                events=events,
            )
            await self.memberships.start()
            self.matchmaker = Matchmaker(self.node, MatchmakingSettings(max_group_size=MAX_GROUP), events)
            await self.matchmaker.start()
            # Chunks over direct TCP on the listen host, advertised as the engine's address is.
            self.state_server = StateServer(
                self.node, events, tcp_host=cfg.network.host, advertise_host=self._advertise_host()
            )
            await self.state_server.start()
            self.prober = LinkProber(cfg.network.host, 0, events=events)
            await self.prober.start()
            self._probing = asyncio.create_task(self._probe_links(), name="link-probes")
            for run_id in cfg.run:
                await self._join(run_id, secret(run_id) if secret else None, cfg.train.task, cfg.train.set_dict())
            await self._drop_preloaded()  # none of the runs took it
            await self._start_control()
            self._set_state(DaemonState.READY)
            await self.control.set_serving(True)
            self.data_dir.write_ready(self.ready_info())
            self.progress.start()
        except BaseException:
            await self._teardown(grace=0)
            raise

    def _measured_runs(self) -> list[str]:
        """The runs whose peers' links this daemon measures: those that use the measurements, i.e.
        loss-tolerant runs (per-link data path) and, with --local-group auto, every training run."""
        auto = self.config.train.local_group == AUTO
        return [
            run_id
            for run_id, h in self.runs.items()
            if h.manifest is not None and (auto or h.manifest.averaging.loss_tolerant)
        ]

    async def _probe_links(self) -> None:
        """Measure the link to every peer of the runs that use it (_measured_runs; peers/linkprobe.py):
        a new peer at the next tick, the others every PROBE_INTERVAL (a failed link sooner:
        LinkProber.due); PROBE_BATCH at a time, each
        measurement bounded. Every daemon answers probes whatever its runs."""
        while True:
            await asyncio.sleep(PROBE_TICK)
            try:
                runs = self.memberships.runs if self.memberships else {}
                targets = {
                    e.peer_id: e.probe_address
                    for r in self._measured_runs()
                    if r in runs
                    for e in runs[r].peers()
                    if e.probe_address
                }
                self.prober.forget(set(targets))
                t = time.monotonic()
                due = [(p, a) for p, a in targets.items() if self.prober.due(p, a, PROBE_INTERVAL, t)]
                for i in range(0, len(due), PROBE_BATCH):
                    await asyncio.gather(
                        *(self.prober.measure(p, a) for p, a in due[i : i + PROBE_BATCH]), return_exceptions=True
                    )
                if self.config.train.local_group == AUTO:  # one train at a time: trains would share links
                    t = time.monotonic()
                    for p, a in targets.items():
                        s = self.prober.stats.get(p)
                        if s is not None and s.passes and s.address == a and t - s.bandwidth_at >= BANDWIDTH_INTERVAL:
                            await self.prober.measure_bandwidth(p, a)
            except Exception:  # one failed tick must not end the loop
                logger.exception("link probes failed")

    def _secret_for_start(self):
        path = self.config.run_secret_file
        if not path:
            return None
        RunSecret.from_file(path, "check")  # fail before starting anything if the file is unusable
        return lambda run_id: RunSecret.from_file(path, run_id)

    async def _start_control(self) -> None:
        if self.control_address.startswith("unix:"):
            Path(self.control_address[5:]).unlink(missing_ok=True)  # stale: we hold the data dir lock
        self.control = ControlServer(self, self.control_address, self.config.control_max_request_bytes)
        port = await self.control.start()
        if not self.control_address.startswith("unix:") and self.control_address.endswith(":0"):
            self.control_address = f"{self.control_address.rsplit(':', 1)[0]}:{port}"

    def ready_info(self) -> dict:
        return {
            "peer_id": self.node.peer_id,
            "maddrs": self.maddrs,
            "control": self.control_address,
            "metrics_url": self.metrics_server.url,
            "pid": os.getpid(),
            "version": __version__,
            "runs": sorted(self.memberships.runs),
        }

    async def run(self) -> None:
        """Wait for a stop request (signal or Shutdown RPC), then drain within drain_timeout."""
        await self._stop.wait()
        logger.info("draining: %s", self._stop_reason)
        self._set_state(DaemonState.DRAINING)
        try:
            async with asyncio.timeout(self.config.drain_timeout):
                await self.control.set_serving(False)
                await asyncio.gather(*(self._stop_run(h) for h in self.runs.values()))
                # Goodbyes go through p2pd: if a terminal's Ctrl-C or hang-up stopped it too, drop them.
                await self.node.unless_p2pd_exits(self.memberships.leave_all())
                await self._teardown(grace=1.0)
        except TimeoutError:
            logger.error("drain took longer than %.1f s; stopping hard", self.config.drain_timeout)
            await self._teardown(grace=0)
            raise

    def request_shutdown(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def _take_preloaded(self) -> Preloaded | None:
        """The preloaded training process, for the first task run that starts one (its own then)."""
        preloaded, self._preloaded = self._preloaded, None
        return preloaded

    async def _drop_preloaded(self) -> None:
        if self._preloaded is not None:
            preloaded, self._preloaded = self._preloaded, None
            await preloaded.close()

    async def _teardown(self, grace: float) -> None:
        """Stop whatever started, in reverse order. Safe to call more than once."""
        await self._drop_preloaded()
        await self.progress.stop()
        if self.control is not None:
            await self.control.stop(grace)
            self.control = None
            if self.control_address.startswith("unix:"):
                Path(self.control_address[5:]).unlink(missing_ok=True)
        for handle in self.runs.values():
            await self._stop_run(handle)
        if self._probing is not None:
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)
            self._probing = None
        if self.prober is not None:
            self.prober.close()
            self.prober = None
        if self.state_server is not None:
            await self.state_server.stop()
            self.state_server = None
        if self.node is not None:
            node, self.node = self.node, None
            self.memberships = None
            started = time.monotonic()
            await node.shutdown()
            if time.monotonic() - started > 1.0:  # a drain that runs out of time: say where it went
                logger.info("leaving the DHT and stopping p2pd took %.1f s", time.monotonic() - started)
        await self.metrics_server.stop()
        self.data_dir.close()
        if DaemonState.STOPPED in ALLOWED[self.state]:
            self._set_state(DaemonState.STOPPED)

    # ---- what the control API calls ------------------------------------------------------------

    def reject(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    @staticmethod
    def check_run_id(run_id: str) -> str:
        return validate_run_id(run_id)

    def _require_ready(self) -> Memberships:
        if self.state is not DaemonState.READY or self.memberships is None:
            raise RuntimeError(f"daemon is {self.state.value}, not READY")
        return self.memberships

    async def join_run(
        self, run_id: str, secret_file: str | None, task: str = "", settings: dict[str, str] | None = None
    ) -> bool:
        """Join a run (creating it when `task` is given and it has no manifest). Raises RunRefused,
        InvalidSecret, TooManyRuns beyond max_runs, or RuntimeError when not READY; a refused join
        changes nothing. Joining a run this daemon is in already returns False."""
        self._require_ready()
        secret = RunSecret.from_file(secret_file, run_id) if secret_file else None
        async with self._run_changes:
            if run_id not in self.runs and len(self.runs) >= self.config.max_runs:
                raise TooManyRuns(
                    f"this daemon is in {len(self.runs)} runs, its limit (max_runs); "
                    "leave one first, or restart the daemon with a larger --max-runs"
                )
            joined = await self._join(run_id, secret, task, settings or {})
        self.data_dir.write_ready(self.ready_info())
        return joined

    async def _join(self, run_id: str, secret: RunSecret | None, task: str, settings: dict[str, str]) -> bool:
        if run_id in self.runs:
            current = self.runs[run_id].manifest
            if task and (current is None or current.task != task):
                raise run_setup.RunRefused(
                    f"already in run {run_id!r}, which trains {current.task if current else 'nothing'!r}, not {task!r}"
                )
            return False
        data_dir = self.config.data_dir
        resolved = await run_setup.resolve(self.node, run_id, secret, task, settings, self.reject, data_dir)
        # Idle until a process trains here (the trainer announces it: on_role), a run with no manifest
        # yet too: --min-peers counts peers with training (RunMembership.trainers), not daemons.
        await self.memberships.join(run_id, secret)
        self.memberships.runs[run_id].probe_address = (
            self.prober.announced(self._advertise_host()) if self.prober else ""
        )
        handle = RunHandle(run_id, None, None, secret=secret)
        if resolved is not None:
            await self._train(handle, *resolved)
        else:
            logger.warning(
                "run %s: no manifest and no --task: joined for discovery only, nothing to train until a "
                "manifest appears (a mistyped run ID, or a run not created yet? --task creates it; a "
                "script's peerd.torch.Optimizer attaching creates it too)",
                run_id,
            )
            handle.republisher = asyncio.create_task(self._await_manifest(handle), name=f"manifest-watch:{run_id}")
        self.runs[run_id] = handle
        return True

    async def _await_manifest(self, handle: RunHandle) -> None:
        """A run joined with no manifest: look for one every MANIFEST_POLL s (a DHT read that timed
        out at the join, or a creator that starts later) and train it once it appears."""
        while True:
            await asyncio.sleep(MANIFEST_POLL)
            try:
                resolved = await run_setup.resolve(
                    self.node, handle.run_id, handle.secret, "", {}, self.reject, self.config.data_dir
                )
            except run_setup.RunRefused as e:
                logger.warning("run %s: its manifest appeared, and this daemon cannot train it: %s", handle.run_id, e)
                return
            if resolved is None:
                continue
            async with self._run_changes:
                if self.runs.get(handle.run_id) is not handle or handle.manifest is not None:
                    return  # left, or an attach set it up meanwhile
                logger.info("run %s: its manifest appeared; training it", handle.run_id)
                handle.republisher = None  # this task ends here; _train starts the republisher
                await self._train(handle, *resolved)
            self.data_dir.write_ready(self.ready_info())
            return

    async def _train(self, handle: RunHandle, manifest, data: bytes) -> None:
        """Set up the run's rounds, state serving and trainer: the daemon's half of a training process
        (daemon/attached.py), which waits for a script to attach or, for a task's run, starts the
        task's children (daemon/taskchild.py)."""
        # Imported here, as the trainer is (daemon/joining.py): the averager imports torch, which a
        # daemon whose runs are discovery only never loads; in a worker thread first (preload), so
        # that the loop does not stop for the seconds torch takes to import.
        await asyncio.to_thread(run_setup.preload, manifest.task)
        from peerd.peers.averaging import MoshpitAverager
        from peerd.peers.dear.delegate import spread_round

        run_id, secret = handle.run_id, handle.secret
        handle.manifest = manifest
        membership = self.memberships.runs[run_id]
        averager = MoshpitAverager(
            run_id=run_id,
            secret=secret,
            peer_id=self.node.peer_id,
            matchmaker=self.matchmaker,
            bind_host=self.config.network.host,
            advertise_host=self._advertise_host(),
            max_group_size=manifest.averaging.max_group_size,
            p2p=self.node.p2p,
            reliable_links=self.config.network.reliable_links,
            loss_tolerant=manifest.averaging.loss_tolerant,
            data_path=self.config.network.data_path,
            udp_path_ok=lambda peer_id: self.prober is not None and self.prober.passes(peer_id),
            datagram_bytes=manifest.averaging.datagram_bytes,
            udp_rate_bps=self.config.network.udp_rate_mbit * 1e6 or None,
            events=self.metrics.peer_events(),
            rendezvous=run_setup.rendezvous_for(
                membership, manifest.averaging.phases, manifest.averaging.round_timeout
            ),
            lanes=manifest.averaging.lanes,
            density=manifest.averaging.density,
        )

        def live() -> dict[str, tuple[int, str]]:
            # Peers with nothing training (role idle: no process attached) are nobody's mates, and
            # so are the followers of a spanning local group, but for the lanes they average for it
            # (they announce its ID; peers/dear/delegate.py).
            return {
                e.peer_id: (e.delegated_lanes, e.dear_group)
                for e in membership.peers()
                if e.role == TRAINER or (e.role == FOLLOWER and e.dear_group)
            }

        async def run_round(vector, weight, round_t, lanes, restore, payload):
            # This daemon's pace goes in its matchmaking entries: the group agrees on average_every=auto's
            # figures from them (peers/pace.py).
            pace = Pace(trainer.step_seconds, self.metrics.round_seconds(run_id))
            group = trainer.delegation[1]
            owners = trainer.lane_owners() if lanes is None else []
            if not owners:
                return await averager.average(vector, weight, round_t, live(), lanes, group, restore, payload, pace)
            # The leader of a local group that spans daemons: each daemon averages its lanes.
            stores = {e.peer_id: e.dear_address for e in membership.peers()}
            timeout = manifest.averaging.round_timeout

            async def own(which):
                return await averager.average(vector, weight, round_t, live(), which, group, restore, payload, pace)

            async def ask(peer, request):
                if not stores.get(peer):
                    raise OSError("its store's address is not in the table")
                return await asyncio.to_thread(trainer.span.ask, stores[peer], request, timeout)

            return await spread_round(
                vector,
                weight,
                round_t,
                manifest.averaging.lanes,
                payload,
                self.node.peer_id,
                owners,
                own,
                ask,
                lambda why: self.reject("lane_answer"),
            )

        loop = asyncio.get_running_loop()
        average = run_setup.bounded_round(handle, run_round, manifest.averaging.round_timeout)
        sync = run_setup.sync_bridge(handle, loop, self.node, run_id, secret, membership, self.metrics.peer_events())
        # With --local-group auto the heartbeats carry this daemon's link reports: the group is
        # decided from them.
        prober = self.prober if self.config.train.local_group == AUTO else None
        if not manifest.task:
            handle.trainer = trainer = self._attached_trainer(manifest, membership, average, sync, loop)
        else:
            handle.trainer = trainer = await self._task_child(manifest, membership, average, sync, loop)
        training = RunTraining(trainer, prober)
        if trainer.span is not None and manifest.averaging.lanes > 1:
            from peerd.daemon.groupspan import serve_lanes

            async def average_lanes(vector, weight, round_t, which, payload):
                group = trainer.delegation[1]
                return await averager.average(vector, weight, round_t, live(), which, group, True, payload)

            trainer.lanes_served = lambda: serve_lanes(
                trainer.span,
                trainer.owned,
                trainer.numel,
                manifest.averaging.lanes,
                average_lanes,
                trainer.serving,
                trainer.served,
                lambda why: self.reject("lane_request"),
                manifest.averaging.round_timeout,
            )
        membership.announcement = training.announcement
        self.state_server.serve(run_id, secret, lambda: trainer.snapshot)
        await asyncio.to_thread(trainer.load)  # status shows the restored step from its first answer
        trainer.start()
        handle.republisher = asyncio.create_task(
            run_setup.republish(self.node, manifest, data, secret), name=f"manifest:{run_id}"
        )

    async def _task_child(self, manifest, membership, average, sync, loop):
        """The daemon's half of a task's run trained by its child process (daemon/taskchild.py)."""
        from peerd.daemon.taskchild import TaskChild, child_argv, task_model

        seed = run_setup.init_seed(manifest)
        layout, identity, model, optimizer = await asyncio.to_thread(task_model, manifest, seed)  # builds it once
        train = self.config.train
        argv = child_argv(manifest, self.config.data_dir, train, seed)
        state = {}
        if manifest.averaging.algorithm == "state":  # the rounds average the child's whole state vector
            from peerd.daemon.algorithms import StateAveraging
            from peerd.daemon.flat import state_tensors

            # The optimizer's state, materialized off the loop: its first step imports torch._dynamo (1-3 s).
            await asyncio.to_thread(state_tensors, optimizer)
            # No straggler budget: a state run's phases all take H steps.
            state = {"algorithm": StateAveraging(model, optimizer), "inner_budget": 0.0}
        preloaded = self._take_preloaded()
        try:
            return self._attached_trainer(
                manifest,
                membership,
                average,
                sync,
                loop,
                TaskChild,
                **state,
                layout=layout,
                identity=identity,
                argv=argv,
                processes=train.train_processes,
                max_steps=train.max_steps,
                preloaded=preloaded,
                # Before the child starts, daemons in the run (no child trains before it attaches): a
                # daemon alone does not start one. What decides its first step is trainers_ready.
                ready=lambda: len(membership.table) + 1 >= train.min_peers,
                trainers_ready=lambda: self._trainers_ready(membership),
                ready_timeout=train.min_peers_timeout,
            )
        except BaseException:
            if preloaded is not None:
                await preloaded.close()
            raise

    def _trainers_ready(self, membership) -> bool:
        """--min-peers, the one count of it: whether the run's peers with training
        (RunMembership.trainers: a process trains there, or a task's child attaches), and this
        daemon, whose process attaches now, are min_peers or more. A daemon with no process
        attached, or no manifest yet, does not count."""
        return len(membership.trainers()) + 1 >= self.config.train.min_peers

    async def _await_trainers(self, handle: RunHandle, membership) -> bool:
        """--min-peers for a script's first process (a task's child waits in its own attach,
        daemon/taskchild.py): it waits until _trainers_ready, at most --min-peers-timeout, then
        trains with whoever is there. It is announced as training from here on, ready or not: the
        others' first processes wait for this one, and the run's creator waits for the daemons
        whose attach downloads its first parameters. Nothing to wait for without --min-peers, or
        where a process is attached already or the run has trained here (a checkpoint's step).
        Returns whether it announced this daemon."""
        from peerd.daemon.taskchild import TRAINERS_POLL

        trainer = handle.trainer
        if self.config.train.min_peers <= 1 or trainer.attached is not None or trainer.global_step:
            return False
        membership.role = trainer.role
        self._announce_soon(membership, asyncio.get_running_loop())
        if not self._trainers_ready(membership):
            logger.info("run %s: the process waits for --min-peers daemons training", handle.run_id)
        deadline = time.monotonic() + self.config.train.min_peers_timeout
        while not self._trainers_ready(membership) and time.monotonic() < deadline and not handle.stopping:
            await asyncio.sleep(TRAINERS_POLL)
        return True

    def _attached_trainer(self, manifest, membership, average, sync, loop, cls=None, **kwargs):
        """The daemon's half of a run trained by an attached process (docs/your-loop.md): a script's
        (AttachedTrainer), or with `cls` and its arguments, the task's child (TaskChild). The run's
        algorithm is DiLoCo (daemon/algorithms.py) unless the arguments give another."""
        from peerd.daemon.algorithms import DiLoCo
        from peerd.daemon.attached import AttachedTrainer, remove_stale, shared_directory
        from peerd.daemon.checkpoint import CheckpointStore

        run_id, train = manifest.run_id, self.config.train
        run_dir = self.config.data_dir / "runs" / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        shared = shared_directory(run_dir)
        if removed := remove_stale(shared):
            logger.info("removed %d shared-memory file(s) of daemons that are gone from %s", removed, shared)
        membership.role = IDLE  # until a process attaches

        def on_role(role: str) -> None:
            membership.role = role
            self._announce_soon(membership, loop)

        if cls is None:  # a script's run
            cls, kwargs = AttachedTrainer, {"layout": manifest.model, "creator": manifest.creator == self.node.peer_id}

        settings = dict(
            run_id=run_id,
            store=CheckpointStore(
                run_dir / "checkpoints",
                on_corrupt=lambda path, why: self.reject("checkpoint_corrupt"),
                on_foreign=lambda path, why: self.reject("checkpoint_foreign"),
            ),
            phases=manifest.averaging.phases,
            round_timeout=manifest.averaging.round_timeout,
            checkpoint_every=train.checkpoint_every,
            shared_dir=shared,
            average=average,
            on_round=lambda result: self.metrics.observe_round(run_id, result),
            peer_steps=lambda: [e.step for e in membership.trainers()],
            sync=sync,
            on_sync=lambda result: self.metrics.observe_sync(run_id, result),
            on_role=on_role,
            inner_budget=manifest.averaging.inner_budget,
            auto_every=_auto_bounds(manifest.averaging),
            round_seconds=lambda: self.metrics.round_seconds(run_id),
            lanes=manifest.averaging.lanes,
        )
        if "algorithm" not in kwargs:
            settings["algorithm"] = DiLoCo(run_setup.outer_settings(manifest.averaging))
        trainer = cls(**{**settings, **kwargs})
        if train.local_group:
            trainer.span = self._group_span(run_id, membership, trainer)
        return trainer

    def _group_span(self, run_id: str, membership, trainer):
        """The local group of this daemon's processes and those of the run's daemons of the same
        --local-group label (daemon/groupspan.py)."""
        from peerd.daemon.groupspan import GroupSpan

        label = membership.local_group = self.config.train.local_group

        def peers() -> list[tuple[str, str]]:
            if label != AUTO:
                return [(e.peer_id, e.dear_address) for e in membership.peers() if e.local_group == label]
            # By measured links: the group local_groups decides among the peers labelled auto from
            # their records' link reports, the same on every one of them (peers/dear/member.py).
            timestamp, links = membership.published_links
            table = [
                GroupPeer(e.peer_id, e.local_group, e.dear_address, e.links, e.timestamp) for e in membership.peers()
            ]
            me = GroupPeer(self.node.peer_id, AUTO, "", links, timestamp)
            everyone = {p.peer for p in table} | {me.peer}
            group = set(plan_group(me, table, everyone, AUTO_RULES, dht_now()).members) - {me.peer}
            return [(p.peer, p.address) for p in table if p.peer in group]

        def awaited() -> int:  # --min-peers: the label's peers with training, whom the first step waits for
            if self.config.train.min_peers <= 1:
                return 0
            training = {e.peer_id for e in membership.trainers()}
            grouped = sum(peer in training for peer, _ in peers())
            if label != AUTO:
                return grouped
            # By links: a training peer labelled auto whose link with this daemon is not in both
            # records yet may still be in the group by links; the first step waits for it too (at
            # most the attach's PLACE_WAIT). Else each daemon's process trained alone first, its
            # own group, and the run of test_group_span's auto case was over before they grouped.
            _, links = membership.published_links
            mine = {r.peer_id for r in links}
            unmeasured = [
                e
                for e in membership.peers()
                if e.local_group == AUTO
                and e.peer_id in training
                and (e.peer_id not in mine or self.node.peer_id not in {r.peer_id for r in e.links})
            ]
            return grouped + len(unmeasured)

        return GroupSpan(
            run_id=run_id,
            peer_id=self.node.peer_id,
            label=label,
            host=self.config.train.local_group_host or self._advertise_host(),
            peers=peers,
            local=trainer.spanned,
            placed=trainer.placed,
            failed=self.metrics.local_group_store_failures.labels(run_id).inc,
            awaited=awaited,
        )

    async def attach(
        self,
        run_id: str,
        pid: int,
        device: str,
        layout: tuple,
        settings: dict[str, str],
        step: int,
        group_size: int = 1,
    ):
        """A training process attaches to a run this daemon is in (docs/your-loop.md); several
        processes attached to one run are its local group (daemon/attached.py). The first attach to
        a run with no manifest creates it with the process's model. Raises UnknownRun, RunRefused
        (another model, a task's run, other settings), AttachRefused (no state to start from),
        RuntimeError when not READY."""
        from peerd.daemon.attached import SCRIPT_RUN_DEFAULTS, AttachedTrainer, AttachRefused
        from peerd.daemon.taskchild import TaskChild
        from peerd.peers.manifest import check_layout

        self._require_ready()
        check_layout(layout)  # ValueError: nothing changes
        async with self._run_changes:
            handle = self.runs.get(run_id)
            if handle is None:
                raise UnknownRun(
                    f"this daemon is not in run {run_id!r}: start it with --run {run_id} (or `peerd join {run_id}`)"
                )
            if handle.manifest is None:
                created = {**SCRIPT_RUN_DEFAULTS, **settings}
                resolved = await run_setup.resolve(
                    self.node, run_id, handle.secret, "", created, self.reject, self.config.data_dir, model=layout
                )
                await self._train(handle, *resolved)
                self.data_dir.write_ready(self.ready_info())
            elif isinstance(handle.trainer, TaskChild):  # a task's run: only its own child attaches
                handle.trainer.check_child(pid, layout)
            else:
                run_setup.check_attach(handle.manifest, layout, settings)
        trainer = handle.trainer
        if not isinstance(trainer, AttachedTrainer):
            raise AttachRefused(f"run {run_id!r} is not trained by scripts on this daemon")
        membership = self._membership(run_id)
        announced = not isinstance(trainer, TaskChild) and await self._await_trainers(handle, membership)
        try:
            return await asyncio.to_thread(trainer.attach, pid, device, step, group_size)
        except BaseException:
            if announced and trainer.attached is None:  # nothing trains here after all
                membership.role = IDLE
                self._announce_soon(membership, asyncio.get_running_loop())
            raise

    def attached_trainers(self) -> list:
        """The AttachedTrainers of this daemon's runs (daemon/attached.py; a task's child's too)."""
        trainers = [h.trainer for h in self.runs.values() if h.trainer is not None]
        if not trainers:
            return []
        from peerd.daemon.attached import AttachedTrainer  # loaded already: a trainer exists

        return [t for t in trainers if isinstance(t, AttachedTrainer)]

    @staticmethod
    def _announce_soon(membership, loop: asyncio.AbstractEventLoop) -> None:
        """From a worker thread: send a heartbeat now (the trainer's role or lanes changed), not at the
        next interval. A failure is the periodic heartbeat's to make up for."""

        async def announce() -> None:
            try:
                await membership.heartbeat()
            except Exception:
                logger.debug("run %s: immediate heartbeat failed", membership.run_id, exc_info=True)

        try:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(announce()))
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass

    def _advertise_host(self) -> str:
        """The address peers dial for this daemon's collective engine: the listen host, or for a
        wildcard listen the first non-loopback IPv4 address libp2p sees, else loopback."""
        host = self.config.network.host
        if host not in ("0.0.0.0", "::"):
            return host
        for maddr in self.maddrs:
            parts = maddr.split("/")
            if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127."):
                return parts[2]
        return "127.0.0.1"

    async def _stop_run(self, handle: RunHandle) -> None:
        handle.cancel()  # the round and download in flight; none the trainer asks for next is run
        if self.state_server is not None:
            self.state_server.stop_serving(handle.run_id)
        if handle.republisher is not None:
            handle.republisher.cancel()
            handle.republisher = None
        if handle.trainer is not None:
            await asyncio.to_thread(handle.trainer.stop)

    async def leave_run(self, run_id: str) -> bool:
        """Leave a run; False if this daemon was not in it (nothing changes: leaving is idempotent).
        Raises RuntimeError when not READY."""
        memberships = self._require_ready()
        async with self._run_changes:
            handle = self.runs.pop(run_id, None)
            if handle is None and run_id not in memberships.runs:
                return False
            if handle is not None:
                await self._stop_run(handle)
            if run_id in memberships.runs:
                await memberships.leave(run_id)
        self.data_dir.write_ready(self.ready_info())
        return True

    def _membership(self, run_id: str):
        if self.memberships is None or run_id not in self.memberships.runs:
            raise UnknownRun(run_id)
        return self.memberships.runs[run_id]

    def list_peers(self, run_id: str) -> list[PeerView]:
        membership = self._membership(run_id)
        t = dht_now()
        return [
            PeerView(e.peer_id, list(e.maddrs), max(t - e.last_seen, 0.0), e.version, e.role, e.delegated_lanes)
            for e in membership.peers()
        ]

    def status(self) -> control_pb2.StatusResponse:
        """What `peerd status`, the Status RPC, the metrics and the progress log show. The schema is
        protos/control.proto's RunStatus, documented there; this fills it from the trainers."""
        t = dht_now()
        runs = []
        for m in self.memberships.runs.values() if self.memberships else []:
            handle = self.runs.get(m.run_id)
            tr = handle.trainer if handle else None
            manifest = handle.manifest if handle else None
            payload, overlap = _rounds(manifest.averaging) if manifest else ("", False)
            r = control_pb2.RunStatus(
                run_id=m.run_id,
                peers=len(m.table),
                secured=m.secured,
                joined_seconds=t - m.joined_at,
                task=manifest.task if manifest else "",
                algorithm=manifest.averaging.algorithm if manifest else "",
                average_every=manifest.averaging.phases.every if manifest else 0,
                average_every_auto=manifest.averaging.average_every_auto if manifest else False,
                payload=payload,
                density=manifest.averaging.density if payload == "arctopk" else 0.0,
                overlap=overlap,
                round_seconds=self.metrics.round_seconds(m.run_id),
                step_seconds=math.nan,
                param_divergence=math.nan,
                param_distance_to_group_mean=math.nan,
                compute_fraction=math.nan,
                dear_overlap_ratio=math.nan,
                wan_share=1.0,
                local_group_rank=-1,
            )
            if tr is not None:
                lr, div, lg, session = tr.last_round, m.divergence(), tr.local_group, tr.session
                r.train_state, r.step, r.loss, r.samples = tr.state.value, tr.step, tr.loss, tr.samples
                r.samples_averaged = int(tr.samples_averaged)
                r.samples_per_second, r.error, r.local_step = tr.samples_per_second, tr.error, tr.local_step
                if tr.eval is not None:
                    r.eval_metric, r.eval_score = tr.eval.metric, tr.eval.score
                if lr is not None:
                    r.last_round, r.last_round_outcome, r.group_size = lr.round_t, lr.outcome_name, lr.group_size
                    r.last_round_digest = lr.outcome.digest.hex() if lr.completed else ""
                    r.last_round_links = lr.links_summary
                    r.last_round_group.extend((self.node.peer_id, *sorted(lr.links)))
                if div is not None:
                    r.param_divergence, r.param_divergence_step = div.value, div.step
                r.param_distance_to_group_mean = tr.param_distance_to_group_mean
                if lg is not None:
                    r.local_group, r.local_group_size, r.local_group_rank = lg.label, lg.size, lg.rank
                    r.local_group_reason = lg.last_reason
                r.wan_share = tr.wan_share
                r.compute_fraction, r.train_wait_seconds = tr.compute_fraction, tr.train_wait_seconds
                r.dear_overlap_ratio = tr.dear_overlap_ratio
                r.parameters = tr.parameters
                r.step_seconds = tr.step_seconds
                if tr.fitted is not None:  # average_every=auto's decision
                    r.average_every, r.average_every_reason = tr.fitted.every, tr.fitted.reason
                    r.average_every_round = tr.fitted_round
                r.resumed_from, r.synced_from = tr.resumed_from, tr.synced_from
                if session is not None:
                    r.attached_pid, r.attached_device = session.pid, session.device
                    r.attached_processes, r.attached_group_epoch = len(tr.members), tr.group_epoch
                if (child := getattr(tr, "child", None)) is not None:  # daemon/taskchild.py
                    r.train_process_state, r.train_process_restarts = child.state.value, child.restarts
            runs.append(r)
        return control_pb2.StatusResponse(
            state=self.state.value,
            peer_id=self.node.peer_id if self.node else "",
            maddrs=self.maddrs,
            runs=sorted(runs, key=lambda r: r.run_id),
            uptime_seconds=time.monotonic() - self.metrics.started,
            version=__version__,
            metrics_url=self.metrics_server.url,
            pid=os.getpid(),
        )

    def failed_runs(self) -> dict[str, str]:
        """The runs whose training FAILED (the task raised), with the error, by run ID."""
        return {
            run_id: h.trainer.error
            for run_id, h in sorted(self.runs.items())
            if h.trainer is not None and h.trainer.state.value == "FAILED"
        }

    def serving(self) -> bool:
        """What the health service answers (docs/operations.md, "Health checks"): READY, and no run
        this daemon trains has FAILED."""
        return self.state is DaemonState.READY and not self.failed_runs()

    def _peer_counts(self) -> dict[str, int]:
        if self.memberships is None:
            return {}
        return {run_id: len(m.table) for run_id, m in self.memberships.runs.items()}


def _auto_bounds(averaging) -> tuple[int, int] | None:
    """averaging.average_every=auto's bounds for the trainer (daemon/plan.py fit_every); None: off."""
    return (averaging.average_every_min, averaging.average_every_max) if averaging.average_every_auto else None


def _rounds(averaging) -> tuple[str, bool]:
    """How a run's rounds go (RunStatus.payload and overlap): a state run's average its whole state in
    float32 (no codec) and its phases wait for them (no outer loop to land them into)."""
    diloco = averaging.algorithm == "diloco"
    return (averaging.payload if diloco else "fp32"), averaging.overlap and diloco


def _listen_maddr(host: str, port: int) -> str:
    return f"/ip6/{host}/tcp/{port}" if ":" in host else f"/ip4/{host}/tcp/{port}"
