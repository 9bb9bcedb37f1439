"""DiLoCo with and without overlap, simulated in one process with the real outer loop: final model quality.

    python -m bench.diloco_sim                                   # sync and overlap at momentum 0.9: about 3 minutes
    python -m bench.diloco_sim --setups sync,overlap,alone,single --momentum 0.9,0.5
    python -m bench.diloco_sim --setups overlap --land-after 50  # rounds land a whole phase late
    python -m bench.diloco_sim --quick                           # 200 steps, H = 25: a smoke run
    python -m bench.diloco_sim --setups alone,overlap --first-phase 0,5 --curve-every 25 --workers 4
                                                                 # phases of 5, 10, 20, 40, then H: θ at any moment

N workers (default 3) each train their own copy of a `charlm` model (daemon/tasks/charlm.py, built
with the same seed, each drawing its own batches) and each hold a real `peerd.daemon.diloco.OuterLoop`,
driven as a daemon drives it (daemon/attached.py): every H steps `end_phase(round_t, samples,
repair)`, a repair round every `--repair-every` outer steps; at the end the round in flight lands
and each model takes θ (`finish`). The network is
emulated by the `average` callback: a barrier where the N members of the round meet and each
payload becomes the exact weighted mean (float32, the members in a fixed order), then, for int8
and fp16 payloads, the codec's encoding of that mean (the owner's encoding of the result, as the
engines send it). Every round completes with every member: no loss, no stragglers, no timeouts.
With overlap each loop's round runs on the loop's own thread, and lands `--land-after` inner steps
into the next phase (`landed()` then: how long the round took, in steps; a daemon lands a
round as soon as it ends). The workers take each step in turn on one torch thread, so a run is
deterministic (same seeds, same numbers).

Setups: `sync` (overlap off), `overlap` (on), each at every `--momentum`; `alone`: one worker, no
rounds; `single`: one process trained on the run's total samples (steps of N x batch). The score is
bits per character on charlm's held-out text (lower is better) of θ, the run's model, on every
worker after `finish()` (the same on all of them). With overlap, also θ had the last round been
cut short by a stop: dropped (`eval_last_round_dropped`, what a daemon does) or taken as each
member's own outer step (`eval_last_round_own_p`, what daemons did before). JSON lines on stdout,
one per setup with its curve (θ of worker 0 every `--eval-every` outer steps), the last the
headline: overlap's final eval (ours) against sync's (baseline) at the first momentum listed.
With `--curve-every N`, θ is also evaluated every N step times of wall time (`anytime`): what a
user of the run holds at any moment, the phase's progress not yet in it; and worker 0's inner
parameters (`anytime_inner`: θ plus that worker's progress since the round in flight began, the
model that peer holds). Wall time counts inner
steps plus compute's waits for rounds (a round takes `--land-after` step times: without overlap
compute waits for each; with overlap a phase shorter than the round in flight waits for its end);
alone's model is sampled every N steps. `--first-phase N` makes the phases N, 2N, 4N, ... inner
steps up to H; with several values and `alone`, the headline is the first sample time from which
θ stays at or below alone's model, the last value listed (ours) against the first (baseline).
`--payload arctopk` sends each round as ARC-Top-K, a run's `averaging.payload = "arctopk"`
(peers/collective/arctopk.py): the members' sketches averaged, then `--density` of the rows in
`--values` format (a run's: int8); what a member did not send stays in its parameters (daemon/diloco.py);
repair rounds stay dense.
Nothing of the WAN is emulated: this measures the algorithm, not the daemons
(bench/wan_training.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import time

import torch

from bench.common import emit, progress, result
from peerd.daemon.diloco import OuterLoop, OuterSettings, outer_step
from peerd.daemon.flat import from_flat
from peerd.daemon.tasks.charlm import CharLM, CharLMHparams
from peerd.peers.averaging import RoundResult
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.collective import arctopk, codec
from peerd.peers.phases import Phases

BENCH = "diloco_sim"
INIT_SEED = 1  # every worker builds the same model, as every peer of a run does (the run's seed), plus --seed
PEER_SEED = 100  # worker i draws its batches from PEER_SEED + 10 x --seed + i
ROUND_TIMEOUT = 600.0  # seconds a member waits at the barrier: a bug, not a slow round


class Rounds:
    """The emulated network: the i-th member's `average` waits for the other members of the same
    round, then every payload becomes their weighted mean (and the codec's encoding of it)."""

    def __init__(self, n: int):
        self.n = n
        self.entries: dict[int, tuple[torch.Tensor, float, int, str]] = {}
        self.own: dict[int, torch.Tensor] = {}  # each member's payload of the latest round, before the mean
        self.met: asyncio.Event | None = None  # set when the round's last member arrives

    def _mean(self) -> None:
        entries = [self.entries[i] for i in sorted(self.entries)]
        if len({(t, fmt) for _, _, t, fmt in entries}) != 1:
            raise RuntimeError(f"members in different rounds: {[(t, fmt) for _, _, t, fmt in entries]}")
        total = sum(w for _, w, _, _ in entries)
        mean = torch.zeros_like(entries[0][0])
        for vector, weight, _, _ in entries:
            mean.add_(vector, alpha=weight / total)
        fmt = entries[0][3]
        if fmt != "fp32":
            codec.Codec(fmt).roundtrip(mean.numpy())
        for vector, _, _, _ in entries:
            vector.copy_(mean)
        self.entries.clear()

    def member(self, i: int):
        async def average(vector: torch.Tensor, weight: float, round_t: int, fmt: str) -> list:
            if not self.entries:
                self.met = asyncio.Event()
            met = self.met
            self.entries[i] = (vector, weight, round_t, fmt)
            self.own[i] = vector.clone()
            if len(self.entries) == self.n:
                self._mean()
                met.set()
            await asyncio.wait_for(met.wait(), ROUND_TIMEOUT)
            return [RoundResult(round_t, self.n, None, "emulated: every member meets")]

        return average


class ArcTopK:
    """`--payload arctopk`: the round as a daemon's ArcTopKRound runs it (peers/collective/arctopk.py),
    emulated: the members' sketches averaged (float32, exact), the k rows every member selects from
    the mean, their values as `--values` delivers them averaged (and the owner's encoding of the
    mean), the vector left with the mean at those rows and zeros elsewhere. Each member's OuterLoop
    (payload arctopk) keeps what it did not send in its parameters, as a daemon's does. Repair rounds
    average θ densely."""

    def __init__(self, n: int, numel: int, args):
        self.n, self.sketches, self.values = n, Rounds(n), Rounds(n)
        self.v = arctopk.sketch_matrix(args.seed)
        self.k, self.fmt = arctopk.keep(numel, args.density), args.values
        self.own: dict[int, torch.Tensor] = {}  # each member's payload of the latest round, before the round

    def member(self, i: int):
        to_sketches, to_values = self.sketches.member(i), self.values.member(i)

        async def average(vector: torch.Tensor, weight: float, round_t: int, fmt: str) -> list:
            if fmt != arctopk.PAYLOAD:
                return await to_values(vector, weight, round_t, fmt)
            self.own[i] = vector.clone()
            x = vector.numpy()
            mine = torch.from_numpy(arctopk.sketch(x, self.v).reshape(-1))
            await to_sketches(mine, weight, round_t, "fp32")
            rows = arctopk.select(mine.numpy().reshape(-1, arctopk.RANK), self.k)
            values = arctopk.gather(x, rows)
            codec.Codec(self.fmt).roundtrip(values)
            await to_values(torch.from_numpy(values), weight, round_t, self.fmt)
            arctopk.scatter(values, rows, x)
            done = Outcome(Status.COMPLETED, "emulated", 1, (), (1.0,), 0, 0, 0.0, b"")
            return [RoundResult(round_t, self.n, done, "emulated", selected=arctopk.Selected(rows, self.fmt))]

        return average


async def together(calls: list) -> list:
    """Run the members' coroutines at once (each may wait for the round's other members), as N daemons would."""
    return await asyncio.gather(*(call() for call in calls))


def hparams_of(args) -> CharLMHparams:
    return CharLMHparams(
        d_model=args.d_model,
        n_layers=args.n_layers,
        context=args.context,
        batch_size=args.batch,
        corpus_bytes=args.corpus_bytes,
    )


def score(task: CharLM, model: torch.nn.Module, hparams: CharLMHparams) -> float:
    return round(task.evaluate(model, hparams).score, 4)


def phase_lengths(every: int, first: int, steps: int) -> list[int]:
    """The phases of `steps` inner steps, as a run's (peers/phases.py): `first`, 2·first, 4·first, …
    steps, each at most `every` (H), then H; a tail shorter than its phase has no round. first 0:
    every phase is H."""
    phases = Phases(every, first)
    return [phases.length(phases.end(r)) for r in range(phases.round_of(steps - 1) + 1)]


class Anytime:
    """θ's eval every `every` step times of wall time (inner steps plus compute's waits for rounds):
    what a user of the run holds at any moment, not only at a phase's end. every 0: none."""

    def __init__(self, every: int, task, hparams, model, view):
        self.every, self.task, self.hparams, self.model, self.view = every, task, hparams, model, view
        self.next, self.points = every, []

    def at(self, wall: int) -> None:
        while self.every and wall >= self.next:
            with self.view():
                self.points.append((self.next, score(self.task, self.model, self.hparams)))
            self.next += self.every


def simulate(args, overlap: bool, momentum: float, first_phase: int = 0) -> dict:
    """N workers with real OuterLoops for args.steps steps; θ's eval along the way and at the end."""
    return asyncio.run(_simulate(args, overlap, momentum, first_phase))


async def _simulate(args, overlap: bool, momentum: float, first_phase: int) -> dict:
    """simulate() on an event loop, where the OuterLoops' rounds run as on a daemon's."""
    task, hparams = CharLM(), hparams_of(args)
    built = [task.build(hparams, INIT_SEED + args.seed) for _ in range(args.workers)]
    data = [task.data(hparams, PEER_SEED + 10 * args.seed + i) for i in range(args.workers)]
    numel = sum(p.numel() for p in built[0][0].parameters())
    rounds = ArcTopK(args.workers, numel, args) if args.payload == "arctopk" else Rounds(args.workers)
    settings = OuterSettings(
        lr=args.outer_lr, momentum=momentum, payload=args.payload, overlap=overlap, repair_every=args.repair_every
    )
    loops = [OuterLoop(list(m.parameters()), settings, rounds.member(i), f"w{i}") for i, (m, _) in enumerate(built)]
    curve = []
    anytime = Anytime(args.curve_every, task, hparams, built[0][0], loops[0].outer_params)
    # The model worker 0 holds (its inner parameters x: θ plus its progress since the round in
    # flight began): what that peer would hand a user at that moment.
    inner = Anytime(args.curve_every, task, hparams, built[0][0], contextlib.nullcontext)
    step = wall = 0  # inner steps; step times of wall time: inner steps plus compute's waits for rounds
    land_at = None  # with overlap: the wall time at which the round in flight ends (it took land_after steps)
    boundary = 0
    for round_t, length in enumerate(phase_lengths(args.every, first_phase, args.steps), start=1):
        boundary += length
        while step < min(boundary, args.steps):
            for (model, optimizer), batches in zip(built, data, strict=True):
                model.train()
                optimizer.zero_grad(set_to_none=True)
                task.loss(model, next(batches)).backward()
                optimizer.step()
            step, wall = step + 1, wall + 1
            if land_at is not None and wall >= land_at:  # the round in flight lands between two steps
                for loop in loops:
                    await loop.landed()
                land_at = None
            anytime.at(wall)
            inner.at(wall)
        if step < boundary:
            break  # a tail shorter than a phase has no round, as a daemon stopped mid-phase
        if land_at is not None:  # a phase shorter than the round in flight: compute waits for it
            wall, land_at = max(wall, land_at), None
        repair = bool(args.repair_every and round_t % args.repair_every == 0)
        weight = float(length * args.batch)
        await together([functools.partial(loop.end_phase, round_t, weight, repair) for loop in loops])
        if overlap:
            land_at = wall + args.land_after
        else:
            wall += args.land_after  # compute waits for the round
        anytime.at(wall)
        inner.at(wall)
        if args.eval_every and round_t % args.eval_every == 0:
            with loops[0].outer_params():
                curve.append((step, score(task, built[0][0], hparams)))
    before = [loop.outer.clone() for loop in loops]  # [θ; m] before the round in flight lands
    await together([functools.partial(finish, loop) for loop in loops])
    evals = [score(task, model, hparams) for model, _ in built]
    extra = {}
    if overlap:  # a daemon stopped while its last round is in flight (see the module docstring)
        extra["eval_last_round_dropped"] = dropped(task, hparams, built[0][0], loops[0], before[0])
        extra["eval_last_round_own_p"] = [
            own_p(task, hparams, m, loop, b, rounds.own[i])
            for i, ((m, _), loop, b) in enumerate(zip(built, loops, before, strict=True))
        ]
    for loop in loops:
        loop.close()
    if args.curve_every:
        extra["anytime"] = anytime.points
        extra["anytime_inner"] = inner.points
    return {"eval": evals[0], "evals": evals, "curve": curve, **extra}


async def finish(loop: OuterLoop) -> None:
    """Training ends: the round in flight lands (waited for), and the model holds θ, the run's model."""
    await loop.landed()
    with torch.no_grad():
        from_flat(loop.theta, loop.params)


@torch.no_grad()
def own_p(task, hparams, model, loop: OuterLoop, before: torch.Tensor, own: torch.Tensor) -> float:
    """θ if the last round's outer step took this member's own P (what a daemon stopped with that
    round in flight did until the stop's cancelled rounds were dropped)."""
    theta, momentum = before[: loop.n].clone(), before[loop.n :].clone()
    outer_step(theta, momentum, own, loop.settings.lr, loop.settings.momentum, torch.empty_like(theta))
    from_flat(theta, list(model.parameters()))
    return score(task, model, hparams)


@torch.no_grad()
def dropped(task, hparams, model, loop: OuterLoop, before: torch.Tensor) -> float:
    """θ when the round in flight at the end is not applied: the last shared θ (a daemon stopped
    with that round in flight: the stop cancels it, daemon/diloco.py)."""
    from_flat(before[: loop.n], list(model.parameters()))
    return score(task, model, hparams)


def behind_until(run: list, alone: list) -> int:
    """The first sample time from which the run's eval is at or below alone's at every later sample
    of both curves (lower is better); past the last sample when the run ends behind."""
    at = dict(alone)
    times = [t for t, _ in run if t in at]
    behind = [t for t, e in run if t in at and e > at[t]]
    if not behind:
        return times[0] if times else 0
    later = [t for t in times if t > behind[-1]]
    return later[0] if later else behind[-1] + 1


def alone(args) -> dict:
    task, hparams = CharLM(), hparams_of(args)
    model, optimizer = task.build(hparams, INIT_SEED + args.seed)
    batches = task.data(hparams, PEER_SEED + 10 * args.seed)
    anytime = Anytime(args.curve_every, task, hparams, model, contextlib.nullcontext)
    for step in range(1, args.steps + 1):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        task.loss(model, next(batches)).backward()
        optimizer.step()
        anytime.at(step)
    return {"eval": score(task, model, hparams), **({"anytime": anytime.points} if args.curve_every else {})}


def single(args) -> dict:
    from peerd.daemon.tasks import train_single_process

    task, hparams = CharLM(), hparams_of(args)
    return {
        "eval": round(
            train_single_process(task, hparams, args.steps, args.workers * args.batch, INIT_SEED + args.seed).score, 4
        )
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="sync,overlap", help="comma-separated: sync, overlap, alone, single")
    p.add_argument("--momentum", default="0.9", help="outer momenta, comma-separated; the headline uses the first")
    p.add_argument("--seed", type=int, default=0, help="changes the model's initialization and every worker's batches")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=600, help="inner steps per worker")
    p.add_argument("--every", type=int, default=50, help="H: inner steps per phase (averaging.average_every)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    formats = [f.value for f in codec.Format]  # a run's payloads, as peers/collective/group.py's PAYLOADS
    p.add_argument("--payload", default="int8", choices=[*formats, "arctopk"])
    p.add_argument("--density", type=float, default=0.01, help="arctopk: the fraction of rows a round sends")
    row_formats = [f for f in formats if f != codec.Format.FP16.value]  # all but fp16, which was never offered
    p.add_argument("--values", default="int8", choices=row_formats, help="arctopk: the rows' format")
    p.add_argument("--repair-every", type=int, default=25)
    p.add_argument(
        "--land-after",
        type=int,
        default=10,
        help="with overlap: inner steps into the next phase at which a round lands (how long it takes); "
        "H: at the next phase's end, the whole phase late",
    )
    p.add_argument("--eval-every", type=int, default=2, help="outer steps between two points of the curve; 0: none")
    p.add_argument(
        "--first-phase",
        default="0",
        help="comma-separated: phases of N, 2N, 4N, ... inner steps up to H (0: every phase H); "
        "the headline compares the last listed with the first",
    )
    p.add_argument(
        "--curve-every",
        type=int,
        default=0,
        help="θ's eval every N step times of wall time (inner steps, plus compute's waits for rounds "
        "that take --land-after steps), and alone's model every N steps: the anytime curve",
    )
    p.add_argument("--d-model", type=int, default=64, help="charlm's width (its default is 128: 3x slower here)")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--corpus-bytes", type=int, default=512 * 1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--quick", action="store_true", help="200 steps, H = 25")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every = 200, 25
    torch.set_num_threads(args.threads)
    momenta = [float(m) for m in args.momentum.split(",")]
    firsts = [int(f) for f in args.first_phase.split(",")]
    common = {
        "seed": args.seed,
        "workers": args.workers,
        "steps": args.steps,
        "every": args.every,
        "outer_lr": args.outer_lr,
        "payload": args.payload,
        **({"density": args.density, "values": args.values} if args.payload == "arctopk" else {}),
        "repair_every": args.repair_every,
        "land_after": args.land_after,
        "d_model": args.d_model,
        "batch": args.batch,
        "corpus_bytes": args.corpus_bytes,
        "curve_every": args.curve_every,
    }
    setups = args.setups.split(",")
    if unknown := set(setups) - {"sync", "overlap", "alone", "single"}:
        raise SystemExit(f"unknown setup(s) {sorted(unknown)}")
    runs = [
        (setup, momentum, first)
        for setup in setups
        for momentum in (momenta if setup in ("sync", "overlap") else [None])
        for first in (firsts if setup in ("sync", "overlap") else [None])
    ]
    finals: dict[tuple[str, float], float] = {}
    anytime: dict[tuple, list] = {}
    for setup, momentum, first in runs:
        t0 = time.monotonic()
        if setup in ("sync", "overlap"):
            record = simulate(args, setup == "overlap", momentum, first)
            if first == firsts[0]:
                finals[(setup, momentum)] = record["eval"]
        else:
            record = alone(args) if setup == "alone" else single(args)
        anytime[(setup, momentum, first)] = record.get("anytime", [])
        line = {
            "bench": BENCH,
            "setup": setup,
            "momentum": momentum,
            "first_phase": first,
            **record,
            **common,
            "seconds": round(time.monotonic() - t0, 1),
            "metric": "bits_per_char",
        }
        print(json.dumps(line), flush=True)
        progress(
            BENCH, f"{setup} momentum {momentum} first phase {first}: {record['eval']} bits/char ({line['seconds']} s)"
        )
    m, alone_curve = momenta[0], anytime.get(("alone", None, None))
    setup = next((x for x in ("overlap", "sync") if x in setups), None)
    if len(firsts) > 1 and alone_curve and setup:
        # The run's first moment from which θ is at or below alone's model at every later sample:
        # short first phases (ours, the last listed) against every phase H (the first listed).
        ours, base = (behind_until(anytime[(setup, m, f)], alone_curve) for f in (firsts[-1], firsts[0]))
        emit(
            result(
                BENCH,
                f"step_times_until_at_or_below_alone_{setup}_first_phase_{firsts[-1]}_vs_{firsts[0]}",
                ours,
                base,
                "step times",
                note="lower is better; θ sampled every --curve-every step times of wall time",
                **common,
            )
        )
    elif ("overlap", m) in finals and ("sync", m) in finals:
        emit(
            result(
                BENCH,
                f"bits_per_char_overlap_vs_sync_momentum_{m:g}",
                finals[("overlap", m)],
                finals[("sync", m)],
                "bits/char",
                note="lower is better; θ after finish()",
                **common,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
