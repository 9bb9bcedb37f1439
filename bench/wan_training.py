"""Training over a WAN in the network lab: DiLoCo (the default) against state averaging and against
the same hosts training alone, with the same wall-clock budget.

    sudo .venv/bin/python -m bench.wan_training [--quick] [--hosts 3] [--seconds 150] [--rate 100]
                                                [--rtt-ms 50] [--loss 1] [--every 50] [--task charlm]
                                                [--extra udp10,throttled] [--engine loss-tolerant]
                                                [--curve [SECONDS]] [--plot FILE.png]

Each setup is one `peerd lab` scenario (daemon/lab/runner.py: hosts in network namespaces on one
bridge, every link limited to --rate Mbit/s, --loss % of the packets delivered to a host dropped,
--rtt-ms added by the userspace delay line), run for --seconds of training:

  (a) diloco    the default algorithm: H = --every inner steps, int8 pseudo-gradients, overlapped rounds
  (b) state     today's averaging of the whole state (parameters and Adam moments) every 10 steps
  (c) alone     the same hosts, each its own run (the lab's `isolated`: no peers): the compute ceiling
                under the same CPU sharing, since all hosts share this machine's cores. A state run
                (its lone rounds change nothing) whose child hands its state over every ALONE_EVERY
                steps: the daemon's checkpoint at the stop holds the state of the last hand-over,
                at most ALONE_EVERY steps behind (a DiLoCo run's would hold θ, which alone an outer
                step moves)
  extras:       udp10: (a) with the UDP engine and 10 % loss; sync: (a) with averaging.overlap=false;
                h_from_start: (a) without the short first phases (averaging.first_phase=0);
                local_groups: (a) on half the hosts, each training in two processes (--train-processes 2:
                a local group, one WAN peer; docs/your-loop.md): the same processes as (a), half the peers;
                throttled: (a) with host h0 held to 0.35 of a core by a cgroup quota, about half
                the others' speed (the straggler budget; needs cgroup v1's cpu controller)

Per host: global and local steps, compute fraction (peerd_train_compute_fraction), MB the engine
sent per 1,000 samples, and the eval loss of the host's final checkpoint (written when the lab
stops it; under DiLoCo the checkpoint's model is the outer parameters θ), evaluated here. Also one
process trained on as many samples as (a)'s hosts took together (batch = hosts x batch). JSON lines;
the last is the headline: utilization, (a)'s steps per host over (c)'s. Needs root (namespaces).
Exits 1, naming them, where a setup's host took no step or its checkpoint evaluates no better than
the untrained model (tests/test_lab.py runs --quick --hosts 2: a regression fails CI).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import json

import psutil

from bench.common import emit, progress as _progress, result
from peerd.daemon.lab.runner import Lab
from peerd.daemon.lab.scenario import parse

BENCH = "wan_training"
ALONE_EVERY = 10  # (c)'s steps between two hand-overs of its state: what its final checkpoint may lag


def progress(message: str) -> None:
    _progress(BENCH, message)


def line(record: dict) -> None:
    print(json.dumps(record), flush=True)


class TrainingLab(Lab):
    """A lab run that also evaluates each host's last checkpoint before the lab is removed, and with
    `curve_every` > 0 the newest checkpoint of every host every `curve_every` s while it trains
    (the model the daemon holds: θ after its latest round, or the thread's model at its latest
    checkpoint; checkpoint_every is then one phase)."""

    evaluations: dict[str, float]
    curve_every: float = 0.0
    curve: list[dict]

    def run(self):
        self.curve, stop = [], threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), name="curve", daemon=True)
        if self.curve_every:
            sampler.start()
        try:
            return super().run()
        finally:
            stop.set()
            if sampler.is_alive():
                sampler.join(60)

    def _sample(self, stop: threading.Event) -> None:
        """At t = k x curve_every after training began (a tick whose evaluations ran late is skipped)."""
        while not stop.wait(0.2) and not self.t0:
            pass  # not training yet
        tick = 1
        while not stop.wait(max(self.t0 + tick * self.curve_every - time.monotonic(), 0.0)):
            t = time.monotonic() - self.t0
            tick = int(t // self.curve_every) + 1
            for name in list(self.daemons):
                try:
                    got = self._evaluate_latest(name)
                except Exception as e:  # a checkpoint replaced or the lab removed meanwhile: the next tick
                    progress(f"  curve: {name}: {type(e).__name__}: {e}")
                    continue
                if got is not None:
                    step, score = got
                    self.curve.append({"t": round(t, 1), "host": name, "step": step, "eval": round(score, 4)})

    def _evaluate_latest(self, name: str) -> tuple[int, float] | None:
        from peerd.daemon.checkpoint import CheckpointStore
        from peerd.daemon.export import checkpoint_weights
        from peerd.daemon.joining import hparams_from_text
        from peerd.daemon.tasks import get_task

        task = get_task(self.scenario.run.task)
        hparams = hparams_from_text(task, {k: v for k, v in self.scenario.run.settings.items() if "." not in k})
        ckpt = CheckpointStore(self._data_dir(name) / "runs" / self.scenario.run.id / "checkpoints").load_latest()
        if ckpt is None:
            return None
        model, _ = task.build(hparams, 0)
        # θ by name: the thread's checkpoints hold the model and θ, a child's θ cut by the layout.
        loaded = model.load_state_dict(checkpoint_weights(ckpt)[1], strict=False)
        if missing := [n for n, _ in model.named_parameters() if n in loaded.missing_keys]:
            raise RuntimeError(f"{name}'s checkpoint lacks parameters {missing}")
        return ckpt.step, task.evaluate(model, hparams).score

    def extras(self) -> dict:
        """More of the setup's result line, once the run is over: none here."""
        return {}

    def _check_checkpoints(self) -> None:
        super()._check_checkpoints()
        self.evaluations = {}
        for name in self.daemons:
            got = self._evaluate_latest(name)
            if got is not None:
                self.evaluations[name] = got[1]


