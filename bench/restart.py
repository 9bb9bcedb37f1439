"""A training daemon's restart: seconds from its spawn until its training process trains again.

    python -m bench.restart [--restarts 6] [--task digits-mlp] [--no-results]

One `peerd start --run R --task T` on loopback (peerd.daemon.procs.LocalDaemon, `--torch-threads 1`)
trains until its process attaches; then it is stopped and started again `--restarts` times in each
of two ways, alternated so that both see the same load on the machine:

* **ours**: `peerd start --run R --task T`, as it was first started (and as the lab restarts a
  host): the daemon starts the run's training process with itself (`taskproc --preload`), which
  imports torch while the daemon joins the network and reads its arguments once the run is set up;
* **baseline**: `peerd start --run R`, the run resumed from the data directory: the daemon starts
  the training process once the run is set up, as it did for every start before the preload.

Each restart: seconds from the spawn until the daemon answers (ready), and until the run's status
shows a training process attached (it took the run's parameters: it trains from its next step).
The headline: the median seconds to attached, ours against the baseline. Every process started
here is killed on exit. Figures: docs/benchmarks.md, "A daemon's restart".
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import append_results, emit, interrupt_on_signals, median, progress, result
from peerd.daemon.client import ControlClient
from peerd.daemon.procs import LocalDaemon

BENCH = "restart"
RESULTS = Path(__file__).resolve().parent / "results" / "restart.jsonl"
RUN = "restart"
ATTACH_TIMEOUT = 180.0  # seconds a restart has to attach its process, on a loaded machine
POLL = 0.02  # seconds between two looks at the daemon's ready file and status
SETTLE = 2.0  # seconds the process trains after attaching, before the next stop


def attached(d: LocalDaemon) -> bool:
    """Whether the daemon answers and its run shows a training process attached."""
    if not d.poll_ready():
        return False
    try:
        with ControlClient(d.control) as c:
            return any(r.run_id == RUN and r.attached_pid for r in c.status().runs)
    except Exception:  # the control socket is there before it answers
        return False


def restart(d: LocalDaemon, args: list[str]) -> dict[str, float]:
    """Stop `d`, start it with `args`: seconds from the spawn to ready and to attached."""
    if d.proc is not None and d.stop() != 0:
        raise RuntimeError(f"the daemon did not stop cleanly:\n{d.log_tail()}")
    d.args = args
    began = time.monotonic()
    d.start(wait=False)
    ready = None
    while time.monotonic() - began < ATTACH_TIMEOUT:
        if ready is None and d.poll_ready():
            ready = time.monotonic() - began
        if ready is not None and attached(d):
            return {"ready_s": round(ready, 2), "attached_s": round(time.monotonic() - began, 2)}
        if d.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited:\n{d.log_tail()}")
        time.sleep(POLL)
    raise RuntimeError(f"no process attached within {ATTACH_TIMEOUT:.0f} s:\n{d.log_tail()}")


def measure(base: Path, args) -> list[dict]:
    common = ["--run", RUN, "--torch-threads", "1", "--eval-every", "1000000", "--checkpoint-every", "1000000"]
    ways = {"ours": [*common, "--task", args.task], "baseline": common}
    d = LocalDaemon(base / "d")
    times: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    try:
        first = restart(d, ways["ours"])  # the run's first start creates it
        progress(BENCH, f"first start: ready {first['ready_s']} s, attached {first['attached_s']} s")
        for i in range(args.restarts):
            for way, argv in ways.items():
                time.sleep(SETTLE)
                times[way].append(restart(d, argv))
                progress(BENCH, f"restart {i + 1}, {way}: {times[way][-1]}")
    finally:
        d.kill_group()
    lines = []
    for key in ("ready_s", "attached_s"):
        ours, baseline = (round(median([t[key] for t in times[way]]), 2) for way in ways)
        lines.append(
            result(
                BENCH,
                "restart_to_" + key.removesuffix("_s"),
                ours,
                baseline,
                "s",
                task=args.task,
                restarts=args.restarts,
                ours_each=[t[key] for t in times["ours"]],
                baseline_each=[t[key] for t in times["baseline"]],
                note="median seconds from the daemon's spawn; ours: --task on the command line (the training "
                "process preloaded with the daemon); baseline: the run resumed from the data directory "
                "(the process started once the run is set up)",
            )
        )
    return lines  # the headline last: to attached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=6, help="restarts each way, alternated (default 6)")
    parser.add_argument("--task", default="digits-mlp", help="the run's task (default digits-mlp)")
    parser.add_argument("--no-results", action="store_true", help=f"do not append the lines to {RESULTS.name}")
    args = parser.parse_args(argv)
    interrupt_on_signals()
    base = Path(tempfile.mkdtemp(prefix="peerd-restart-"))
    try:
        lines = measure(base, args)
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; the daemon is killed")
        return 130
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for line in lines:
        emit(line)
    if not args.no_results:
        append_results(RESULTS, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
