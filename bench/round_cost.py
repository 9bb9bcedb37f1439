"""The fixed cost of one averaging round in the network lab: peerd's round as the daemon runs it vs gloo.

    python -m bench.round_cost [--quick] [--hosts 3] [--rtt-ms 0,50,200] [--rounds 10] [--numel 256]

A tiny vector (--numel float32, 1 KiB by default) makes a round's bytes negligible, so what is left
is its fixed cost: round trips and waits. The hosts are `peerd lab` network namespaces on one bridge
(daemon/lab/netns.py), every link 100 Mbit/s (tbf, both directions), no loss; at each --rtt-ms the
delay line (daemon/lab/delayline.py) holds what every host sends for rtt/2, so the RTT between any
two hosts is the setting (measured in every cell).

One process per host, inside its namespace (the harness of bench.lab_baselines), runs both systems
in turn, the first of the pair alternating; the first round of each is reported apart (*_first_round_s:
ours may have to open libp2p connections between hosts that only know each other through the DHT,
gloo's init opened all of its own), then --rounds measured rounds:
(1) ours: a daemon's round, built from the daemon's own parts with their default settings: a
    PeerNode (p2pd + DHT) bound to the host's address, the run's membership (heartbeats, refreshes,
    the table), the Matchmaker, and MoshpitAverager.average called through daemon/joining.bounded_round
    from a trainer-like thread, with the daemon's rendezvous and the live table as the view. So a
    round is: the rendezvous (announce this step, read the run's records until every mate is at
    it), matchmaking directly between the view's mates (peers/matchmaking.py, no join window), and
    GroupAllReduce over direct TCP on a fresh per-round listener. Each round must complete in a group
    of every host. Parts of the slowest host's round: the rendezvous (RoundResult.waited),
    matchmaking (Matchmaker.form_group), the engine (Outcome.duration), and what is left (the
    listener, the group, closing, the hop between the trainer's worker thread and the event loop).
(2) baseline: torch.distributed gloo all_reduce of the same vector (GLOO_SOCKET_IFNAME=eth0; its
    init, which opens every connection, is not timed).
A round's time is its slowest host's; each figure is the median over --rounds rounds. Each cell
also gives its cost in RTTs: (figure - the same figure at 0 ms) / added RTT. Every wait is bounded
(--round-timeout per round, SETUP_TIMEOUT for the start); the lab is removed on exit, Ctrl-C or
SIGTERM (after a SIGKILL: `peerd lab clean`). Nothing leaves the lab's namespaces. JSON lines: one
per RTT, the headline last (the 50 ms cell); also appended to bench/results/round_cost.jsonl
(not with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from bench.common import emit, interrupt_on_signals, progress, result
from bench.engine_allreduce import _data
from bench.lab_baselines import GlooStep, _timed, measured_rtt, round_time, rtt_settings, run_system

BENCH = "round_cost"
RESULTS = Path(__file__).resolve().parent / "results" / "round_cost.jsonl"
SETUP_TIMEOUT = 60.0  # seconds for a host's PeerNode to start, and for every host to see the others in its table
STOP_TIMEOUT = 10.0  # seconds for a host's PeerNode to shut down at the end
RUN = "round-cost"
PARTS = ("rendezvous", "matchmaking", "engine", "other")  # the parts of ours, in the order they run
KEYS = ("ours", "gloo", *PARTS, "ours_first", "gloo_first")


# ---- one process per host, inside its namespace (bench.lab_baselines._worker calls this) ----------


def host(rank, n, numel, rounds, conn, barrier, scratch, ip, timeout) -> None:
    """Start a daemon's parts on this host, then a first round and `rounds` measured rounds of ours
    and of gloo in turn; every time goes to the parent as soon as it is measured."""
    import torch.distributed as dist
    import uvloop

    from peerd.daemon import __version__
    from peerd.daemon.config import DiscoveryConfig, NetworkConfig
    from peerd.daemon.joining import CANCEL_GRACE, RunHandle, bounded_round, rendezvous_for
    from peerd.peers.averaging import MoshpitAverager
    from peerd.peers.collective.group import MAX_GROUP
    from peerd.peers.events import PeerEvents
    from peerd.peers.manifest import AveragingSettings
    from peerd.peers.matchmaking import Matchmaker, MatchmakingSettings
    from peerd.peers.membership import Announcement, DiscoverySettings, RunMembership
    from peerd.peers.node import NodeSettings, PeerNode

    class TimedMatchmaker(Matchmaker):
        """The daemon's Matchmaker, timing its last form_group."""

        last: float | None = None

        async def form_group(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await super().form_group(*args, **kwargs)
            finally:
                self.last = time.perf_counter() - t0

    # The daemon's event loop runs in a thread of its own, as in the daemon: between rounds it keeps
    # heartbeating and answering DHT requests while this (trainer) thread waits or runs gloo.
    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="peerd-loop", daemon=True)
    thread.start()

    def on_loop(coro, wait: float):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(wait)

    network, discovery, averaging = NetworkConfig(), DiscoveryConfig(), AveragingSettings()
    events = PeerEvents()
    if rank:  # hosts 1.. bootstrap from host 0's DHT node
        conn.send(("address", None))
        initial = conn.recv()[0]
    else:
        initial = []
    settings = NodeSettings(
        host_maddrs=[f"/ip4/{ip}/tcp/0"],
        identity_path=Path(scratch) / f"h{rank}.key",
        initial_peers=initial,
        request_timeout=network.dht_timeout,
    )
    node = on_loop(PeerNode.start(settings, events), SETUP_TIMEOUT)
    if not rank:
        conn.send(("address", on_loop(node.visible_maddrs(), SETUP_TIMEOUT)))
        conn.recv()
    matchmaker = TimedMatchmaker(node, MatchmakingSettings(max_group_size=MAX_GROUP), events)
    on_loop(matchmaker.start(), SETUP_TIMEOUT)
    membership = RunMembership(
        node,
        RUN,
        None,
        DiscoverySettings(
            heartbeat_interval=discovery.heartbeat_interval,
            refresh_interval=discovery.refresh_interval,
            peer_ttl=discovery.peer_ttl,
            goodbye_timeout=discovery.goodbye_timeout,
        ),
        version=__version__,
        events=events,
    )
    step = 0
    membership.announcement = lambda: Announcement(step=step)
    on_loop(membership.start(), SETUP_TIMEOUT)

    async def everyone_in_table() -> None:
        while len(membership.peers()) < n - 1:
            await asyncio.sleep(discovery.refresh_interval)

    on_loop(everyone_in_table(), SETUP_TIMEOUT)
    averager = MoshpitAverager(
        run_id=RUN,
        secret=None,
        peer_id=node.peer_id,
        matchmaker=matchmaker,
        bind_host=ip,
        advertise_host=ip,
        max_group_size=averaging.max_group_size,
        p2p=node.p2p,
        reliable_links="auto",
        events=events,
        rendezvous=rendezvous_for(membership, averaging.phases, averaging.round_timeout),
    )

    async def run_round(vector, weight, round_t, lanes, restore, payload):  # as daemon/app.py's
        live = {e.peer_id: (e.delegated_lanes, e.dear_group) for e in membership.peers()}
        return await averager.average(vector, weight, round_t, live, lanes, "", restore, payload)

    bound = min(timeout, averaging.round_timeout)
    average = bounded_round(RunHandle(RUN, None, None), run_round, bound)
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/gloo.store", rank=rank, world_size=n, timeout=timedelta(seconds=timeout)
    )
    x, gloo = _data(rank, numel), GlooStep(_data(rank, numel), n)
    parts: dict[str, float | None] = {}

    def ours(round_t: int) -> bool:
        nonlocal step
        step = averaging.phases.end(round_t)  # the trainer's step at this round's boundary
        matchmaker.last = None
        t0 = time.perf_counter()
        r = on_loop(average(x, float(rank + 1), round_t), bound + CANCEL_GRACE + 1.0)[0]
        total = time.perf_counter() - t0
        ok = r.completed and r.group_size == n
        outcome = r.outcome_name if r.group_size == n else f"group of {r.group_size}: {r.reason}"
        conn.send(("put", "outcomes", outcome if round_t > 1 else f"first round: {outcome}"))
        parts.clear()
        if ok and matchmaker.last is not None:
            parts.update(rendezvous=r.waited, matchmaking=matchmaker.last, engine=r.outcome.duration)
            parts["other"] = total - sum(parts.values())
        return ok

    for r in range(rounds + 1):  # the first round is reported apart: it may open libp2p connections
        pair = (("ours", ours), ("gloo", gloo)) if r % 2 else (("gloo", gloo), ("ours", ours))
        for name, system in pair:
            _timed(conn, name if r else f"{name}_first", barrier, timeout, lambda: system(r + 1))
        if r:
            for part in PARTS:
                conn.send(("put", part, parts.get(part)))
    gloo.close()

    async def stop() -> None:  # as a daemon stops: leave the run, stop p2pd, end what is left
        await membership.leave()
        await node.shutdown()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    on_loop(stop(), STOP_TIMEOUT)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(STOP_TIMEOUT)


