"""Loss-tolerant averaging in the network lab: peerd's UDP engine vs its reliable engine vs gloo.

    python -m bench.lossy [--quick] [--mib 64] [--hosts 4] [--rate 100] [--loss 0,1,5,10,20] [--cc bbr,reno]
                          [--rtt-ms 0] [--skip-rounds] [--skip-convergence] [--steps 300]

Two parts, both in `peerd lab` network namespaces (daemon/lab/): every host's link limited to
`--rate` Mbit/s both ways (tbf on both ends of its veth), `loss` % of the packets delivered to each
host dropped at random (nftables, bridge forward hook), every host's TCP on one congestion control.
`--rtt-ms` adds latency through the lab's delay line (a userspace TUN device on every host holding
what it sends for rtt/2; this kernel has no netem); each setting's RTT is measured and reported.
At 0 the RTT is what the veths give, under 1 ms.

1. Round time. For each (cc, loss), one process per host (bench.lab_baselines' harness) runs three
   systems in turn (UDP, reliable, gloo in round 1, rotating after): peerd's loss-tolerant engine (LossyAllReduce over
   UdpTransport, 1,472-byte datagrams, paced to 95 % of the link rate, authenticated), peerd's
   reliable engine (GroupAllReduce over TcpTransport) and torch.distributed gloo all_reduce. One
   averaging round of `--mib` MiB of float32. A round's time is its slowest process's.
2. Convergence. `--hosts` real daemons train digits-mlp with `averaging.engine=loss-tolerant` for
   `--steps` steps each, once per loss rate (0, 10 and 20 %, reno), and the final evaluation of
   every host is compared (accuracy; and how far the hosts ended from each other).

JSON lines; the last one is the headline: peerd UDP vs gloo round time, reno, 5 % loss (ratio = UDP
time / gloo time: < 1 means peerd is faster). Everything the lab creates is removed on exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

from bench.common import emit, interrupt_on_signals, progress, result
from bench.engine_allreduce import _data
from bench.lab_baselines import GlooStep, _timed, measured_rtt, round_time, rtt_settings, run_system

BENCH = "lossy"
SYSTEMS = ("udp", "reliable", "gloo")
PACE = 0.95  # share of the link rate the UDP engine paces itself to: the tbf queue absorbs the rest
DATAGRAM = 1472  # a 1500-byte MTU (the lab's veths) minus IP and UDP headers


def _trio(rank, n, numel, rounds, conn, barrier, scratch, ip, timeout) -> None:
    """One host's process: the three systems, one round each in turn, `rounds` times."""
    import torch.distributed as dist
    import uvloop

    from peerd.peers.collective import (
        AllReduceSettings,
        Group,
        GroupAllReduce,
        LossyAllReduce,
        TcpTransport,
        UdpTransport,
    )

    rate = float(os.environ["PEERD_BENCH_RATE_MBIT"]) * 1e6 * PACE
    loop = uvloop.new_event_loop()
    tcp = TcpTransport(ip, 0)
    udp = UdpTransport(
        ip, 0, secret=b"bench-secret-0123456789abcdef012", session="bench", max_datagram=DATAGRAM, rate_bps=rate
    )
    conn.send(("address", (loop.run_until_complete(tcp.start()), loop.run_until_complete(udp.start()))))
    addresses = conn.recv()
    members = [f"peer{i}" for i in range(n)]
    settings = AllReduceSettings(
        connect_timeout=min(10.0, timeout / 2),
        contribute_timeout=timeout / 2,
        gather_timeout=timeout,
        verdict_timeout=5.0,
        drain_timeout=2.0,
    )
    reliable = GroupAllReduce(Group("bench", members, [a[0] for a in addresses], rank), tcp, numel, settings=settings)
    lossy = LossyAllReduce(Group("bench", members, [a[1] for a in addresses], rank), udp, numel, settings=settings)
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/gloo.store", rank=rank, world_size=n, timeout=timedelta(seconds=timeout)
    )
    x, z = _data(rank, numel), _data(rank, numel)
    gloo = GlooStep(_data(rank, numel), n)

    def run_udp(r: int) -> bool:
        outcome = loop.run_until_complete(lossy.all_reduce(z, float(rank + 1), r))
        conn.send(("put", "outcomes", f"udp:{outcome.status.value}"))
        conn.send(("put", "held", statistics.fmean(outcome.held) if outcome.held else 0.0))
        return outcome.applied

    def run_reliable(r: int) -> bool:
        outcome = loop.run_until_complete(reliable.all_reduce(x, float(rank + 1), r))
        conn.send(("put", "outcomes", f"reliable:{outcome.status.value}"))
        return outcome.completed

    steps = {"udp": run_udp, "reliable": run_reliable, "gloo": gloo}
    for r in range(1, rounds + 1):
        # UDP first in round 1: a gloo that hangs ends the cluster, and what comes after it is lost.
        order = SYSTEMS[(r - 1) % 3 :] + SYSTEMS[: (r - 1) % 3]
        for name in order:
            _timed(conn, name, barrier, timeout, lambda: steps[name](r))
    gloo.close()
    for engine in (lossy, reliable):
        loop.run_until_complete(engine.close())
    loop.run_until_complete(udp.close())
    loop.run_until_complete(tcp.close())
    loop.close()


