"""`peerd lab run|clean`: what daemon/cli.py calls, after it has parsed the arguments.

Exit codes: 0 the scenario ran (whatever it found; read the report) or clean succeeded; 1 the lab
failed while running (a daemon did not start, a network command failed); 2 unusable scenario, or
no root or no network namespaces here; 130 interrupted. Every case removes what the lab built.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path


def _progress(message: str) -> None:
    print(f"[lab] {message}", file=sys.stderr, flush=True)


def _fail(code: int, message: str) -> int:
    print(f"peerd: error: {message}", file=sys.stderr)
    return code


def run_command(scenario_path: str, json_out: str | None, logs: str | None) -> int:
    from peerd.daemon.lab.netns import LabError, environment_problem
    from peerd.daemon.lab.scenario import ScenarioError, load

    try:
        scenario = load(scenario_path)
    except ScenarioError as e:
        return _fail(2, str(e))
    problem = environment_problem()
    if problem:
        return _fail(2, problem)

    from peerd.daemon.lab import report
    from peerd.daemon.lab.runner import Lab
    from peerd.daemon.procs import DaemonFailed

    def interrupt(signum, frame):  # SIGTERM too: the finally blocks tear the lab down,
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # and a second Ctrl-C must not cut that short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        record = Lab(scenario, progress=_progress, logs=Path(logs) if logs else None).run()
    except KeyboardInterrupt:
        _progress("interrupted; the lab was removed")
        return 130
    except (LabError, DaemonFailed, TimeoutError, RuntimeError, OSError) as e:
        return _fail(1, f"lab failed: {e}")
    result = report.build(record)
    print(report.table(result), flush=True)
    if json_out:
        text = json.dumps(result, indent=2, sort_keys=True)
        if json_out == "-":
            print(text)
        else:
            Path(json_out).write_text(text + "\n")
    return 0


def clean_command(force: bool) -> int:
    from peerd.daemon.lab.netns import clean, environment_problem

    problem = environment_problem()
    if problem:
        return _fail(2, problem)
    removed, skipped = clean(force=force)
    for item in removed:
        print(f"removed {item}")
    for lab_id in skipped:
        print(f"kept pdlab-{lab_id}: its `peerd lab` process still runs (--force removes it anyway)")
    if not removed and not skipped:
        print("nothing to clean")
    return 0
