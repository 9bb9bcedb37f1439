"""The fusion tuner live: DeAR training in a network lab, the link's rate changed mid-run.

    python -m bench.dear_tuner [--quick] [--world 2] [--rate1 400] [--rate2 50] [--width 128] [--depth 64]

Root only (it builds a lab, daemon/lab/netns.py). Each rank runs in its own lab host (a network
namespace on the lab's bridge), its veth limited by a real tbf at both ends; the ranks train an MLP
(`depth` Linear layers of `width`: small layers, so that the bucket sizes the tuner picks are
several parameters apart) with DeAR over gloo, starting from 1 MiB buckets, calling `retune()`
every `--retune-every` steps (DeARSettings.retune_every, as a trainer would). Three phases:

  A  `--steps-a` steps at `--rate1` Mbit/s: the tuner fits alpha and beta from the transfers it sees
     and re-plans;
  B  the lab reshapes every host's link to `--rate2` (netns.Network.shape, both ends, between two
     steps, while the ranks wait), then `--steps-b` steps: the fit drifts to the new link and the
     group re-plans again. A lower rate raises beta, so the model predicts smaller buckets
     (b* = sqrt(M alpha / 2 beta), tuner.py);
  C  at rate2, rounds of `--steps` steps with fixed plans, order rotating: the tuned size (B's last
     plan), the stale size (A's last plan), 1 MiB (DeAR's default and the tuner's starting point)
     and 25 MB (DDP's default). A plan's figure is the median over rounds of the slowest rank's
     mean step time.

At the end of A and of B each rank also times reduce-scatter + all-gather pairs of a few fixed sizes
and fits alpha and beta to them (a controlled sweep, for reference only: the tuner never sees it),
so the tuner's fit and the optimum it implies can be checked against the link as measured apart.

Output, one JSON line each: every retune (phase, step, the fit: alpha in us and the buffer bytes
per second 1/beta, the proposal, the agreed size, whether the group re-planned, the plan's bucket
count, the mean step time since the last retune); the sweep of each phase; the step times of phase
C against the stale plan and 25 MB; and last the headline, the tuned plan's step time against
1 MiB's after the rate change. Load averages at start and end are in every summary line. Every
process is killed and the lab destroyed when the run ends or fails.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import emit, progress, result
from bench.dear import _mlp, _slowest, lab_hosts, make_collective, reshape_all, run_group
from peerd.peers.dear.tuner import TunerSettings

BENCH = "dear_tuner"
KIB = 1024  # as tuner.KIB
SWEEP_BYTES = (16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB)  # buffer sizes of the reference sweep
SYNC_TIMEOUT = 60.0  # seconds the ranks wait for the lab to reshape, and the lab for the ranks
FIXED_PLANS = {"stale": None, "1MiB": float(1 << 20), "25MB": 25e6}


def _sweep(collective, world: int, reps: int = 3) -> dict:
    """Median time of reduce-scatter + all-gather of a few buffer sizes; alpha and beta per op
    fitted to them by least squares (one op is half the pair)."""
    import torch
    import torch.distributed as dist

    xs, ys = [], []
    for nbytes in SWEEP_BYTES:
        flat = torch.zeros(nbytes // 4 // world * world)
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            collective.wait(collective.all_gather(collective.reduce_scatter(flat)))
            times.append(time.perf_counter() - start)
        xs.append(flat.numel() * 4)
        ys.append(_slowest(statistics.median(times)) / 2)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(0.0, my - beta * mx)
    return {
        "op_seconds": dict(zip(xs, ys)),
        "alpha_us": round(alpha * 1e6, 1),
        "mb_per_s": round(1e-6 / beta, 2) if beta > 0 else None,
    }


def _tuner_rank(rank: int, world: int, cfg: dict, sync: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from peerd.peers.dear import DeAR, DeARSettings, FusionTuner, TunerSettings

    model = _mlp(cfg["width"], cfg["depth"])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=g)
    y = torch.randn(cfg["batch"], cfg["width"], generator=g)
    collective = make_collective("gloo", cfg["op_timeout"])
    tuner = FusionTuner(TunerSettings(min_bytes=cfg["min_kib"] * KIB))
    dear = DeAR(
        model, optimizer, collective, DeARSettings(bucket_bytes=1 << 20, retune_every=cfg["retune_every"]), tuner=tuner
    )
    model_bytes = dear.plan.nbytes
    retunes: list[dict] = []
    started = time.monotonic()

    def train(phase: str, steps: int) -> None:
        since = time.perf_counter()
        for _ in range(steps):
            F.mse_loss(model(x), y).backward()
            dear.step()  # every retune_every steps: flush, propose, agree, maybe re-plan (schedule.py)
            if dear.steps % cfg["retune_every"] == 0:
                fit, _ = tuner.fit()
                decision = dear.last_retune
                retunes.append(
                    {
                        "phase": phase,
                        "step": dear.steps,
                        "t_s": round(time.monotonic() - started, 2),
                        "alpha_us": round(fit.alpha * 1e6, 1) if fit else None,
                        "mb_per_s": round(fit.bytes_per_second / 1e6, 2) if fit else None,
                        "proposal_kib": round(proposal / KIB) if (proposal := tuner.propose(model_bytes)[0]) else None,
                        "bucket_kib": round(dear.plan.bucket_bytes / KIB),
                        "replan": decision.replan,
                        "buckets": len(dear.plan.buckets),
                        "mean_step_s": round((time.perf_counter() - since) / cfg["retune_every"], 4),
                        "reason": decision.reason,
                    }
                )
                since = time.perf_counter()

    train("A", cfg["steps_a"])
    dear.flush()
    sweep_a = _sweep(collective, world)
    plan_a = dear.plan.bucket_bytes
    dist.barrier()
    if rank == 0:
        Path(sync, "a_done").touch()
    deadline = time.monotonic() + SYNC_TIMEOUT
    while not Path(sync, "reshaped").exists():  # the parent reshapes every host's link
        if time.monotonic() > deadline:
            raise TimeoutError(f"the lab did not reshape the links within {SYNC_TIMEOUT:.0f} s")
        time.sleep(0.05)
    dist.barrier()
    train("B", cfg["steps_b"])
    dear.flush()
    sweep_b = _sweep(collective, world)
    plan_b = dear.plan.bucket_bytes
    dear.close()

    plans = {"tuned": plan_b, **FIXED_PLANS, "stale": plan_a}
    names = list(plans)
    samples: dict[str, list[float]] = {n: [] for n in names}
    buckets: dict[str, int] = {}
    for r in range(cfg["rounds"]):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fixed = DeAR(model, optimizer, collective, DeARSettings(bucket_bytes=plans[name]), tuner=FusionTuner())
            F.mse_loss(model(x), y).backward()  # one step to warm the plan's buffers up
            fixed.step()
            fixed.flush()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                F.mse_loss(model(x), y).backward()
                fixed.step()
            fixed.flush()
            samples[name].append(_slowest((time.perf_counter() - start) / cfg["steps"]))
            buckets[name] = len(fixed.plan.buckets)
            fixed.close()
    collective.close()
    return {
        "retunes": retunes,
        "sweep_a": sweep_a,
        "sweep_b": sweep_b,
        "plan_a": plan_a,
        "plan_b": plan_b,
        "model_bytes": model_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": {n: statistics.median(v) for n, v in samples.items()},
        "samples": samples,
        "buckets": buckets,
        "plans": plans,
    }


def optimum_kib(model_bytes: int, alpha_us: float, mb_per_s: float | None) -> float | None:
    """The tuner's rule (tuner.py) applied to a fit, unbounded: sqrt(M alpha / 2 beta), in KiB."""
    if not mb_per_s:
        return None
    return round(math.sqrt(model_bytes * alpha_us * 1e-6 * mb_per_s * 1e6 / 2) / KIB, 1)