def measure_rounds(args, net, hosts, numel: int, cc: str, loss: float, rtt: float) -> dict:
    measured = measured_rtt(net, hosts)[0] if rtt else None
    before, load = net.dropped(), os.getloadavg()[0]
    progress(
        BENCH,
        f"rtt {rtt:g} ms (measured {measured}), {cc}, {loss:g} % loss: peerd UDP, peerd reliable and gloo in turn, {args.rounds} round(s) each",
    )
    reports = run_system("bench.lossy:_trio", (*SYSTEMS, "held"), hosts, numel, args.rounds, args.round_timeout)
    times = {s: round_time(reports, s) for s in SYSTEMS}
    after = net.dropped()
    held = [h for r in reports for h in r["held"] if h is not None]
    record = result(
        BENCH,
        f"round_s_{cc}_{loss:g}pct" + (f"_rtt{rtt:g}ms" if rtt else ""),
        times["udp"][0],
        times["gloo"][0],
        "s",
        cc=cc,
        loss_pct=loss,
        rate_mbit=args.rate,
        hosts=len(hosts),
        bytes=numel * 4,
        added_rtt_ms=rtt,
        measured_rtt_ms=measured,
        reliable_s=times["reliable"][0],
        ratio_vs_reliable=round(times["udp"][0] / times["reliable"][0], 3)
        if times["udp"][0] and times["reliable"][0]
        else None,
        rounds_s={s: t[1] for s, t in times.items()},
        outcomes=sorted({o for r in reports for o in r["outcomes"]}),
        udp_held=round(statistics.fmean(held), 4) if held else None,
        packets_dropped=sum(after[h]["loss"] - before[h]["loss"] for h in after),
        cores=os.cpu_count(),
        load_1min_at_start=round(load, 2),
        load_1min_at_end=round(os.getloadavg()[0], 2),
        round_timeout_s=args.round_timeout,
        datagram=DATAGRAM,
        udp_pace_mbit=round(args.rate * PACE, 1),
        emulated=f"{len(hosts)} network namespaces on one bridge; tbf {args.rate:g} Mbit/s both directions; "
        f"{loss:g} % random drop of packets delivered to each host; TCP {cc}; "
        + (
            f"{rtt:g} ms added RTT (userspace TUN delay line, {rtt / 2:g} ms on each host's egress; measured {measured} ms median)"
            if rtt
            else "no added latency (no netem)"
        ),
        note="ours = peerd UDP round time, baseline = gloo's; ratio < 1: peerd faster; None = failed or timed out",
    )
    emit(record)
    return record


def rounds_part(args, numel: int) -> list[dict]:
    from peerd.daemon.lab.netns import LinkShape, Network

    os.environ["PEERD_BENCH_RATE_MBIT"] = str(args.rate)  # read by the spawned workers
    net, records = Network(), []
    try:
        net.create()
        hosts = [net.add_host(f"h{i}", LinkShape(rate_mbit=args.rate)) for i in range(args.hosts)]
        for rtt in args.rtts:
            for cc in args.cc.split(","):
                for h in hosts:
                    net.set_congestion_control(h, cc)
                for loss in [float(x) for x in args.loss.split(",")]:
                    for h in hosts:
                        net.shape(h.name, LinkShape(rate_mbit=args.rate, loss_pct=loss, rtt_ms=rtt))
                    records.append(measure_rounds(args, net, hosts, numel, cc, loss, rtt))
    finally:
        net.destroy()
    return records


