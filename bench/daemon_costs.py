"""What one daemon costs: start-to-ready time, idle memory, and how fast a SIGKILLed peer is dropped.

    python -m bench.daemon_costs [--quick]

Real `peerd start` subprocesses (peerd.daemon.procs.LocalDaemon) on loopback, data dirs in a temp dir.
Baselines come from the same run: a bare hivemind.DHT on loopback, for start time its constructor in
this process, for memory a Python process holding one (with the DHT's child process, p2pd and
torch_shm_manager). Nothing is emulated. The figures and what they mean are in
docs/benchmarks.md. Every process started here is killed on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import emit, median, progress, result
from peerd.daemon.client import ControlClient
from peerd.daemon.procs import READY_TIMEOUT, LocalDaemon

BENCH = "daemon_costs"
RUN_ID = "bench"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TARGET = 5.0  # seconds, spawn to ready.json
RSS_TARGET = 300.0  # MiB, daemon plus p2pd, idle in a run of three
LEAVE_TARGET = 15.0  # seconds, SIGKILL to gone from every other table
PEERS_TIMEOUT = 30.0  # seconds for three daemons to list each other: bootstrap plus a few heartbeats
LEAVE_TIMEOUT = 60.0  # seconds to wait for a killed peer to leave a table: four times the target
POLL = 0.1  # seconds between ListPeers calls
CALL_TIMEOUT = 2.0  # seconds for one ListPeers call while polling
IDLE = 5.0  # seconds of idling before memory is read
DEFAULTS = {"peer_ttl_s": 10.0, "refresh_s": 1.0, "heartbeat_s": 2.0}  # the daemon's, not passed explicitly


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


# ---- processes, from /proc ------------------------------------------------------------------------


def _tree(root: int) -> list[int]:
    """root and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)", which may hold spaces
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _memory_kib(pid: int) -> tuple[str, int, int]:
    """(command name, RSS, PSS) in KiB; ("", 0, 0) if the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return "", 0, 0
    name = status.split("\n", 1)[0].split(":", 1)[1].strip()
    kib = {line.split(":")[0]: int(line.split()[1]) for line in rollup.splitlines()[1:] if line.endswith(" kB")}
    return name, kib.get("Rss", 0), kib.get("Pss", 0)  # a zombie has neither


def tree_memory(root: int) -> dict[str, float]:
    """MiB used by root and all its descendants: RSS of the Python processes, of p2pd, of anything
    else (torch_shm_manager under hivemind.DHT), their sum, and the PSS sum (shared pages split
    between the processes sharing them)."""
    rss = {"python": 0, "p2pd": 0, "other": 0}
    pss = processes = 0
    for pid in _tree(root):
        name, r, p = _memory_kib(pid)
        rss["python" if name.startswith("python") else "p2pd" if name.startswith("p2pd") else "other"] += r
        pss, processes = pss + p, processes + (r > 0)
    return {k: _mib(v) for k, v in rss.items()} | {
        "total": _mib(sum(rss.values())),
        "pss": _mib(pss),
        "processes": processes,
    }


# ---- the baseline: a bare hivemind.DHT ------------------------------------------------------------


def start_dht(initial_peers: list[str] | None = None):
    import hivemind

    # Loopback only, and never UPnP/NAT-PMP or AutoNAT: a benchmark must not touch the LAN.
    return hivemind.DHT(
        initial_peers=initial_peers, start=True, host_maddrs=[LOOPBACK], nat_port_map=False, auto_nat=False
    )


def stop_dht(dht) -> float:
    """Shut a DHT down; returns the seconds shutdown() took. Kills its p2pd if it outlived it."""
    below = [pid for pid in _tree(dht.pid) if pid != dht.pid] if dht.is_alive() else []
    t0 = time.monotonic()
    dht.shutdown()
    took = time.monotonic() - t0
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return took


# What a program that wants a bare DHT runs: import hivemind, start a DHT (a forked child, which
# starts p2pd), then wait. Run as its own process so that nothing of this benchmark is counted.
_DHT_HOST = f"""
import json, sys, hivemind
dht = hivemind.DHT(initial_peers=sys.argv[1:] or None, start=True, host_maddrs=[{LOOPBACK!r}], nat_port_map=False, auto_nat=False)
print(json.dumps([str(m) for m in dht.get_visible_maddrs()]), flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
dht.shutdown()
"""
DHT_HOST_TIMEOUT = 30.0  # seconds for a DHT host to print its addresses: import hivemind, p2pd, bootstrap


class DhtHost:
    """A Python process holding one bare hivemind.DHT, in its own session."""

    def __init__(self, initial_peers: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DHT_HOST, *initial_peers],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.maddrs: list[str] = []

    def wait_ready(self) -> list[str]:
        ready, _, _ = select.select([self.proc.stdout], [], [], DHT_HOST_TIMEOUT)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise TimeoutError(f"hivemind.DHT host gave no addresses within {DHT_HOST_TIMEOUT:.0f} s")
        self.maddrs = json.loads(line)
        return self.maddrs

    def kill_tree(self) -> None:
        """SIGKILL the host and its descendants: the DHT child and p2pd share its session, but
        torch_shm_manager starts one of its own."""
        below = _tree(self.proc.pid) if self.proc.poll() is None else []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


# ---- peerd daemons ---------------------------------------------------------------------------------


def _peer_ids(daemon: LocalDaemon) -> set[str]:
    with ControlClient(daemon.control, timeout=CALL_TIMEOUT) as c:
        return {p.peer_id for p in c.list_peers(RUN_ID).peers}


def wait_mutual(daemons: list[LocalDaemon], timeout: float = PEERS_TIMEOUT) -> float:
    """Wait until each daemon lists exactly the others; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(_peer_ids(d) == {o.peer_id for o in daemons if o is not d} for d in daemons):
            return time.monotonic() - t0
        time.sleep(POLL)
    raise TimeoutError(f"{len(daemons)} daemons did not list each other within {timeout:.0f} s")


class Bench:
    def __init__(self, base: Path, quick: bool):
        self.base = base
        self.n_start = 2 if quick else 5
        self.trials = 1 if quick else 3
        self.daemons: list[LocalDaemon] = []  # every daemon ever started, for the final kill
        self.dhts: list = []  # in-process hivemind.DHTs (start-time baseline)
        self.hosts: list[DhtHost] = []  # DHT host processes (memory baseline)
        self.trio: list[LocalDaemon] = []  # three daemons in RUN_ID, from (b) to (c)
        self._dirs = 0

    def spawn(self, args: list[str], data_dir: Path | None = None, wait: bool = True) -> LocalDaemon:
        if data_dir is None:
            data_dir, self._dirs = self.base / f"d{self._dirs}", self._dirs + 1
        d = LocalDaemon(data_dir, args)
        self.daemons.append(d)
        return d.start(wait=wait)

    def cleanup(self) -> None:
        for dht in self.dhts:
            stop_dht(dht)
        for h in self.hosts:
            h.kill_tree()
        for d in self.daemons:
            d.kill_group()

    # ---- (a) start-to-ready, restart, stop ----------------------------------------------------------

    def start_costs(self) -> list[dict]:
        """Start N daemons on fresh data dirs (no run, like the bare DHT), each alternating with a
        bare DHT, then restart each daemon on its own data dir. The headline comes first."""
        fresh, restart, stop, dht_start, dht_stop, imports, dirs = [], [], [], [], [], [], []
        for i in range(self.n_start):
            t0 = time.monotonic()
            d = self.spawn([])
            fresh.append(time.monotonic() - t0)
            t0 = time.monotonic()
            d.stop()
            stop.append(time.monotonic() - t0)
            dirs.append(d.data_dir)
            t0 = time.monotonic()
            dht = start_dht()
            dht_start.append(time.monotonic() - t0)
            self.dhts.append(dht)
            dht_stop.append(stop_dht(dht))
            self.dhts.remove(dht)
            imports.append(_import_time())
            progress(
                BENCH,
                f"start {i + 1}/{self.n_start}: peerd {fresh[-1]:.2f} s (its imports alone {imports[-1]:.2f} s), "
                f"hivemind.DHT {dht_start[-1]:.2f} s",
            )
        for data_dir in dirs:
            t0 = time.monotonic()
            d = self.spawn([], data_dir=data_dir)
            restart.append(time.monotonic() - t0)
            d.stop()
        progress(BENCH, f"restarts: {', '.join(f'{t:.2f}' for t in restart)} s")
        baseline = round(median(dht_start), 3)
        excludes = (
            "the baseline is the hivemind.DHT constructor in a warm Python: "
            "it excludes interpreter start and imports (hivemind for it), which the daemon pays"
        )
        headline = result(
            BENCH,
            "start_to_ready_s",
            round(median(fresh), 3),
            baseline,
            "s",
            n=len(fresh),
            max=round(max(fresh), 3),
            samples=_r(fresh),
            baseline_samples=_r(dht_start),
            imports_s=round(median(imports), 3),
            target=START_TARGET,
            meets_target=max(fresh) <= START_TARGET,
            ok=True,
            note=f"median seconds from spawn to ready.json, fresh data dir; lower is better; {excludes} "
            "(imports_s: a Python that only imports peerd.daemon.app)",
        )
        others = [
            result(
                BENCH,
                "restart_to_ready_s",
                round(median(restart), 3),
                baseline,
                "s",
                n=len(restart),
                max=round(max(restart), 3),
                samples=_r(restart),
                target=START_TARGET,
                meets_target=max(restart) <= START_TARGET,
                ok=True,
                note=f"as start_to_ready_s, on a data dir that already holds an identity; {excludes}",
            ),
            result(
                BENCH,
                "stop_s",
                round(median(stop), 3),
                round(median(dht_stop), 3),
                "s",
                n=len(stop),
                max=round(max(stop), 3),
                samples=_r(stop),
                baseline_samples=_r(dht_stop),
                ok=True,
                note="SIGTERM to exit of a daemon in no run, vs hivemind.DHT.shutdown(); lower is better",
            ),
        ]
        return [headline, *others]

    # ---- (b) idle memory ----------------------------------------------------------------------------

    def baseline_memory(self) -> list[dict[str, float]]:
        """Three bare DHT hosts on loopback, the last two bootstrapped from the first; idle; memory of each."""
        hosts = [DhtHost([])]
        self.hosts += hosts
        peers = hosts[0].wait_ready()
        hosts += [DhtHost(peers), DhtHost(peers)]
        self.hosts += hosts[1:]
        for h in hosts[1:]:
            h.wait_ready()
        time.sleep(IDLE)
        samples = [tree_memory(h.proc.pid) for h in hosts]
        for h in hosts:
            h.kill_tree()
        return samples

    def start_trio(self) -> list[LocalDaemon]:
        first = self.spawn(["--run", RUN_ID])
        rest = [self.spawn(["--run", RUN_ID, "--initial-peers", first.maddrs[0]], wait=False) for _ in range(2)]
        for d in rest:
            d.wait_ready()
        took = wait_mutual([first, *rest])
        progress(BENCH, f"three daemons list each other {took:.1f} s after the last was ready")
        return [first, *rest]

    def memory(self) -> list[dict]:
        """Idle memory of three bare DHT hosts, then of three daemons in one run (kept as self.trio)."""
        baseline = self.baseline_memory()
        self.trio = self.start_trio()
        time.sleep(IDLE)
        ours = [tree_memory(d.pid) for d in self.trio]
        extra = {"n": len(ours), "idle_s": IDLE, "ok": True}

        def line(metric: str, key: str, note: str, **more) -> dict:
            ours_v, base_v = median([s[key] for s in ours]), median([s[key] for s in baseline])
            return result(BENCH, metric, ours_v, base_v, "MiB", **more, **extra, note=note)

        return [
            line(
                "idle_rss_total_mib",
                "total",
                samples=ours,
                baseline_samples=baseline,
                target=RSS_TARGET,
                meets_target=max(s["total"] for s in ours) <= RSS_TARGET,
                note="median over three peers idle in one run of the RSS summed over a process tree: `peerd start` and "
                "its p2pd, vs a Python process holding a bare hivemind.DHT, the DHT's forked child, its p2pd and "
                "torch_shm_manager; RSS counts pages shared between processes once per process; lower is better",
            ),
            line(
                "idle_pss_total_mib",
                "pss",
                note="as idle_rss_total_mib with PSS: shared pages are split between the processes sharing them "
                "(other peers' included), so this is the fairer comparison; lower is better",
            ),
            line(
                "idle_rss_python_mib", "python", note="the Python processes alone: one for peerd, two for hivemind.DHT"
            ),
            line("idle_rss_p2pd_mib", "p2pd", note="the p2pd child alone"),
        ]

    # ---- (c) a SIGKILLed peer leaves the others' tables -------------------------------------------------

    def leave_after_kill(self) -> list[dict]:
        """Each trial SIGKILLs trio[2] (daemon and p2pd) and times until trio[0] and trio[1] stop
        listing it; the next trial starts a fresh third peer first."""
        trio = self.trio
        if len(trio) != 3:
            raise RuntimeError("no run of three daemons to kill one of (see idle_rss_total_mib)")
        observers, samples = trio[:2], []
        for trial in range(self.trials):
            if trial:
                trio[2] = self.spawn(["--run", RUN_ID, "--initial-peers", trio[0].maddrs[0]])
                wait_mutual(trio)
            victim = trio[2]
            gone: list[float | None] = [None] * len(observers)
            with contextlib.ExitStack() as stack:
                clients = [stack.enter_context(ControlClient(o.control, timeout=CALL_TIMEOUT)) for o in observers]
                t0 = time.monotonic()
                victim.kill_group()
                while None in gone and time.monotonic() - t0 < LEAVE_TIMEOUT:
                    for i, c in enumerate(clients):
                        if gone[i] is None and victim.peer_id not in {p.peer_id for p in c.list_peers(RUN_ID).peers}:
                            gone[i] = round(time.monotonic() - t0, 2)
                    time.sleep(POLL)
            samples.append(gone)
            progress(BENCH, f"kill trial {trial + 1}/{self.trials}: gone from the observers after {gone} s")
        complete = [max(g) for g in samples if None not in g]
        per_observer = [median([g[i] for g in samples if g[i] is not None]) for i in range(len(observers))]
        ours = median(complete) if len(complete) == len(samples) else None
        return [
            result(
                BENCH,
                "killed_peer_dropped_s",
                ours,
                None,
                "s",
                n=len(samples),
                samples=samples,
                per_observer_median_s=per_observer,
                max=max(complete, default=None),
                target=LEAVE_TARGET,
                meets_target=ours is not None and max(complete) <= LEAVE_TARGET,
                ok=ours is not None,
                timeout_s=LEAVE_TIMEOUT,
                poll_s=POLL,
                **DEFAULTS,
                note="median over trials of the seconds from SIGKILL (daemon and p2pd) until both other peers stopped listing "
                "it; no baseline; lower is better",
            )
        ]


def _start_torch_shm_manager() -> None:
    """Start torch_shm_manager now, with SIGINT ignored, rather than inside the first hivemind.DHT.

    hivemind's futures live in torch shared memory, whose manager starts once per process. A signal
    that interrupts that start makes torch spin forever (torch/lib/libshm/core.cpp, start_manager:
    its retry-on-EINTR loop re-tests the failed read's result instead of reading again), and a
    process spinning in C never runs our handler, so Ctrl-C would leave the daemons running.
    """
    import torch

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # an ignored signal interrupts no read()
    try:
        torch.empty(1, dtype=torch.uint8).share_memory_()
    finally:
        signal.signal(signal.SIGINT, previous)


def _import_time() -> float:
    """Seconds from spawning a Python to its having imported what `peerd start` imports (its exit not included)."""
    t0 = time.time()  # wall clock, to compare with the child's
    out = subprocess.run(
        [sys.executable, "-c", "import time, peerd.daemon.app; print(time.time())"],
        check=True,
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT,
    )
    return float(out.stdout) - t0


def _r(xs: list[float]) -> list[float]:
    return [round(x, 3) for x in xs]


def _attempt(fn, metric: str, unit: str) -> list[dict]:
    """Run one measurement; a failure becomes a result with ok=false, so the others still run."""
    try:
        return fn()
    except Exception as e:
        progress(BENCH, f"{metric} failed: {type(e).__name__}: {e}")
        return [result(BENCH, metric, None, None, unit, ok=False, error=f"{type(e).__name__}: {e}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials, for a CI smoke run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    t0 = time.monotonic()
    import hivemind  # noqa: F401  (timed once, as context for the start-time baseline)

    progress(BENCH, f"import hivemind took {time.monotonic() - t0:.2f} s in this process")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    _start_torch_shm_manager()

    def interrupt(signum, frame):  # so that the finally below runs and kills every process
        raise KeyboardInterrupt

    # SIGINT too: a shell without job control starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    base = Path(tempfile.mkdtemp(prefix="peerd-bench-"))
    bench = Bench(base, args.quick)
    records: list[dict] = []

    def emit_all(rs: list[dict]) -> None:
        for r in rs:
            emit(r)
        records.extend(rs)

    try:
        # (a) forks this process for the in-process DHT baseline: it runs before any gRPC channel exists here.
        progress(BENCH, f"(a) start-to-ready: {bench.n_start} fresh data dirs, then a restart of each")
        start = _attempt(bench.start_costs, "start_to_ready_s", "s")
        headline, others = start[0], start[1:]  # held back: the headline is the last line
        emit_all(others)
        progress(BENCH, "(b) idle memory: three bare hivemind.DHT hosts, then three daemons in one run")
        emit_all(_attempt(bench.memory, "idle_rss_total_mib", "MiB"))
        progress(BENCH, f"(c) a SIGKILLed peer leaves the others' tables: {bench.trials} trial(s)")
        emit_all(_attempt(bench.leave_after_kill, "killed_peer_dropped_s", "s"))
        emit_all([headline])
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; killing every process started here")
        return 130
    finally:
        bench.cleanup()
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r.get("ok") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