def run(args: argparse.Namespace, *, emit_lines: bool = True) -> dict:
    """One run (the lab built and destroyed here); returns rank 0's report plus what the parent saw."""
    load0, started = os.getloadavg()[0], time.monotonic()
    cfg = {
        "width": args.width,
        "depth": args.depth,
        "batch": args.batch,
        "retune_every": args.retune_every,
        "steps_a": args.steps_a,
        "steps_b": args.steps_b,
        "rounds": args.rounds,
        "steps": args.steps,
        "min_kib": args.min_kib,
        "op_timeout": 60.0,
    }
    progress(
        BENCH,
        f"{args.world} ranks in lab hosts, MLP {args.depth} x {args.width}, batch {args.batch}: {args.rate1:g} Mbit/s, then {args.rate2:g}",
    )
    sync = tempfile.mkdtemp(prefix="dear-tuner-")
    reshaped_at: list[float] = []
    try:
        with lab_hosts(args.world, args.rate1) as net:
            lab_id = net.id
            stop = threading.Event()

            def reshape_when_asked() -> None:  # bounded: the ranks' own timeout ends the run otherwise
                deadline = time.monotonic() + args.timeout
                while not stop.is_set() and time.monotonic() < deadline:
                    if Path(sync, "a_done").exists():
                        reshape_all(net, args.rate2)
                        reshaped_at.append(time.monotonic() - started)
                        Path(sync, "reshaped").touch()
                        return
                    time.sleep(0.05)

            watcher = threading.Thread(target=reshape_when_asked, name="dear-tuner-reshape", daemon=True)
            watcher.start()
            try:
                reports = run_group(
                    _tuner_rank,
                    args.world,
                    cfg,
                    sync,
                    timeout=args.timeout,
                    op_timeout=cfg["op_timeout"],
                    hosts=list(net.hosts.values()),
                )
            finally:
                stop.set()
                watcher.join(SYNC_TIMEOUT)
    finally:
        for f in Path(sync).glob("*"):
            f.unlink()
        os.rmdir(sync)
    for rank, (status, value) in enumerate(reports):
        if status != "ok":
            raise RuntimeError(f"rank {rank}: {status}: {value}")
    report = reports[0][1]
    report["reshaped_at_s"] = round(reshaped_at[0], 2) if reshaped_at else None
    report["lab_id"] = lab_id
    report["load_1min_at_start"], report["load_1min_at_end"] = round(load0, 2), round(os.getloadavg()[0], 2)
    report["seconds"] = round(time.monotonic() - started, 1)
    if emit_lines:
        _emit(args, report)
    return report


