"""What each part of the collective engine's round contract costs, measured in paired rounds.

    python -m bench.engine_costs [--quick] [--mib 64] [--peers 4] [--rounds 41]

bench.engine_allreduce compares peerd's GroupAllReduce with gloo; this one explains the result.
The same `--peers` processes each hold two engines on two TcpTransports: A, the engine as shipped
(restore=False, as the daemon's trainer calls it), and B, the same engine with one part of the
contract switched off by patching it out around B's rounds only. Rounds of A and B alternate
(which goes first alternates too) after a barrier, so both see the same machine at the same
moment; a round's time is its slowest process's, the figure the median after warm-up. Parts:

* none: nothing is switched off (A/A): how far from 1.0 the method itself lands;
* digest_sums: the wrapping 64-bit sum of every chunk, as received or reduced, that goes into the
  digest members compare (decision.sum64);
* own_backup: the copy of this member's own shard before it becomes the accumulator (what an
  aborted round puts back, and where a contribution is read again if a chunk holds NaN/Inf);
* nonfinite_check: the NaN/Inf check of each reduced chunk (reduction.all_finite);
* contract: the three together;
* bare: the three and the weighted-mean arithmetic as well: data movement, headers and the verdict
  exchange only, which is what the issue's "bare uvloop prototype" measured.

ratio = A's bus bandwidth / B's: the fraction of B's speed the whole engine keeps, so 1 - ratio is
what the part costs. B skips work, so its tensors are wrong; only A's outcomes and digests are
checked. The last line (the headline) is `contract`. Nothing in the product switches these off:
this is a measurement, not a mode.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time

from bench.common import emit, progress, result
from bench.engine_allreduce import BARRIER_TIMEOUT, ROUND_LIMIT, SETUP_TIMEOUT, Cluster, _data, summarize

BENCH = "engine_costs"
PARTS = ("none", "digest_sums", "own_backup", "nonfinite_check", "contract", "bare")


@contextlib.contextmanager
def switched_off(part: str):
    """Patch the engine so that `part` does nothing, for the duration of one B round."""
    from peerd.peers.collective import chunks, inbox, reduction

    parts = {
        "none": (),
        "contract": ("digest_sums", "own_backup", "nonfinite_check"),
        "bare": ("digest_sums", "own_backup", "nonfinite_check", "arithmetic"),
    }.get(part, (part,))
    saved = (
        chunks.sum64,
        reduction.sum64,
        inbox.Inbox.back_up,
        reduction.all_finite,
        reduction.ShardReducer.fold,
        reduction.ShardReducer.finish,
    )
    if "digest_sums" in parts:
        chunks.sum64 = reduction.sum64 = lambda values: 0
    if "own_backup" in parts:
        inbox.Inbox.back_up = lambda self, st, j, c: None
    if "nonfinite_check" in parts:
        reduction.all_finite = lambda values: True
    if "arithmetic" in parts:

        def fold(self, st, k, c):  # only the bookkeeping: which contributions the chunk holds
            self._started(st, c)
            st.acc_mask[c] |= 1 << k
            st.acc_weight[c] += st.weights[k]

        def finish(self, st):
            c = st.reduced
            self._started(st, c)
            st.reduced += 1
            st.result_have[self.me] |= 1 << c
            st.result_mask[self.me][c], st.result_weight[self.me][c] = st.acc_mask[c], st.acc_weight[c]
            st.result_sum[self.me][c] = 0
            return True

        reduction.ShardReducer.fold, reduction.ShardReducer.finish = fold, finish
    try:
        yield
    finally:
        (
            chunks.sum64,
            reduction.sum64,
            inbox.Inbox.back_up,
            reduction.all_finite,
            reduction.ShardReducer.fold,
            reduction.ShardReducer.finish,
        ) = saved


def pair(part, rank, n, numel, rounds, conn, barrier, scratch, chunk) -> dict:
    """Engines A and B in this worker process (bench.engine_allreduce._worker runs it)."""
    import uvloop

    from peerd.peers.collective import AllReduceSettings, Group, GroupAllReduce, TcpTransport

    loop = uvloop.new_event_loop()
    settings = AllReduceSettings(contribute_timeout=20.0, gather_timeout=40.0, verdict_timeout=5.0)
    if chunk:
        settings.chunk_elements = chunk
    engines = []
    for _ in range(2):  # A, then B: each on its own transport, addresses exchanged through the parent
        transport = TcpTransport("127.0.0.1", 0)
        conn.send(("address", loop.run_until_complete(transport.start())))
        group = Group("bench", [f"peer{i}" for i in range(n)], conn.recv(), rank)
        engines.append((GroupAllReduce(group, transport, numel, settings=settings), transport))
    xs = {"A": _data(rank, numel), "B": _data(rank, numel)}
    report = {"A": [], "B": [], "A_cpu": [], "B_cpu": [], "outcomes": []}

    def run(name: str, r: int) -> None:
        engine = engines[name == "B"][0]
        with switched_off(part) if name == "B" else contextlib.nullcontext():
            outcome = loop.run_until_complete(engine.all_reduce(xs[name], float(rank + 1), r, restore=False))
        if name == "A":
            report["outcomes"].append((outcome.status.value, outcome.digest.hex()))
        elif not outcome.completed:
            raise RuntimeError(f"B round {r} did not complete: {outcome.reason}")

    for r in range(1, rounds + 1):
        for name in ("A", "B") if r % 2 else ("B", "A"):
            barrier.wait(BARRIER_TIMEOUT)
            c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run(name, r)
            t1, c1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            report[name].append(t1 - t0)
            report[f"{name}_cpu"].append(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
    for engine, transport in engines:
        loop.run_until_complete(engine.close())
        loop.run_until_complete(transport.close())
    loop.close()
    return report


def measure(part: str, n: int, numel: int, rounds: int, chunk: int) -> list[dict]:
    cluster, grace = Cluster(f"costs:{part}", n, numel, rounds, chunk), 0.0
    try:
        for _ in range(2):  # A's addresses, then B's
            addresses = [cluster.recv(rank, SETUP_TIMEOUT) for rank in range(n)]
            for c in cluster.conns:
                c.send(addresses)
        reports = [cluster.recv(rank, SETUP_TIMEOUT + 2 * ROUND_LIMIT * rounds) for rank in range(n)]
        grace = 20.0
        return reports
    finally:
        cluster.kill(grace)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB, 3 rounds per part: a smoke run")
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=41, help="measured rounds of A and of B per part, after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.rounds, args.warmup = 4.0, 3, 1
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: choose among {', '.join(PARTS)}")
    parts.sort(key=lambda p: p == "contract")  # the headline last
    n, numel = args.peers, int(args.mib * (1 << 20)) // 4
    nbytes = numel * 4
    progress(BENCH, f"{n} peers, {nbytes / (1 << 20):.0f} MiB, load {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    ok = True
    for part in parts:
        load = os.getloadavg()[0]
        reports = measure(part, n, numel, args.warmup + args.rounds, 0)
        a, b = (summarize(reports, key, args.warmup, n, nbytes) for key in ("A", "B"))
        outcomes = [r["outcomes"] for r in reports]
        agree = all(len({o[i] for o in outcomes}) == 1 for i in range(len(outcomes[0])))
        ok &= agree and all(o[0] == "completed" for o in outcomes[0])
        emit(
            result(
                BENCH,
                f"bus_bandwidth_with_{part}",
                round(a["busbw"], 1),
                round(b["busbw"], 1),
                "MB/s",
                n=n,
                bytes=nbytes,
                cores=os.cpu_count(),
                load_1min_at_start=round(load, 2),
                part=part,
                a_round_s=round(a["time"], 4),
                b_round_s=round(b["time"], 4),
                a_cpu_s_per_round=round(a["cpu"], 4),
                b_cpu_s_per_round=round(b["cpu"], 4),
                cost=round(1 - a["busbw"] / b["busbw"], 3),
                a_outcomes_agree=agree,
                note=f"ours = the engine as shipped, baseline = {'the same engine again (A/A)' if part == 'none' else 'the same engine without ' + part}, "
                "in alternating rounds in the same processes; cost = 1 - ratio",
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
