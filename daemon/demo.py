"""The README's first command: three daemons on loopback train one run together, with metrics.

    python -m peerd.daemon.demo [--daemons 3] [--task digits-mlp] [--steps N] [--duration SECONDS] [--dir DIR]

The first daemon creates run "demo" for the task; the others join it. Every few seconds the demo
prints a line per daemon (step, loss, samples/s, last averaging round, evaluation), so the loss can
be watched falling. It ends when every daemon has taken --steps steps (0: never), after --duration
seconds, or on SIGINT (Ctrl-C), SIGTERM or SIGHUP (its terminal closed): it then stops every daemon
it started, in parallel, and prints a summary. A second signal kills them (p2pd included) at once.
The data dirs and logs are kept; the summary says where.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc

from peerd.daemon.client import ControlClient
from peerd.daemon.procs import READY_TIMEOUT, DaemonFailed, LocalDaemon, stop_all

RUN_ID = "demo"
STATUS_TIMEOUT = 2.0  # seconds for one daemon's status RPC; a daemon that does not answer shows as such
HEADER = (
    f"{'TIME':>6}  {'DAEMON':<6}  {'STATE':<9}  {'STEP':>5}  {'LOSS':>7}  {'SAMPLES/S':>9}  {'LAST ROUND':<16}  EVAL"
)


class _Signals:
    """Counts SIGINT, SIGTERM and SIGHUP instead of raising KeyboardInterrupt, so that no daemon is
    left half-started or half-stopped: the demo looks at the count between short waits."""

    def __init__(self) -> None:
        self.count, self.first = 0, ""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.count and signum == signal.SIGHUP:  # a closing terminal can hang up twice: not a hurry
            return
        self.count += 1
        self.first = self.first or signal.Signals(signum).name

    def done(self) -> None:
        """Every daemon is stopped: later signals are ignored. Python puts the default handlers back
        as it exits, so an impatient second Ctrl-C that lands then would kill the demo (exit -2)
        after it had stopped everything cleanly; an ignored signal is left ignored."""
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)

    def sleep(self, seconds: float) -> bool:
        """Sleep until `seconds` have passed or a signal came; returns whether one came."""
        deadline = time.monotonic() + seconds
        while not self.count and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return bool(self.count)


def _say(text: str = "") -> None:
    try:
        print(text, flush=True)
    except OSError:  # the terminal closed (SIGHUP): keep stopping the daemons, silently
        sys.stdout = open(os.devnull, "w")


def _status(d: LocalDaemon):
    """The daemon's RunStatus of the demo run; None if it does not answer or is not in the run."""
    if not d.ready:
        return None
    try:
        with ControlClient(d.control, timeout=STATUS_TIMEOUT) as c:
            return next((r for r in c.status().runs if r.run_id == RUN_ID), None)
    except grpc.RpcError:
        return None


def _elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def progress_line(elapsed: str, name: str, r) -> str:
    """One row under HEADER: a dash for what a daemon has not done yet (no step, no round, no eval)."""
    if r is None:
        return f"{elapsed:>6}  {name:<6}  not answering"
    stepped = r.local_step > 0 and not math.isnan(r.loss)
    loss = f"{r.loss:.4f}" if stepped else "-"
    rate = f"{r.samples_per_second:.0f}" if stepped and r.samples_per_second > 0 else "-"
    rnd = f"{r.last_round} {r.last_round_outcome} ({r.group_size})" if r.last_round_outcome else "-"
    ev = f"{r.eval_metric} {r.eval_score:.3f}" if r.eval_metric else "-"
    return f"{elapsed:>6}  {name:<6}  {r.train_state or '-':<9}  {r.step:>5}  {loss:>7}  {rate:>9}  {rnd:<16}  {ev}"


def _cli() -> str:
    """How to call the CLI from here: the `peerd` script beside this Python (the venv's), else -m."""
    script = Path(sys.executable).parent / "peerd"
    if not script.exists():
        return f"{sys.executable} -m peerd.daemon.cli"
    try:
        return str(script.relative_to(Path.cwd()))  # e.g. .venv/bin/peerd
    except ValueError:
        return str(script)


