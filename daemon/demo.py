"""The README's first command: three daemons on loopback train one run together, with metrics.

    python -m daemon.demo [--daemons 3] [--task digits-mlp] [--steps N] [--duration SECONDS] [--dir DIR]

The first daemon creates run "demo" for the task; the others join it. Every few seconds the demo
prints each daemon's global step, loss, last averaging round and evaluation, so the loss can be
watched falling; each daemon's metrics URL is printed at the start. It ends when every daemon has
taken --steps steps (0: never), after --duration seconds, or on Ctrl-C, and stops every daemon
cleanly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from daemon.client import ControlClient
from daemon.procs import LocalDaemon

RUN_ID = "demo"


def _row(d: LocalDaemon) -> tuple[str, str]:
    with ControlClient(d.control, timeout=5) as c:
        r = next((r for r in c.status().runs if r.run_id == RUN_ID), None)
    if r is None:
        return "-", "not in the run"
    rnd = f"round {r.last_round} {r.last_round_outcome} ({r.group_size})" if r.last_round_outcome else "no round yet"
    ev = f"{r.eval_metric} {r.eval_score:.3f}" if r.eval_metric else ""
    return r.train_state, f"step {r.step:5d}  loss {r.loss:.4f}  {rnd}  {ev}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemons", type=int, default=3, help="how many daemons (default 3)")
    parser.add_argument("--task", default="digits-mlp", help="task of the run (default digits-mlp)")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (default 0: never)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: Ctrl-C)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between progress lines (default 5)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the data dirs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.daemons < 1:
        parser.error("--daemons must be at least 1")
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    base = args.dir or Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    common = ["--run", RUN_ID, "--min-peers", str(args.daemons), "--max-steps", str(args.steps), "--eval-every", "50"]
    daemons: list[LocalDaemon] = []
    codes: list[int] = []
    try:
        first = LocalDaemon(base / "peer0", [*common, "--task", args.task]).start()
        daemons.append(first)
        for i in range(1, args.daemons):
            daemons.append(LocalDaemon(base / f"peer{i}", [*common, "--initial-peers", first.maddrs[0]]).start(wait=False))
        for d in daemons[1:]:
            d.wait_ready()
        print(f"{len(daemons)} daemons train {args.task!r} in run {RUN_ID!r} (data dirs and logs under {base}):")
        for d in daemons:
            print(f"  {d.data_dir.name}  {d.peer_id}  metrics {d.metrics_url}")
        print(f"try:  peerd status --data-dir {daemons[0].data_dir}", flush=True)
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while deadline is None or time.monotonic() < deadline:
            time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())) if deadline else args.interval)
            rows = [_row(d) for d in daemons]
            for d, (_, line) in zip(daemons, rows):
                print(f"  {d.data_dir.name}  {line}")
            print(flush=True)
            if args.steps and all(state in ("FINISHED", "FAILED") for state, _ in rows):
                print("every daemon finished", flush=True)
                break
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        for d in daemons:
            try:
                codes.append(d.stop())
            except Exception as e:  # keep stopping the others
                print(f"{d.data_dir.name}: {e}", file=sys.stderr)
                codes.append(-1)
        print(f"stopped; exit codes {codes}")
    return 0 if codes and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
