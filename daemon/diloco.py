"""DiLoCo's outer loop for one trainer: inner steps with the task's own optimizer, then the
pseudo-gradient averaged in the round's group and applied by an outer Nesterov optimizer.

Every member holds the *outer state*: the outer parameters θ and the outer momentum m (one flat
float32 vector [θ; m], what checkpoints keep and late joiners download). An inner phase starts from
parameters s and ends, after H steps (or the straggler budget), at parameters y. Its progress
P = s − y is what the round averages, weighted by samples, after error feedback (the codec's
quantization residual of the previous phase is added, the new one kept: `codec.with_feedback`).
The mean P̄ is applied identically on every member of a completed round:

    m ← μ·m + P̄ ;  θ ← θ − lr·(P̄ + μ·m)          (Nesterov SGD, as torch.optim.SGD(nesterov=True))

Without overlap the phase waits for its round, then the inner parameters restart from θ (DiLoCo).
With overlap (Streaming DiLoCo's overlapped communication) the round of phase k runs on the
network while phase k+1 computes, and its result *lands* as soon as the round ends (`land_into`,
the one place a round lands): the outer step on θ, and the move θ − s that takes the inner
parameters x to θ − (s − x), the new θ plus this member's progress since the phase began (its
progress of phase k, now averaged, is replaced by the outer step); that progress is from then on
counted from θ. A round that takes τ inner steps is τ steps stale, not a whole phase: landing at
the next phase's end, as before, cost 13 % of charlm's quality at outer momentum 0.9 in simulation,
landing 10 steps into a 50-step phase 1.2 % (docs/benchmarks.md). A round still running when the
next phase ends is waited for and lands then; compute waits only when a round takes longer than a
phase. The parameters are an attached process's (daemon/attached.py), in the shared file: the daemon
calls `land_into` as soon as the round ends and hands the process the move to add between two of
its steps (`on_round_done` says when); a round still in flight at the phase's end moves the vector
the process wrote (`land`, as the simulation's workers do between their steps).

A round that met no mate although the grid planned some, or whose group aborted (no lane applied
a result), is *deferred*: θ and m stay, the inner parameters keep their progress (with overlap
what the round would have averaged goes into the residual; without, the next P, counted from θ,
holds it) and its samples go into the next round's weight, so that the next round sends it. For
this member the phase is one round longer, and a mate's crash costs it no samples and no step of
its own apart from the run's θ. At most MAX_OWED rounds in a row: the next such round takes the
outer step on its own P, so that a member out of step with the run still trains. A member alone in
the run (no mate planned) takes that step every round: DiLoCo with one worker. A lane that formed
no group while others of the round applied leaves this member's own P there (the engine restores
it). A round the run's stop cancelled (a result
with `cancelled`, daemon/joining.bounded_round) is not applied: θ and m stay the last shared outer
state. Applied, a member's own P made the final charlm model 0.4-0.6 bits/char worse, and
different on every host (docs/benchmarks.md, "Training over a WAN"). A PARTIAL round (UDP engine)
gives the mean where its packets arrived and this member's own P elsewhere, so outer parameters may
drift apart by lr·(P − P̄) on the lost packets; every `repair_every` outer steps, when the run uses
the UDP engine or the grid has several groups, the round averages θ itself instead
(docs/algorithms.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from peerd.daemon.flat import from_flat, to_flat
from peerd.peers.averaging import RoundResult
from peerd.peers.collective import arctopk, codec
from peerd.peers.dear.hierarchy import lane_bounds

logger = logging.getLogger(__name__)

# A phase's round, awaited on the daemon's loop: (vector, weight, round_t, payload format) -> one
# RoundResult per lane; daemon/algorithms.py DiLoCo.bind's, over daemon/joining.bounded_round.
PhaseRound = Callable[[torch.Tensor, float, int, str], Awaitable[list[RoundResult]]]


@torch.no_grad()
def outer_step(
    params: torch.Tensor, momentum: torch.Tensor, mean_delta: torch.Tensor, lr: float, mu: float, scratch: torch.Tensor
) -> None:
    """One Nesterov step of the outer optimizer, in place: m ← μ·m + g ; θ ← θ − lr·(g + μ·m),
    with g the mean pseudo-gradient (torch.optim.SGD(nesterov=True, dampening=0)'s arithmetic).
    `scratch` may be `mean_delta` itself (it is then overwritten)."""
    momentum.mul_(mu).add_(mean_delta)
    torch.add(mean_delta, momentum, alpha=mu, out=scratch)
    params.sub_(scratch, alpha=lr)


@dataclass(frozen=True, slots=True)
class OuterSettings:
    lr: float = 0.7
    momentum: float = 0.5  # peers/manifest.py's default (why not DiLoCo's 0.9: docs/benchmarks.md)
    payload: str = "int8"  # how pseudo-gradients travel (peers/collective/codec.py)
    lanes: int = 1  # the run's lanes: error feedback is exact per lane, the vector each round averages
    overlap: bool = False
    repair_every: int = 0  # outer steps between two averages of θ itself; 0: never


@dataclass(frozen=True, slots=True)
class Applied:
    """A round whose result landed (or, cancelled by the run's stop, was dropped): its number, its
    results, and how long compute waited for it. round_t None: no round landed (with overlap: the
    first phase, or the round landed between two inner steps and was reported by `land`)."""

    round_t: int | None
    results: list
    waited: float
    repaired: bool = False  # the round averaged θ itself
    weight: float = 0.0  # the samples of the phases the round averaged (deferred ones included)
    deferred: bool = False  # no mate met or the group aborted: nothing moved, the round is owed (`owed`)

    @property
    def moved(self) -> bool:
        """θ took a step (an outer step, or a repair's mean), and the inner parameters move with it."""
        return self.round_t is not None and not self.deferred and not cancelled(self.results)


def cancelled(results: list[RoundResult]) -> bool:
    """Whether the run's stop cancelled the round (daemon/joining.bounded_round): its result is not applied."""
    return any(r.cancelled for r in results)


MAX_OWED = 2  # rounds in a row a member may owe; the next takes its own outer step (it still trains)
# Elements a pass over the vector takes at a time where it would otherwise need a model-sized
# temporary (P read again, the codec's error feedback, a distance): 4 MiB of float32, whole codec blocks.
CHUNK = 1 << 20
ENDED_POLL = 0.05  # seconds between two looks of a worker thread at a round in flight that it waits for


def lanes_to_put_back(results: list[RoundResult], lanes: int) -> list[int]:
    """The lanes a round run with restore=False may have left partly written: those whose result
    ran the engine without applying its outcome, was interrupted, or is missing (an interrupted
    round answers once for every lane). A lane alone or without a group was not touched."""
    by_lane = {r.lane: r for r in results}
    return [
        lane
        for lane in range(lanes)
        if (r := by_lane.get(lane)) is None or (not r.applied and (r.outcome is not None or r.interrupted))
    ]


def owed(results: list[RoundResult]) -> bool:
    """Whether every lane of the round met no mate although the grid planned some, or formed a group
    that aborted: nothing applied, and the run did not cancel it. A member alone in the run, a lane
    that failed with an error, or a group that could not share the vector is not owed."""
    return (
        bool(results)
        and not cancelled(results)
        and all(
            (r.outcome is None and r.group_size == 1 and r.planned > 0 and not r.interrupted)
            or (r.outcome is not None and not r.outcome.applied)
            for r in results
        )
    )


class OuterLoop:
    """The outer state of one trainer and its rounds. `average(vector, weight, round_t, payload)` is
    the trainer's round, a coroutine (daemon/joining.bounded_round): it averages `vector` in place,
    sent in `payload`'s format, and returns one RoundResult per lane. `end_phase` and `landed` are
    awaited on the daemon's event loop, where the round runs (with overlap as a task of that loop
    while the process computes); the arithmetic over the vector runs in a worker thread meanwhile,
    so that the loop serves the network. The other methods are called under the trainer's lock
    (daemon/attached.py) from a worker thread, or from the simulation's loop."""

    def __init__(
        self,
        params: list[torch.Tensor],
        settings: OuterSettings,
        average: PhaseRound,
        name: str,
        on_round_done: Callable[[], None] | None = None,
    ):
        """`on_round_done()`: with overlap, called on the loop when a round in flight ends."""
        self.params, self.settings, self.average, self.name = params, settings, average, name
        self.on_round_done = on_round_done
        n = sum(p.numel() for p in params)
        self.n = n
        # s: the phase's progress is counted from here (P = s − y). Without overlap every phase starts
        # at θ and θ changes only between phases, so s is θ itself: one copy of the model fewer.
        self.start = torch.empty(n) if settings.overlap else None
        self._point(torch.empty(2 * n))  # [θ; m]: served to peers, checkpointed
        self._lent = False  # [θ; m] is a snapshot's too (share): it moves to a copy before it changes
        # P of the latest phase, kept until its round is applied. Without overlap it is not kept: s is
        # θ and y stays where it is until the round is applied (the process waits for it), so P =
        # θ − y is read again where needed, a chunk at a time. One copy of the model fewer.
        self.progress = torch.empty(n) if settings.overlap else None
        self._chunk = None if settings.overlap else torch.empty(min(CHUNK, n))
        self._kept = torch.empty(min(CHUNK, n))  # a chunk of the residual or of P, for the codec
        self._top_k = settings.payload == arctopk.PAYLOAD  # rows selected per round, carried (`_carry`)
        self._distance = math.nan  # ARC-Top-K: the distance `_owe` measured, over the rows averaged
        # its scratch serves every chunk; ARC-Top-K's payload is float32 (the round encodes the rows)
        self._codec = codec.Codec("fp32" if self._top_k else settings.payload)
        self._y = None  # y of the phase whose round runs (the parameters' vector, or the scratch copy)
        self.payload = torch.empty(n)  # what the round averages, in place
        # Error feedback: quantization error carried to the next phase, and a deferred round's vector.
        # While a round runs it holds the previous phase's (what the payload was made with).
        self.residual = torch.zeros(n)
        self.deferred_weight = 0.0  # samples of deferred rounds, added to the next round's weight
        self._owed = 0  # rounds deferred in a row
        # An attached process's parameters are one flat vector (the shared file): y is read, and a
        # landed round's move added, in place. Parameters as tensors (the simulation) go through a
        # scratch copy.
        self._flat = len(params) == 1 and params[0].dim() == 1 and params[0].dtype == torch.float32
        self._flat = self._flat and params[0].is_contiguous()
        self.scratch = None if self._flat else torch.empty(n)
        # With overlap: the round in flight, a task of the loop, and (round_t, repair, weight) of it.
        # `_ended` is set once it has ended, for a worker thread that waits for it (land_into).
        self._pending: asyncio.Task | None = None
        self._pending_round: tuple[int, bool, float] = (0, False, 0.0)
        self._ended = threading.Event()
        self.distance = float("nan")  # at the latest applied round: this member's distance to the group's mean
        self.reset_from_params()

    # -- state ------------------------------------------------------------------------------

    def _point(self, outer: torch.Tensor) -> None:
        self.outer = outer
        self.theta, self.momentum = outer[: self.n], outer[self.n :]
        if not self.settings.overlap:
            self.start = self.theta

    def share(self) -> torch.Tensor:
        """[θ; m] for a snapshot peers download, without a copy: before θ or m next change, this
        loop moves its own to a copy (one per round while downloads may read the old one; the old
        one is freed once no snapshot holds it), and the snapshot keeps these values."""
        self._lent = True
        return self.outer

    def _before_change(self, keep: bool = True) -> None:
        """Every change of θ or m comes here first (share); `keep`: the change reads them (else it
        overwrites both)."""
        if self._lent:
            self._point(self.outer.clone() if keep else torch.empty_like(self.outer))
            self._lent = False

    @torch.no_grad()
    def reset_from_params(self) -> None:
        """θ := the model's parameters, m := 0 (a new run, or a checkpoint without outer state)."""
        self._before_change(keep=False)
        to_flat(self.params, self.theta)
        self.momentum.zero_()
        self.start.copy_(self.theta)
        self.residual.zero_()
        self.deferred_weight = 0.0

    @torch.no_grad()
    def adopt(self, outer: torch.Tensor) -> None:
        """Take [θ; m] from a checkpoint or from peers: the inner parameters restart from θ. A
        round still in flight is waited for and dropped (its result belongs to the old state)."""
        self.drop_pending()
        self._before_change(keep=False)
        self.outer.copy_(outer)
        from_flat(self.theta, self.params)
        self.start.copy_(self.theta)
        self.residual.zero_()
        self.deferred_weight = 0.0

    def drop_pending(self) -> None:
        """From a worker thread (never the loop's: the round runs there): wait for the round in
        flight, if any, and drop it."""
        if self._pending is not None:
            self._wait_ended()
            pending, self._pending = self._pending, None
            if not pending.cancelled() and pending.exception() is not None:  # no longer matters: not applied
                logger.debug("%s: a dropped round failed", self.name, exc_info=pending.exception())

    def _wait_ended(self) -> None:
        """Block this worker thread until the round in flight has ended (its bound is the round's)."""
        while not self._pending.done():
            self._ended.wait(ENDED_POLL)

    # -- rounds -------------------------------------------------------------------------------

    async def end_phase(self, round_t: int, weight: float, repair: bool = False) -> Applied:
        """The inner phase that ends now is averaged in round `round_t` (weight: its samples). With
        overlap, a round still in flight lands first (waited for), and this one starts as a task of
        the loop: the inner parameters stay where they are, the next phase's progress counted from
        them until it lands. Without, this one runs and is applied, and the inner parameters
        restart from θ. `repair`: this round averages θ − P (float32) and adopts the mean as θ,
        instead of an outer step on the mean P: the phase's progress is kept, the members' θ meet
        again."""
        applied = await self.landed() or Applied(None, [], 0.0)
        fmt = "fp32" if repair else self.settings.payload
        weight, self.deferred_weight = weight + self.deferred_weight, 0.0
        await asyncio.to_thread(self._send, repair)
        if self.settings.overlap:
            self._pending_round = (round_t, repair, weight)
            self._ended.clear()
            self._pending = asyncio.ensure_future(self.average(self.payload, weight, round_t, fmt))
            self._pending.add_done_callback(self._round_ended)
            return applied
        t0 = time.monotonic()
        results = await self.average(self.payload, weight, round_t, fmt)
        return await asyncio.to_thread(self._finish, round_t, results, repair, weight, time.monotonic() - t0)

    @torch.no_grad()
    def _send(self, repair: bool) -> None:
        """The payload of the phase that ends: from P = s − y (kept with overlap, where the next
        phase starts at y, the model's parameters now)."""
        if self._flat:
            y = self.params[0]
        else:
            to_flat(self.params, self.scratch)
            y = self.scratch
        self._y = y
        if self.progress is not None:
            torch.sub(self.start, y, out=self.progress)  # P = s − y
        for a, b in self._lane_spans():
            self._fill(a, b, repair)
        if self.settings.overlap:
            self.start.copy_(y)

    @torch.no_grad()
    def _finish(self, round_t: int, results: list[RoundResult], repair: bool, weight: float, waited: float) -> Applied:
        """Without overlap, the round's results: applied, or deferred; the inner parameters restart from θ."""
        deferred = self._defers(results)
        self._settle(results, repair, deferred)
        if deferred:  # the inner parameters keep their progress, still counted from θ
            self._defer(repair, weight)
            return Applied(round_t, results, waited, repair, weight, deferred=True)
        if not cancelled(results):
            self._apply(repair)
        from_flat(self.theta, self.params)
        self.start.copy_(self.theta)
        if self._top_k and not repair and not cancelled(results):
            if self._flat:
                self._carry(self.params[0])
            else:
                from_flat(self._carry(self.scratch.copy_(self.theta)), self.params)
        return Applied(round_t, results, waited, repair, weight)

    def _round_ended(self, task: asyncio.Task) -> None:
        self._ended.set()
        if self.on_round_done is not None:
            self.on_round_done()

    async def landed(self) -> Applied | None:
        """On the loop: wait for the round in flight, if any, and `land` it. None when none was in
        flight (or another caller landed it meanwhile); `waited`: how long this took."""
        if self._pending is None:
            return None
        t0 = time.monotonic()
        await asyncio.wait({self._pending})
        applied = await asyncio.to_thread(self.land)
        return None if applied is None else replace(applied, waited=time.monotonic() - t0)

    @torch.no_grad()
    def land(self) -> Applied | None:
        """`land_into` for the parameters this loop holds: if the round in flight has ended, they
        move by θ − s in place, to θ − (s − x). The move is written in P's buffer (the round's P
        is not needed once it landed). None when no round was in flight or it still runs."""
        t0 = time.monotonic()
        applied = self.land_into(self.progress)
        if applied is None:
            return None
        if applied.moved:
            if self._flat:
                self.params[0].add_(self.progress)
            else:
                to_flat(self.params, self.scratch)
                from_flat(self.scratch.add_(self.progress), self.params)
        return replace(applied, waited=time.monotonic() - t0)

    @torch.no_grad()
    def land_into(self, move: torch.Tensor, wait: bool = False) -> Applied | None:
        """Where a round lands: if the round in flight has ended (or, with `wait`, from a worker
        thread, once it has), the outer step on θ, and `move` := θ − s, what the parameters x take
        to hold θ − (s − x) (an attached process adds it between two steps; `land` here); from then
        on the progress is counted from θ. The parameters are left alone. None when no round was in
        flight or it still runs; a cancelled round changes nothing, and `move` is not written. A
        round that raised is dropped, and its exception raised here."""
        if self._pending is None or not (wait or self._pending.done()):
            return None
        self._wait_ended()
        pending, self._pending = self._pending, None
        round_t, repair, weight = self._pending_round
        if pending.cancelled():  # the daemon's loop ended with the round in flight
            results = [
                RoundResult(round_t, 1, None, "round cancelled: the daemon stops", interrupted=True, cancelled=True)
            ]
        else:
            results = pending.result()
        deferred = self._defers(results)
        self._settle(results, repair, deferred)
        if deferred:  # θ stays, and the process keeps its parameters: no move
            self._defer(repair, weight)
            return Applied(round_t, results, 0.0, repair, weight, deferred=True)
        if not cancelled(results):
            self._apply(repair)
            torch.sub(self.theta, self.start, out=move)
            self.start.copy_(self.theta)
            if self._top_k and not repair:
                self._carry(move)
        return Applied(round_t, results, 0.0, repair, weight)

    @staticmethod
    def _spans(start: int, end: int):
        """[a, b) of CHUNK elements from start (whole codec blocks from there), the last one shorter."""
        return ((a, min(a + CHUNK, end)) for a in range(start, end, CHUNK))

    def _lane_spans(self, lanes: list[int] | None = None):
        """The spans of these lanes (every lane when None): codec blocks start at each lane's start."""
        bounds = lane_bounds(self.n, self.settings.lanes)
        for lane in range(self.settings.lanes) if lanes is None else lanes:
            yield from self._spans(*bounds[lane])

    def _fill(self, a: int, b: int, repair: bool) -> None:
        """payload[a:b] := what this member sends there: θ − P for a repair, else what the codec
        delivers for P + residual (error feedback). The residual is not touched: what the codec
        loses is taken once the round is over (`_settle`), so that until then the payload can be
        written again from P and the residual, and the engine need not back it up (restore=False)."""
        if repair:
            torch.sub(self.theta[a:b], self._progress(a, b), out=self.payload[a:b])
            return
        if self._top_k:  # P + residual, exactly: the round sends its rows (peers/collective/arctopk.py)
            torch.add(self._progress(a, b), self.residual[a:b], out=self.payload[a:b])
            return
        self.payload[a:b].copy_(self._progress(a, b))
        kept = self._kept[: b - a].copy_(self.residual[a:b])
        codec.with_feedback(self.payload[a:b].numpy(), kept.numpy(), self.settings.payload, self._codec)

    def _settle(self, results: list[RoundResult], repair: bool, deferred: bool) -> None:
        """After a round, before it is applied or deferred: the lanes it may have left partly
        written hold what this member sent again (`_fill`), and, unless it is owed, the residual
        becomes what the codec lost of P + residual (the payload's error feedback; a repair's
        float32 loses nothing). An owed round's residual stays: `_defer` says what it owes."""
        for a, b in self._lane_spans(lanes_to_put_back(results, self.settings.lanes)):
            self._fill(a, b, repair)
        if repair or deferred:
            return
        if self._top_k:
            self._owe(results)
            return
        for a, b in self._lane_spans():
            sent = self._kept[: b - a].copy_(self._progress(a, b))
            codec.with_feedback(sent.numpy(), self.residual[a:b].numpy(), self.settings.payload, self._codec)

    def _owe(self, results: list[RoundResult]) -> None:
        """ARC-Top-K's error feedback, per lane: the residual becomes what this member owed there
        (P + residual) less what it sent, its rows as their format delivers them (arctopk.split);
        nothing in a lane where no rows were averaged (alone, no group, a round that failed and is
        not owed: the outer step takes the member's own P + residual whole). And this member's
        distance to the group's mean over the rows averaged (NaN where none was)."""
        selected = {r.lane: r.selected for r in results if r.selected is not None and r.applied}
        squares = 0.0
        for lane, (a, b) in enumerate(lane_bounds(self.n, self.settings.lanes)):
            if lane not in selected:
                self.residual[a:b].zero_()
                continue
            rows, fmt = selected[lane]
            p = torch.empty(b - a)  # P of the lane (read again a chunk at a time where it is not kept)
            for c, d in self._spans(a, b):
                p[c - a : d - a] = self._progress(c, d)
            apart = arctopk.gather(p.numpy(), rows) - arctopk.gather(self.payload[a:b].numpy(), rows)
            squares += float(np.square(apart, dtype=np.float64).sum())
            owed = p.add_(self.residual[a:b])
            arctopk.split(owed.numpy(), rows, fmt, self.residual[a:b].numpy())
        self._distance = squares**0.5 if selected else math.nan

    def _carry(self, into: torch.Tensor) -> torch.Tensor:
        """ARC-Top-K: what this member did not send stays in its inner parameters, not in the
        residual: `into` (θ's move, or θ) takes it off (x := θ − (s − x) − residual), and the residual
        empties. The next phase's progress, counted from θ, then holds it, where a residual added to
        the next round makes the next phase, starting again from θ, learn it a second time
        (docs/benchmarks.md, "ARC-Top-K"). Returns `into`."""
        into.sub_(self.residual)
        self.residual.zero_()
        return into

    def _progress(self, a: int, b: int) -> torch.Tensor:
        """P[a:b] of the phase whose round runs: a view of P where it is kept (the caller may write
        it), else θ − y in a scratch chunk (valid until the next call)."""
        if self.progress is not None:
            return self.progress[a:b]
        return torch.sub(self.start[a:b], self._y[a:b], out=self._chunk[: b - a])

    def _defers(self, results: list[RoundResult]) -> bool:
        """Whether this round is deferred: owed, and fewer than MAX_OWED in a row were."""
        self._owed = self._owed + 1 if owed(results) and self._owed < MAX_OWED else 0
        return self._owed > 0

    def _defer(self, repaired: bool, weight: float) -> None:
        """The round is owed to the next; its samples go into the next round's weight. With overlap
        the next phase counts from y: this member's P goes into the residual, which kept what the
        codec lost before (`_fill`). Without, s is θ, which did not move: the next phase's P holds
        this one's, and the residual stays as it was."""
        if self.start is not self.theta:
            self.residual.add_(self.progress)
        self.deferred_weight = weight

    def _apply(self, repaired: bool) -> None:
        """The round's result is in `payload` (its mean where it applied, this member's own values
        elsewhere): a repair adopts it as θ, a pseudo-gradient takes an outer step. Before that,
        how far this member was from the group's mean: |P − P̄| (for a repair, |θ − P − mean|; for
        ARC-Top-K, over the rows averaged: the others hold no mean)."""
        self._before_change()
        if self._top_k and not repaired:
            self.distance = self._distance  # `_owe` measured it
        else:
            squares = 0.0
            for a, b in self._spans(0, self.n):
                if repaired:  # |P − θ + mean| = |θ − P − mean|, in P's buffer: P is not needed once applied
                    squares += float(self._progress(a, b).sub_(self.theta[a:b]).add_(self.payload[a:b]).norm()) ** 2
                else:
                    squares += float(torch.dist(self._progress(a, b), self.payload[a:b])) ** 2
            self.distance = squares**0.5
        if repaired:
            self.theta.copy_(self.payload)
        else:
            # The payload is the outer step's temporary: the mean is not needed after it either.
            outer_step(self.theta, self.momentum, self.payload, self.settings.lr, self.settings.momentum, self.payload)

    @contextlib.contextmanager
    def outer_params(self):
        """Within the block the model holds θ (evaluation), then its inner parameters again."""
        saved = self.scratch if self.scratch is not None else torch.empty(self.n)
        with torch.no_grad():
            to_flat(self.params, saved)
            from_flat(self.theta, self.params)
        try:
            yield
        finally:
            with torch.no_grad():
                from_flat(saved, self.params)

    def close(self) -> None:
        """From a worker thread: wait for a round in flight (the round bounds it) and drop it."""
        self.drop_pending()
