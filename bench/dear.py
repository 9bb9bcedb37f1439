"""Iteration time of DeAR against its baselines, on gloo or peerd's engine among processes on 127.0.0.1.

    python -m bench.dear [--quick] [--backend gloo|peerd] [--world 2] [--width 1024] [--depth 8] [--rounds 7] [--steps 8]
    python -m bench.dear --lab [--rate-mbit 400] ...     # root: in a network lab, over real rate-limited links

Every process trains the same MLP (`depth` square Linear layers of `width`, ReLU, MSE on fixed
random data, SGD with momentum) under each schedule of peers/dear in turn, in rounds (the order
rotates every round, so every mode sees the same machine at the same moments):
  dear            DeAR, buckets sized by the online tuner (1 MiB until it re-tunes after warm-up)
  after_backward  (a) backward, then one all-reduce of the whole gradient
  ddp25           (b) DDP-style: 25 MB buckets, each all-reduced from the backward hooks
  dear_nofusion   (c) DeAR with one parameter per bucket
  torch_ddp       torch's DistributedDataParallel (gloo's native all-reduce, 25 MB buckets): not a
                  mode of ours, the reference point for what gloo's own all-reduce costs
  compute_only    forward, backward, optimizer step, no communication      } bounds: one after the
  comm_only       reduce-scatter + all-gather of every gradient, no compute } other, or perfectly overlapped
All modes of ours use the same primitives, those of `--backend`: gloo (all-to-all + local sum, then
all-gather; peers/dear/gloo.py, the default) or peerd (the engine's reduce-scatter and all-gather,
peers/collective/halves.py through peers/dear/engine.py). With peerd, one more reference:
  comm_only_gloo  comm_only over gloo's primitives, so the engine's cost is compared in the same run
A mode's time per step is the slowest rank's mean over `steps` steps, the figure the median over
rounds. The batch is sized so that one step's compute about equals its communication: measured at
start (forward, backward and optimizer step of 64 samples, and one reduce-scatter + all-gather of
all gradients, with every rank doing the same at once), then batch = 64 x comm / compute, bounded
to [8, 4096].

Two runs, each in fresh processes. First over an *emulated link* (lines prefixed `emulated_link_`):
every op lasts at least its bytes on the wire divided by a rate at which one step's all-reduce
takes 5 times as long as on loopback (the batch then sized to match); the backend's thread sleeps
the rest, so most of the wire's time is off the CPU, as on a real network, though the bytes are still
copied over loopback (torch_ddp is left out: its traffic cannot be paced). Then plain loopback, nothing
emulated, whose last line (DeAR against (b)) is the headline: there the cores run both the compute
and all of the communication (kernel copies, the backend's threads, the local sums), so time hidden behind
compute is not free; the output says how many cores there were and how loaded, and puts DeAR's
time between the two bounds measured in the same rounds (compute_only + comm_only one after the
other, and their max). Every process is killed when the run ends or fails, and by the kernel if
this parent dies.

`--lab` (root; instead of the two runs above): one run in a network lab (daemon/lab/netns.py):
each rank runs in its own lab host (a network namespace on the lab's bridge), its veth limited to
`--rate-mbit` by a real tbf at both ends, and the group (gloo, or the engine) talks over those
links, not loopback (lines prefixed `lab_`; the last, DeAR against (b), is the headline). The batch
is sized from the measured communication over the shaped link as above, so compute about equals
communication. The wire's time is then really off the CPU (packets wait in tbf's queue), but the
TCP stack's copies, the backend's threads and the sums still run on the cores beside compute. The
lab is destroyed when the run ends or fails (`peerd lab clean` finds it after a SIGKILL).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import resource
import shutil
import signal
import statistics
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Sequence

from bench.common import emit, progress, result

BENCH = "dear"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CLONE_NEWNET = 0x40000000  # linux/sched.h
CALIBRATION_BATCH = 64
END_GRACE = 1.0  # seconds a rank that is not waited for may take to end once the waited-for ranks reported
INIT_TIMEOUT = 60.0  # seconds a group of ranks may take to connect (each op then gets its own op_timeout)
EMULATED_SLOWDOWN = 5  # the emulated link's all-reduce takes this many times loopback's
MODES = ("dear", "after_backward", "ddp25", "dear_nofusion", "torch_ddp", "compute_only", "comm_only")
BACKENDS = ("gloo", "peerd")
LAB_RATE_MBIT = 400.0  # --lab default: 33.6 MB of gradients take about 1.2 s per step over gloo (half the nominal rate: TCP through two tbfs)


# ---- a group of real processes on loopback (also used by tests/test_dear.py) ---------------------


def run_group(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float,
    op_timeout: float,
    wait_for: Iterable[int] | None = None,
    hosts: Sequence[Any] | None = None,
) -> list[tuple[str, Any]]:
    """Run target(rank, world, *args) in `world` spawned processes joined in a gloo group.

    The group binds to 127.0.0.1 only (GLOO_SOCKET_IFNAME=lo), rendezvous through a FileStore in a
    fresh temp dir; `op_timeout` is the group's timeout (what one collective op may take). With
    `hosts` (lab hosts of daemon/lab/netns.py, one per rank), rank r first enters hosts[r]'s network
    namespace and the group binds to its eth0 instead, so every byte between ranks crosses the lab's
    shaped links (`lab_hosts` below builds them); make_collective then listens on the host's address. Returns,
    once every rank in `wait_for` (default: all) reported or ended, per rank ("ok", value),
    ("error", traceback), ("exited", exit code) for a process that ended without reporting, or
    ("killed", None) for one still running END_GRACE seconds after that. Raises TimeoutError after `timeout` seconds.
    Every process is killed on return."""
    ctx = mp.get_context("spawn")
    scratch = tempfile.mkdtemp(prefix="dear-")
    pipes, procs = [], []
    try:
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_entry,
                name=f"dear-rank{rank}",
                daemon=True,
                args=(
                    target,
                    rank,
                    world,
                    f"{scratch}/store",
                    op_timeout,
                    args,
                    child,
                    hosts[rank].netns if hosts else None,
                ),
            )
            proc.start()
            child.close()
            pipes.append(parent)
            procs.append(proc)
        results: dict[int, tuple[str, Any]] = {}
        needed = set(range(world) if wait_for is None else wait_for)
        deadline = time.monotonic() + timeout
        while not needed <= set(results):
            waiting = [p for r, p in enumerate(pipes) if r not in results]
            ready = mp.connection.wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"ranks {sorted(needed - set(results))} did not report within {timeout:.0f} s")
            for pipe in ready:
                rank = pipes.index(pipe)
                try:
                    results[rank] = pipe.recv()
                except EOFError:
                    procs[rank].join(5.0)
                    results[rank] = ("exited", procs[rank].exitcode)
        for rank in set(range(world)) - set(results):  # one that ended as the others reported ended, not killed
            procs[rank].join(END_GRACE)
            if procs[rank].exitcode is not None:
                try:
                    results[rank] = pipes[rank].recv() if pipes[rank].poll() else ("exited", procs[rank].exitcode)
                except EOFError:
                    results[rank] = ("exited", procs[rank].exitcode)
        return [results.get(r, ("killed", None)) for r in range(world)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5.0)
        shutil.rmtree(scratch, ignore_errors=True)


def _entry(target, rank, world, store_path, op_timeout, args, conn, netns=None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the parent
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # bind to 127.0.0.1 only
    if netns is not None:  # before any thread or socket: both inherit the namespace of the thread that makes them
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
        os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the lab link, shaped at both ends
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # `world` processes share the machine's cores
    store = dist.FileStore(store_path, world)
    # Connecting the group may take longer than one op may on a loaded machine (a CI run's ranks
    # missed a 3 s init): it gets INIT_TIMEOUT, then the group's ops get `op_timeout` (a private
    # setter of the pinned torch; gloo's timeout is the group's, not an op's).
    init = timedelta(seconds=max(op_timeout, INIT_TIMEOUT))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=init)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=op_timeout))
    try:
        conn.send(("ok", target(rank, world, *args)))
    except BaseException:  # report it rather than leave the parent waiting for the timeout
        conn.send(("error", traceback.format_exc()))
    os._exit(0)  # skip destroy_process_group and atexit: a broken group may not tear down cleanly


def make_collective(backend: str, timeout: float, min_seconds: Callable[[int], float] | None = None):
    """This rank's DeAR collective, in a run_group process: gloo's, or peerd's engine (its members
    listen on 127.0.0.1, or on their lab host's eth0 address, ports from the OS, and learn each
    other's addresses over the gloo group)."""
    import torch.distributed as dist

    if backend == "gloo":
        from peerd.peers.dear.gloo import GlooCollective

        return GlooCollective(timeout=timeout, min_seconds=min_seconds)
    from peerd.peers.dear.engine import EngineCollective

    host = _eth0_address() if os.environ.get("GLOO_SOCKET_IFNAME") == "eth0" else "127.0.0.1"
    collective = EngineCollective(
        rank=dist.get_rank(), world=dist.get_world_size(), timeout=timeout, min_seconds=min_seconds, host=host
    )
    addresses: list[str | None] = [None] * collective.world
    dist.all_gather_object(addresses, collective.start())
    collective.join(addresses)
    return collective


