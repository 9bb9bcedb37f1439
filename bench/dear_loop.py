"""Where DeAR's engine runs: on an event loop of its own (a thread it owns, what peerd does) or on
the loop of the process's other network work (a daemon's: heartbeats, datagrams, control calls).

    python -m bench.dear_loop [--world 3] [--mib 16] [--ops 40] [--repeats 2]

`--world` processes on loopback (bench/dear.py's run_group). Each runs a stand-in for a daemon's
loop: uvloop in a thread with a ticker that sleeps TICK_MS and records how late it wakes up, the
delay every other callback on that loop (a heartbeat, a datagram handler) sees. From the main
thread (as DeAR's hooks call it from the training thread) each rank all-reduces a `--mib` MiB
float32 vector `--ops` times (reduce-scatter then all-gather, back to back) over an EngineCollective
that serves (a) on its own loop in its own thread, (b) on the ticker's loop (`loop=`). Both kinds
run in the same processes, `--repeats` times each, in alternating order. Lines: the ticker's
lateness (p50, p99, max, in ms, the worst rank's) while the ops run, and the all-reduce time
(median, the slowest rank's), for each; the headline is the ticker's p99 lateness, own loop vs the
shared loop (ratio < 1: the own loop delays the other work less).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from bench.common import emit, progress, result
from bench.dear import run_group

BENCH = "dear_loop"
TICK_MS = 5.0  # the ticker's period: a loop with nothing else to do wakes it up within a fraction of a ms
OP_TIMEOUT = 60.0
KINDS = ("own", "shared")


def _rank(rank: int, world: int, numel: int, ops: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    import uvloop

    from peerd.peers.dear.engine import EngineCollective

    torch.set_num_threads(1)
    loop = uvloop.new_event_loop()
    threading.Thread(target=loop.run_forever, name="daemon-loop", daemon=True).start()
    late: list[float] = []
    recording = threading.Event()

    async def ticker() -> None:
        while True:
            due = time.monotonic() + TICK_MS / 1000
            await asyncio.sleep(TICK_MS / 1000)
            if recording.is_set():
                late.append((time.monotonic() - due) * 1000)

    asyncio.run_coroutine_threadsafe(ticker(), loop)
    flat = torch.randn(numel - numel % world, generator=torch.Generator().manual_seed(rank))
    out: dict[str, dict[str, list[float]]] = {k: {"late": [], "op_s": []} for k in KINDS}
    for i in range(repeats):
        for kind in KINDS if i % 2 == 0 else KINDS[::-1]:  # every rank the same order: the ops must match
            collective = EngineCollective(
                rank=rank, world=world, timeout=OP_TIMEOUT, loop=loop if kind == "shared" else None
            )
            addresses: list[str | None] = [None] * world
            dist.all_gather_object(addresses, collective.start())
            collective.join(addresses)
            collective.wait(collective.all_gather(collective.reduce_scatter(flat)))  # connect, warm up
            dist.barrier()
            late.clear()
            recording.set()
            for _ in range(ops):
                t0 = time.monotonic()
                collective.wait(collective.all_gather(collective.reduce_scatter(flat)))
                out[kind]["op_s"].append(time.monotonic() - t0)
            recording.clear()
            out[kind]["late"] += late
            dist.barrier()
            collective.close()
    loop.call_soon_threadsafe(loop.stop)
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--mib", type=float, default=16.0, help="the all-reduced vector, MiB of float32")
    parser.add_argument("--ops", type=int, default=40, help="all-reduces per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each kind, alternating")
    args = parser.parse_args(argv)
    numel = int(args.mib * (1 << 20)) // 4
    progress(BENCH, f"{args.world} ranks on loopback, {args.mib:g} MiB, {args.ops} ops x {args.repeats} per kind")
    results = run_group(_rank, args.world, numel, args.ops, args.repeats, timeout=600, op_timeout=OP_TIMEOUT)
    failed = [value for status, value in results if status != "ok"]
    if failed:
        progress(BENCH, f"a rank failed: {failed[0]}")
        return 1
    reports = [value for _, value in results]
    figures = {}
    for kind in KINDS:
        late = [r[kind]["late"] for r in reports]
        figures[kind] = {
            "p50_ms": max(_quantile(x, 0.5) for x in late),
            "p99_ms": max(_quantile(x, 0.99) for x in late),
            "max_ms": max(max(x) for x in late),
            "op_s": statistics.median(max(ts) for ts in zip(*(r[kind]["op_s"] for r in reports))),
            "ticks": min(len(x) for x in late),
        }
    common = {"world": args.world, "mib": args.mib, "ops": args.ops * args.repeats, "tick_ms": TICK_MS}
    own, shared = figures["own"], figures["shared"]
    emit(
        result(BENCH, "allreduce_s_own_vs_shared_loop", round(own["op_s"], 4), round(shared["op_s"], 4), "s", **common)
    )
    for q in ("p50_ms", "max_ms"):
        emit(result(BENCH, f"loop_lateness_{q}_own_vs_shared", round(own[q], 2), round(shared[q], 2), "ms", **common))
    emit(
        result(
            BENCH,
            "loop_lateness_p99_ms_own_vs_shared",
            round(own["p99_ms"], 2),
            round(shared["p99_ms"], 2),
            "ms",
            **common,
            ticks=min(own["ticks"], shared["ticks"]),
            note="headline: how late the other work on a daemon's loop runs while DeAR all-reduces, the engine "
            "on its own loop (ours) vs on that loop (baseline); ratio < 1: its own loop delays the daemon's work less",
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
