"""One averaging round over shaped links in the network lab: peerd's reliable engine vs gloo vs hivemind.

    python -m bench.lab_baselines [--quick] [--mib 64] [--hosts 4] [--rate 100] [--loss 0,1,5,10] [--cc reno,bbr]
                                  [--rtt-ms 0,50] [--hivemind-loss 0,5] [--budget-min 40]

The hosts are `peerd lab` network namespaces (daemon/lab/netns.py) on one bridge: each link is
limited to `--rate` Mbit/s in both directions (tbf on both ends of its veth) and drops `--loss` % of
the packets delivered to the host (nftables, bridge forward hook: a loss on the wire, not a local
error); every host's TCP uses one congestion control, `--cc` (reno or bbr; cubic cannot be chosen
inside a namespace here). `--rtt-ms` adds latency: every host's delay line (daemon/lab/delayline.py,
a userspace TUN device; this kernel has no netem) holds what it sends for rtt/2, so the RTT between
any two hosts is the setting; it is measured (TCP SYN/RST round trips between neighbour hosts) in
every cell, and both are in the JSON. Without it (0, the default) the RTT is under 1 ms.
For each (rtt, cc, loss), one process per host joins its host's namespace, then:
(1) peerd: peerd.peers.collective.GroupAllReduce over TcpTransport bound to the host's address, and
(2) torch.distributed gloo all_reduce (GLOO_SOCKET_IFNAME=eth0), in the same processes, one round
    of each in turn (which goes first alternates), as bench/engine_allreduce does on loopback;
(3) hivemind DecentralizedAverager.step() in other processes afterwards (DHT bound to the host's
    address, no UPnP, no AutoNAT; group size fixed to --hosts; its step includes matchmaking).
Every wait is bounded by --round-timeout (a hung system is reported as failed, not waited for);
a round's time is its slowest process's; the figure is the median over --rounds rounds. A cell
that would start after --budget-min minutes of the run is not run, and its line says so
("skipped": "budget"). JSON lines: one per (rtt, cc, loss), the last one the headline: peerd vs gloo, reno, 5 % loss. The lab (namespaces,
links, tables, processes) is removed on exit, Ctrl-C or SIGTERM; after a SIGKILL, `peerd lab clean`.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta

from bench.common import emit, interrupt_on_signals, progress, result
from bench.engine_allreduce import PR_SET_PDEATHSIG, Cluster, _data

BENCH = "lab_baselines"
SETUP_TIMEOUT = 120.0  # seconds for the processes of one system to start and report their address
QUIET_SLACK = 30.0  # seconds beyond --round-timeout that a cluster may send nothing before it is stopped
CLONE_NEWNET = 0x40000000  # linux/sched.h


def _enter(netns: str) -> None:
    """Move this (still single-threaded) process into a lab host's namespace: every thread, child
    process and socket it makes afterwards lives there (os.setns only exists from Python 3.12)."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    finally:
        os.close(fd)


def _worker(
    system: str,
    rank: int,
    n: int,
    numel: int,
    rounds: int,
    conn,
    barrier,
    scratch: str,
    netns: str,
    ip: str,
    timeout: float,
) -> None:
    os.setpgrp()  # own process group: the parent kills it with all its children in one call
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # and the kernel kills it if the parent dies
    _enter(netns)
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the namespace's only link; gloo would guess from the hostname
    import torch

    torch.set_num_threads(1)
    try:
        # "module:function" runs a worker defined elsewhere (bench.lossy's), in this same harness.
        module, _, name = system.partition(":")
        run = getattr(importlib.import_module(module), name) if name else {"duel": _duel, "hivemind": _hivemind}[system]
        run(rank, n, numel, rounds, conn, barrier, scratch, ip, timeout)
        conn.send(("done", None))
    except Exception as e:  # report, do not hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _timed(conn, key: str, barrier, timeout: float, step) -> None:
    """One step of one system, after all processes met; its time (None: failed) goes to the parent
    at once, so that what was measured survives a later step that the parent has to kill."""
    barrier.wait(timeout + 60)  # the others may still be in the previous round's timeout
    t0 = time.perf_counter()
    ok = step()
    conn.send(("put", key, time.perf_counter() - t0 if ok else None))


