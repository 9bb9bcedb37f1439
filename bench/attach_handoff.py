"""The cost of attaching a training script to its daemon: one outer step's hand-over of the
parameters through shared memory, against plain in-process copies of the same bytes.

    python -m bench.attach_handoff [--quick] [--params 25_000_000] [--repeats 10] [--threads N]

One hand-over is three copies of the whole float32 vector (4·params bytes each); it was four
before OuterLoop read the shared vector in place (the daemon's read, reported as 0 since):

    script  write   the model's tensors -> the shared vector    peerd.torch.Optimizer._write
    daemon  read    (none: OuterLoop.end_phase reads y in place; to_flat before)
    daemon  write   the daemon's buffer -> the shared vector    from_flat in OuterLoop.end_phase
    script  read    the shared vector -> the model's tensors    peerd.torch.Optimizer._read

(a) The script's side: a real `peerd start --run` (peerd.daemon.procs.LocalDaemon, loopback, a temp data
dir) and a real attached peerd.torch.Optimizer over a GPT-2-shaped model (148 tensors) with a
parameter-free inner SGD and average_every 1, so that every step() ends a phase; _write, _read and
the EndPhase call are timed around the real calls. EndPhase's latency (the daemon alone in its
run) includes the outer step's arithmetic, DiLoCo's cost, and is reported apart.
(b) The daemon's side: its process does not expose its copies, so the real OuterLoop runs over a
real SharedVector in a second process, as daemon/attached.py builds them, with to_flat and
from_flat timed where OuterLoop.end_phase calls them; its round is "alone in the run" and its
payload fp32 (no int8 codec: not timed, only faster).
The baseline is `Tensor.copy_` of the same bytes between two preallocated, already written
tensors, in the process that makes the copy it stands for: two in this process between the phases
of (a), two in (b)'s between its phases, so that each pair sees the same moment of a shared
machine. --threads sets this process's torch threads (the script's copies and their baseline;
torch's default otherwise); the daemon and the second process keep torch's default, as a daemon does.

Results are JSON lines (bench/common.py); a full run appends them to
bench/results/attach_handoff.jsonl (--quick does not). The daemon is killed, not stopped, on exit
(a stop would write the run's checkpoint, three vectors, for nothing); its shared file, the second
process's and the temp dir are removed whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import multiprocessing
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import peerd.torch
from bench.common import append_results, emit, progress, result
from peerd.daemon.flat import from_flat, to_flat
from peerd.daemon.procs import LocalDaemon

BENCH = "attach_handoff"
RUN_ID = "handoff"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / f"{BENCH}.jsonl"
TARGET = 2.0  # ours / baseline, for the whole hand-over
COPIES = 4  # whole-vector copies in one hand-over (above)
DAEMON_SIDE_TIMEOUT = 600.0  # seconds for (b): a 100M-value OuterLoop's setup and phases on a loaded machine
ATTACH_TIMEOUT = 120.0  # seconds for the Optimizer's attach (the run is new here: nothing to download)
SHM = Path("/dev/shm")


# ---- measuring ---------------------------------------------------------------------------------


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextlib.contextmanager
def timing(into: list[tuple[float, int]]):
    """Appends (seconds, minor page faults of this process) of the block."""
    f0, t0 = _minor_faults(), time.perf_counter()
    try:
        yield
    finally:
        into.append((time.perf_counter() - t0, _minor_faults() - f0))


def gpt_like(params: int) -> dict[str, tuple[int, ...]]:
    """Shapes of a GPT-2-like model of about `params` values: 12 blocks (attention, MLP, LayerNorms,
    biases) of a width d chosen for the size, position embeddings, and the token embedding taking
    what is left (at 100M: d = 768, the shapes of GPT-2 small with a smaller vocabulary)."""
    layers = 12
    d = max(64, int(math.sqrt(0.85 * params / (12 * layers))) // 64 * 64)
    block = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.c_attn.weight": (3 * d, d),
        "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d),
        "attn.c_proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (4 * d, d),
        "mlp.c_fc.bias": (4 * d,),
        "mlp.c_proj.weight": (d, 4 * d),
        "mlp.c_proj.bias": (d,),
    }
    shapes = {f"h.{i}.{k}": s for i in range(layers) for k, s in block.items()}
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,), "wpe.weight": (1024, d)}
    vocab = max(1, (params - sum(math.prod(s) for s in shapes.values())) // d)
    return {"wte.weight": (vocab, d), **shapes}


def build_model(params: int) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, shape in gpt_like(params).items():
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.empty(shape).normal_(0.0, 0.02)))
    return model


class TimedOptimizer(peerd.torch.Optimizer):
    """peerd.torch.Optimizer with its two copies and its EndPhase call timed around the real ones."""

    def __init__(self, *args, **kwargs):
        self.timings: dict[str, list[tuple[float, int]]] = {"write": [], "read": [], "end_phase": []}
        super().__init__(*args, **kwargs)
        end_phase = self._attachment.end_phase

        def timed_end_phase(*a, **kw):
            with timing(self.timings["end_phase"]):
                return end_phase(*a, **kw)

        self._attachment.end_phase = timed_end_phase

    def _write(self) -> None:
        with timing(self.timings["write"]):
            super()._write()

    def _read(self) -> None:
        with timing(self.timings["read"]):
            super()._read()


# ---- (b) the daemon's side, in a second process ------------------------------------------------


def daemon_side(params: int, phases: int, directory: str, conn) -> None:
    """In a process of its own: the real SharedVector and OuterLoop as daemon/attached.py builds
    them, `phases` phase ends; sends back the timings of to_flat (read) and from_flat (write) inside
    end_phase, of end_phase itself, of two plain copies of the same bytes before each phase (this
    process's baseline), and this process's peak RSS."""
    import peerd.daemon.diloco as diloco
    from peerd.daemon.attached import SharedVector
    from peerd.peers.averaging import RoundResult

    timings: dict[str, list[tuple[float, int]]] = {"read": [], "write": [], "end_phase": [], "plain": []}

    def timed(fn, key):
        def call(*a, **kw):
            with timing(timings[key]):
                return fn(*a, **kw)

        return call

    # The seam: OuterLoop.end_phase calls these module-level names once each.
    diloco.to_flat, diloco.from_flat = timed(diloco.to_flat, "read"), timed(diloco.from_flat, "write")

    async def alone(vector, weight, round_t, payload):  # the round of a daemon alone in its run
        return [RoundResult(round_t, 1, None, "alone in the run")]

    numel = sum(math.prod(s) for s in gpt_like(params).values())
    shared = SharedVector(Path(directory), numel)
    loop = None
    try:
        conn.send(("path", str(shared.path)))
        loop = diloco.OuterLoop([shared.tensor], diloco.OuterSettings(payload="fp32"), alone, "bench")
        for key in timings:  # the constructor's own to_flat is not a phase's
            timings[key].clear()
        a, b = torch.empty(numel), torch.ones(numel)
        a.copy_(b)
        for t in range(phases):
            plain_copies(a, b, timings["plain"])
            with timing(timings["end_phase"]):
                asyncio.run(loop.end_phase(t, 1.0))  # as the daemon awaits it on its loop
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        conn.send(("done", timings, peak))
    finally:
        if loop is not None:
            loop.close()
        shared.close()


def run_daemon_side(params: int, phases: int, timeout: float = DAEMON_SIDE_TIMEOUT) -> tuple[dict, float, int]:
    """(b): returns the second process's timings, peak RSS (MiB) and pid. Bounded by `timeout`; the
    process and its shared file are removed whatever happens."""
    context = multiprocessing.get_context("spawn")  # a fresh process, as the daemon's
    ours, theirs = context.Pipe()
    directory = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    proc = context.Process(target=daemon_side, args=(params, phases, str(directory), theirs), name="bench-daemon-side")
    proc.start()
    theirs.close()
    path, done = None, False
    deadline = time.monotonic() + timeout
    try:
        while True:
            if not ours.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the daemon's side did not finish within {timeout:.0f} s")
            message = ours.recv()
            if message[0] == "path":
                path = Path(message[1])
            else:
                done = True
                return message[1], message[2], proc.pid
    except EOFError:
        raise RuntimeError(f"the daemon's side exited with {proc.exitcode} before reporting") from None
    finally:
        proc.join(30 if done else 0)  # done: it closes its OuterLoop and removes its file
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if path is not None:
            path.unlink(missing_ok=True)


# ---- (a) the script's side, attached to a real daemon ------------------------------------------


class Attached:
    """A real daemon and a TimedOptimizer attached to it; close() kills the one and removes its file."""

    def __init__(self, base: Path, params: int):
        self.daemon = LocalDaemon(base / "daemon", ["--run", RUN_ID, "--checkpoint-every", "100000000"])
        self.opt: TimedOptimizer | None = None
        self.model = build_model(params)
        try:
            self.daemon.start()
            inner = torch.optim.SGD(self.model.parameters(), lr=1e-3)  # no gradients: its step changes nothing
            self.opt = TimedOptimizer(
                inner,
                run=RUN_ID,
                daemon=self.daemon.data_dir,
                model=self.model,
                settings={"average_every": 1},
                attach_timeout=ATTACH_TIMEOUT,
                reconnect_timeout=5.0,
            )
        except BaseException:
            self.close()
            raise

    def phase(self) -> None:
        self.opt.step()  # average_every 1: _write, EndPhase, _read

    def daemon_peak_mib(self) -> float:
        status = Path(f"/proc/{self.daemon.pid}/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024

    def close(self) -> None:
        pid = self.daemon.pid if self.daemon.proc is not None else None
        self.daemon.kill_group()
        if self.opt is not None:
            self.opt.close()  # its Detach finds no daemon: answered at once
        if pid is not None:
            for path in SHM.glob(f"peerd-{pid}-*"):
                path.unlink(missing_ok=True)


# ---- the run -----------------------------------------------------------------------------------


def _median(pairs: list[tuple[float, int]]) -> float:
    """0 for a copy that no longer happens (the daemon reads the shared vector in place)."""
    return statistics.median(s for s, _ in pairs) if pairs else 0.0


def _faults(pairs: list[tuple[float, int]]) -> int:
    return int(statistics.median(f for _, f in pairs)) if pairs else 0


def plain_copies(a: torch.Tensor, b: torch.Tensor, into: list[tuple[float, int]]) -> None:
    """The baseline: two plain copies of the vector's bytes, a -> b -> a; one entry each."""
    for src, dst in ((a, b), (b, a)):
        with timing(into):
            dst.copy_(src)


def measure(args, base: Path) -> list[dict]:
    numel = sum(math.prod(s) for s in gpt_like(args.params).values())
    nbytes = 4 * numel
    gb = nbytes / 1e9
    common = {
        "params": numel,
        "bytes": nbytes,
        "tensors": len(gpt_like(args.params)),
        "repeats": args.repeats,
        "script_threads": torch.get_num_threads(),
    }

    progress(BENCH, f"(b) the daemon's side: OuterLoop over a SharedVector of {numel:,} values in a second process")
    daemon, daemon_peak, side_pid = run_daemon_side(args.params, args.repeats + 1)
    daemon = {k: v[1:] for k, v in daemon.items()}  # the first phase is a warm-up

    progress(BENCH, f"(a) the script's side: a real daemon, an attached Optimizer, {args.repeats} phases")
    plain: list[tuple[float, int]] = []
    first_plain: list[tuple[float, int]] = []
    # The script's copies tensor by tensor, into and out of a private buffer in this process: what
    # the 148 tensors cost apart from the shared memory.
    private: dict[str, list[tuple[float, int]]] = {"write": [], "read": []}
    attached = Attached(base, args.params)
    shared_file_pids = [side_pid, attached.daemon.pid]  # its shared files are named peerd-PID-*
    try:
        first_write = attached.opt.timings["write"][0]  # the attach's upload: the first touch of the mapping
        a, b = torch.empty(numel), torch.ones(numel)
        with timing(first_plain):  # the same in-process: a copy into a fresh tensor, its first touch
            a.copy_(b)
        attached.phase()  # a warm-up phase
        for t in attached.opt.timings.values():
            t.clear()
        params = list(attached.model.parameters())
        for _ in range(args.repeats):
            plain_copies(a, b, plain)
            with timing(private["write"]):
                to_flat(params, a)
            with timing(private["read"]):
                from_flat(a, params)
            attached.phase()
        timings = attached.opt.timings
        script_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        peak = attached.daemon_peak_mib()
        del a, b
    finally:
        attached.close()

    copy, daemon_copy = _median(plain), _median(daemon["plain"])
    records = []

    def line(metric: str, ours: float, faults: int, note: str, baseline: float = copy, **extra) -> None:
        records.append(
            result(
                BENCH,
                metric,
                round(ours, 5),
                round(baseline, 5),
                "s",
                **common,
                ours_gb_per_s=round(gb / ours, 2) if ours else None,  # None: a copy no longer made
                baseline_gb_per_s=round(gb / baseline, 2),
                ours_minor_faults=faults,
                note=note,
                **extra,
            )
        )

    line(
        "script_write_s",
        _median(timings["write"]),
        _faults(timings["write"]),
        "peerd.torch.Optimizer._write, model -> shared vector, per phase; baseline: one Tensor.copy_ of the same "
        "bytes; per_tensor_private_s: the same tensor-by-tensor copies into a private buffer (peerd.daemon.flat.to_flat)",
        per_tensor_private_s=round(_median(private["write"]), 5),
    )
    line(
        "daemon_read_s",
        _median(daemon["read"]),
        _faults(daemon["read"]),
        "OuterLoop.end_phase's to_flat, shared vector -> the daemon's buffer, in a second process; baseline: "
        "one Tensor.copy_ of the same bytes in that process, between its phases"
        + ("" if daemon["read"] else "; 0: no such copy, OuterLoop reads the shared vector in place"),
        daemon_copy,
    )
    line(
        "daemon_write_s",
        _median(daemon["write"]),
        _faults(daemon["write"]),
        "OuterLoop.end_phase's from_flat, the daemon's buffer -> shared vector, in a second process; baseline: "
        "as daemon_read_s",
        daemon_copy,
    )
    line(
        "script_read_s",
        _median(timings["read"]),
        _faults(timings["read"]),
        "peerd.torch.Optimizer._read, shared vector -> model, per phase; per_tensor_private_s: the same "
        "tensor-by-tensor copies from a private buffer (peerd.daemon.flat.from_flat)",
        per_tensor_private_s=round(_median(private["read"]), 5),
    )
    records.append(
        result(
            BENCH,
            "first_write_s",
            round(first_write[0], 5),
            round(first_plain[0][0], 5),
            "s",
            **common,
            ours_minor_faults=first_write[1],
            baseline_minor_faults=first_plain[0][1],
            note="once per attach: the upload's _write, the script's first touch of the mapping; "
            "baseline: a copy into a fresh, never-touched tensor",
        )
    )
    records.append(
        result(
            BENCH,
            "end_phase_s",
            round(_median(timings["end_phase"]), 4),
            None,
            "s",
            **common,
            daemon_outer_loop_end_phase_s=round(_median(daemon["end_phase"]), 4),
            daemon_peak_rss_mib=round(peak),
            daemon_side_peak_rss_mib=round(daemon_peak),
            script_peak_rss_mib=round(script_peak),
            note="the EndPhase call's latency, a daemon alone in its run: its two copies plus the outer "
            "step (pseudo-gradient, int8 error feedback, Nesterov, the state snapshot); "
            "daemon_outer_loop_end_phase_s: OuterLoop.end_phase alone, fp32, in (b)",
        )
    )
    ours = sum(_median(x) for x in (timings["write"], daemon["read"], daemon["write"], timings["read"]))
    copies = COPIES if daemon["read"] else COPIES - 1  # the daemon reads the shared vector in place now
    baseline = 2 * copy + (copies - 2) * daemon_copy  # a plain copy for each copy made
    records.append(
        result(
            BENCH,
            "outer_step_handoff_s",
            round(ours, 5),
            round(baseline, 5),
            "s",
            **common,
            copies=copies,
            ours_gb_per_s=round(copies * gb / ours, 2),
            baseline_gb_per_s=round(copies * gb / baseline, 2),
            target=TARGET,
            meets_target=ours / baseline <= TARGET,
            shared_file_pids=shared_file_pids,
            note="one hand-over, script -> daemon -> script: the sum of the copies' medians above (three "
            "since the daemon reads the shared vector in place, four before); baseline: the sum of their "
            "baselines, a Tensor.copy_ of the same bytes for each (two in this process, the rest in the "
            "daemon's side's)",
        )
    )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 1M-value vector, 3 phases: a smoke run")
    parser.add_argument(
        "--params",
        type=int,
        default=25_000_000,
        help="the model's size in float32 values (default 25M: about 2 GiB of memory at the peak; 100M: about 6.3 GiB)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="phases timed (after one warm-up)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads of the script's side (0: torch's default)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.params, args.repeats = 1_000_000, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def interrupt(signum, frame):  # so that the finally below runs and removes every process and file
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    base = Path(tempfile.mkdtemp(prefix="peerd-bench-"))
    try:
        records = measure(args, base)
    except KeyboardInterrupt:
        progress(BENCH, "interrupted; the daemon and the shared files are removed")
        return 130
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for r in records:
        emit(r)
    if not args.quick:
        append_results(RESULTS, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
