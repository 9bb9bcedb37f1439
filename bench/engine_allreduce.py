"""Group all-reduce of one float32 vector: peerd's collective engine vs gloo vs hivemind's averager.

    python -m bench.engine_allreduce [--quick] [--mib 64] [--peers 4] [--rounds 21] [--skip-hivemind]

(1) peerd: peerd.peers.collective.GroupAllReduce over TcpTransport on a uvloop loop, a weighted mean,
    with restore=False as the daemon's trainer calls it (it keeps no backup of other shards; the
    complete-or-abort verdict and digest are unchanged), and
(2) torch.distributed gloo all_reduce (a sum; rendezvous through a FileStore in a temp dir) run in
    the same `--peers` processes on loopback, one round of each in turn (which goes first
    alternates), so both see the same machine at the same moment;
(3) hivemind DecentralizedAverager.step() in `--peers` other processes afterwards (DHT on
    127.0.0.1, no UPnP, no AutoNAT; group size fixed to `--peers`; its step includes matchmaking).
Before every round all processes meet at a barrier; a round's time is its slowest process's; the
figure is the median over rounds after warm-up. Bus bandwidth = 2(N-1)/N * bytes / time. CPU
seconds per round (all processes, user + system) are reported too: on a small machine they explain
the times. torch uses one thread per process for every system. Nothing is emulated: this is
loopback on one machine, so all processes share its cores. Every process started here (with its
children: hivemind's DHT, averager and p2pd) is killed on exit, Ctrl-C or SIGTERM, and by the
kernel if this parent dies.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta

from bench.common import emit, progress, result

BENCH = "engine_allreduce"
SETUP_TIMEOUT = 120.0  # seconds for all processes of one system to start and report their address
ROUND_LIMIT = 60.0  # seconds one system's rounds may take, per round, before it is killed
BARRIER_TIMEOUT = 60.0  # seconds a process waits for the others before a round
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _data(rank: int, numel: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _expected(n: int, numel: int):
    """The exact weighted mean every peerd member must hold after its first round (weights rank + 1)."""
    total = sum(_data(r, numel).mul_(r + 1) for r in range(n))
    return total.div_(sum(range(1, n + 1)))


# ---- workers (each in its own spawned process) -----------------------------------------------------


def _worker(system: str, rank: int, n: int, numel: int, rounds: int, conn, barrier, scratch: str, chunk: int) -> None:
    os.setpgrp()  # own process group: the parent kills it with all its children in one call
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # and the kernel kills it if the parent dies
    import torch

    torch.set_num_threads(1)  # N processes share 2 cores; the same for every system (peerd computes in numpy)
    try:
        if system.startswith("costs:"):  # bench.engine_costs: two peerd engines, a part switched off in one
            from bench.engine_costs import pair

            report = pair(system.split(":", 1)[1], rank, n, numel, rounds, conn, barrier, scratch, chunk)
        else:
            report = {"duel": _duel, "hivemind": _hivemind}[system](
                rank, n, numel, rounds, conn, barrier, scratch, chunk
            )
        conn.send(("done", report))
    except Exception as e:  # report, do not hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _duel(rank, n, numel, rounds, conn, barrier, scratch, chunk) -> dict:
    """peerd and gloo in the same processes, one round of each in turn, the first of the pair
    alternating: both see the same machine at the same moment."""
    import torch.distributed as dist
    import uvloop

    from peerd.peers.collective import AllReduceSettings, Group, GroupAllReduce, TcpTransport

    loop = uvloop.new_event_loop()
    transport = TcpTransport("127.0.0.1", 0)
    conn.send(("address", loop.run_until_complete(transport.start())))
    addresses = conn.recv()
    group = Group("bench", [f"peer{i}" for i in range(n)], addresses, rank)
    settings = AllReduceSettings(contribute_timeout=20.0, gather_timeout=40.0, verdict_timeout=5.0)
    if chunk:
        settings.chunk_elements = chunk
    engine = GroupAllReduce(group, transport, numel, settings=settings)
    store = f"file://{scratch}/gloo.store"
    # gloo binds to whatever the hostname resolves to unless told; loopback only, like everything here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=n, timeout=timedelta(seconds=ROUND_LIMIT))
    x, y = _data(rank, numel), _data(rank, numel)
    report = {"peerd": [], "gloo": [], "peerd_cpu": [], "gloo_cpu": [], "outcomes": [], "max_error": None}

    def peerd(r: int) -> None:
        outcome = loop.run_until_complete(engine.all_reduce(x, float(rank + 1), r, restore=False))
        report["outcomes"].append((outcome.status.value, outcome.digest.hex(), outcome.reason))

    def gloo(r: int) -> None:
        dist.all_reduce(y)

    for r in range(1, rounds + 1):
        for name, step in (("peerd", peerd), ("gloo", gloo)) if r % 2 else (("gloo", gloo), ("peerd", peerd)):
            barrier.wait(BARRIER_TIMEOUT)
            c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            step(r)
            t1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            report[name].append(t1 - t0)
            report[f"{name}_cpu"].append(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
        y.div_(n)  # keeps gloo's sums bounded over many rounds; not timed
        if r == 1:
            report["max_error"] = float((x - _expected(n, numel)).abs().max())
    dist.destroy_process_group()
    loop.run_until_complete(engine.close())
    loop.run_until_complete(transport.close())
    loop.close()
    return report


def _hivemind(rank, n, numel, rounds, conn, barrier, scratch, chunk) -> dict:
    import logging

    import hivemind

    # hivemind's DHT and averager are fork-started processes; a spawned child inherits "spawn".
    mp.set_start_method("fork", force=True)
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    initial = None
    if rank:
        conn.send(("address", None))
        initial = conn.recv()
    # Loopback only, and never UPnP/NAT-PMP or AutoNAT: a benchmark must not touch the LAN.
    dht = hivemind.DHT(
        start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False
    )
    if not rank:
        conn.send(("address", [str(m) for m in dht.get_visible_maddrs()]))
        conn.recv()
    x = _data(rank, numel)
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[x],
        dht=dht,
        prefix="bench",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        allreduce_timeout=ROUND_LIMIT,
        start=True,
    )
    times, failed = [], 0
    for _ in range(rounds):
        barrier.wait(BARRIER_TIMEOUT)
        t0 = time.perf_counter()
        try:
            ok = averager.step(timeout=ROUND_LIMIT) is not None
        except Exception:  # hivemind raises some failures (MatchmakingException) instead of returning None
            ok = False
        times.append(time.perf_counter() - t0)
        failed += not ok
    averager.shutdown()
    dht.shutdown()
    return {"hivemind": times, "failed": failed}


# ---- the parent ------------------------------------------------------------------------------------


class Cluster:
    """N worker processes of one system; `kill()` ends them and everything they started."""

    def __init__(self, system: str, n: int, numel: int, rounds: int, chunk: int):
        ctx = mp.get_context("spawn")
        self.scratch = tempfile.mkdtemp(prefix="peerd-bench-")
        self.barrier = barrier = ctx.Barrier(n)  # kept: children rebuild it from its name
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(system, rank, n, numel, rounds, child, barrier, self.scratch, chunk))
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def recv(self, rank: int, timeout: float):
        if not self.conns[rank].poll(timeout):
            raise TimeoutError(f"worker {rank} said nothing within {timeout:.0f} s")
        kind, value = self.conns[rank].recv()
        if kind == "error":
            raise RuntimeError(f"worker {rank}: {value}")
        return value

    def kill(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace  # workers that reported exit by themselves: give them that long
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            p.join(5)
        self.barrier = None  # lets its semaphores be released now, not at interpreter exit
        shutil.rmtree(self.scratch, ignore_errors=True)


def run_system(system: str, n: int, numel: int, rounds: int, chunk: int = 0) -> list[dict]:
    cluster, grace = Cluster(system, n, numel, rounds, chunk), 0.0
    try:
        if system == "hivemind":  # peers 1.. join through peer 0's DHT address
            first = cluster.recv(0, SETUP_TIMEOUT)
            for rank in range(1, n):
                cluster.recv(rank, SETUP_TIMEOUT)
                cluster.conns[rank].send(first)
            cluster.conns[0].send(None)
        else:
            addresses = [cluster.recv(rank, SETUP_TIMEOUT) for rank in range(n)]
            for c in cluster.conns:
                c.send(addresses)
        reports = [cluster.recv(rank, SETUP_TIMEOUT + ROUND_LIMIT * rounds) for rank in range(n)]
        grace = 20.0
        return reports
    finally:
        cluster.kill(grace)


def summarize(reports: list[dict], key: str, warmup: int, n: int, nbytes: int) -> dict:
    """A round's time is its slowest process's; the figure is the median over rounds after warm-up."""
    rounds = [max(r[key][i] for r in reports) for i in range(len(reports[0][key]))][warmup:]
    t = statistics.median(rounds)
    out = {"time": t, "busbw": 2 * (n - 1) / n * nbytes / t / 1e6, "samples": [round(x, 4) for x in rounds]}
    if f"{key}_cpu" in reports[0]:  # CPU seconds of all processes together, per round
        cpu = [sum(r[f"{key}_cpu"][i] for r in reports) for i in range(len(reports[0][key]))][warmup:]
        out["cpu"] = statistics.median(cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB, 3 rounds: a smoke run")
    parser.add_argument("--mib", type=float, default=64.0, help="vector size in MiB (float32)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=21, help="measured rounds of peerd and of gloo, after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hivemind-rounds", type=int, default=3, help="hivemind is slow: fewer measured rounds")
    parser.add_argument("--skip-hivemind", action="store_true", help="peerd vs gloo only")
    parser.add_argument("--chunk-elements", type=int, default=0, help="peerd chunk size (default: the engine's)")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.rounds, args.warmup, args.hivemind_rounds = 4.0, 3, 1, 2

    def interrupt(signum, frame):  # so that the finally blocks run and kill every process
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    n, numel = args.peers, int(args.mib * (1 << 20)) // 4
    nbytes, load = numel * 4, os.getloadavg()[0]
    progress(BENCH, f"{n} peers, {nbytes / (1 << 20):.0f} MiB float32, load {load:.2f}, {os.cpu_count()} cores")
    try:
        progress(BENCH, f"peerd and gloo in turn: {args.warmup} warm-up + {args.rounds} rounds each")
        duel = run_system("duel", n, numel, args.warmup + args.rounds, args.chunk_elements)
        p, g = (summarize(duel, key, args.warmup, n, nbytes) for key in ("peerd", "gloo"))
        progress(BENCH, f"peerd median {p['time'] * 1e3:.1f} ms, gloo median {g['time'] * 1e3:.1f} ms")
        h = None
        if not args.skip_hivemind:
            progress(BENCH, f"hivemind: {args.warmup} warm-up + {args.hivemind_rounds} rounds")
            reports = run_system("hivemind", n, numel, args.warmup + args.hivemind_rounds)
            h = summarize(reports, "hivemind", args.warmup, n, nbytes) | {"failed": sum(r["failed"] for r in reports)}
            progress(BENCH, f"hivemind median {h['time'] * 1e3:.1f} ms")
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; every process started here was killed")
        return 130
    statuses = {o[0] for r in duel for o in r["outcomes"]}
    agree = all(len({r["outcomes"][i][1] for r in duel}) == 1 for i in range(len(duel[0]["outcomes"])))
    wins = sum(a < b for a, b in zip(p["samples"], g["samples"]))
    common = {
        "n": n,
        "bytes": nbytes,
        "cores": os.cpu_count(),
        "torch_threads": 1,
        "load_1min_at_start": round(load, 2),
        "load_1min_at_end": round(os.getloadavg()[0], 2),
        "peerd_round_s": round(p["time"], 4),
        "peerd_samples": p["samples"],
    }
    if h is not None:
        emit(
            result(
                BENCH,
                "bus_bandwidth_vs_hivemind",
                round(p["busbw"], 1),
                round(h["busbw"], 1),
                "MB/s",
                **common,
                hivemind_round_s=round(h["time"], 4),
                hivemind_samples=h["samples"],
                hivemind_failed_steps=h["failed"],
                target=10.0,
                note="ratio = peerd / hivemind bus bandwidth; >1 means peerd is faster; "
                "hivemind's step() includes its matchmaking",
            )
        )
    emit(
        result(
            BENCH,
            "bus_bandwidth_vs_gloo",
            round(p["busbw"], 1),
            round(g["busbw"], 1),
            "MB/s",
            **common,
            gloo_round_s=round(g["time"], 4),
            gloo_samples=g["samples"],
            peerd_faster_rounds=f"{wins}/{len(g['samples'])}",
            peerd_cpu_s_per_round=round(p["cpu"], 4),
            gloo_cpu_s_per_round=round(g["cpu"], 4),
            peerd_statuses=sorted(statuses),
            peerd_digests_agree=agree,
            peerd_max_error=max(r["max_error"] for r in duel),
            target=1.0,
            note="headline: ratio = peerd / gloo bus bandwidth (= gloo time / peerd time); >1 means peerd "
            "is faster; the two alternate round by round in the same 4 processes",
        )
    )
    return 0 if statuses == {"completed"} and agree else 1


if __name__ == "__main__":
    sys.exit(main())
