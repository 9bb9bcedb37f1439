"""`peerd`: start a daemon, talk to a running one over its control API, or export a run's weights.

Exit codes: 0 success; 1 the daemon or the request failed; 2 bad usage or configuration
(one line on stderr, no traceback); 141 stdout's reader left before the output ended (`| head`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import faulthandler
import json
import logging
import math
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

import grpc

from peerd.daemon import __version__
from peerd.daemon import plan as plan_mod
from peerd.daemon.client import ControlClient, as_dict, control_address
from peerd.daemon.config import (
    OPTIONS,
    REMOVED_FLAGS,
    RENAMED_FLAGS,
    ConfigError,
    client_defaults,
    default_of,
    load_config,
)
from peerd.daemon.tables import columns

logger = logging.getLogger("peerd")

_BOOL_PATHS = {"network.nat_port_map", "network.auto_nat", "train.dear"}
_APPEND_PATHS = {"run", "network.announce", "train.set"}
_EXTEND_PATHS = {"network.initial_peers"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, as the docs promise
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Renamed(argparse.Action):
    """A flag renamed after peerd 0.1.0 (daemon/config.py RENAMED_FLAGS): refused, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {RENAMED_FLAGS[option_string]} (renamed)")


class _Removed(argparse.Action):
    """A flag removed (daemon/config.py REMOVED_FLAGS): refused, saying why."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is {REMOVED_FLAGS[option_string]}")


def _fail(code: int, message: str):
    print(f"peerd: error: {message}", file=sys.stderr)
    return code


# ---- peerd start --------------------------------------------------------------------------------


def _add_start(sub) -> None:
    p = sub.add_parser(
        "start",
        help="run a daemon in the foreground",
        description="Run a peerd daemon in the foreground until SIGTERM/SIGINT/SIGHUP or `peerd stop`. "
        "Settings come from flags > PEERD_* variables > the --config TOML file > defaults; each flag's "
        "variable is named after it, e.g. --metrics-port is PEERD_METRICS_PORT.",
        argument_default=argparse.SUPPRESS,  # only what was typed goes to load_config: it applies the precedence
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file (variable PEERD_CONFIG)")
    for o in OPTIONS:
        help_text = f"{o.help} (default: {_shown(default_of(o.path))}) [{o.env}]".replace("%", "%%")
        if o.path in _BOOL_PATHS:  # --no-X too, to override a true from the variable or the file
            p.add_argument(o.flag, dest=o.path, action=argparse.BooleanOptionalAction, help=help_text)
        elif o.path in _APPEND_PATHS:
            p.add_argument(o.flag, dest=o.path, action="append", metavar=o.metavar, help=help_text)
        elif o.path in _EXTEND_PATHS:
            p.add_argument(o.flag, dest=o.path, action="extend", nargs="+", metavar=o.metavar, help=help_text)
        else:
            p.add_argument(o.flag, dest=o.path, metavar=o.metavar, help=help_text)
    for old in RENAMED_FLAGS:
        p.add_argument(old, action=_Renamed, help=argparse.SUPPRESS)
    for old in REMOVED_FLAGS:
        p.add_argument(old, action=_Removed, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_start)


def _shown(default) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default) if default not in ("", []) else "none"


def _check_ports_free(config) -> None:
    """ConfigError naming the port if the libp2p or metrics port cannot be listened on now: checked
    before anything starts. p2pd binds with SO_REUSEPORT, so a second daemon on a port in use would
    start and split its incoming connections with the first. (A port 0 is always free.)"""
    ports = {
        "--port": (config.network.host, config.network.port),
        "--metrics-port": (config.metrics_host, config.metrics_port),
    }
    for flag, (host, port) in ports.items():
        if port == 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a previous run's TIME_WAIT is no clash
            try:
                s.bind((host, port))  # without SO_REUSEPORT: fails while any socket listens on the port
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{flag} {port} is in use on {host} (another peerd daemon, or another program, "
                        f"listens on it): pick another {flag}, or 0 for any free port"
                    ) from None
                raise ConfigError(f"{flag} {port}: cannot listen on {host}: {e.strerror}") from None


def _cmd_start(args: argparse.Namespace) -> int:
    cli = {k: v for k, v in vars(args).items() if "." in k or k in {o.path for o in OPTIONS}}
    try:
        config = load_config(cli, config_file=getattr(args, "config", None))
        _check_ports_free(config)
    except ConfigError as e:
        return _fail(2, str(e))
    if not config.run and (config.train.task or config.train.set):  # they would go unused
        return _fail(2, "--task and --set are for the runs joined at start: give --run RUN_ID too")
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    from peerd.daemon.supervisor import die_with_parent

    die_with_parent(signal.SIGTERM)  # started by a test, demo or benchmark (daemon/procs.py): go with it
    for noisy in ("hivemind", "p2pclient"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(config.log_level)))

    import uvloop

    from peerd.daemon.app import Daemon, worker_threads
    from peerd.daemon.datadir import DataDirError
    from peerd.daemon.joining import RunRefused
    from peerd.peers.run_ids import InvalidSecret

    async def serve() -> None:
        daemon = Daemon(config)
        loop = asyncio.get_running_loop()
        loop.set_default_executor(worker_threads())
        signals_seen = 0

        starting = asyncio.create_task(daemon.start(), name="start")

        def on_signal(name: str) -> None:
            nonlocal signals_seen
            if signals_seen and name == "SIGHUP":  # a closing terminal can hang up twice (its shell, the kernel)
                return
            signals_seen += 1
            if signals_seen == 1:
                daemon.request_shutdown(name)
                starting.cancel()  # a signal during start-up undoes what started, then exits
            else:  # p2pd exits by itself when our end of its pipes closes
                print("peerd: second signal, exiting without draining", file=sys.stderr, flush=True)
                os._exit(1)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its terminal closed
            loop.add_signal_handler(sig, on_signal, sig.name)
        try:
            await starting
        except asyncio.CancelledError:
            print("peerd: stopped during start-up", file=sys.stderr, flush=True)
            return
        info = daemon.ready_info()
        print(
            f"peerd {__version__} ready\n  peer ID:  {info['peer_id']}\n"
            + "".join(f"  address:  {m}\n" for m in info["maddrs"])
            + f"  control:  {info['control']}\n  metrics:  {info['metrics_url']}\n  pid:      {info['pid']}\n"
            + f"  runs:     {', '.join(info['runs']) or '(none)'}\n  ready file: {config.data_dir / 'ready.json'}",
            flush=True,
        )
        await daemon.run()

    try:
        uvloop.run(serve())
    except (DataDirError, RunRefused, InvalidSecret) as e:  # InvalidSecret: --run-secret-file, checked first
        return _fail(2, str(e))
    except TimeoutError:  # before OSError: TimeoutError is one of its subclasses
        return _fail(1, "timed out (starting p2pd, reaching the initial peers, or draining)")
    except (OSError, ValueError) as e:
        return _fail(1, f"could not start: {e}")
    except Exception as e:  # p2pd and DHT bootstrap failures come as several hivemind types
        logger.debug("start failed", exc_info=True)
        return _fail(1, f"could not start: {type(e).__name__}: {e}")
    # Everything has stopped and closed above. The interpreter's own teardown of torch, hivemind and
    # gRPC costs about a second of CPU, which a Ctrl-C should not wait for.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a terminal that closed (SIGHUP) takes no more output
            stream.flush()
    os._exit(0)


# ---- the client subcommands ------------------------------------------------------------------------


def _daemon_options(p: argparse.ArgumentParser) -> None:
    """How a client command finds the daemon to talk to."""
    data_dir, control = client_defaults()
    p.add_argument("--data-dir", type=Path, default=data_dir, help="data dir of the daemon to talk to [PEERD_DATA_DIR]")
    p.add_argument("--control", default=control, help="control address instead of --data-dir [PEERD_CONTROL]")


def _client_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    _daemon_options(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    return p


def _client(args) -> ControlClient:
    return ControlClient(control_address(args.data_dir, args.control))


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _cmd_status(args) -> int:
    with _client(args) as c:
        s = c.status()
    if args.json:
        _print_json(as_dict(s))
        return 0
    print(f"state     {s.state}\npeer ID   {s.peer_id}\nversion   {s.version}\nuptime    {s.uptime_seconds:.0f} s")
    print(f"pid       {s.pid}\nmetrics   {s.metrics_url}")
    for m in s.maddrs:
        print(f"address   {m}")
    print()
    rows = []
    for r in s.runs:
        trains = bool(r.train_state)  # a task, or a script's model: status has training figures
        rows.append(
            (
                r.run_id,
                str(r.peers),
                "yes" if r.secured else "no",
                r.task or ("script" if trains else "-"),
                r.train_state or "-",
                str(r.step) if trains else "-",
                str(r.local_step) if trains else "-",
                f"{r.loss:.4f}" if trains else "-",
                f"{r.samples_per_second:.0f}" if trains else "-",
                f"{r.last_round} {r.last_round_outcome} ({r.group_size}{', ' + r.last_round_links if r.last_round_links else ''})"
                if r.last_round_outcome
                else "-",
                f"{r.eval_metric} {r.eval_score:.4f}" if r.eval_metric else "-",
            )
        )
    _table(
        (
            "RUN",
            "PEERS",
            "SECRET",
            "TASK",
            "TRAINING",
            "STEP",
            "LOCAL",
            "LOSS",
            "SAMPLES/S",
            "LAST ROUND (GROUP, LINKS)",
            "EVAL",
        ),
        rows,
        empty="not in any run (peerd join RUN_ID)",
    )
    for r in s.runs:
        if r.train_state and not r.task:
            who = (
                f"pid {r.attached_pid} ({r.attached_device})"
                if r.attached_pid
                else "none (peerd.torch.Optimizer attaches one)"
            )
            if r.attached_processes > 1:
                who += f", leading a local group of {r.attached_processes} (epoch {r.attached_group_epoch})"
            print(f"{r.run_id}: attached process: {who}")
        if r.train_process_state:
            pid = f"pid {r.attached_pid}, " if r.attached_pid else ""
            print(f"{r.run_id}: training process: {pid}{r.train_process_state}, restarts {r.train_process_restarts}")
        if r.local_group:
            rank = str(r.local_group_rank) if r.local_group_rank >= 0 else "-"
            # The training processes of the group, of every daemon with the label (daemon/groupspan.py).
            print(f"{r.run_id}: local group {r.local_group}  processes {r.local_group_size}  first rank here {rank}")
            if r.local_group_reason:
                print(f"{r.run_id}: local group decision: {r.local_group_reason}")
        if not math.isnan(r.dear_overlap_ratio):
            print(f"{r.run_id}: DeAR in the local group: {r.dear_overlap_ratio:.0%} of its communication hidden")
        if r.average_every_auto:
            why = r.average_every_reason or "no decision yet"
            print(f"{r.run_id}: average_every=auto: H={r.average_every} ({why})")
        if len(r.last_round_group) > 1:
            # Peer IDs share their first characters ("12D3KooW..."); the last ones tell them apart.
            mates = ", ".join("…" + p[-8:] for p in r.last_round_group[1:])
            print(f"{r.run_id}: group of round {r.last_round}: this daemon, {mates}")
        if not math.isnan(r.param_divergence):
            print(
                f"{r.run_id}: parameter divergence {r.param_divergence:.4g} (largest pair of peers at step {r.param_divergence_step})"
            )
        if r.error:
            print(f"{r.run_id}: {'training failed: ' if r.train_state == 'FAILED' else ''}{r.error}")
    return 0


def _cmd_peers(args) -> int:
    with _client(args) as c:
        runs = [args.run] if args.run else [r.run_id for r in c.status().runs]
        replies = [c.list_peers(run_id) for run_id in runs]
    if args.json:
        _print_json(
            {
                r.run_id: [
                    {
                        "peer_id": p.peer_id,
                        "maddrs": list(p.maddrs),
                        "last_seen_seconds": round(p.last_seen_seconds, 2),
                        "version": p.version,
                        "role": p.role,
                        "delegated_lanes": p.delegated_lanes,
                    }
                    for p in r.peers
                ]
                for r in replies
            }
        )
        return 0
    rows = [
        (r.run_id, p.peer_id, p.role, p.version, f"{p.last_seen_seconds:.1f} s", p.maddrs[0] if p.maddrs else "")
        for r in replies
        for p in r.peers
    ]
    _table(("RUN", "PEER", "ROLE", "VERSION", "SEEN", "ADDRESS"), rows, empty="no peers")
    return 0


def _cmd_join(args) -> int:
    secret_file = str(Path(args.run_secret_file).absolute()) if args.run_secret_file else ""
    bad = [s for s in args.settings if "=" not in s]
    if bad:
        return _fail(2, f"--set {bad[0]!r} is not KEY=VALUE")
    settings = dict(s.split("=", 1) for s in args.settings)
    try:
        with _client(args) as c:
            joined = c.join(args.run_id, secret_file, args.task, settings).joined
            run = next((r for r in c.status().runs if r.run_id == args.run_id), None)
    except grpc.RpcError as e:
        return _refused(e, f"cannot join {args.run_id}")
    if run is not None and not run.task:
        print(
            f"peerd: warning: run {args.run_id!r} has no manifest and no --task was given: joined for discovery "
            "only, nothing to train (a mistyped run ID, or a run not created yet? --task creates it)",
            file=sys.stderr,
        )
    if args.json:
        _print_json({"run_id": args.run_id, "joined": joined})
    else:
        print(f"joined {args.run_id}" if joined else f"already in {args.run_id}")
    return 0


def _cmd_leave(args) -> int:
    try:
        with _client(args) as c:
            was_in = args.run_id in {r.run_id for r in c.status().runs}
            c.leave(args.run_id)  # leaving a run the daemon is not in succeeds and changes nothing
    except grpc.RpcError as e:
        return _refused(e, f"cannot leave {args.run_id}")
    if args.json:
        _print_json({"run_id": args.run_id, "left": was_in})
    else:
        print(f"left {args.run_id}" if was_in else f"not in {args.run_id}")
    return 0


def _refused(e: grpc.RpcError, what: str) -> int:
    """A join or leave the daemon refused, in its words (no gRPC code names): exit 2 when the request
    is at fault (bad run ID or secret, a run it cannot train), 1 when the daemon cannot do it now (not
    READY, or at its --max-runs). No answer at all is main()'s to report."""
    code, details = e.code(), e.details() or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and "not READY" not in details:
        raise e
    at_fault = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
    return _fail(2 if code in at_fault else 1, f"{what}: {details}")