class GlooStep:
    """One gloo all_reduce of `y` per call, as a timed step: False once the group has timed out
    (a gloo group that timed out is unusable, so later calls fail at once)."""

    def __init__(self, y, n: int):
        self.y, self.n, self.broken = y, n, False

    def __call__(self, r: int) -> bool:
        import torch.distributed as dist

        if self.broken:
            return False
        try:
            dist.all_reduce(self.y)
        except RuntimeError:
            self.broken = True
            return False
        self.y.div_(self.n)  # keeps the sums bounded over rounds; inside the timing, and negligible at these rates
        return True

    def close(self) -> None:
        import torch.distributed as dist

        if not self.broken:
            dist.destroy_process_group()


def _duel(rank, n, numel, rounds, conn, barrier, scratch, ip, timeout) -> dict:
    import torch.distributed as dist
    import uvloop

    from peerd.peers.collective import AllReduceSettings, Group, GroupAllReduce, TcpTransport

    loop = uvloop.new_event_loop()
    transport = TcpTransport(ip, 0)
    conn.send(("address", loop.run_until_complete(transport.start())))
    group = Group("bench", [f"peer{i}" for i in range(n)], conn.recv(), rank)
    # Owners wait for contributions up to half the limit, members for results up to all of it.
    settings = AllReduceSettings(
        connect_timeout=min(10.0, timeout / 2),
        contribute_timeout=timeout / 2,
        gather_timeout=timeout,
        verdict_timeout=5.0,
        drain_timeout=2.0,
    )
    engine = GroupAllReduce(group, transport, numel, settings=settings)
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/gloo.store", rank=rank, world_size=n, timeout=timedelta(seconds=timeout)
    )
    x = _data(rank, numel)
    gloo = GlooStep(_data(rank, numel), n)

    def peerd(r: int) -> bool:
        outcome = loop.run_until_complete(engine.all_reduce(x, float(rank + 1), r))
        conn.send(("put", "outcomes", outcome.status.value))
        return outcome.completed

    for r in range(1, rounds + 1):
        for name, step in (("peerd", peerd), ("gloo", gloo)) if r % 2 else (("gloo", gloo), ("peerd", peerd)):
            _timed(conn, name, barrier, timeout, lambda: step(r))
    gloo.close()
    loop.run_until_complete(engine.close())
    loop.run_until_complete(transport.close())
    loop.close()


def _hivemind(rank, n, numel, rounds, conn, barrier, scratch, ip, timeout) -> dict:
    import logging

    import hivemind

    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager are fork-started processes
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    initial = None
    if rank:
        conn.send(("address", None))
        initial = conn.recv()
    # The host's address only, and never UPnP/NAT-PMP or AutoNAT: nothing leaves the lab.
    dht = hivemind.DHT(
        start=True, initial_peers=initial, host_maddrs=[f"/ip4/{ip}/tcp/0"], nat_port_map=False, auto_nat=False
    )
    if not rank:
        conn.send(("address", [str(m) for m in dht.get_visible_maddrs()]))
        conn.recv()
    averager = hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[_data(rank, numel)],
        dht=dht,
        prefix="bench",
        target_group_size=n,
        min_group_size=n,
        min_matchmaking_time=2.0,
        request_timeout=2.0,
        allreduce_timeout=timeout,
        start=True,
    )

    def step() -> bool:
        # `timeout` bounds finding the group and allreduce_timeout the round itself. A failed step
        # returns None or, for some failures, raises: either way it failed, and the bench goes on.
        try:
            return averager.step(timeout=timeout) is not None
        except Exception:
            return False

    for _ in range(rounds):
        _timed(conn, "hivemind", barrier, timeout, step)
    averager.shutdown()
    dht.shutdown()