def convergence_part(args) -> list[dict]:
    """digits-mlp on `hosts` daemons with averaging.engine=loss-tolerant, at each loss rate: final accuracy."""
    from peerd.daemon.lab import report
    from peerd.daemon.lab.runner import Lab
    from peerd.daemon.lab.scenario import parse

    out = []
    for loss in (0.0, 10.0, 20.0):
        scenario = parse(
            {
                "name": f"lossy-convergence-{loss:g}",
                "duration": args.converge_seconds,
                "congestion_control": "reno",
                "run": {
                    "id": "lossy",
                    "task": "digits-mlp",
                    "max_steps": args.steps,
                    "settings": {
                        "averaging.average_every": "10",
                        "averaging.algorithm": "state",
                        "averaging.engine": "loss-tolerant",
                        "optimizer": "sgd",
                        "lr": "0.05",
                    },
                    "args": ["--eval-every", str(args.steps), "--udp-rate-mbit", str(args.rate * PACE)],
                },
                "link": {"rate_mbit": args.rate},
                "host": [{"name": f"h{i}"} for i in range(args.hosts)],
                # Loss from the moment all train: p2pd gives up bootstrapping when its first dials are lost.
                "fault": [
                    {"at": 0.1, "action": "link", "hosts": [f"h{i}" for i in range(args.hosts)], "loss_pct": loss}
                ],
            }
        )
        progress(BENCH, f"convergence: {args.hosts} daemons, {args.steps} steps, UDP averaging, {loss:g} % loss")
        built = report.build(Lab(scenario, progress=lambda m: progress(BENCH, m)).run())
        hosts = built["hosts"]
        scores = [h["eval_score"] for h in hosts.values() if h["eval_score"] is not None]
        steps = [h["step"] for h in hosts.values()]
        out.append(
            {
                "loss_pct": loss,
                "accuracy_mean": round(statistics.fmean(scores), 4) if scores else None,
                "accuracy_spread": round(max(scores) - min(scores), 4) if scores else None,
                "steps": steps,
                "rounds": {n: h["rounds"] for n, h in hosts.items()},
                "max_divergence": (built["max_param_divergence"] or {}).get("value"),
                "nothing_lost": built["nothing_lost"],
            }
        )
    base = out[0]["accuracy_mean"]
    for o in out:
        emit(
            result(
                BENCH,
                f"accuracy_{o['loss_pct']:g}pct_vs_0pct",
                o["accuracy_mean"],
                base,
                "accuracy",
                **o,
                task="digits-mlp",
                hosts=args.hosts,
                rate_mbit=args.rate,
                steps_per_host=args.steps,
                note="final test accuracy (mean over hosts) with UDP averaging at this loss vs at 0 % loss",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="4 MiB, reno, loss 0 and 5 %%, 60 training steps: a smoke run"
    )
    parser.add_argument("--mib", type=float, default=64.0, help="vector size in MiB of float32 (64 = 16M values)")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s, both directions")
    parser.add_argument("--loss", default="0,1,5,10,20", help="packet loss settings in %%, comma-separated")
    parser.add_argument("--cc", default="bbr,reno", help="TCP congestion controls, comma-separated")
    parser.add_argument(
        "--rtt-ms", default="0", help="added RTT settings in ms between any two hosts, comma-separated (0-2000)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="measured rounds per system and setting")
    parser.add_argument(
        "--round-timeout", type=float, default=90.0, help="seconds a round may take before it counts as failed"
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps per host in the convergence part")
    parser.add_argument("--converge-seconds", type=float, default=150.0, help="schedule length of each convergence run")
    parser.add_argument("--skip-rounds", action="store_true")
    parser.add_argument("--skip-convergence", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.loss, args.cc, args.steps, args.converge_seconds = 4.0, "0,5", "reno", 60, 90.0
    args.rtts = rtt_settings(parser, args.rtt_ms)

    from peerd.daemon.lab.netns import environment_problem

    problem = environment_problem()
    if problem:
        print(f"{BENCH}: {problem}", file=sys.stderr)
        return 2

    interrupt_on_signals()
    numel = int(args.mib * (1 << 20)) // 4
    started = time.monotonic()
    try:
        records = [] if args.skip_rounds else rounds_part(args, numel)
        if not args.skip_convergence:
            convergence_part(args)
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; every process started here was killed and the lab removed")
        return 130
    if records:
        headline = next(
            (r for r in records if r["cc"] == "reno" and r["loss_pct"] == 5.0 and not r["added_rtt_ms"]),
            next((r for r in records if r["cc"] == "reno" and r["loss_pct"] == 5.0), records[-1]),
        )
        emit(
            {
                **headline,
                "metric": f"round_s_udp_vs_gloo_{headline['cc']}_{headline['loss_pct']:g}pct",
                "total_s": round(time.monotonic() - started, 1),
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