def _cmd_stop(args) -> int:
    with _client(args) as c:
        pid = c.status().pid
        c.shutdown()
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:  # another user's daemon: we cannot watch it, trust the RPC
            break
        time.sleep(0.1)
    else:
        return _fail(1, f"daemon (pid {pid}) still running after {args.wait:.0f} s")
    if args.json:
        _print_json({"stopped": True, "pid": pid})
    else:
        print(f"stopped (pid {pid})")
    return 0


def _cmd_health(args) -> int:
    with _client(args) as c:
        status = c.health()
        try:  # which runs it trains, and how: a FAILED one is why a READY daemon is NOT_SERVING
            runs = [r for r in c.status().runs if r.task]
        except grpc.RpcError:  # stopping: the health answer is the one that counts
            runs = []
    if args.json:
        by_run = {r.run_id: {"train_state": r.train_state, "error": r.error} for r in runs}
        _print_json({"status": status, "runs": by_run})
    else:
        print(status)
        for r in runs:
            print(f"run {r.run_id}: {r.train_state}{': ' + r.error if r.error else ''}")
    return 0 if status == "SERVING" else 1


# ---- peerd export (issue 16; reads the data dir's files, talks to no daemon) ---------------------------


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="bytes per outer step, round time and compute fraction of each payload",
        description="Numbers to plan a run with: for the model's parameter count, a step time and a link, "
        "each payload's bytes per outer step (what one member sends), the round's duration, the compute "
        "fraction at H steps per phase, and the smallest H whose phase hides the round. The round's "
        "duration is a model fitted to the lab's bench.round_cost: fixed "
        f"{plan_mod.FIXED_S} s + {plan_mod.FIXED_RTTS} RTTs + 2(g-1)/g of the payload at the link's rate; "
        "loss and slower peers make real rounds longer (docs/benchmarks.md). With --run RUN_ID, the local "
        "daemon gives what it measured of that run: the parameter count, the step time of its training "
        "process, the run's H and overlap, and the last round's group size (a flag given overrides each), "
        "and the plan ends with the run's measured round duration against the model's for its payload. "
        "The link (--mbit, --rtt-ms) is always by hand: the daemon shows no link figures per peer.",
    )
    p.add_argument(
        "--run", metavar="RUN_ID", help="take the inputs not given from the local daemon's figures of this run"
    )
    _daemon_options(p)
    p.add_argument("--params", type=float, help="the model's parameter count (e.g. 1e9); with --run, the daemon's")
    p.add_argument("--step-seconds", type=float, help="seconds one inner step takes; with --run, the daemon's mean")
    p.add_argument("--mbit", type=float, required=True, help="each peer's link rate, Mbit/s (by hand, also with --run)")
    p.add_argument("--rtt-ms", type=float, help=f"round-trip time between peers (default {plan_mod.DEFAULT_RTT_MS:g})")
    p.add_argument(
        "--every",
        type=int,
        help=f"H: inner steps per phase (default: the run's with --run, else {plan_mod.DEFAULT_EVERY}, the run default)",
    )
    p.add_argument(
        "--group",
        type=int,
        help=f"members of a round's group (default: the run's last round's with --run, else {plan_mod.DEFAULT_GROUP})",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        help="a round runs while the next phase computes; --no-overlap: phases wait for their round "
        "(default: the run's with --run, else on)",
    )
    p.add_argument(
        "--density",
        type=float,
        help="arctopk's share of rows a round sends (default: the run's with --run, else "
        f"{plan_mod.arctopk.DENSITY:g}, the run default)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON line per payload instead of the table; with --run, then one line of the inputs and rounds",
    )
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    if args.params is not None and not (math.isfinite(args.params) and args.params == int(args.params)):
        return _fail(2, f"--params must be a whole number, not {args.params}")
    try:
        run = _run_figures(args) if args.run else None
        given = plan_mod.inputs(
            params=int(args.params) if args.params is not None else None,
            step_seconds=args.step_seconds,
            mbit=args.mbit,
            rtt_ms=args.rtt_ms,
            every=args.every,
            group=args.group,
            overlap=args.overlap,
            run=run,
        )
        density = args.density if args.density is not None else (run and run.density) or plan_mod.arctopk.DENSITY
        plans = plan_mod.plan(
            given.params,
            given.step_seconds,
            given.mbit,
            given.rtt_ms,
            given.every,
            given.group,
            given.overlap,
            density,
        )
    except ValueError as e:  # an input missing or out of range, or a run the daemon is not in
        return _fail(2, str(e))
    measured = plan_mod.compare(run, given) if run is not None else None
    if args.json:
        for p in plans:
            print(json.dumps(dataclasses.asdict(p)))
        if run is not None:
            inputs = {k: v for k, v in dataclasses.asdict(given).items() if k != "from_daemon"}
            line = {"run_id": run.run_id, "inputs": inputs, "from_daemon": list(given.from_daemon)}
            if measured is not None:
                line |= {
                    "payload": measured.payload,
                    "round_s_measured": None if math.isnan(measured.measured_s) else round(measured.measured_s, 3),
                    "round_s_model": measured.model_s,
                }
            print(json.dumps(line))
        return 0
    if run is not None:
        print(plan_mod.header(given, run))
    print(plan_mod.table(plans, given.every, given.overlap, density))
    if measured is not None:
        print(plan_mod.comparison_line(measured, given, run.algorithm))
    return 0