def _emit(args: argparse.Namespace, report: dict) -> None:
    m = report["model_bytes"]
    rates = {"A": args.rate1, "B": args.rate2}
    for r in report["retunes"]:
        opt = optimum_kib(m, r["alpha_us"], r["mb_per_s"]) if r["alpha_us"] is not None else None
        emit(
            result(
                BENCH, "retune", r["bucket_kib"], None, "KiB", rate_mbit=rates[r["phase"]], optimum_kib_of_fit=opt, **r
            )
        )
    for phase, key in (("A", "sweep_a"), ("B", "sweep_b")):
        sw = report[key]
        fits = [r for r in report["retunes"] if r["phase"] == phase and r["mb_per_s"]]
        last = fits[-1] if fits else {"alpha_us": None, "mb_per_s": None}
        emit(
            result(
                BENCH,
                f"phase_{phase}_tuner_fit_vs_sweep_mb_per_s",
                last["mb_per_s"],
                sw["mb_per_s"],
                "MB/s",
                rate_mbit=rates[phase],
                tuner_alpha_us=last["alpha_us"],
                sweep_alpha_us=sw["alpha_us"],
                sweep_op_seconds=sw["op_seconds"],
                tuner_optimum_kib=optimum_kib(m, last["alpha_us"], last["mb_per_s"])
                if last["alpha_us"] is not None
                else None,
                sweep_optimum_kib=optimum_kib(m, sw["alpha_us"], sw["mb_per_s"]),
                plan_kib=round(report[f"plan_{phase.lower()}"] / KIB),
            )
        )
    replans_b = [r for r in report["retunes"] if r["phase"] == "B" and r["replan"]]
    common = {
        "n": args.world,
        "params": report["params"],
        "model_bytes": m,
        "batch": args.batch,
        "rate1_mbit": args.rate1,
        "rate2_mbit": args.rate2,
        "retune_every": args.retune_every,
        "plan_kib": {k: (round(v / KIB) if math.isfinite(v) else None) for k, v in report["plans"].items()},
        "buckets": report["buckets"],
        "step_s": {k: round(v, 4) for k, v in report["step_s"].items()},
        "first_replan_after_change_step": replans_b[0]["step"] if replans_b else None,
        "reshaped_at_s": report["reshaped_at_s"],
        "cores": os.cpu_count(),
        "load_1min_at_start": report["load_1min_at_start"],
        "load_1min_at_end": report["load_1min_at_end"],
        "seconds": report["seconds"],
        "note": (
            f"{args.world} ranks, each in a lab network namespace, gloo over veths limited by tbf at both ends to {args.rate1:g} Mbit/s, "
            f"then to {args.rate2:g} Mbit/s mid-run; the tuner re-plans from what it observed (no sweep feeds it). Step times: phase C, "
            f"at {args.rate2:g} Mbit/s, median over {args.rounds} rounds of {args.steps} steps, slowest rank."
        ),
    }
    s = report["step_s"]
    emit(result(BENCH, "step_seconds_tuned_vs_stale_plan", round(s["tuned"], 4), round(s["stale"], 4), "s", **common))
    emit(result(BENCH, "step_seconds_tuned_vs_25MB", round(s["tuned"], 4), round(s["25MB"], 4), "s", **common))
    emit(result(BENCH, "step_seconds_tuned_vs_1MiB", round(s["tuned"], 4), round(s["1MiB"], 4), "s", **common))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dear_tuner", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small model and short phases: a smoke run")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rate1", type=float, default=400.0, help="Mbit/s of every link in phase A")
    p.add_argument("--rate2", type=float, default=50.0, help="Mbit/s of every link from phase B on")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--retune-every", type=int, default=5)
    p.add_argument("--steps-a", type=int, default=40)
    p.add_argument("--steps-b", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="phase C: rounds over the fixed plans")
    p.add_argument("--steps", type=int, default=6, help="phase C: steps per plan per round")
    p.add_argument(
        "--min-kib",
        type=int,
        default=TunerSettings().min_bytes // KIB,
        help="the tuner's smallest bucket (TunerSettings.min_bytes)",
    )
    p.add_argument("--timeout", type=float, default=840.0, help="seconds the whole run may take")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.quick:
        args.depth, args.steps_a, args.steps_b, args.rounds, args.steps, args.batch = 32, 20, 20, 2, 3, 64
    run(args)


if __name__ == "__main__":
    main()