class LabCluster(Cluster):
    """engine_allreduce's Cluster (recv, kill), with one worker per lab host, inside its namespace."""

    def __init__(self, system: str, hosts: list, numel: int, rounds: int, timeout: float):
        ctx = mp.get_context("spawn")
        self.scratch = tempfile.mkdtemp(prefix="peerd-lab-bench-")
        self.barrier = barrier = ctx.Barrier(len(hosts))
        self.conns, self.procs = [], []
        for rank, h in enumerate(hosts):
            parent, child = ctx.Pipe()
            args = (system, rank, len(hosts), numel, rounds, child, barrier, self.scratch, h.netns, h.ip, timeout)
            p = ctx.Process(target=_worker, args=args)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)


def run_system(system: str, keys: tuple[str, ...], hosts: list, numel: int, rounds: int, timeout: float) -> list[dict]:
    """Each process's measurements: {key: [seconds or None per round], "outcomes": [...]}. gloo's own
    timeout bounds each wait inside a collective, not the collective: a step that sends nothing for
    `timeout` + QUIET_SLACK seconds ends the cluster, and what it did not measure counts as failed."""
    cluster, n = LabCluster(system, hosts, numel, rounds, timeout), len(hosts)
    reports = [{key: [] for key in (*keys, "outcomes")} for _ in range(n)]
    try:
        first = [cluster.recv(rank, SETUP_TIMEOUT) for rank in range(n)]
        if system == "hivemind":  # hosts 1.. join through host 0's DHT address
            for rank in range(1, n):
                cluster.conns[rank].send(first[0])
            cluster.conns[0].send(None)
        else:
            for c in cluster.conns:
                c.send(first)
        pending = dict(enumerate(cluster.conns))
        while pending:
            ready = mp.connection.wait(list(pending.values()), timeout + QUIET_SLACK)
            if not ready:
                progress(
                    BENCH, f"{system}: nothing for {timeout + QUIET_SLACK:.0f} s; stopped, the rest counts as failed"
                )
                break
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    kind, *value = pending[rank].recv()
                except EOFError:  # the process died (gloo aborts the process on some timeouts)
                    kind = "done"
                if kind == "put":
                    reports[rank][value[0]].append(value[1])
                elif kind == "done":
                    del pending[rank]
                else:
                    raise RuntimeError(f"{system} worker {rank}: {value[0]}")
    finally:
        cluster.kill(grace=10.0)
    for r in reports:
        for key in keys:
            r[key] += [None] * (rounds - len(r[key]))
    return reports