def _run_figures(args) -> plan_mod.RunFigures:
    """The local daemon's figures of run args.run. Raises ValueError where the daemon is not in the
    run; no daemon answering (grpc.RpcError) is main()'s to report."""
    with _client(args) as c:
        runs = c.status().runs
    r = next((r for r in runs if r.run_id == args.run), None)
    if r is None:
        joined = ", ".join(r.run_id for r in runs) or "none"
        raise ValueError(f"the daemon is not in run {args.run!r} (its runs: {joined})")
    return plan_mod.RunFigures(
        run_id=r.run_id,
        parameters=r.parameters,
        step_seconds=r.step_seconds,
        average_every=r.average_every,
        group_size=r.group_size,
        round_seconds=r.round_seconds,
        payload=r.payload,
        overlap=r.overlap,
        algorithm=r.algorithm,
        density=r.density,
    )


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's trained weights to a file torch.load(weights_only=True) reads",
        description="Write the weights of RUN_ID, from its newest checkpoint in the data dir (or --step's), to "
        "OUT as a plain state_dict (a dict of tensor name to tensor, torch.save): torch.load(OUT, "
        "weights_only=True) reads it and, for a task's run, the task's model.load_state_dict(..., strict=True) "
        "loads it. Under DiLoCo (the default algorithm) the weights are the outer parameters θ, the model "
        "every member of a completed round shares, with the model's buffers (a task's training process keeps "
        "them with its optimizer's state); under averaging.algorithm=state, the model as the daemon held it; "
        "for a run trained by your own script, θ by your model's parameter names (no buffers). Reads files "
        "only: the daemon may be running or stopped. A checkpoint that does not verify is skipped for the "
        "next newest, with a warning.",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument(
        "--out", required=True, type=Path, metavar="OUT", help="file to write, e.g. model.pt (replaced atomically)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=client_defaults()[0],
        help="data dir of the daemon that trained the run [PEERD_DATA_DIR]",
    )
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint of this global step (default: the newest)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from peerd.daemon.export import ExportError, export  # imports torch: only for this command

    try:
        r = export(args.data_dir, args.run_id, args.out, args.step)
    except ExportError as e:
        return _fail(2, str(e))
    for warning in r.warnings:
        print(f"peerd: warning: {warning}", file=sys.stderr)
    if args.json:
        _print_json(
            {
                "path": str(r.path),
                "run_id": args.run_id,
                "step": r.step,
                "parameters": r.parameters,
                "kind": r.kind.value,
                "checkpoint": str(r.checkpoint),
                "warnings": list(r.warnings),
            }
        )
        return 0
    what = {"diloco": "θ, DiLoCo's outer parameters", "state": "the model", "script": "θ, by the script's layout"}
    print(f"wrote {r.path}: run {args.run_id} at step {r.step}, {r.parameters:,} parameters ({what[r.kind.value]})")
    return 0