def _eth0_address() -> str:
    """This namespace's eth0 IPv4 address (a lab host's)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", b"eth0"))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


@contextlib.contextmanager
def lab_hosts(world: int, rate_mbit: float) -> Iterator[Any]:
    """A network lab (daemon/lab/netns.py) of `world` hosts r0, r1, ... on one bridge, each link
    rate-limited to `rate_mbit` by tbf at both ends; yields the Network (`.hosts`, `.shape(name,
    LinkShape)`). Destroyed on exit however the block ends (processes in its namespaces killed
    first); a lab left by a SIGKILL of this process is removed by `peerd lab clean`."""
    from peerd.daemon.lab import netns

    problem = netns.environment_problem()
    if problem:
        raise SystemExit(f"--lab: {problem}")
    net = netns.Network()
    try:
        net.create()
        for r in range(world):
            net.add_host(f"r{r}", netns.LinkShape(rate_mbit=rate_mbit))
        yield net
    finally:
        net.destroy()


def reshape_all(net: Any, rate_mbit: float) -> None:
    """Every host's link to `rate_mbit` (both ends), through the lab's public API."""
    from peerd.daemon.lab import netns

    for name in list(net.hosts):
        net.shape(name, netns.LinkShape(rate_mbit=rate_mbit))


# ---- the benchmark (one process per rank) ----------------------------------------------------------


def _mlp(width: int, depth: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _median_time(fn, reps: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _bench_rank(
    rank: int,
    world: int,
    width: int,
    depth: int,
    rounds: int,
    steps: int,
    op_timeout: float,
    link: str,
    backend: str,
) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    from peerd.peers.dear import DeAR, DeARSettings, FusionTuner, Mode

    model = _mlp(width, depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    numel = sum(p.numel() for p in model.parameters())
    flat = torch.zeros(-(-numel // world) * world)
    wire_share = (world - 1) / world  # of a buffer's bytes, what each rank sends in one half of an all-reduce

    def batch(n: int):
        return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)

    def all_reduce() -> None:
        collective.wait(collective.all_gather(collective.reduce_scatter(flat)))

    def compute_step() -> None:
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # Calibration: a step's compute for 64 samples against one all-reduce of every gradient.
    x, y = batch(CALIBRATION_BATCH)
    compute_step()  # warm-up: the first step allocates
    compute = _slowest(_median_time(compute_step, 5))
    collective = make_collective(backend, op_timeout)
    comm = _slowest(_median_time(all_reduce, 3))
    rate = pace = None
    emulate = link == "emulated"
    if emulate:  # a link EMULATED_SLOWDOWN times slower than loopback: the copies' CPU is a small part of its time
        collective.close()
        comm *= EMULATED_SLOWDOWN
        rate = 2 * wire_share * flat.numel() * 4 / comm

        def pace(nbytes: int) -> float:
            return nbytes * wire_share / rate

        collective = make_collective(backend, op_timeout, pace)
    gloo = make_collective("gloo", op_timeout, pace) if backend != "gloo" else None
    size = torch.tensor([min(4096, max(8, round(CALIBRATION_BATCH * comm / compute)))])
    dist.broadcast(size, 0)  # every rank uses rank 0's figure
    x, y = batch(int(size))
    modes = tuple(m for m in MODES if not (emulate and m == "torch_ddp"))  # torch DDP's traffic cannot be paced
    modes += ("comm_only_gloo",) if gloo is not None else ()

    settings = {
        "dear": DeARSettings(bucket_bytes=1 << 20),
        "after_backward": DeARSettings(mode=Mode.AFTER_BACKWARD, bucket_bytes=math.inf),
        "ddp25": DeARSettings(mode=Mode.DDP, bucket_bytes=25e6),
        "dear_nofusion": DeARSettings(bucket_bytes=0),
    }
    ddp_model = nn.parallel.DistributedDataParallel(_mlp(width, depth), bucket_cap_mb=25)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-3, momentum=0.9)
    tuner = FusionTuner()  # shared by every DeAR block: the fit spans the whole run

    def ddp_step() -> None:
        F.mse_loss(ddp_model(x), y).backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad(set_to_none=True)

    references = {"torch_ddp": ddp_step, "compute_only": compute_step, "comm_only": all_reduce}
    if gloo is not None:
        references["comm_only_gloo"] = lambda: gloo.wait(gloo.all_gather(gloo.reduce_scatter(flat)))

    def run(mode: str, n: int) -> dict:
        dear = (
            DeAR(model, optimizer, collective, settings[mode], tuner=tuner if mode == "dear" else None)
            if mode in settings
            else None
        )
        cpu0, start = _cpu_seconds(), time.perf_counter()
        for _ in range(n):
            if dear is None:
                references[mode]()
            else:
                F.mse_loss(model(x), y).backward()
                dear.step()
        if dear is None:
            return {"seconds": (time.perf_counter() - start) / n, "cpu_s": (_cpu_seconds() - cpu0) / n}
        dear.flush()
        out = {"seconds": (time.perf_counter() - start) / n, "cpu_s": (_cpu_seconds() - cpu0) / n}
        dear.close()
        return {**out, "overlap": dear.overlap_ratio, "buckets": len(dear.plan.buckets)}

    for mode in modes:  # warm-up, and observations for the tuner
        dist.barrier()
        run(mode, 2)
    probe = DeAR(model, optimizer, collective, settings["dear"], tuner=tuner)
    retune = probe.retune()
    probe.close()
    settings["dear"] = DeARSettings(bucket_bytes=retune.bucket_bytes)
    samples: dict[str, list] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            dist.barrier()
            out = run(mode, steps)
            out["seconds"] = _slowest(out["seconds"])
            samples[mode].append(out)
    collective.close()
    if gloo is not None:
        gloo.close()
    return {
        "samples": samples,
        "batch": int(size),
        "link_bytes_per_second": rate,
        "params": sum(p.numel() for p in model.parameters()),
        "dear_bucket_bytes": retune.bucket_bytes,
        "dear_buckets": samples["dear"][-1]["buckets"],
        "retune": retune.reason,
    }


def _variant(args: argparse.Namespace, link: str) -> None:
    """One group of processes through every mode; prints its results, DeAR against (b) last.
    link: "loopback", "emulated" (ops paced by sleeping) or "lab" (each rank in a lab host, links
    rate-limited by tbf to args.rate_mbit)."""
    op_timeout = 120.0
    emulate = link == "emulated"
    load0, started = os.getloadavg()[0], time.monotonic()
    what = {
        "emulated": f"an emulated link {EMULATED_SLOWDOWN}x slower than loopback",
        "lab": f"lab hosts, links shaped to {args.rate_mbit:g} Mbit/s by tbf",
    }.get(link, "loopback")
    progress(
        BENCH,
        f"{what}, {args.backend}: {args.world} ranks, MLP {args.depth} x {args.width}, {args.rounds} rounds of {args.steps} steps per mode",
    )
    with lab_hosts(args.world, args.rate_mbit) if link == "lab" else contextlib.nullcontext() as net:
        reports = run_group(
            _bench_rank,
            args.world,
            args.width,
            args.depth,
            args.rounds,
            args.steps,
            op_timeout,
            link,
            args.backend,
            timeout=120 + args.rounds * 300,
            op_timeout=op_timeout,
            hosts=list(net.hosts.values()) if net else None,
        )
    for rank, (status, value) in enumerate(reports):
        if status != "ok":
            raise SystemExit(f"rank {rank}: {status}: {value}")
    report = reports[0][1]
    samples = report["samples"]
    median = {m: statistics.median(s["seconds"] for s in ss) for m, ss in samples.items()}
    cpu = {m: round(statistics.median(s["cpu_s"] for s in ss), 4) for m, ss in samples.items()}
    overlap = {
        m: round(statistics.median(s["overlap"] for s in ss), 3) for m, ss in samples.items() if "overlap" in ss[0]
    }
    compute, comm = median["compute_only"], median["comm_only"]
    serial, perfect = compute + comm, max(compute, comm)
    share = (serial - median["dear"]) / (serial - perfect)
    where = (
        f"an emulated link of {report['link_bytes_per_second'] / 1e6:.0f} MB/s per rank (each op lasts at least its bytes on the "
        "wire / that rate, the backend sleeping the rest: the wire's time is off the CPU, but the bytes are still copied "
        "over loopback by the cores)"
        if emulate
        else f"a network lab: each rank in its own network namespace, its veth rate-limited to {args.rate_mbit:g} Mbit/s "
        "by tbf at both ends (real TCP over the lab bridge; GSO capped at one MTU, as the lab does)"
        if link == "lab"
        else "loopback"
    )
    common = {
        "link": link,
        **({"rate_mbit": args.rate_mbit} if link == "lab" else {}),
        "backend": args.backend,
        "n": args.world,
        "params": report["params"],
        "batch": report["batch"],
        "cores": os.cpu_count(),
        "load_1min_at_start": round(load0, 2),
        "load_1min_at_end": round(os.getloadavg()[0], 2),
        "step_s": {m: round(v, 4) for m, v in median.items()},
        "step_s_rounds": {m: [round(s["seconds"], 4) for s in ss] for m, ss in samples.items()},
        "cpu_s_per_step_rank0": cpu,
        "overlap_ratio": overlap,
        "bounds_s": {"serial": round(serial, 4), "perfect_overlap": round(perfect, 4)},
        "dear_share_of_possible_gain": round(share, 3),
        "dear_bucket_bytes": report["dear_bucket_bytes"],
        "dear_buckets": report["dear_buckets"],
        "retune": report["retune"],
        "seconds": round(time.monotonic() - started, 1),
        "note": (
            f"{where}; {os.cpu_count()} cores run {args.world} ranks' compute and all of their communication (kernel copies, "
            f"the {args.backend} backend's threads, local sums). Compute alone took {compute:.3f} s per step, communication alone {comm:.3f} s: "
            f"{serial:.3f} s one after the other, {perfect:.3f} s if perfectly overlapped. DeAR took {median['dear']:.3f} s, "
            f"{share:.0%} of that possible gain, while hiding {overlap['dear']:.0%} of its communication: hidden "
            "communication still takes the cores from compute. Other jobs shared the machine (load above)."
        ),
    }
    prefix = {"emulated": "emulated_link_", "lab": "lab_"}.get(link, "")
    emit(result(BENCH, f"{prefix}compute_vs_comm_seconds_per_step", round(compute, 4), round(comm, 4), "s", **common))
    if "comm_only_gloo" in median:
        emit(
            result(
                BENCH,
                f"{prefix}comm_seconds_peerd_vs_gloo",
                round(comm, 4),
                round(median["comm_only_gloo"], 4),
                "s",
                **common,
            )
        )

    def speed(mode: str) -> float:
        return round(1.0 / median[mode], 3)

    for baseline, label in (("after_backward", "a"), ("dear_nofusion", "c"), ("torch_ddp", "native")):
        if baseline in median:
            emit(
                result(
                    BENCH,
                    f"{prefix}steps_per_second_vs_{baseline}",
                    speed("dear"),
                    speed(baseline),
                    "steps/s",
                    baseline_label=label,
                    **common,
                )
            )
    emit(
        result(
            BENCH,
            f"{prefix}steps_per_second_vs_ddp25",
            speed("dear"),
            speed("ddp25"),
            "steps/s",
            baseline_label="b",
            target=1.2,
            **common,
        )
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few rounds: a smoke run")
    parser.add_argument("--world", type=int, default=2, help="processes (ranks) on this machine")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo", help="the collective under every mode of ours")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8, help="steps per mode per round")
    parser.add_argument("--skip-emulated", action="store_true", help="only the loopback run")
    parser.add_argument(
        "--lab", action="store_true", help="only a run in a network lab (root): ranks in namespaces, tbf-shaped links"
    )
    parser.add_argument(
        "--rate-mbit", type=float, default=LAB_RATE_MBIT, help="--lab: each host's link rate (both directions)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.rounds, args.steps = 256, 4, 2, 3
    if args.lab:
        _variant(args, "lab")  # its last line, DeAR against (b) over the shaped links, is the headline
        return
    if not args.skip_emulated:
        _variant(args, "emulated")
    _variant(args, "loopback")  # the headline, DeAR against (b) on plain loopback, comes last


if __name__ == "__main__":
    main()