def _wait_ready(daemons: list[LocalDaemon], signals: _Signals) -> bool:
    """Wait until every daemon is ready; False if a signal came first. Raises DaemonFailed."""
    deadline = time.monotonic() + READY_TIMEOUT
    while not all(d.poll_ready() for d in daemons):
        if signals.sleep(0.05):
            return False
        if time.monotonic() > deadline:
            raise DaemonFailed(f"daemons not ready after {READY_TIMEOUT:.0f} s; logs in {daemons[0].log_path.parent}")
    return True


def _train(args, base: Path, daemons: list[LocalDaemon], signals: _Signals, started: float) -> str:
    """Start the daemons and print their progress until a stop condition; returns the reason."""
    common = ["--run", RUN_ID, "--min-peers", str(args.daemons), "--max-steps", str(args.steps), "--eval-every", "50"]
    # Each daemon is registered before it is spawned, so that whatever happens next stops it.
    daemons.append(LocalDaemon(base / "peer0", [*common, "--task", args.task]))
    daemons[0].start(wait=False)
    if not _wait_ready(daemons, signals):
        return signals.first
    for i in range(1, args.daemons):
        daemons.append(LocalDaemon(base / f"peer{i}", [*common, "--initial-peers", daemons[0].maddrs[0]]))
        daemons[-1].start(wait=False)
    if not _wait_ready(daemons, signals):
        return signals.first
    _say(f"peerd demo: {len(daemons)} daemons train {args.task!r} together in run {RUN_ID!r}; Ctrl-C stops them")
    for d in daemons:
        _say(f"  {d.data_dir.name}  {d.peer_id}  metrics {d.metrics_url}")
    _say(f"  data dirs and logs: {base}")
    _say(f"  try: {_cli()} status --data-dir {daemons[0].data_dir}")
    _say()
    _say(HEADER)
    deadline = None if args.duration is None else started + args.duration
    while True:
        wait = args.interval if deadline is None else min(args.interval, max(0.0, deadline - time.monotonic()))
        if signals.sleep(wait):
            return signals.first
        rows = [_status(d) for d in daemons]
        elapsed = _elapsed(time.monotonic() - started)
        for d, r in zip(daemons, rows):
            _say(progress_line(elapsed, d.data_dir.name, r))
            elapsed = ""  # once per block
        if args.steps and all(r is not None and r.train_state in ("FINISHED", "FAILED") for r in rows):
            return f"training ended, --steps {args.steps}"
        if deadline is not None and time.monotonic() >= deadline:
            return f"--duration {args.duration:g} s"


def _summary(daemons: list[LocalDaemon], finals: list, codes: list, reason: str, took: float, base: Path) -> None:
    if all(c == 0 for c in codes):
        how = "every daemon exited cleanly"
    else:
        shown = (f"{d.data_dir.name} {'killed' if c is None else c}" for d, c in zip(daemons, codes))
        how = "exit codes " + ", ".join(shown)
    _say(f"stopped after {_elapsed(took)} ({reason}); {how}")
    for d, r in zip(daemons, finals):
        if r is not None:
            ev = f"  {r.eval_metric} {r.eval_score:.3f}" if r.eval_metric else ""
            loss = f"{r.loss:.4f}" if not math.isnan(r.loss) else "-"
            _say(f"  {d.data_dir.name}  step {r.step}  loss {loss}{ev}")
    _say(f"data dirs and logs kept in {base}")


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
    signals = _Signals()
    base = (args.dir or Path(tempfile.mkdtemp(prefix="peerd-demo-"))).absolute()
    daemons: list[LocalDaemon] = []
    started = time.monotonic()
    reason, failed, finals, codes = "an error", False, [], []
    try:
        reason = _train(args, base, daemons, signals, started)
        finals = [_status(d) for d in daemons] if signals.count < 2 else []
    except DaemonFailed as e:
        _say(f"peerd demo: {e}")
        reason, failed = "a daemon failed", True
    finally:  # whatever happened, no daemon outlives the demo
        _say(f"stopping {len(daemons)} daemons; a second Ctrl-C kills them")
        codes = stop_all(daemons, hurry=lambda: signals.count >= 2)
        signals.done()
    _summary(daemons, finals, codes, reason, time.monotonic() - started, base)
    return 0 if not failed and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