# ---- peerd lab (issue 4; daemon/lab/, imported only when used) ----------------------------------------


def _add_lab(sub) -> None:
    p = sub.add_parser(
        "lab",
        help="network lab: real daemons in network namespaces, shaped links, faults (docs/lab.md)",
        description="Build hosts as Linux network namespaces on one machine, run a real daemon in each, "
        "shape their links and play a scenario of faults (root; docs/lab.md).",
    )
    lab = p.add_subparsers(dest="lab_command", required=True, metavar="LAB_COMMAND", parser_class=_Parser)
    r = lab.add_parser(
        "run", help="run a scenario and print its report", description="Run SCENARIO.toml and print its report."
    )
    r.add_argument("scenario", metavar="SCENARIO.toml")
    r.add_argument("--json", dest="json_out", metavar="OUT", help="also write the report as JSON to OUT (- for stdout)")
    r.add_argument("--logs", metavar="DIR", help="copy every daemon's log to DIR before the lab is removed")
    r.set_defaults(func=lambda a: _lab().run_command(a.scenario, a.json_out, a.logs))
    c = lab.add_parser(
        "clean",
        help="remove what crashed labs left behind",
        description="Remove the namespaces, links, "
        "nftables tables, processes and work dirs of labs whose `peerd lab` process is gone.",
    )
    c.add_argument("--force", action="store_true", help="also remove labs whose process still runs")
    c.set_defaults(func=lambda a: _lab().clean_command(a.force))


