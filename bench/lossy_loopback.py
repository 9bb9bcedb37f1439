"""Loss-tolerant UDP engine vs the reliable TCP engine on loopback, with packets lost on purpose.

    python -m bench.lossy_loopback [--quick] [--mib 64] [--peers 4] [--rounds 9] [--loss 0,5,10]
                                   [--datagram 8972] [--gso]

`--peers` processes each run both engines on one uvloop loop: (1) peerd's LossyAllReduce over
UdpTransport (datagrams of `--datagram` bytes, unpaced, GMAC on every datagram) and (2) peerd's
GroupAllReduce over TcpTransport, one round of each in turn (which goes first alternates), the
parent starting every round of every process at once over a pipe. A round's time is its slowest
process's; figures are medians after `--warmup` rounds. Every round starts from the same seeded
vectors (weights 1..N), so the UDP engine's error against the exact weighted mean is measured.

Loss, per `--loss` percentage:
* as root with nft: an nftables rule on the input hook of lo drops that share of the packets
  arriving at the members' ports (TCP data segments and UDP datagrams alike, in both engines), in
  a table of its own, removed on exit; loopback TCP segments are up to 64 KiB, so a lost TCP packet
  carries more data than a lost datagram: the same packet loss rate, not the same byte loss rate;
* also (and otherwise only) by rule: the UDP transport's drop seam loses that share of datagrams
  at the sender; TCP cannot lose by rule and runs without loss then.
With `--gso` a GSO batch is one packet on lo: nftables drops it whole (bursts of loss).
JSON lines, one per condition; the last is the headline: UDP vs TCP bus bandwidth at the highest
loss (nft when available). Every worker is killed on exit, and by the kernel if this process dies.
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
import subprocess
import sys
import time

from bench.common import emit, progress, result
from bench.engine_allreduce import Cluster

BENCH = "lossy_loopback"
SETUP_TIMEOUT = 120.0  # seconds for the workers to start and report their addresses
ROUND_LIMIT = 120.0  # seconds one round of one system may take on every worker
PR_SET_PDEATHSIG = 1
SECRET = b"lossy loopback benchmark secret!"


def _data(rank: int, numel: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def _worker(rank: int, n: int, numel: int, conn, datagram: int, gso: bool) -> None:
    os.setpgrp()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        _serve(rank, n, numel, conn, datagram, gso)
    except Exception as e:  # report, do not hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _serve(rank: int, n: int, numel: int, conn, datagram: int, gso: bool) -> None:
    import random

    import numpy as np
    import torch
    import uvloop

    from peerd.peers.collective import (
        AllReduceSettings,
        Group,
        GroupAllReduce,
        LossyAllReduce,
        TcpTransport,
        UdpTransport,
    )
    from peerd.peers.events import PeerEvents

    torch.set_num_threads(1)
    tally = {"sent": 0, "lost": 0}
    events = PeerEvents(
        packets_sent=lambda k: tally.__setitem__("sent", tally["sent"] + k),
        packets_lost=lambda k: tally.__setitem__("lost", tally["lost"] + k),
    )
    rng, seam = random.Random(rank), {"p": 0.0}
    loop = uvloop.new_event_loop()
    tcp = TcpTransport("127.0.0.1", 0)
    udp = UdpTransport(
        "127.0.0.1",
        0,
        secret=SECRET,
        session="bench",
        max_datagram=datagram,
        gso=gso,
        events=events,
        drop=lambda address, h: seam["p"] > 0 and rng.random() < seam["p"],
    )
    conn.send(("address", (loop.run_until_complete(tcp.start()), loop.run_until_complete(udp.start()))))
    tcp_addresses, udp_addresses = conn.recv()
    members = [f"peer{i}" for i in range(n)]
    settings = AllReduceSettings(contribute_timeout=30.0, gather_timeout=60.0, verdict_timeout=5.0, drain_timeout=5.0)
    engines = {
        "tcp": GroupAllReduce(Group("bench", members, tcp_addresses, rank), tcp, numel, settings=settings),
        "udp": LossyAllReduce(
            Group("bench", members, udp_addresses, rank), udp, numel, settings=settings, events=events
        ),
    }
    weights = [float(i + 1) for i in range(n)]
    exact = sum(w * _data(r, numel).numpy().astype(np.float64) for r, w in enumerate(weights)) / sum(weights)
    exact_rms = float(np.sqrt(np.mean(exact**2)))
    base, x = _data(rank, numel), torch.empty(numel)
    rounds = dict.fromkeys(engines, 0)
    while True:
        command = conn.recv()
        if command[0] == "stop":
            break
        _, system, seam["p"] = command
        x.copy_(base)
        before = dict(tally)
        rounds[system] += 1
        c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        outcome = loop.run_until_complete(engines[system].all_reduce(x, weights[rank], rounds[system]))
        t1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        error = x.numpy() - exact
        conn.send(
            (
                "round",
                {
                    "time": t1 - t0,
                    "cpu": c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime,
                    "status": outcome.status.value,
                    "held": statistics.mean(outcome.held or [0.0]),
                    "coverage": statistics.mean(outcome.coverage),
                    "rel_error": float(np.sqrt(np.mean(error**2))) / exact_rms,
                    "bias": float(error.mean()),
                    "sent": tally["sent"] - before["sent"],
                    "lost": tally["lost"] - before["lost"],
                    "kernel_drops": udp.kernel_drops,
                },
            )
        )
    for engine in engines.values():
        loop.run_until_complete(engine.close())
    loop.run_until_complete(tcp.close())
    loop.run_until_complete(udp.close())


class Workers(Cluster):
    """engine_allreduce's Cluster (its recv), with this bench's workers and a graceful stop."""

    def __init__(self, n: int, numel: int, datagram: int, gso: bool):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, n, numel, child, datagram, gso))
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def round(self, system: str, seam: float) -> list[dict]:
        for c in self.conns:
            c.send(("round", system, seam))
        return [self.recv(rank, ROUND_LIMIT) for rank in range(len(self.conns))]

    def kill(self, grace: float = 0.0) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(10)
            if p.exitcode is None and p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.join(5)


class NftLoss:
    """One nftables table dropping a share of the packets that arrive on lo for the given ports."""

    def __init__(self, ports: list[int]):
        self.table, self.ports = f"peerd_lossy_bench_{os.getpid()}", ", ".join(map(str, ports))
        self.active = False

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and shutil.which("nft") is not None

    def _nft(self, script: str) -> None:
        subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True, capture_output=True, timeout=10)

    def set(self, percent: float) -> None:
        t = self.table
        if not self.active:
            self._nft(
                f"add table inet {t}\nadd chain inet {t} input {{ type filter hook input priority 0; policy accept; }}\n"
            )
            self.active = True
        rule = f"add rule inet {t} input iifname lo meta l4proto {{ tcp, udp }} th dport {{ {self.ports} }} "
        rule += f"numgen random mod 10000 < {round(percent * 100)} drop\n" if percent else "accept\n"
        self._nft(f"flush chain inet {t} input\n{rule}")

    def remove(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True, timeout=10)
            self.active = False


def summarize(reports: list[list[dict]], n: int, nbytes: int) -> dict:
    times = [max(r["time"] for r in round_) for round_ in reports]
    t = statistics.median(times)
    everyone = [r for round_ in reports for r in round_]

    def mean(key):
        return round(statistics.mean(r[key] for r in everyone), 5)

    sent = sum(r["sent"] for r in everyone)
    return {
        "time": t,
        "busbw": round(2 * (n - 1) / n * nbytes / t / 1e6, 1),
        "samples": [round(x, 4) for x in times],
        "cpu": round(statistics.median(sum(r["cpu"] for r in round_) for round_ in reports), 4),
        "statuses": sorted({r["status"] for r in everyone}),
        "held": mean("held"),
        "coverage": mean("coverage"),
        "rel_error": mean("rel_error"),
        "bias": mean("bias"),
        "datagrams_lost": round(sum(r["lost"] for r in everyone) / sent, 4) if sent else None,
        "kernel_drops": max(r["kernel_drops"] for r in everyone),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB, 3 rounds: a smoke run")
    parser.add_argument("--mib", type=float, default=64.0, help="vector size in MiB (float32): 64 = 16M values")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds per system and condition")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--loss", default="0,5,10", help="loss percentages, comma-separated")
    parser.add_argument(
        "--datagram", type=int, default=65507, help="UDP datagram bytes (65507: the most lo carries unfragmented)"
    )
    parser.add_argument(
        "--gso", action="store_true", help="UDP segmentation offload (nft then drops GSO batches whole)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = 4.0, 3

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    n, numel = args.peers, int(args.mib * (1 << 20)) // 4
    nbytes, losses = numel * 4, [float(p) for p in args.loss.split(",")]
    modes = (["nft"] if NftLoss.available() else []) + ["rule"]
    load = os.getloadavg()[0]
    progress(
        BENCH,
        f"{n} peers, {nbytes / (1 << 20):.0f} MiB, datagrams {args.datagram} B, gso {args.gso}, "
        f"loss {losses} % by {' and '.join(modes)}, load {load:.2f}, {os.cpu_count()} cores",
    )
    workers, nft, lines = Workers(n, numel, args.datagram, args.gso), None, []
    try:
        addresses = [workers.recv(rank, SETUP_TIMEOUT) for rank in range(n)]
        for c in workers.conns:
            c.send(([a[0] for a in addresses], [a[1] for a in addresses]))
        nft = NftLoss([int(a.rsplit(":", 1)[1]) for pair in addresses for a in pair])
        for mode in modes:
            for percent in losses:
                if mode == "rule" and not percent and "nft" in modes:
                    continue  # the same condition as nft at 0 %
                if "nft" in modes:
                    nft.set(percent if mode == "nft" else 0.0)
                seam = percent / 100 if mode == "rule" else 0.0
                reports = {"udp": [], "tcp": []}
                for r in range(args.warmup + args.rounds):
                    for system in ("udp", "tcp") if r % 2 else ("tcp", "udp"):
                        round_ = workers.round(system, seam if system == "udp" else 0.0)
                        if r >= args.warmup:
                            reports[system].append(round_)
                u, t = (summarize(reports[s], n, nbytes) for s in ("udp", "tcp"))
                progress(
                    BENCH,
                    f"{mode} {percent:g} %: udp {u['time'] * 1e3:.0f} ms (held {u['held']:.3f}), "
                    f"tcp {t['time'] * 1e3:.0f} ms {t['statuses']}",
                )
                lines.append(
                    result(
                        BENCH,
                        f"bus_bandwidth_{mode}_{percent:g}pct_loss",
                        u["busbw"],
                        t["busbw"],
                        "MB/s",
                        n=n,
                        bytes=nbytes,
                        loss_percent=percent,
                        loss_by=mode,
                        datagram=args.datagram,
                        gso=args.gso,
                        cores=os.cpu_count(),
                        load_1min_at_start=round(load, 2),
                        udp=u,
                        tcp=t,
                        note="ratio = UDP / TCP bus bandwidth (>1: the UDP engine is faster); "
                        + (
                            "TCP lost nothing: a rule cannot drop TCP segments"
                            if mode == "rule"
                            else "nftables dropped the same share of packets for both engines"
                        ),
                    )
                )
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; every worker was killed")
        return 130
    finally:
        if nft is not None:
            nft.remove()
        workers.kill()
    for line in lines:
        line["load_1min_at_end"] = round(os.getloadavg()[0], 2)
    headline = max(lines, key=lambda d: (d["loss_by"] == "nft", d["loss_percent"]))
    for line in [x for x in lines if x is not headline] + [headline]:
        emit(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