# ---- the parent: the lab, the cells, the figures ------------------------------------------------


def breakdown(reports: list[dict]) -> dict[str, float | None]:
    """Median over rounds of each part of ours, taken from each round's slowest host (the one whose
    round time is the round's), so that in one round the parts add up to the round."""
    per_part: dict[str, list[float]] = {p: [] for p in PARTS}
    for i in range(len(reports[0]["ours"])):
        times = [r["ours"][i] for r in reports]
        if any(t is None for t in times):
            continue
        slowest = reports[times.index(max(times))]
        for p in PARTS:
            if slowest[p][i] is not None:
                per_part[p].append(slowest[p][i])
    return {p: round(statistics.median(v), 4) if v else None for p, v in per_part.items()}


def in_rtts(value: float | None, at_zero: float | None, rtt_ms: float) -> float | None:
    """How many added RTTs `value` costs over the same figure at 0 ms."""
    if value is None or at_zero is None or not rtt_ms:
        return None
    return round((value - at_zero) / (rtt_ms / 1000), 2)


def measure(args, net, hosts, rtt: float) -> dict:
    """One RTT setting: the measured RTT, then both systems in the same processes; one record."""
    measured, rtts = measured_rtt(net, hosts)
    load = os.getloadavg()[0]
    progress(BENCH, f"rtt {rtt:g} ms (measured {measured} ms): ours and gloo in turn, 1 + {args.rounds} rounds each")
    t_cell = time.monotonic()
    reports = run_system(f"{__name__}:host", KEYS, hosts, args.numel, args.rounds, args.round_timeout)
    ours, ours_rounds = round_time(reports, "ours", digits=4)
    gloo, gloo_rounds = round_time(reports, "gloo", digits=4)
    parts = breakdown(reports)
    progress(BENCH, f"rtt {rtt:g} ms: ours {ours} s, gloo {gloo} s; parts of ours {parts}")
    delay = (
        f"{rtt:g} ms added RTT between any two hosts (userspace TUN delay line, {rtt / 2:g} ms on each host's egress)"
        if rtt
        else "no added latency"
    )
    return result(
        BENCH,
        f"round_s_rtt{rtt:g}ms",
        ours,
        gloo,
        "s",
        added_rtt_ms=rtt,
        measured_rtt_ms=measured,
        measured_rtt_pairs={f"{a}->{b}": m for (a, b), m in rtts.items()},
        hosts=len(hosts),
        numel=args.numel,
        bytes=args.numel * 4,
        rate_mbit=args.rate,
        rounds=args.rounds,
        ours_parts_s=parts,
        ours_rounds_s=ours_rounds,
        gloo_rounds_s=gloo_rounds,
        ours_first_round_s=round_time(reports, "ours_first", digits=4)[1][0],
        gloo_first_round_s=round_time(reports, "gloo_first", digits=4)[1][0],
        ours_outcomes=sorted({o for r in reports for o in r["outcomes"]}),
        cell_s=round(time.monotonic() - t_cell, 1),
        cores=os.cpu_count(),
        load_1min_at_start=round(load, 2),
        load_1min_at_end=round(os.getloadavg()[0], 2),
        emulated=f"{len(hosts)} network namespaces on one bridge; tbf {args.rate:g} Mbit/s both directions; no loss; {delay}",
        note="ours: one peerd round as the daemon runs it (rendezvous, direct matchmaking, reliable engine); "
        "baseline: gloo all_reduce; ratio = ours / gloo; *_rtts: (figure - its 0 ms figure) / added RTT",
    )


