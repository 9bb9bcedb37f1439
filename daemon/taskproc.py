"""A built-in or plug-in task trained in a process of its own, as a client of the public API
(peerd.torch.Optimizer): the training process DESIGN.md ("Processes") asks the daemon to start and
supervise for `--task` runs.

    python -m peerd.daemon.taskproc --run R --task digits-mlp --daemon DATA_DIR [--set lr=0.01] [--max-steps N]

A daemon starts it for its `--task` runs (daemon/taskchild.py), with the run's hyper-parameters
and seed; started by hand, it attaches like any script (a script's run, created by this attach or
joined with the model's layout). The task's model, data, loss and inner optimizer are here; every H
steps the run's outer step is the daemon's (with --state-vector, a state run's round on the
parameters and the inner optimizer's state); the run's parameters θ are evaluated every
`--eval-every` run steps (at a phase's end, through Optimizer.run_parameters) and reported to the
daemon (ReportEval); the inner optimizer's state and the model's buffers are saved next to the
daemon's checkpoints (`--state`), so that a restarted process resumes them.

    python -m peerd.daemon.taskproc --preload

imports torch and what training needs, then reads the other arguments from stdin (one JSON list):
a daemon starts its first child so while it starts itself (daemon/supervisor.py, Preloaded).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import traceback
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m peerd.daemon.taskproc", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--task", required=True, help="an installed task (peerd tasks)")
    p.add_argument("--daemon", required=True, type=Path, help="the daemon's --data-dir")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a task hyper-parameter")
    p.add_argument("--average-every", type=int, default=50, help="H of a run this process creates")
    p.add_argument("--max-steps", type=int, default=0, help="stop at this run step (0: never)")
    p.add_argument("--eval-every", type=int, default=50, help="run steps between two evaluations")
    p.add_argument("--checkpoint-every", type=int, default=100, help="run steps between two saves of --state")
    p.add_argument("--state", type=Path, default=None, help="the inner optimizer's state file (resumed if present)")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="the model's initialization (a run this process creates)")
    p.add_argument("--rank", type=int, default=0, help="this process among --group-size (its own data stream)")
    p.add_argument("--group-size", type=int, default=None, help="processes the daemon starts for the run together")
    p.add_argument(
        "--dear",
        action="store_true",
        help="in a local group, the gradients' all-reduce under DeAR (docs/dear.md; the daemon's train.dear)",
    )
    p.add_argument(
        "--state-vector",
        action="store_true",
        help="the run averages the state (averaging.algorithm=state): hand over the inner optimizer's state too",
    )
    return p.parse_args(argv)


def save_state(opt, path: Path, identity: dict, model: torch.nn.Module) -> None:
    """opt.state_dict() and the model's buffers (BatchNorm's running statistics: not parameters, so
    neither averaged nor in the daemon's checkpoints; `peerd export` takes them from here), with the
    identity of the run's model (load_state checks it), written atomically (a crash leaves the
    previous file)."""
    partial = path.with_name(path.name + ".partial")
    buffers = {name: b.detach().cpu() for name, b in model.named_buffers()}
    torch.save({**opt.state_dict(), "buffers": buffers, "identity": identity}, partial)
    os.replace(partial, path)


def load_state(opt, path: Path, identity: dict, model: torch.nn.Module) -> None:
    """Resume the inner optimizer from `path`, if it was saved for this identity (run, task,
    hyper-parameters, model layout: the daemon's checkpoints'). A run ID reused for another model
    (its manifest deleted) passes the old model's file over, as the daemon passes over its
    checkpoints: torch's load_state_dict checks only the number of parameters, and Adam's moments
    of other shapes failed the first step, every restart."""
    from peerd.daemon.checkpoint import mismatch

    saved = torch.load(path, weights_only=False)
    if why := mismatch(identity, saved.get("identity", identity)):  # a file without one: an older release's
        logger.warning("run %s: %s not loaded: %s; the inner optimizer starts anew", opt.run, path, why)
        return
    run_step = opt.run_step
    opt.load_state_dict(saved)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved.get("buffers", {}):
                b.copy_(saved["buffers"][name])
    # The run's step is the daemon's, whose checkpoint may be older than this file (a torn newest one).
    opt.run_step = run_step
    logger.info("run %s: inner optimizer resumed from %s", opt.run, path)


def train(args: argparse.Namespace) -> int:
    import peerd.torch
    from peerd.daemon.checkpoint import identity_of
    from peerd.daemon.joining import hparams_from_text, seed_from
    from peerd.daemon.tasks import get_task

    torch.set_num_threads(args.torch_threads)
    task = get_task(args.task)
    hparams = hparams_from_text(task, dict(kv.split("=", 1) for kv in args.set))
    model, inner = task.build(hparams, args.seed)
    opt = peerd.torch.Optimizer(
        inner,
        run=args.run,
        daemon=args.daemon,
        model=model,
        settings={"average_every": args.average_every},
        state_vector=args.state_vector,
        group_size=args.group_size,
        dear=args.dear,
    )
    text = {k: str(v) for k, v in hparams.to_dict().items()}  # as the manifest writes them
    identity = identity_of(args.run, task.name, text, model)
    if args.state is not None and args.state.exists():
        load_state(opt, args.state, identity, model)
    # Each daemon its own stream of samples, a new one after a restart; each
    # process of a local group (--rank) its own.
    rank = [str(args.rank)] if args.rank else []
    data = task.data(hparams, seed_from(args.run, str(args.daemon.resolve()), str(opt.run_step), *rank))
    evaluated = saved = phase_step = opt.run_step
    reported = False  # an evaluation in status from this process (a run resumed at --max-steps has none yet)
    try:
        while not args.max_steps or opt.run_step < args.max_steps:
            batch = next(data)
            model.train()
            loss = task.loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step(samples=batch.samples, loss=loss)
            if opt.run_step == phase_step:  # within a phase: the model holds this process's own progress
                continue
            phase_step = (
                opt.run_step
            )  # a phase ended: evaluate, save (a local group's first process on this daemon: they are one model)
            if opt.run_step - evaluated >= args.eval_every and opt.local_leader:
                report(task, hparams, model, opt)
                evaluated, reported = opt.run_step, True
            if args.state is not None and opt.run_step - saved >= args.checkpoint_every and opt.local_leader:
                save_state(opt, args.state, identity, model)
                saved = opt.run_step
        if (evaluated != opt.run_step or not reported) and opt.local_leader:
            report(task, hparams, model, opt)
        if args.state is not None and opt.local_leader:
            save_state(opt, args.state, identity, model)
    except SystemExit:  # SIGTERM (main): the daemon stops the run; its thread would checkpoint too
        if args.state is not None and opt.local_leader:
            save_state(opt, args.state, identity, model)
        raise
    finally:
        opt.close()
    return 0


def report(task, hparams, model: torch.nn.Module, opt) -> None:
    """Evaluate the run's parameters θ (with overlap the model holds θ plus this process's progress
    since the latest round landed)."""
    with opt.run_parameters():
        result = task.evaluate(model, hparams)
    loss = result.loss if math.isfinite(result.loss) else math.nan
    opt.report_eval(result.metric, result.score, higher_is_better=result.higher_is_better, loss=loss)
    logger.info("run %s: step %d: %s %.4f", opt.run, opt.run_step, result.metric, result.score)


def main(argv: list[str] | None = None) -> int:
    from peerd.daemon.supervisor import PARENT_ENV, PRELOAD_FLAG, die_with_parent

    die_with_parent()  # started by a daemon (daemon/supervisor.py): it goes when the daemon goes
    # The supervisor's stop: leave through `finally` (Detach: the daemon checkpoints at once).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if os.environ.get(PARENT_ENV):
        # A terminal's Ctrl-C or hang-up reaches the daemon's whole process group: they are the
        # daemon's, which stops its child with SIGTERM (the child saves its state). As a
        # KeyboardInterrupt the child left without saving it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    if argv == [PRELOAD_FLAG]:  # started while the daemon starts (supervisor.Preloaded): the rest comes on stdin
        import torch._dynamo  # noqa: F401  (the inner optimizer's first call imports it: 1 s of CPU)

        import peerd.daemon.checkpoint  # noqa: F401  (what train() imports)
        import peerd.daemon.joining  # noqa: F401
        import peerd.daemon.tasks  # noqa: F401
        import peerd.torch  # noqa: F401

        line = sys.stdin.readline()
        if not line:  # not needed after all
            return 0
        argv = json.loads(line)
    return train(parse_args(argv))


def exit_now(code: int) -> None:
    """Exit without the interpreter's finalization: with torch loaded, tearing the modules down took
    2 to 5 s on a loaded machine after the process had detached and saved its state, and a daemon
    stopping waits for its child (Ctrl-C within 2 s, tests/test_stopping.py), as a failed child's
    restart does. Nothing is left to do then but flush the output."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: the daemon is gone
            pass
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as e:  # SIGTERM (128 + 15), or argparse's exit (its message printed already)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # what the interpreter would print and exit 1 with
        traceback.print_exc()
        status = 1
    exit_now(status)
