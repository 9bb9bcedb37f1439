"""Goodput under churn: the same run with a fault every 15 s and without, side by side in the lab.

    sudo .venv/bin/python -m bench.churn [--hosts 4] [--seconds 600] [--every 15] [--freeze-for 20]
                                         [--rate 100] [--loss 1] [--rtt-ms 0] [--steps-per-second 20]
                                         [--quick] [--logs DIR]

Two `peerd lab` scenarios (daemon/lab/runner.py) run at the same time on this machine, each in
its own network: `faults` and `none`, the same --hosts hosts, links and run (paced-digits, the
run's defaults: DiLoCo, H = 50 after the first phases, int8, overlap). Side by side, not one after
the other, so both see the same load on the machine; the training load is paced
(bench/paced_task.py: --steps-per-second steps a second per host, about 1 % of a core each), so
what one lab loses is the protocol's, not CPU the other took.

`faults` plays a cycle of one fault every --every s (schedule()):

    kill X, restart X (same data dir), freeze Y for --freeze-for s (SIGSTOP, SIGCONT),
    cut Z off (a partition of Z against the rest), heal

the targets turning over the hosts, and its last host joins late, at 3.5 x --every s (in `none`
every host is there from the start). Per run, over the schedule:

* availability: the share of host-seconds the schedule leaves a host up and unfrozen (a cut-off
  host counts as up); goodput's ratio over it is what the protocol loses beyond the faults themselves.
* goodput: samples that reached the run's model per second. Counted by each daemon as
  peerd_samples_averaged_total (the samples of phases whose round with mates applied; a phase lost
  to a kill, trained alone behind a cut, or thrown away by a catch-up download is not counted),
  summed over the hosts and their incarnations. The headline is goodput(faults) / goodput(none).
* the longest stall: the longest time a running host's local step stood still, its own frozen
  time left out, against the bound detection + 5 s (detection: the lab's peer TTL + refresh + DHT
  timeout); the fault and host where it happened.
* step regressions, torn checkpoints (every checkpoint verified at the end), the largest
  parameter divergence at the end (from the daemons' sketches), and each host's final eval.

Targets (issue 28): goodput ratio at least 0.9; longest stall at most detection + 5 s; no step
regression, no torn checkpoint, no silent divergence. JSON lines, the last the headline; every
line also goes to bench/results/churn.jsonl. Needs root (network namespaces). --quick: 4 hosts,
90 s, the smoke scenario tests/test_churn.py runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import paced_task
from bench.common import checkout_commit, emit, interrupt_on_signals, progress as _progress, result
from bench.scale import register_paced_task
from peerd.daemon.lab import report as lab_report
from peerd.daemon.lab.runner import DAEMON_DEFAULTS, Lab, Record
from peerd.daemon.lab.scenario import parse

BENCH = "churn"
RESULTS = Path(__file__).resolve().parent / "results" / "churn.jsonl"
GOODPUT_TARGET = 0.9  # issue 28
STALL_MARGIN = 5.0  # issue 28: the longest stall at most detection + 5 s
LATE_JOIN = 3.5  # the last host of `faults` joins at LATE_JOIN x --every s: between a freeze and a cut


def progress(message: str) -> None:
    _progress(BENCH, message)


def detection_s(args: list[str] = DAEMON_DEFAULTS) -> float:
    """Seconds until the lab's daemons drop a dead peer: its record outlives its last heartbeat by
    the peer TTL, a reader sees that at its next refresh, whose DHT read may take the DHT timeout."""
    value = {args[i]: float(args[i + 1]) for i in range(len(args) - 1) if args[i].startswith("--")}
    return value["--peer-ttl"] + value["--refresh-interval"] + value["--dht-timeout"]


def host_names(n: int) -> list[str]:
    return [f"h{i}" for i in range(n)]


def schedule(n_hosts: int, seconds: float, every: float, freeze_for: float) -> tuple[float, list[dict]]:
    """The `faults` scenario's late join time and its [[fault]] tables. Cycle c starts at
    (5c + 1) x every: kill X, restart X, freeze Y (thawed freeze_for s later), cut Z off, heal, one
    every `every` s, with X, Y, Z the hosts c, c + 1, c + 2 (mod their count) of those present. The
    last host joins at LATE_JOIN x every and is a target from the next cycle on. A pair whose
    second half would fall after `seconds` is left out whole: at the end every host runs, whole."""
    if n_hosts < 3:
        raise ValueError("churn needs at least 3 hosts: two there from the start and a late joiner")
    if not 0 < freeze_for < 3 * every:
        raise ValueError(f"--freeze-for must be more than 0 and less than 3 x --every ({3 * every:g} s)")
    names, late_at = host_names(n_hosts), LATE_JOIN * every
    faults: list[dict] = []
    for cycle in range(int(seconds // (5 * every)) + 1):
        base = (5 * cycle + 1) * every
        present = [n for n in names if n != names[-1] or base > late_at]
        kill, freeze, cut = (present[(cycle + j) % len(present)] for j in range(3))
        pairs = [
            (base, {"action": "kill", "hosts": [kill]}, base + every, {"action": "restart", "hosts": [kill]}),
            (
                base + 2 * every,
                {"action": "freeze", "hosts": [freeze]},
                base + 2 * every + freeze_for,
                {"action": "thaw", "hosts": [freeze]},
            ),
            (base + 3 * every, {"action": "partition", "hosts": [cut]}, base + 4 * every, {"action": "heal"}),
        ]
        for at, opens, until, closes in pairs:
            if until < seconds:
                faults += [{"at": at, **opens}, {"at": until, **closes}]
    return late_at, sorted(faults, key=lambda f: f["at"])


def scenario(name: str, args, faults: bool) -> dict:
    names = host_names(args.hosts)
    late_at, tables = schedule(args.hosts, args.seconds, args.every, args.freeze_for) if faults else (0.0, [])
    hosts = [{"name": n, "join_at": late_at if faults and n == names[-1] else 0.0} for n in names]
    return {
        "name": name,
        "duration": args.seconds,
        "start_timeout": 180.0,
        "run": {
            "id": "churn",
            "task": paced_task.NAME,
            "settings": {"steps_per_second": args.steps_per_second},
            "args": ["--eval-every", "100"],
        },
        "link": {"rate_mbit": args.rate, "loss_pct": args.loss, "rtt_ms": args.rtt_ms},
        "host": hosts,
        "fault": tables,
    }


# ---- figures from a lab Record (pure functions) ------------------------------------------------


def goodput(record: Record) -> dict[str, Any]:
    """Samples averaged into the run's model during the schedule, per host and in all, and per
    second. Each incarnation's counter starts at 0 with its process: a host's figure is the sum of
    each incarnation's last value, less what its first incarnation had counted before the schedule
    began (its first poll, at t ~ 0)."""
    per_host: dict[str, float] = {}
    trained: dict[str, float] = {}
    for name in (h.name for h in record.scenario.hosts):
        samples = sorted((s for s in record.samples if s.host == name), key=lambda s: s.t)
        if not samples:
            per_host[name] = trained[name] = 0.0
            continue
        last: dict[int, dict] = {}
        for s in samples:
            last[s.pid] = s.metrics
        first = samples[0]
        before = first.metrics.get("samples_averaged", 0.0) if record.scenario.host(name).join_at == 0 else 0.0
        per_host[name] = sum(m.get("samples_averaged", 0.0) for m in last.values()) - before
        # Trained (peerd_samples_total is restored from the checkpoint: the last incarnation's value holds
        # what the host kept), for context.
        trained[name] = samples[-1].metrics.get("samples", 0.0) - first.metrics.get("samples", 0.0)
    total = sum(per_host.values())
    return {
        "samples_averaged": total,
        "samples_trained": sum(trained.values()),
        "per_second": total / record.duration if record.duration else 0.0,
        "per_host": {k: round(v) for k, v in per_host.items()},
    }


def frozen_windows(record: Record) -> dict[str, list[tuple[float, float]]]:
    """Per host, the (start, end) of each time it was frozen, or down (killed until restarted)."""
    windows: dict[str, list[tuple[float, float]]] = {}
    opened: dict[tuple[str, str], float] = {}
    for e in record.events:
        for h in e.fault.hosts:
            if e.fault.action in ("freeze", "kill"):
                opened[(h, e.fault.action)] = e.t
            elif e.fault.action in ("thaw", "restart"):
                start = opened.pop((h, "freeze" if e.fault.action == "thaw" else "kill"), None)
                if start is not None:
                    windows.setdefault(h, []).append((start, e.t))
    for (h, _), start in opened.items():
        windows.setdefault(h, []).append((start, record.duration))
    return windows


def availability(record: Record) -> float:
    """The share of host-seconds in which a host ran unfrozen (or, cut off, ran on its side): what
    the schedule itself leaves, whatever the protocol does. Goodput over it is the protocol's part."""
    hosts, duration = record.scenario.hosts, record.duration
    if not hosts or not duration:
        return 0.0
    lost = sum(h.join_at for h in hosts)
    lost += sum(b - a for windows in frozen_windows(record).values() for a, b in windows)
    return 1.0 - lost / (len(hosts) * duration)