def scenario(
    name: str,
    args,
    settings: dict,
    *,
    loss: float | None = None,
    daemon_args: tuple = (),
    hosts: int = 0,
    isolated: bool = False,
) -> dict:
    """A lab scenario of `hosts` hosts (`args.hosts` unless given); with --curve every phase's end
    checkpoints (what the curve evaluates), else only the stop. `isolated`: each host trains alone."""
    hosts = [{"name": f"h{i}"} for i in range(hosts or args.hosts)]
    data = {
        "name": name,
        "duration": args.seconds,
        "congestion_control": "bbr",
        "run": {
            "id": name,
            "task": args.task,
            "settings": {k: str(v) for k, v in settings.items()},
            "checkpoint_every": args.every if args.curve else 100_000,
            "args": ["--eval-every", "100000", "--progress-interval", "0", *daemon_args],
            "isolated": isolated,
        },
        "link": {"rate_mbit": args.rate, "loss_pct": args.loss if loss is None else loss, "rtt_ms": args.rtt_ms},
        "host": hosts,
    }
    return data


def _tasks(pid: int) -> list[int]:
    """Every thread of the process and of its descendants (the daemon, its p2pd)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in processes:
        try:
            out += [t.id for t in p.threads()]
        except psutil.NoSuchProcess:  # gone meanwhile
            pass
    return out


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (this lab machine's kernel mounts v1)
THROTTLE_CPUS = 0.35  # of one core: the other two hosts share the rest of this 2-core machine, ~0.8 each


def _cpu_quota_group() -> Path:
    """A new cgroup (v1 cpu controller) holding its threads to THROTTLE_CPUS of one core."""
    if not (CPU_CGROUP / "tasks").exists():
        raise SystemExit(f"the throttled setup needs cgroup v1's cpu controller at {CPU_CGROUP}")
    group = CPU_CGROUP / f"peerd-throttle-{os.getpid()}"
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text(str(int(THROTTLE_CPUS * 100000)))
    return group


def _remove_group(group: Path) -> None:
    for tid in (group / "tasks").read_text().split():  # back to the root group, or rmdir fails
        try:
            (CPU_CGROUP / "tasks").write_text(tid)
        except OSError:  # gone meanwhile
            pass
    try:
        group.rmdir()
    except OSError as e:
        progress(f"  could not remove {group}: {e}")


def _throttle(lab: "TrainingLab", slow: str, group: Path, stop: threading.Event) -> None:
    """Every thread of host `slow` (its daemon and p2pd) goes into `group`, whose CPU quota is
    THROTTLE_CPUS of one core: it computes at about half the speed of the others. Re-applied every
    second (threads come and go). Busy-looping neighbours on its core, tried first, did not slow
    it: the scheduler shares a core by threads, and a daemon has more runnable threads than two."""
    while not stop.wait(1.0):
        d = lab.daemons.get(slow)
        if d is None or d.proc is None:
            continue
        for tid in _tasks(d.proc.pid):
            try:
                (group / "tasks").write_text(str(tid))
            except OSError:  # gone meanwhile
                pass


def run_setup(
    name: str,
    data: dict,
    throttle: str = "",
    logs: Path | None = None,
    curve: float = 0.0,
    lab_class: type[TrainingLab] = TrainingLab,
) -> dict:
    """One setup's result line; a `lab_class` adds what its `extras()` returns."""
    progress(f"{name}: {data['duration']:.0f} s of training on {len(data['host'])} hosts")
    lab = lab_class(parse(data, name), progress=lambda m: progress(f"  {m}"), logs=logs / name if logs else None)
    lab.curve_every = curve
    stop, pinning, group = threading.Event(), None, None
    if throttle:
        group = _cpu_quota_group()
        pinning = threading.Thread(target=_throttle, args=(lab, throttle, group, stop), name="throttle", daemon=True)
        pinning.start()
    try:
        record = lab.run()
    finally:
        stop.set()
        if pinning is not None:
            pinning.join(10)
            _remove_group(group)
    hosts = {}
    for host in (h["name"] for h in data["host"]):
        last = [s for s in record.samples if s.host == host]
        if not last:
            continue
        s = last[-1]
        samples = s.metrics.get("samples", 0.0)
        hosts[host] = {
            "steps": s.step,
            "local_steps": s.local_step,
            "compute_fraction": round(s.metrics.get("compute_fraction", math.nan), 3),
            "mb_per_1000_samples": round(s.metrics.get("sent_bytes", 0.0) / 1e6 / max(samples, 1) * 1000, 4),
            "samples": samples,
            "eval": round(lab.evaluations.get(host, math.nan), 4),
            "rounds_completed": s.metrics.get("rounds_completed", 0.0),
            "rounds_partial": s.metrics.get("rounds_partial", 0.0),  # the loss-tolerant engine's usual outcome
            "samples_averaged": s.metrics.get("samples_averaged", 0.0),
        }
    out = {
        "bench": BENCH,
        "setup": name,
        "hosts": hosts,
        "settings": data["run"]["settings"],
        "link": data["link"],
        "duration": round(record.duration, 1),
        "exit_codes": record.exit_codes,
        **({"curve": lab.curve} if curve else {}),
        **lab.extras(),
    }
    line(out)
    return out


