"""The README's first command: three daemons on loopback find each other; their metrics URLs print.

    python -m daemon.demo [--daemons 3] [--duration SECONDS] [--dir DIR]

With no --duration it runs until Ctrl-C, then stops every daemon cleanly.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--daemons", type=int, default=3, help="how many daemons (default 3)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: Ctrl-C)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the data dirs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.daemons < 1:
        parser.error("--daemons must be at least 1")
    base = args.dir or Path(tempfile.mkdtemp(prefix="peerd-demo-"))
    daemons: list[LocalDaemon] = []
    try:
        first = LocalDaemon(base / "peer0", ["--run", RUN_ID]).start()
        daemons.append(first)
        for i in range(1, args.daemons):
            daemons.append(LocalDaemon(base / f"peer{i}", ["--run", RUN_ID, "--initial-peers", first.maddrs[0]]).start(wait=False))
        for d in daemons[1:]:
            d.wait_ready()
        print(f"{len(daemons)} daemons in run {RUN_ID!r} (data dirs and logs under {base}):")
        for d in daemons:
            print(f"  {d.data_dir.name}  {d.peer_id}  metrics {d.metrics_url}")
        print(f"try:  peerd peers --data-dir {daemons[0].data_dir}", flush=True)
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while deadline is None or time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())) if deadline else 5.0)
            counts = []
            for d in daemons:
                with ControlClient(d.control, timeout=5) as c:
                    counts.append(sum(r.peers for r in c.status().runs if r.run_id == RUN_ID))
            print(f"peers seen by each daemon: {counts}", flush=True)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        codes = []
        for d in daemons:
            try:
                codes.append(d.stop())
            except Exception as e:  # keep stopping the others
                print(f"{d.data_dir.name}: {e}", file=sys.stderr)
                codes.append(-1)
        print(f"stopped; exit codes {codes}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