def longest_stall(record: Record) -> dict[str, Any]:
    """The longest time a host's local step stood still while it ran: within one incarnation, from
    its first step on (a restart's start-up and download are its recovery, reported by the lab's
    resumed_s), its own frozen time left out. With the host, when it began, and the fault before it."""
    down = frozen_windows(record)
    worst = {"seconds": 0.0, "host": None, "t": None, "after": None}
    for name in (h.name for h in record.scenario.hosts):
        samples = sorted((s for s in record.samples if s.host == name), key=lambda s: s.t)
        for pid in dict.fromkeys(s.pid for s in samples):
            mine = [s for s in samples if s.pid == pid]
            moved = next((i for i in range(1, len(mine)) if mine[i].local_step != mine[i - 1].local_step), None)
            if moved is None:
                continue
            since = mine[moved].t
            for a, b in zip(mine[moved:], mine[moved + 1 :]):
                if b.local_step != a.local_step:
                    since = b.t
                    continue
                still = b.t - since - sum(_overlap(since, b.t, w) for w in down.get(name, []))
                if still > worst["seconds"]:
                    worst = {"seconds": round(still, 2), "host": name, "t": round(since, 2), "after": None}
    if worst["t"] is not None:
        before = [e for e in record.events if e.t <= worst["t"] + 0.5]
        worst["after"] = f"{before[-1].fault.describe()} at {before[-1].t:.1f} s" if before else "no fault yet"
    return worst


