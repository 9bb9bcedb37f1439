"""What every benchmark in bench/ shares: one JSON line per measurement on stdout, progress on stderr.

A result line always has bench, metric, ours, baseline, ratio (ours / baseline, null when either is
missing) and unit; extra fields (n, samples, target, note, ...) follow. The last line a benchmark
prints is its headline.
"""

from __future__ import annotations

import datetime
import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def progress(bench: str, message: str) -> None:
    print(f"[{bench}] {message}", file=sys.stderr, flush=True)


def result(bench: str, metric: str, ours: float | None, baseline: float | None, unit: str, **extra: Any) -> dict:
    """Build one result; `emit` prints it. Kept apart so a benchmark can hold its headline until last."""
    ratio = round(ours / baseline, 3) if ours is not None and baseline else None
    return {"bench": bench, "metric": metric, "ours": ours, "baseline": baseline, "ratio": ratio, "unit": unit, **extra}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
    ratio = "" if record["ratio"] is None else f"  (ratio {record['ratio']})"
    ours, baseline, unit = record["ours"], record["baseline"], record["unit"]
    progress(record["bench"], f"{record['metric']}: ours {ours} vs baseline {baseline} {unit}{ratio}")


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def interrupt_on_signals() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt once, so that a benchmark's finally blocks
    kill what it started and remove its lab; a second signal is ignored, so as not to cut that short."""

    def interrupt(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    # SIGINT too: a shell without job control starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def checkout_commit() -> str:
    """The checkout's commit, with `+` when its tree has changes (processes a benchmark starts import
    what is there); "" where git cannot say."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def append_results(path: Path, lines: list[dict]) -> None:
    """Append a run's result lines to a results file, each with the time and the checkout's commit."""
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = checkout_commit() or None
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for line in lines:
            f.write(json.dumps({**line, "at": at, "commit": commit}) + "\n")