def plot(lines: dict, args) -> None:
    """Eval against time, one line per host of every setup (matplotlib: the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for k, (name, record) in enumerate(lines.items()):
        for j, host in enumerate(sorted(record["hosts"])):
            points = [(c["t"], c["eval"]) for c in record.get("curve", []) if c["host"] == host]
            if points:
                ts, evals = zip(*points)
                ax.plot(ts, evals, color=f"C{k}", alpha=0.8, marker=".", label=name if j == 0 else None)
    ax.set_xlabel("seconds of training (wall clock)")
    ax.set_ylabel(f"{args.task} eval of the model each daemon holds (lower is better)")
    ax.set_title(
        f"{args.hosts} hosts, {args.rate:g} Mbit/s, {args.rtt_ms:g} ms RTT, {args.loss:g} % loss, H = {args.every}"
        + (f", (a) over {args.engine}" if args.engine else "")
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    progress(f"plot: {args.plot}")


def untrained(lines: dict, task_name: str) -> list[str]:
    """What went wrong in the setups' results: a host missing, or one that took no step, or whose
    checkpoint is not better than the untrained model (the run's seed) on the task's eval."""
    from peerd.daemon.tasks import get_task

    task = get_task(task_name)
    hparams = task.parse_hparams({})
    model, _ = task.build(hparams, 0)
    first = task.evaluate(model, hparams)
    out = []
    for name, record in lines.items():
        if not record["hosts"]:
            out.append(f"{name}: no host reported")
        for host, h in record["hosts"].items():
            score = h["eval"]
            better = score > first.score if first.higher_is_better else score < first.score
            if not h["local_steps"] or math.isnan(score) or not better:
                out.append(f"{name} {host}: {h['local_steps']} steps, eval {score} (untrained: {first.score:.4f})")
    return out


def _mean(line: dict, key: str) -> float:
    values = [h[key] for h in line["hosts"].values() if not (isinstance(h[key], float) and math.isnan(h[key]))]
    return statistics.fmean(values) if values else math.nan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wan_training", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="15 s per setup, (a) and (c) only: a smoke run")
    p.add_argument(
        "--curve",
        type=float,
        nargs="?",
        const=15.0,
        default=0.0,
        help="evaluate every host's newest checkpoint every SECONDS (15) while it trains; each phase's end checkpoints",
    )
    p.add_argument("--plot", type=Path, default=None, help="with --curve: eval against time of every setup, a PNG")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s per link, both directions")
    p.add_argument("--rtt-ms", type=float, default=50.0)
    p.add_argument("--loss", type=float, default=1.0, help="%% of packets delivered to a host that are dropped")
    p.add_argument("--every", type=int, default=50, help="DiLoCo's H: inner steps per outer step")
    p.add_argument("--task", default="charlm")
    p.add_argument("--engine", default="", help="(a)'s averaging.engine, e.g. loss-tolerant (default: the run's)")
    p.add_argument(
        "--extra",
        default="",
        help="comma-separated: udp10, sync, h_from_start, local_groups, throttled",
    )
    p.add_argument("--logs", type=Path, default=None, help="keep each setup's daemon logs under this directory")
    p.add_argument("--skip", default="", help="comma-separated setups not to run: b_state")
    p.add_argument(
        "--single",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train one process on as many samples as (a)'s hosts together",
    )
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.wan_training needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.quick:
        args.seconds, args.single = 15.0, False
    diloco = {"averaging.algorithm": "diloco", "averaging.average_every": args.every}
    if args.engine:
        diloco["averaging.engine"] = args.engine
    setups = [
        ("a_diloco", scenario("a_diloco", args, diloco)),
        (
            "c_alone",
            scenario(
                "c_alone",
                args,
                {"averaging.algorithm": "state", "averaging.average_every": ALONE_EVERY, "averaging.first_phase": 0},
                isolated=True,
            ),
        ),
    ]
    if not args.quick:
        setups.insert(
            1, ("b_state", scenario("b_state", args, {"averaging.algorithm": "state", "averaging.average_every": 10}))
        )
    extras = [e for e in args.extra.split(",") if e]
    for e in extras:
        if e == "udp10":
            setups.append(
                (
                    "a_diloco_udp10",
                    scenario("a_diloco_udp10", args, {**diloco, "averaging.engine": "loss-tolerant"}, loss=10.0),
                )
            )
        elif e == "h_from_start":
            setups.append(
                (
                    "a_diloco_h_from_start",
                    scenario("a_diloco_h_from_start", args, {**diloco, "averaging.first_phase": 0}),
                )
            )
        elif e == "local_groups":
            groups = scenario(
                "a_diloco_local_groups",
                args,
                diloco,
                daemon_args=("--train-processes", "2"),
                hosts=max(args.hosts // 2, 1),
            )
            setups.append(("a_diloco_local_groups", groups))
        elif e == "sync":
            setups.append(("a_diloco_sync", scenario("a_diloco_sync", args, {**diloco, "averaging.overlap": "false"})))
        elif e == "throttled":
            setups.append(("a_diloco_throttled", scenario("a_diloco_throttled", args, diloco)))
        else:
            p.error(f"unknown extra {e!r}")
    skip = {x for x in args.skip.split(",") if x}
    lines = {}
    for name, data in [(n, d) for n, d in setups if n not in skip]:
        throttle = "h0" if name.endswith("throttled") else ""
        lines[name] = run_setup(name, data, throttle=throttle, logs=args.logs, curve=args.curve)
    if args.plot is not None and args.curve:
        plot(lines, args)
    if failed := untrained(lines, args.task):
        for why in failed:
            progress(f"FAILED: {why}")
        return 1
    if "a_diloco" not in lines or "c_alone" not in lines:
        return 0  # no headline without both (a) and (c)
    a, c = lines["a_diloco"], lines["c_alone"]
    if args.single:
        from peerd.daemon.tasks import get_task, train_single_process

        task = get_task(args.task)
        h = task.parse_hparams({})
        steps = round(_mean(a, "local_steps"))
        progress(f"one process: {steps} steps of {args.hosts} x {h.batch_size} samples")
        single = train_single_process(task, h, steps=steps, batch_size=args.hosts * h.batch_size, seed=0)
        line(
            {
                "bench": BENCH,
                "setup": "single_process",
                "steps": steps,
                "batch": args.hosts * h.batch_size,
                "eval": round(single.score, 4),
                "metric": single.metric,
            }
        )
    summary = {
        "bench": BENCH,
        "setup": "summary",
        "eval_a": round(_mean(a, "eval"), 4),
        "eval_c_best": min(h["eval"] for h in c["hosts"].values()),
        "compute_fraction_a": round(_mean(a, "compute_fraction"), 3),
    }
    if "b_state" in lines:
        b = lines["b_state"]
        summary["bytes_per_sample_b_over_a"] = round(
            _mean(b, "mb_per_1000_samples") / _mean(a, "mb_per_1000_samples"), 1
        )
        summary["eval_b"] = round(_mean(b, "eval"), 4)
    line(summary)
    ours, base = _mean(a, "steps"), _mean(c, "steps")
    emit(result(BENCH, "utilization: steps per host, diloco over alone", ours, base, "steps"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