def _overlap(a: float, b: float, window: tuple[float, float]) -> float:
    return max(0.0, min(b, window[1]) - max(a, window[0]))


def summary(name: str, record: Record) -> dict[str, Any]:
    rep = lab_report.build(record)
    g = goodput(record)
    last = {}
    for s in sorted(record.samples, key=lambda s: s.t):
        last[s.host] = s
    divergences = [s.divergence for s in last.values() if not math.isnan(s.divergence)]
    evals = [s.eval_score for s in last.values() if s.eval_score]
    return {
        "run": name,
        "seconds": round(record.duration, 1),
        "faults": len(record.events),
        "goodput": round(g["per_second"], 1),
        "availability": round(availability(record), 3),
        "samples_averaged": round(g["samples_averaged"]),
        "samples_trained": round(g["samples_trained"]),
        "samples_averaged_per_host": g["per_host"],
        "longest_stall": longest_stall(record),
        "step_regressions": rep["step_regressions"],
        "torn_checkpoints": rep["torn_checkpoints"],
        "checkpoints_verified": rep["checkpoints_verified"],
        "divergence_at_end": round(max(divergences), 4) if divergences else None,
        "eval_at_end": round(sum(evals) / len(evals), 4) if evals else None,
        "rounds": {n: h["rounds"] for n, h in rep["hosts"].items()},
        "incarnations": {n: h["incarnations"] for n, h in rep["hosts"].items()},
        "fault_times": [
            {k: f[k] for k in ("t", "action", "hosts", "noticed_s", "resumed_s") if k in f} for f in rep["faults"]
        ],
    }


# ---- running both -----------------------------------------------------------------------------