def add_rtts(records: list[dict]) -> None:
    """Each record's costs in RTTs over the 0 ms record (none without one)."""
    zero = next((r for r in records if r["added_rtt_ms"] == 0), None)
    for r in records:
        rtt = r["added_rtt_ms"]
        r["ours_rtts"] = in_rtts(r["ours"], zero and zero["ours"], rtt)
        r["gloo_rtts"] = in_rtts(r["baseline"], zero and zero["baseline"], rtt)
        r["ours_parts_rtts"] = {
            p: in_rtts(v, zero and zero["ours_parts_s"][p], rtt) for p, v in r["ours_parts_s"].items()
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="RTT 0 and 50 ms, 6 rounds: a smoke run (about a minute)")
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument(
        "--rtt-ms", default="0,50,200", help="added RTT settings in ms between any two hosts, comma-separated (0-2000)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=15,
        help="measured rounds per system and RTT (after the first round, reported apart)",
    )
    parser.add_argument("--numel", type=int, default=256, help="float32 values in the averaged vector")
    parser.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s, both directions")
    parser.add_argument(
        "--round-timeout", type=float, default=30.0, help="seconds a round may take before it counts as failed"
    )
    args = parser.parse_args(argv)
    if args.quick:
        # 6: at 50 ms a fresh host's first rounds can find a leader "unreachable: dial backoff" (an
        # earlier dial to it failed; 2026-11-29, two of 1 + 3 rounds, in three runs), and the smoke
        # run asks for one completed round per cell.
        args.rtt_ms, args.rounds = "0,50", 6
    rtts = rtt_settings(parser, args.rtt_ms)
    if args.hosts < 2 or args.numel < args.hosts or args.rounds < 1:
        parser.error("--hosts must be at least 2, --numel at least --hosts, --rounds at least 1")

    from peerd.daemon.lab.netns import LinkShape, Network, environment_problem

    problem = environment_problem()
    if problem:
        print(f"{BENCH}: {problem}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    net = Network()
    progress(
        BENCH, f"{args.hosts} hosts at {args.rate:g} Mbit/s, {args.numel} float32, added RTT {rtts} ms, lab {net.name}"
    )
    records, started = [], time.monotonic()
    try:
        net.create()
        hosts = [net.add_host(f"h{i}", LinkShape(rate_mbit=args.rate)) for i in range(args.hosts)]
        for rtt in rtts:
            for h in hosts:
                net.shape(h.name, LinkShape(rate_mbit=args.rate, rtt_ms=rtt))
            records.append(measure(args, net, hosts, rtt))
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; every process started here was killed and the lab removed")
        return 130
    finally:
        net.destroy()
    add_rtts(records)
    headline = next((r for r in records if r["added_rtt_ms"] == 50), records[-1])
    rtt = headline["added_rtt_ms"]
    records.append(
        {
            **headline,
            "metric": f"round fixed cost at {rtt:g} ms RTT",
            "total_s": round(time.monotonic() - started, 1),
            "note": f"headline: seconds of one round of {args.numel} float32 among {args.hosts} hosts at {rtt:g} ms RTT, "
            "peerd's round as the daemon runs it vs gloo's all_reduce; ratio = ours / gloo, < 1 means peerd is faster",
        }
    )
    for r in records:
        emit(r)
    if not args.quick:  # a smoke run's figures are not worth keeping
        RESULTS.parent.mkdir(exist_ok=True)
        with RESULTS.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0 if all(r["ours"] is not None for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