def round_time(reports: list[dict], key: str, digits: int = 3) -> tuple[float | None, list]:
    """A round's time is its slowest process's (None if any failed); the median over rounds that all
    completed, and each round's, rounded to `digits` decimals."""
    rounds = [
        None if any(r[key][i] is None for r in reports) else max(r[key][i] for r in reports)
        for i in range(len(reports[0][key]))
    ]
    done = [t for t in rounds if t is not None]
    return (round(statistics.median(done), digits) if done else None), [
        None if t is None else round(t, digits) for t in rounds
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="4 MiB, reno only, loss 0 and 5 %% (hivemind at 0 only): a smoke run"
    )
    parser.add_argument("--mib", type=float, default=64.0, help="vector size in MiB of float32 (64 = 16M values)")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s, both directions")
    parser.add_argument("--loss", default="0,1,5,10", help="packet loss settings in %%, comma-separated")
    parser.add_argument("--cc", default="bbr,reno", help="TCP congestion controls, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="measured rounds per system and setting")
    parser.add_argument(
        "--round-timeout", type=float, default=90.0, help="seconds a round may take before it counts as failed"
    )
    parser.add_argument("--skip-hivemind", action="store_true")
    parser.add_argument(
        "--hivemind-loss",
        default=None,
        help="run hivemind only at these loss settings (%%, comma-separated); default: all",
    )
    parser.add_argument(
        "--rtt-ms", default="0", help="added RTT settings in ms between any two hosts, comma-separated (0-2000)"
    )
    parser.add_argument(
        "--budget-min",
        type=float,
        default=0.0,
        help="start no cell after this many minutes (0 = no limit); the rest are reported as skipped",
    )
    args = parser.parse_args(argv)
    if args.quick:  # hivemind without loss only: under loss it often ends at --round-timeout (docs/benchmarks.md)
        args.mib, args.loss, args.cc = 4.0, "0,5", "reno"
        args.hivemind_loss = "0" if args.hivemind_loss is None else args.hivemind_loss
    losses = [float(x) for x in args.loss.split(",")]
    ccs = args.cc.split(",")
    rtts = rtt_settings(parser, args.rtt_ms)
    args.hivemind_losses = None if args.hivemind_loss is None else {float(x) for x in args.hivemind_loss.split(",")}

    from peerd.daemon.lab.netns import LinkShape, Network, environment_problem

    problem = environment_problem()
    if problem:
        print(f"{BENCH}: {problem}", file=sys.stderr)
        return 2

    interrupt_on_signals()
    numel = int(args.mib * (1 << 20)) // 4
    net = Network()
    progress(
        BENCH,
        f"{args.hosts} hosts at {args.rate:g} Mbit/s, {numel * 4 / (1 << 20):.0f} MiB float32, added RTT {rtts} ms, loss {losses} %, TCP {ccs}, lab {net.name}",
    )
    records, started = [], time.monotonic()
    try:
        net.create()
        hosts = [net.add_host(f"h{i}", LinkShape(rate_mbit=args.rate)) for i in range(args.hosts)]
        for rtt in rtts:
            for cc in ccs:
                for h in hosts:
                    net.set_congestion_control(h, cc)
                for loss in losses:
                    if args.budget_min and time.monotonic() - started > args.budget_min * 60:
                        progress(
                            BENCH,
                            f"rtt {rtt:g} ms, {cc}, {loss:g} % loss: skipped, past --budget-min {args.budget_min:g}",
                        )
                        emit(
                            result(
                                BENCH,
                                f"round_s_{cc}_{loss:g}pct" + (f"_rtt{rtt:g}ms" if rtt else ""),
                                None,
                                None,
                                "s",
                                cc=cc,
                                loss_pct=loss,
                                rate_mbit=args.rate,
                                hosts=len(hosts),
                                added_rtt_ms=rtt,
                                skipped="budget",
                            )
                        )
                        continue
                    for h in hosts:
                        net.shape(h.name, LinkShape(rate_mbit=args.rate, loss_pct=loss, rtt_ms=rtt))
                    records.append(measure(args, net, hosts, numel, cc, loss, rtt))
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; every process started here was killed and the lab removed")
        return 130
    finally:
        net.destroy()
    if not records:
        return 1
    headline = next((r for r in records if r["cc"] == "reno" and r["loss_pct"] == 5.0), records[-1])
    suffix = f"_rtt{headline['added_rtt_ms']:g}ms" if headline["added_rtt_ms"] else ""
    emit(
        {
            **headline,
            "metric": f"round_s_peerd_vs_gloo_{headline['cc']}_{headline['loss_pct']:g}pct{suffix}",
            "total_s": round(time.monotonic() - started, 1),
            "note": "headline: seconds of one averaging round, peerd's reliable engine vs gloo; ratio = peerd / gloo "
            "time, < 1 means peerd is faster",
        }
    )
    return 0


def rtt_settings(parser: argparse.ArgumentParser, text: str) -> list[float]:
    """--rtt-ms as numbers; a bad list is a usage error (also used by bench.lossy)."""
    try:
        rtts = [float(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"--rtt-ms: {text!r} is not a comma-separated list of numbers")
    if any(not 0 <= r <= 2000 for r in rtts):
        parser.error("--rtt-ms: each setting must be between 0 and 2000")
    return rtts


def measured_rtt(net, hosts) -> tuple[float | None, dict]:
    """The RTT between each host and the next (Network.measure_rtt), and the median of their
    medians in ms (None when every probe was lost); also used by bench.lossy."""
    pairs = [(hosts[i].name, hosts[(i + 1) % len(hosts)].name) for i in range(len(hosts))]
    rtts = net.measure_rtt(pairs)
    medians = [m["median_ms"] for m in rtts.values() if m["median_ms"] is not None]
    return (round(statistics.median(medians), 2) if medians else None), rtts


def measure(args, net, hosts, numel: int, cc: str, loss: float, rtt: float = 0.0) -> dict:
    """One (rtt, cc, loss) setting: the measured RTT, then every system; one JSON line."""
    measured, rtts = measured_rtt(net, hosts)
    before, load, lines_before = net.dropped(), os.getloadavg()[0], net.delay_stats()
    where = f"rtt {rtt:g} ms (measured {measured} ms), {cc}, {loss:g} % loss"
    progress(BENCH, f"{where}: peerd and gloo in turn, {args.rounds} round(s) each")
    t_cell = time.monotonic()
    duel = run_system("duel", ("peerd", "gloo"), hosts, numel, args.rounds, args.round_timeout)
    p, p_rounds = round_time(duel, "peerd")
    g, g_rounds = round_time(duel, "gloo")
    h, h_rounds = None, []
    if not args.skip_hivemind and (args.hivemind_losses is None or loss in args.hivemind_losses):
        progress(BENCH, f"{where}: hivemind, {args.rounds} round(s)")
        h, h_rounds = round_time(
            run_system("hivemind", ("hivemind",), hosts, numel, args.rounds, args.round_timeout), "hivemind"
        )
    after, lines_after = net.dropped(), net.delay_stats()
    cell_s = time.monotonic() - t_cell

    def delta(key: str) -> float:
        return sum(lines_after[n][key] - lines_before.get(n, {}).get(key, 0) for n in lines_after)

    delay = (
        f"{rtt:g} ms added RTT between any two hosts (userspace TUN delay line, {rtt / 2:g} ms on each host's egress; measured {measured} ms median)"
        if rtt
        else "no added latency (no netem)"
    )
    record = result(
        BENCH,
        f"round_s_{cc}_{loss:g}pct" + (f"_rtt{rtt:g}ms" if rtt else ""),
        p,
        g,
        "s",
        cc=cc,
        loss_pct=loss,
        rate_mbit=args.rate,
        hosts=len(hosts),
        bytes=numel * 4,
        added_rtt_ms=rtt,
        measured_rtt_ms=measured,
        measured_rtt_pairs={f"{a}->{b}": m for (a, b), m in rtts.items()},
        hivemind_run=not args.skip_hivemind and (args.hivemind_losses is None or loss in args.hivemind_losses),
        delay_line_packets=int(delta("packets")) if lines_after else None,
        delay_line_cpu_s=round(delta("cpu_s"), 2) if lines_after else None,
        delay_line_dropped=int(delta("dropped_overflow") + delta("dropped_send") + delta("tun_dropped"))
        if lines_after
        else None,
        cell_s=round(cell_s, 1),
        hivemind_s=h,
        ratio_vs_hivemind=round(p / h, 3) if p and h else None,
        peerd_rounds_s=p_rounds,
        gloo_rounds_s=g_rounds,
        hivemind_rounds_s=h_rounds,
        peerd_outcomes=sorted({o for r in duel for o in r["outcomes"]}),
        packets_dropped=sum(after[n]["loss"] - before[n]["loss"] for n in after),
        cores=os.cpu_count(),
        load_1min_at_start=round(load, 2),
        load_1min_at_end=round(os.getloadavg()[0], 2),
        round_timeout_s=args.round_timeout,
        emulated=f"{len(hosts)} network namespaces on one bridge; tbf {args.rate:g} Mbit/s both directions; "
        f"{loss:g} % random drop of packets delivered to each host; TCP {cc}; {delay}",
        note="ratio = peerd / gloo round time; < 1 means peerd is faster; None = failed or timed out",
    )
    emit(record)
    return record


if __name__ == "__main__":
    sys.exit(main())