def run_side_by_side(scenarios: dict[str, dict], logs: Path | None) -> dict[str, Record]:
    """Each scenario in a Lab of its own, in a thread each, at once; a failure or Ctrl-C aborts both."""
    labs = {
        name: Lab(parse(s), progress=lambda m, n=name: progress(f"{n}: {m}"), logs=logs / name if logs else None)
        for name, s in scenarios.items()
    }
    records: dict[str, Record] = {}
    errors: dict[str, BaseException] = {}

    def play(name: str) -> None:
        try:
            records[name] = labs[name].run()
        except BaseException as e:  # noqa: BLE001 - reported and re-raised in the main thread
            errors[name] = e
            for lab in labs.values():
                lab.abort()

    threads = [threading.Thread(target=play, args=(n,), name=f"lab-{n}") for n in labs]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except KeyboardInterrupt:
        for lab in labs.values():
            lab.abort()
        for t in threads:
            t.join(120)
        raise
    if errors:
        name, e = next(iter(errors.items()))
        raise RuntimeError(f"lab {name} failed: {type(e).__name__}: {e}") from e
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.churn", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4, help="hosts per lab; in `faults` the last joins late")
    p.add_argument("--seconds", type=float, default=600.0, help="the schedule's length, both labs")
    p.add_argument("--every", type=float, default=15.0, help="seconds between two faults")
    p.add_argument("--freeze-for", type=float, default=20.0, help="seconds a frozen host stays frozen")
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s per link, both directions")
    p.add_argument("--loss", type=float, default=1.0, help="%% of packets delivered to a host that are dropped")
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--steps-per-second", type=float, default=20.0, help="the paced task's pace per host")
    p.add_argument("--quick", action="store_true", help="4 hosts, 90 s: the smoke scenario tests/test_churn.py runs")
    p.add_argument("--logs", type=Path, default=None, help="keep each lab's daemon logs under this directory")
    p.add_argument("--no-results", action="store_true", help=f"do not append the lines to {RESULTS.name}")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.churn needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.quick:
        args.hosts, args.seconds = 4, 90.0
    try:
        scenarios = {"faults": scenario("churn-faults", args, True), "none": scenario("churn-none", args, False)}
        parse(scenarios["faults"])  # refused here, before anything is built
    except ValueError as e:
        print(f"bench.churn: {e}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    plugins = register_paced_task(Path(tempfile.mkdtemp(prefix="peerd-churn-")))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH", "")]))
    progress(
        f"{args.hosts} hosts, {args.seconds:g} s, a fault every {args.every:g} s: "
        f"{len(scenarios['faults']['fault'])} faults and a late join; both labs at once"
    )
    records = run_side_by_side(scenarios, args.logs)
    lines = []
    header = {
        "bench": BENCH,
        "hosts": args.hosts,
        "seconds": args.seconds,
        "every": args.every,
        "freeze_for": args.freeze_for,
        "link": {"rate_mbit": args.rate, "loss_pct": args.loss, "rtt_ms": args.rtt_ms},
        "steps_per_second": args.steps_per_second,
        "detection_s": detection_s(),
        "quick": args.quick,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": checkout_commit(),
    }
    lines.append(header)
    figures = {name: summary(name, rec) for name, rec in records.items()}
    lines.extend({"bench": BENCH, **f} for f in figures.values())
    f, n = figures["faults"], figures["none"]
    bound = detection_s() + STALL_MARGIN
    stall = f["longest_stall"]["seconds"]
    lines.append(result(BENCH, "longest stall of a running host (faults)", stall, bound, "s", where=f["longest_stall"]))
    lines.append(
        result(
            BENCH,
            "goodput: samples averaged into the run's model per second, faults over none",
            f["goodput"],
            n["goodput"],
            "samples/s",
            target=GOODPUT_TARGET,
            # What the schedule leaves (host-seconds up and unfrozen), and the ratio over it: the protocol's part.
            availability=f["availability"],
            of_available=round(f["goodput"] / n["goodput"] / f["availability"], 3)
            if n["goodput"] and f["availability"]
            else None,
            nothing_lost=not (f["step_regressions"] or f["torn_checkpoints"]),
        )
    )
    for rec in lines:
        if "metric" in rec:
            emit(rec)
        else:
            print(json.dumps(rec), flush=True)
    if not args.no_results:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as out:
            for rec in lines:
                out.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