def _lab():
    from peerd.daemon.lab import cli

    return cli


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], empty: str) -> None:
    print("\n".join(columns(header, rows)) if rows else empty)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="peerd",
        description="peerd: a fault-tolerant, decentralized training daemon. "
        "`peerd start` runs a daemon; `peerd export` writes a run's weights from its checkpoints; the other "
        "commands talk to a running daemon.",
    )
    parser.add_argument("--version", action="version", version=f"peerd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    _add_start(sub)
    parent = _client_parent()
    p = sub.add_parser(
        "status",
        parents=[parent],
        help="what the daemon is doing",
        description="Show the daemon's state, identity, addresses and runs.",
    )
    p.set_defaults(func=_cmd_status)
    p = sub.add_parser(
        "peers",
        parents=[parent],
        help="list the live peers of the daemon's runs",
        description="List the live peers of one run, or of every run the daemon is in.",
    )
    p.add_argument("--run", help="only this run")
    p.set_defaults(func=_cmd_peers)
    p = sub.add_parser(
        "join",
        parents=[parent],
        help="join a run",
        description="Make the daemon join a run: announce itself and track the run's peers.",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument(
        "--run-secret-file", help="file holding the run's secret (read by the daemon; give a path it can read)"
    )
    p.add_argument("--task", default="", help="task of the run, if this join creates it (e.g. digits-mlp)")
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="hyper-parameter or averaging.SETTING of a new run (repeatable)",
    )
    p.set_defaults(func=_cmd_join)
    p = sub.add_parser(
        "leave",
        parents=[parent],
        help="leave a run",
        description="Make the daemon leave a run; its peers drop it at once.",
    )
    p.add_argument("run_id", metavar="RUN_ID")
    p.set_defaults(func=_cmd_leave)
    p = sub.add_parser(
        "stop",
        parents=[parent],
        help="drain and stop the daemon",
        description="Ask the daemon to drain and exit, and wait until it has.",
    )
    p.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the process to exit (default 30)")
    p.set_defaults(func=_cmd_stop)
    p = sub.add_parser(
        "health",
        parents=[parent],
        help="exit 0 if the daemon is SERVING",
        description="Query the standard gRPC health service; exit 0 only when the daemon is READY and "
        "no run it trains has FAILED. Prints the status, then each trained run's state.",
    )
    p.set_defaults(func=_cmd_health)
    _add_export(sub)
    _add_plan(sub)
    _add_lab(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit: a reader that left fails this flush within the try
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # another pipe's: a failure to report
        # stdout's reader left (`peerd plan --json | head -1`): end quietly, with the status of a command
        # killed by SIGPIPE. stdout points at /dev/null, so that Python's flush at exit has nothing to fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has closed it (poll says POLLERR or POLLHUP)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or stdout without a file descriptor
        return False


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except grpc.RpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and args.func is not _cmd_start:
            where = getattr(args, "control", None) or control_address(args.data_dir)
            return _fail(1, f"no daemon answering at {where} ({code.name}); is `peerd start` running?")
        return _fail(
            2
            if code
            in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
            else 1,
            f"{code.name}: {e.details()}",
        )
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
