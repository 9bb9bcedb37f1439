"""The collective engine: exact weighted means, refused input, and the complete-or-abort contract.

In-process tests run several engines on one uvloop loop over real TCP on 127.0.0.1 (ports from the
OS). Faults are injected through seams: FilteredTransport drops messages by rule, a member that is
never asked to run a round stays silent, raw sockets send forged headers. The last tests start real
members as subprocesses and SIGKILL or SIGSTOP one of them mid-round.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import uvloop

from peerd.peers.collective import (
    AllReduceSettings,
    FilteredTransport,
    Group,
    GroupAllReduce,
    Status,
    TcpTransport,
    shard_bounds,
)
from peerd.peers.collective.decision import Decision, Verdict, decide
from peerd.peers.collective.inbox import BufferPool
from peerd.peers.collective.reduction import TORCH_GRAIN, fold
from peerd.peers.collective.wire import HEADER, HEADER_SIZE, AbortCode, DType, Header, Kind, WireError, decode, run_tag
from peerd.peers.events import PeerEvents
from bench import vclock
from tests.helpers import ROOT
from tests.memtransport import Hub
from tests.test_codec import mean_bound

FAST = AllReduceSettings(
    connect_timeout=0.5, contribute_timeout=0.5, gather_timeout=1.0, verdict_timeout=0.5, drain_timeout=0.3
)
# For rounds in which every member is live and must complete: a round ends once everything has
# arrived, so wide timeouts cost nothing, and a pause of the busy machine aborts none (FAST's 1 s
# gather did: tests/FLAKY.md, runs 86-87). FAST stays for the rounds that wait out a silent member.
LIVE = dataclasses.replace(FAST, connect_timeout=5.0, contribute_timeout=10.0, gather_timeout=20.0, verdict_timeout=5.0)
RUN = "collective-test"


class Rejections:
    """PeerEvents.rejected, counted; wait_for() returns once a condition on the counts holds."""

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Event()
        self.events = PeerEvents(rejected=self._record)

    def _record(self, reason: str) -> None:
        self.counts[reason] += 1
        self._changed.set()

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate(self.counts):
                self._changed.clear()
                await self._changed.wait()


async def start_group(n: int, numel: int, *, settings=FAST, events=None, wrap=None):
    """n engines on n TCP transports; wrap(i, transport) may put a seam around member i's transport."""
    transports = [TcpTransport("127.0.0.1", 0, events=events) for _ in range(n)]
    addresses = [await t.start() for t in transports]
    members = [f"m{i}" for i in range(n)]
    engines = []
    for i, t in enumerate(transports):
        t = wrap(i, t) if wrap else t
        engines.append(GroupAllReduce(Group(RUN, members, addresses, i), t, numel, settings=settings, events=events))
    return engines, transports


async def stop_group(engines, transports) -> None:
    for e in engines:
        await e.close()
    for t in transports:
        await t.close()


def weighted_mean(xs, ws):
    return sum(w * x for w, x in zip(ws, xs)) / sum(ws)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # float32 rounding: the engine scales each term by w / W, the reference divides the sum by W
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- pure parts ------------------------------------------------------------------------------------


def test_shard_bounds_cover_everything_and_differ_by_at_most_one():
    for numel, parts in [(10, 3), (7, 2), (5, 5), (1001, 4), (64, 1)]:
        bounds = shard_bounds(numel, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [e - s for s, e in bounds]
        assert max(sizes) - min(sizes) <= 1


def test_header_round_trip_and_refusals():
    h = Header(kind=Kind.RESULT, run_tag=run_tag(RUN), round=7, sender=2, shard=2, count=5, weight=3.5, mask=0b111)
    raw = h.pack()
    assert len(raw) == HEADER_SIZE and decode(raw) == h
    for bad, reason in [
        (b"XXXX" + raw[4:], "wire_bad_magic"),
        (raw[:4] + b"\x09" + raw[5:], "wire_bad_version"),
        (raw[:5] + b"\x09" + raw[6:], "wire_bad_kind"),
        (raw[:6] + b"\x09" + raw[7:], "wire_bad_dtype"),
        (raw[:32] + (21).to_bytes(8, "little") + raw[40:], "wire_bad_size"),  # length != count * 4
        (raw[:10], "wire_truncated"),
    ]:
        with pytest.raises(WireError) as e:
            decode(bad)
        assert e.value.reason == reason


def test_messages_sent_before_attach_wait_for_the_sink():
    """A member may dial and send before the receiver's engine has attached; nothing may be lost or crash."""

    class Collect:
        def __init__(self):
            self.got: list[tuple[Header, bytes]] = []
            self.buffers: dict[int, memoryview] = {}

        def on_header(self, link, header):
            self.buffers[header.shard] = memoryview(bytearray(header.length))
            return self.buffers[header.shard]

        def on_payload(self, link, header):
            self.got.append((header, bytes(self.buffers[header.shard])))

        def on_lost(self, link):
            pass

    async def main():
        receiver, sender = TcpTransport(), TcpTransport()
        address = await receiver.start()
        await sender.start()
        link = await sender.connect(address)
        payloads = [torch.full((1000,), float(i)).numpy().tobytes() for i in range(3)]
        for i, data in enumerate(payloads):
            header = Header(kind=Kind.CONTRIBUTION, run_tag=run_tag(RUN), round=1, sender=0, shard=i, count=1000)
            link.send(header, memoryview(data))
        await link.drain()
        await asyncio.sleep(0.2)  # the bytes reach the receiver before anyone listens to them
        sink = Collect()
        receiver.attach(sink)
        async with asyncio.timeout(5):
            while len(sink.got) < 3:
                await asyncio.sleep(0.01)
        await sender.close()
        await receiver.close()
        return sink.got, payloads

    got, payloads = uvloop.run(main())
    assert [h.shard for h, _ in got] == [0, 1, 2]
    assert [data for _, data in got] == payloads


def test_decision_rule_with_a_made_up_clock():
    ok, other = Verdict(ok=True, digest=b"a" * 16), Verdict(ok=True, digest=b"b" * 16)
    abort = Verdict.abort(AbortCode.MISSING_SHARD)
    assert decide(0, 3, ok, {1: ok, 2: ok}, now=0, deadline=10)[0] is Decision.COMPLETE
    assert decide(0, 3, ok, {1: ok}, now=0, deadline=10)[0] is Decision.WAIT
    assert decide(0, 3, ok, {1: ok}, now=10, deadline=10)[0] is Decision.COMPLETE  # member 2 silent: failed
    assert decide(0, 3, ok, {1: abort}, now=0, deadline=10)[0] is Decision.ABORT
    assert decide(0, 3, ok, {1: other, 2: ok}, now=0, deadline=10)[0] is Decision.ABORT
    assert decide(0, 3, abort, {1: ok, 2: ok}, now=0, deadline=10)[0] is Decision.ABORT
    assert ok.then(abort) == abort and abort.then(ok) == abort  # an abort is final


# ---- in-process rounds -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, numel, chunk",
    [(1, 5, 2), (2, 7, 1), (3, 10, 512 * 1024), (3, 1001, 37), (4, 1001, 512 * 1024), (4, 64 * 1024 + 3, 4096)],
)
def test_weighted_mean_is_exact_and_buffers_are_reused(n, numel, chunk):
    """Every size, shards of unequal length, one chunk per shard or many (the pipelined path)."""

    async def main():
        settings = dataclasses.replace(LIVE, chunk_elements=chunk)
        engines, transports = await start_group(n, numel, settings=settings)
        backups = [e.inbox.backup.data_ptr() for e in engines]
        links = None
        for r in (1, 2, 3):
            xs = [torch.randn(numel) for _ in range(n)]
            ws = [float(i + 1) * r for i in range(n)]
            expect = weighted_mean(xs, ws)
            outcomes = await asyncio.gather(*(e.all_reduce(x, w, r) for e, x, w in zip(engines, xs, ws)))
            assert [o.status for o in outcomes] == [Status.COMPLETED] * n, [o.reason for o in outcomes]
            assert len({o.digest for o in outcomes}) == 1 and outcomes[0].digest
            for o in outcomes:
                assert o.coverage == (1.0,) * n and o.members == tuple(f"m{i}" for i in range(n))
                assert o.round == r and (n == 1 or o.bytes_sent > numel * 4 * (n - 1) / n)
            for x in xs:
                assert close(x, expect)
            now = [dict(e.links) for e in engines]
            assert links is None or now == links  # the same connections every round
            links = now
        assert [e.inbox.backup.data_ptr() for e in engines] == backups
        await stop_group(engines, transports)

    uvloop.run(main())


@pytest.mark.parametrize("ws", [(0.0, 1.0, 2.0), (1.0, 0.0, 0.0), (1e-3, 1e3, 7.0), (5.0, 5.0, 5.0)])
def test_weighted_mean_with_zero_and_far_apart_weights(ws):
    """An owner's accumulator counts in units of its own weight (reduction.py): a zero own weight,
    or weights six orders of magnitude apart, still give the weighted mean."""
    n, numel, chunk = 3, 5000, 700

    async def main():
        engines, transports = await start_group(n, numel, settings=dataclasses.replace(LIVE, chunk_elements=chunk))
        xs = [torch.randn(numel) for _ in range(n)]
        expect = weighted_mean(xs, ws)
        outcomes = await asyncio.gather(*(e.all_reduce(x, w, 1) for e, x, w in zip(engines, xs, ws)))
        assert [o.status for o in outcomes] == [Status.COMPLETED] * n, [o.reason for o in outcomes]
        assert all(close(x, expect) for x in xs)
        await stop_group(engines, transports)

    uvloop.run(main())


def test_engines_built_per_round_reuse_pooled_buffers():
    """The daemon builds an engine per round; a BufferPool lends each the previous one's receive
    buffers (stale contents and all) and the results stay exact. Member indices change between
    rounds, shards of unequal length included: the buffers fit any member."""

    async def main():
        n, numel, pools = 3, 1001, [BufferPool() for _ in range(3)]
        seen: list[set[int]] = [set() for _ in range(n)]
        for r in (1, 2, 3):
            transports = [TcpTransport("127.0.0.1", 0) for _ in range(n)]
            addresses = [await t.start() for t in transports]
            order = [(i + r) % n for i in range(n)]  # daemon i is member order[i] this round
            members = [f"m{order.index(k)}" for k in range(n)]
            grouped = [addresses[order.index(k)] for k in range(n)]
            lent = [pools[i].take(numel, n, 37) for i in range(n)]
            settings = dataclasses.replace(LIVE, chunk_elements=37)
            engines = [
                GroupAllReduce(
                    Group(RUN, members, grouped, order[i]), transports[i], numel, settings=settings, buffers=lent[i]
                )
                for i in range(n)
            ]
            xs = [torch.randn(numel) for _ in range(n)]
            ws = [float(i + r) for i in range(n)]
            expect = weighted_mean(xs, ws)
            outcomes = await asyncio.gather(*(e.all_reduce(x, w, 1) for e, x, w in zip(engines, xs, ws)))
            assert [o.status for o in outcomes] == [Status.COMPLETED] * n, [o.reason for o in outcomes]
            assert all(close(x, expect) for x in xs)
            await stop_group(engines, transports)
            for i in range(n):
                pools[i].give(lent[i])
                seen[i].add(lent[i].backup.data_ptr())
        assert all(len(ptrs) == 1 for ptrs in seen)  # one allocation per daemon, for all three rounds

    uvloop.run(main())


def test_buffer_pool_lends_by_shape_and_keeps_few():
    pool = BufferPool(keep=2)
    a = pool.take(100, 4, 10)
    assert pool.take(100, 4, 10) is not a  # lent out: never to two engines at once
    pool.give(a)
    assert pool.take(100, 3, 10) is not a and pool.take(100, 4, 10) is a
    for b in [pool.take(100, 4, 10) for _ in range(3)]:
        pool.give(b)
    assert len(pool._free) == 2
    with pytest.raises(ValueError):
        GroupAllReduce(Group(RUN, ["m0", "m1"], ["127.0.0.1:1"] * 2, 0), TcpTransport(), 100, buffers=a)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [0, 1, TORCH_GRAIN + 5])
def test_fold_adds_a_weighted_part_in_place_an_empty_one_included(threads, n):
    """The one kernel, on one torch thread (DeAR's processes) or more (blocks of TORCH_GRAIN). An empty
    part folds nothing: Halves folds each sender's parked elements, which may be none yet."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = np.arange(n, dtype=np.float32)
        v = np.arange(n, dtype=np.float32) - 7
        want = out + np.float32(2.0) * v  # small integers: exact in float32
        fold(out, v, 2.0)
        assert np.array_equal(out, want)
    finally:
        torch.set_num_threads(before)


def test_settings_refuse_timeouts_that_cannot_work():
    with pytest.raises(ValueError):
        AllReduceSettings(contribute_timeout=5.0, gather_timeout=5.0)  # owners must reduce before members give up
    with pytest.raises(ValueError):
        AllReduceSettings(connect_timeout=0.0)
    with pytest.raises(ValueError):
        AllReduceSettings(chunk_elements=0)


@pytest.mark.parametrize("chunk", [512 * 1024, 50])
def test_bad_input_is_refused_counted_and_the_round_completes(chunk):
    """Forged headers from a raw socket, and a NaN contribution: refused, counted; the others complete.
    The NaN only takes its sender out of the chunk it is in (the whole shard when a shard is one chunk)."""
    n, numel = 3, 999

    async def raw(address: str, *chunks: bytes) -> bytes:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        for c in chunks:
            writer.write(c)
        await writer.drain()
        return reader, writer

    async def main():
        rec = Rejections()
        settings = dataclasses.replace(LIVE, chunk_elements=chunk)
        engines, transports = await start_group(n, numel, events=rec.events, settings=settings)
        target, tag = transports[0].address, run_tag(RUN)
        base = dict(kind=Kind.CONTRIBUTION, run_tag=tag, sender=1, shard=0, count=min(chunk, 333), weight=1.0)
        garbage = Header(**{**base, "round": 1}).pack()
        _, w_magic = await raw(target, b"NOPE" + garbage[4:])
        forged = [
            Header(**{**base, "round": 99}).pack() + bytes(min(chunk, 333) * 4),  # a round far ahead: skipped
            Header(**{**base, "round": 1, "sender": 7}).pack(),  # not a member
            Header(**{**base, "round": 1, "count": 5}).pack() + bytes(20),  # wrong size for shard 0
            Header(**{**base, "round": 1, "run_tag": run_tag("other")}).pack(),  # another run
            Header(**{**base, "round": 1, "offset": 1}).pack(),  # off the chunk grid
            # Bytes where the round carries float32: a wrong dtype. (An unknown dtype code fails
            # decoding: test_header_round_trip_and_refusals.)
            Header(**{**base, "round": 1, "dtype": DType.BYTES, "count": 4 * min(chunk, 333)}).pack()
            + bytes(4 * min(chunk, 333)),
        ]
        writers = [(await raw(target, f))[1] for f in forged]
        expected = {"wire_bad_magic", "wire_wrong_round", "wire_not_in_group", "wire_bad_size", "wire_wrong_run"}
        expected |= {"wire_bad_offset", "wire_bad_dtype"}
        await rec.wait_for(lambda c: all(c[r] >= 1 for r in expected))

        xs = [torch.randn(numel) for _ in range(n)]
        xs[2][5] = float("nan")  # in shard 0: owner 0 must refuse member 2's contribution
        clean = [x.clone() for x in xs]
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        assert [o.status for o in outcomes] == [Status.COMPLETED] * n, [o.reason for o in outcomes]
        assert rec.counts["contribution_nonfinite"] == 1
        bad = min(chunk, 333)  # the chunk of shard 0 that holds the NaN
        assert outcomes[0].coverage == ((bad * 2 + (333 - bad) * 3) / 999, 1.0, 1.0)
        assert outcomes[0].members == ("m0", "m1")
        for x in xs:
            assert close(x[:bad], (clean[0][:bad] + clean[1][:bad]) / 2)
            assert close(x[bad:], sum(c[bad:] for c in clean) / 3)
        assert {o.digest for o in outcomes} == {outcomes[0].digest}
        for w in [w_magic, *writers]:
            w.close()
        await stop_group(engines, transports)

    uvloop.run(main())


def test_a_contribution_that_never_arrives_gives_partial_coverage_everywhere():
    """Member 2's contribution to owner 0 is lost (transport seam): every member completes with the
    same result, shard 0 averaged over members 0 and 1 only, and the Outcome says so."""
    n, numel = 3, 3000
    lose = lambda to, h: h.kind is Kind.CONTRIBUTION and h.shard == 0  # noqa: E731

    async def main():
        engines, transports = await start_group(n, numel, wrap=lambda i, t: FilteredTransport(t, lose) if i == 2 else t)
        xs = [torch.randn(numel) for _ in range(n)]
        clean = [x.clone() for x in xs]
        outcomes = await asyncio.gather(*(e.all_reduce(x, 2.0, 1) for e, x in zip(engines, xs)))
        assert {o.status for o in outcomes} == {Status.COMPLETED}
        assert {o.coverage for o in outcomes} == {(2 / 3, 1.0, 1.0)}
        assert {o.members for o in outcomes} == {("m0", "m1")}
        end = shard_bounds(numel, n)[0][1]
        for x in xs:
            assert close(x[:end], (clean[0][:end] + clean[1][:end]) / 2)
        await stop_group(engines, transports)

    uvloop.run(main())


def test_a_silent_member_makes_everyone_abort_and_keep_their_tensor():
    """Member 2 never runs the round: its shard is missing, so members 0 and 1 both abort, restore
    their tensors, and return within gather_timeout + verdict_timeout + drain_timeout."""
    n, numel = 3, 3000

    async def main():
        engines, transports = await start_group(n, numel)
        xs = [torch.randn(numel) for _ in range(2)]
        before = [x.clone() for x in xs]
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        assert time.monotonic() - t0 < FAST.longest_round + 1.0
        assert {o.status for o in outcomes} == {Status.ABORTED}, [o.reason for o in outcomes]
        assert all(o.coverage[2] == 0.0 and o.digest == b"" for o in outcomes)
        assert all(torch.equal(x, b) for x, b in zip(xs, before))
        # The next round runs with all three, and member 2's stale early messages do not disturb it.
        xs = [torch.randn(numel) for _ in range(n)]
        expect = weighted_mean(xs, [1.0] * n)
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 2) for e, x in zip(engines, xs)))
        assert {o.status for o in outcomes} == {Status.COMPLETED}, [o.reason for o in outcomes]
        assert all(close(x, expect) for x in xs)
        await stop_group(engines, transports)

    uvloop.run(main())


def test_on_virtual_time_a_silent_member_aborts_the_round_exactly_at_the_gather_deadline():
    """The same fault on the loop's clock made virtual (bench/vclock.py) and a transport in memory:
    the round is decided by its deadlines alone, so the abort comes exactly gather_timeout after the
    round began, and a round of all three that follows completes with the mean."""
    n, numel = 3, 3000

    async def main():
        hub, loop = Hub(), asyncio.get_running_loop()
        transports = [hub.transport() for _ in range(n)]
        members, addresses = [f"m{i}" for i in range(n)], [t.address for t in transports]
        engines = [
            GroupAllReduce(Group(RUN, members, addresses, i), t, numel, settings=FAST) for i, t in enumerate(transports)
        ]
        xs = [torch.randn(numel) for _ in range(2)]
        before = [x.clone() for x in xs]
        t0 = loop.time()
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        assert loop.time() - t0 == pytest.approx(FAST.gather_timeout, abs=1e-9)
        assert {o.status for o in outcomes} == {Status.ABORTED}, [o.reason for o in outcomes]
        assert all(torch.equal(x, b) for x, b in zip(xs, before))
        xs = [torch.randn(numel) for _ in range(n)]
        expect = weighted_mean(xs, [1.0] * n)
        t0 = loop.time()
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 2) for e, x in zip(engines, xs)))
        assert loop.time() == t0  # nothing waited on a timer: every message was there
        assert {o.status for o in outcomes} == {Status.COMPLETED}, [o.reason for o in outcomes]
        assert all(close(x, expect) for x in xs) and len({o.digest for o in outcomes}) == 1
        await stop_group(engines, transports)

    vclock.run(main())


def test_without_restore_only_the_own_shard_is_backed_up_and_put_back():
    """restore=False (the trainer's rounds: it holds the old values in its model): a completed round
    is exact and never writes the backup outside this member's shard; an aborted one puts back this
    member's own shard only, and other shards' chunks may hold their owner's result."""
    n, numel, chunk = 3, 3000, 256

    async def main():
        settings = dataclasses.replace(FAST, chunk_elements=chunk)
        engines, transports = await start_group(n, numel, settings=settings)
        bounds = shard_bounds(numel, n)
        for e in engines:
            e.inbox.backup.fill_(float("nan"))
        xs = [torch.randn(numel) for _ in range(n)]
        expect = weighted_mean(xs, [1.0, 2.0, 3.0])
        outcomes = await asyncio.gather(
            *(e.all_reduce(x, i + 1.0, 1, restore=False) for i, (e, x) in enumerate(zip(engines, xs)))
        )
        assert {o.status for o in outcomes} == {Status.COMPLETED}, [o.reason for o in outcomes]
        assert all(close(x, expect) for x in xs)
        for i, e in enumerate(engines):
            untouched = [e.inbox.backup[s:t] for j, (s, t) in enumerate(bounds) if j != i]
            assert all(torch.isnan(b).all() for b in untouched)
            s, t = bounds[i]
            assert not torch.isnan(e.inbox.backup[s:t]).any()  # the own shard: its contribution, read again

        # Member 2 stays silent in round 2: members 0 and 1 abort, having swapped shards 0 and 1.
        xs = [torch.randn(numel) for _ in range(2)]
        before = [x.clone() for x in xs]
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 2, restore=False) for e, x in zip(engines, xs)))
        assert {o.status for o in outcomes} == {Status.ABORTED}, [o.reason for o in outcomes]
        mean01 = [(before[0][s:t] + before[1][s:t]) / 2 for s, t in bounds[:2]]
        for i, (x, b) in enumerate(zip(xs, before)):
            s, t = bounds[i]
            assert torch.equal(x[s:t], b[s:t])  # own shard: put back
            s, t = bounds[1 - i]
            assert close(x[s:t], mean01[1 - i])  # the other member's shard: its result, left there
            s, t = bounds[2]
            assert torch.equal(x[s:t], b[s:t])  # the silent member's shard: never written
        await stop_group(engines, transports)

    uvloop.run(main())


def test_a_shard_that_reaches_only_some_members_makes_all_abort():
    """Owner 2's result reaches member 0 but not member 1 (as if owner 2 died while sending it):
    member 1 aborts, says so, and members 0 and 2, who hold the whole result, abort too."""
    n, numel = 3, 3000

    async def main():
        addresses = []
        lose = lambda to, h: h.kind is Kind.RESULT and to == addresses[1]  # noqa: E731
        engines, transports = await start_group(n, numel, wrap=lambda i, t: FilteredTransport(t, lose) if i == 2 else t)
        addresses += [t.address for t in transports]
        xs = [torch.randn(numel) for _ in range(n)]
        before = [x.clone() for x in xs]
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        assert {o.status for o in outcomes} == {Status.ABORTED}, [o.reason for o in outcomes]
        assert all(torch.equal(x, b) for x, b in zip(xs, before))
        await stop_group(engines, transports)

    uvloop.run(main())


def test_an_abort_heard_by_one_member_is_echoed_to_the_others():
    """Member 1 lacks shard 2 and its ABORT reaches member 2 only (as if it died while sending it).
    Member 2 echoes it, so member 0, who never hears member 1, aborts instead of completing at its
    verdict deadline."""
    n, numel = 3, 3000

    async def main():
        addresses = []

        def wrap(i, t):
            if i == 2:  # owner 2's result never reaches member 1
                return FilteredTransport(t, lambda to, h: h.kind is Kind.RESULT and to == addresses[1])
            if i == 1:  # member 1's verdict never reaches member 0
                return FilteredTransport(t, lambda to, h: h.kind is Kind.VERDICT and to == addresses[0])
            return t

        engines, transports = await start_group(n, numel, wrap=wrap)
        addresses += [t.address for t in transports]
        xs = [torch.randn(numel) for _ in range(n)]
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        assert {o.status for o in outcomes} == {Status.ABORTED}, [o.reason for o in outcomes]
        assert outcomes[0].reason == "member 2 aborted: echo"
        await stop_group(engines, transports)

    uvloop.run(main())


def test_early_messages_of_the_next_round_are_buffered():
    """Members 0 and 1 start round 2 while member 2 is still idle: their contributions and results
    wait in member 2's buffers, and the round completes once member 2 joins."""
    n, numel = 3, 3000

    async def main():
        engines, transports = await start_group(
            n, numel, settings=AllReduceSettings(contribute_timeout=2, gather_timeout=4)
        )
        xs = [torch.randn(numel) for _ in range(n)]
        await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        xs = [torch.randn(numel) for _ in range(n)]
        expect = weighted_mean(xs, [1.0] * n)
        early = [asyncio.create_task(e.all_reduce(x, 1.0, 2)) for e, x in zip(engines[:2], xs)]
        late, now = engines[2].inbox, asyncio.get_running_loop().time()
        # until member 2 holds both contributions to its shard
        assert await late.until(lambda: late.next is not None and late.next.contrib_have[:2] == [1, 1], now + 5)
        outcome = await engines[2].all_reduce(xs[2], 1.0, 2)
        outcomes = [outcome, *await asyncio.gather(*early)]
        assert {o.status for o in outcomes} == {Status.COMPLETED}, [o.reason for o in outcomes]
        assert all(close(x, expect) for x in xs)
        await stop_group(engines, transports)

    uvloop.run(main())


def test_a_member_that_starts_late_completes_with_results_parked_for_it():
    """Member 2 starts round 1 after the others' contribute deadline: owners 0 and 1 reduce without
    it and send their chunks to member 2 while it is idle (parked in its backup buffer). When it
    starts, it swaps them in, and every member completes with the same result."""
    n, numel = 3, 3000
    settings = AllReduceSettings(connect_timeout=0.2, contribute_timeout=0.2, gather_timeout=5.0, verdict_timeout=5.0)

    async def main():
        engines, transports = await start_group(n, numel, settings=settings)
        xs = [torch.randn(numel) for _ in range(n)]
        clean = [x.clone() for x in xs]
        early = [asyncio.create_task(e.all_reduce(x, 1.0, 1)) for e, x in zip(engines[:2], xs)]
        late, now = engines[2].inbox, asyncio.get_running_loop().time()
        # until both other owners' results wait in member 2's backup
        assert await late.until(lambda: late.next is not None and late.next.result_have[:2] == [1, 1], now + 5)
        outcomes = [await engines[2].all_reduce(xs[2], 1.0, 1), *await asyncio.gather(*early)]
        assert {o.status for o in outcomes} == {Status.COMPLETED}, [o.reason for o in outcomes]
        assert {o.coverage for o in outcomes} == {(2 / 3, 2 / 3, 1.0)} and len({o.digest for o in outcomes}) == 1
        (a0, b0), (a1, b1), (a2, b2) = shard_bounds(numel, n)
        for x in xs:
            assert close(x[a0:b1], (clean[0][a0:b1] + clean[1][a0:b1]) / 2)
            assert close(x[a2:b2], sum(c[a2:b2] for c in clean) / 3)
        await stop_group(engines, transports)

    uvloop.run(main())


# ---- real processes: SIGKILL and SIGSTOP mid-round ------------------------------------------------

PROCESS_SETTINGS = dict(
    connect_timeout=1.0, contribute_timeout=1.5, gather_timeout=3.0, verdict_timeout=1.5, drain_timeout=0.5
)
PROCESS_NUMEL = 2 * 1024 * 1024  # 8 MiB: a round lasts long enough for a signal to land inside it


def _member_main(me: int, n: int, rounds: int) -> None:
    """A member in its own process: prints its address, reads the group's, then runs a round each time
    it reads a line, printing one JSON line when it starts and one with the outcome (and a hash of
    its tensor)."""
    import hashlib

    def say(**fields) -> None:
        print(json.dumps(fields), flush=True)

    async def main():
        transport = TcpTransport("127.0.0.1", 0)
        say(address=await transport.start())
        addresses = json.loads(await asyncio.to_thread(sys.stdin.readline))
        group = Group(RUN, [f"m{i}" for i in range(n)], addresses, me)
        engine = GroupAllReduce(group, transport, PROCESS_NUMEL, settings=AllReduceSettings(**PROCESS_SETTINGS))
        x = torch.randn(PROCESS_NUMEL, generator=torch.Generator().manual_seed(me))
        for r in range(1, rounds + 1):
            await asyncio.to_thread(sys.stdin.readline)
            say(started=r)
            outcome = await engine.all_reduce(x, 1.0, r)
            say(
                round=r,
                status=outcome.status.value,
                reason=outcome.reason,
                tensor=hashlib.sha256(x.numpy()).hexdigest(),
            )
        await transport.close()

    uvloop.run(main())


class Member:
    def __init__(self, me: int, n: int, rounds: int):
        code = f"from tests.test_collective import _member_main; _member_main({me}, {n}, {rounds})"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name=f"member-{me}-stdout", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for text in self.proc.stdout:
            self.lines.put(text)
        self.lines.put("")  # end of output

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self, timeout: float) -> dict:
        try:
            text = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"member {self.proc.pid} said nothing within {timeout} s") from None
        assert text, f"member {self.proc.pid} exited with {self.proc.wait()}"
        return json.loads(text)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.reader.join(10)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_member_killed_or_frozen_mid_round_leaves_survivors_in_agreement(sig):
    n, rounds, victim = 3, 3, 2
    longest = AllReduceSettings(**PROCESS_SETTINGS).longest_round
    members = [Member(i, n, rounds) for i in range(n)]
    try:
        addresses = [m.line(timeout=30)["address"] for m in members]
        for m in members:
            m.tell(json.dumps(addresses))
        survivors = [m for i, m in enumerate(members) if i != victim]
        reports: list[dict[int, dict]] = [{}, {}]
        for m in members:  # round 1: everyone, undisturbed
            m.tell("go")
        for m in members:
            assert m.line(timeout=30) == {"started": 1}
            outcome = m.line(timeout=longest + 10)
            assert outcome["status"] == "completed", outcome
        for m in members:
            m.tell("go")
        assert members[victim].line(timeout=10) == {"started": 2}
        os.kill(members[victim].proc.pid, sig)  # a round of 8 MiB lasts tens of ms: this lands inside it
        killed_at = time.monotonic()
        for m, report in zip(survivors, reports):
            assert m.line(timeout=10) == {"started": 2}
            report[2] = m.line(timeout=longest + 5)
        assert time.monotonic() - killed_at < longest + 5
        for m in survivors:  # round 3: the survivors go on without the victim
            m.tell("go")
            assert m.line(timeout=10) == {"started": 3}
        for m, report in zip(survivors, reports):
            report[3] = m.line(timeout=longest + 5)
        print(json.dumps(reports))
        for r in (2, 3):  # the same decision and the same tensor on both survivors, whatever it was
            assert reports[0][r]["status"] == reports[1][r]["status"], reports
            assert reports[0][r]["tensor"] == reports[1][r]["tensor"], reports
        assert reports[0][3]["status"] == "aborted"  # the victim owns shard 2: no round completes without it
    finally:
        for m in members:
            m.kill()


# ---- compressed payloads (codec.py) -----------------------------------------------------------------


@pytest.mark.parametrize("payload, ratio", [("fp16", 0.5), ("int8", 0.2656), ("int4", 0.1406), ("int2", 0.0781)])
def test_compressed_payloads_give_the_mean_within_the_bound_in_identical_bytes_for_fewer_bytes(payload, ratio):
    """Four members, the same inputs through fp32 and through the compressed payload: every member
    holds the same bytes (one digest), within the documented bound of the float32 mean, and sends
    about `ratio` of fp32's bytes (int8: 1 + 4/64 bytes per value, int4 1/2 + 4/64, int2 1/4 + 4/64)."""
    n, numel = 4, 50_001
    xs = [torch.randn(numel) * (1 + 10 * (i == 2)) for i in range(n)]
    ws = [1.0, 2.0, 3.0, 4.0]
    expect = weighted_mean(xs, ws).numpy()

    async def one(fmt: str):
        settings = dataclasses.replace(LIVE, chunk_elements=8192, payload=fmt)
        engines, transports = await start_group(n, numel, settings=settings)
        held = [x.clone() for x in xs]
        outcomes = await asyncio.gather(*(e.all_reduce(x, w, 1) for e, x, w in zip(engines, held, ws)))
        await stop_group(engines, transports)
        assert [o.status for o in outcomes] == [Status.COMPLETED] * n, [o.reason for o in outcomes]
        assert len({o.digest for o in outcomes}) == 1 and outcomes[0].digest
        assert all(torch.equal(held[0], x) for x in held)  # the owners adopted what they sent
        return held[0].numpy(), sum(o.bytes_sent for o in outcomes)

    async def main():
        exact, fp32_bytes = await one("fp32")
        got, sent = await one(payload)
        assert np.all(np.abs(got - expect) <= mean_bound(xs, payload))
        assert not np.array_equal(got, exact)
        assert abs(sent / fp32_bytes - ratio) < 0.01, sent / fp32_bytes

    uvloop.run(main())


def test_garbage_in_compressed_chunks_is_refused_and_counted():
    """After an int8 round, forged chunks of the next round from a raw socket: a NaN or negative
    scale (codec_bad_scale), float32 where the run sends int8 (wire_bad_dtype), a length that is not
    the encoding of the count (wire_bad_size). Each is counted; nothing of them is kept."""
    n, numel, chunk = 3, 999, 256  # shard 0: 6 blocks of 64, chunks of 256 and 128

    async def main():
        rec = Rejections()
        settings = dataclasses.replace(LIVE, chunk_elements=chunk, payload="int8")
        engines, transports = await start_group(n, numel, events=rec.events, settings=settings)
        xs = [torch.randn(numel) for _ in range(n)]
        outcomes = await asyncio.gather(*(e.all_reduce(x, 1.0, 1) for e, x in zip(engines, xs)))
        assert [o.status for o in outcomes] == [Status.COMPLETED] * n and not rec.counts
        assert engines[0].inbox.bounds[0] == (0, 384)

        def chunk_bytes(count: int, scale: float) -> bytes:
            blocks = [struct.pack("<f", scale) + bytes(range(min(64, count - a))) for a in range(0, count, 64)]
            return b"".join(blocks)

        base = dict(
            kind=Kind.CONTRIBUTION, run_tag=run_tag(RUN), round=2, sender=1, shard=0, weight=1.0, dtype=DType.INT8_BLOCK
        )
        nan_scale = Header(**base, count=256).pack() + chunk_bytes(256, float("nan"))
        negative = Header(**base, offset=256, count=128).pack() + chunk_bytes(128, -1.0)
        as_fp32 = Header(**{**base, "dtype": DType.FLOAT32}, count=256).pack() + bytes(1024)
        h = Header(**base, count=256)
        short = HEADER.pack(b"PDCL", 1, h.kind, h.dtype, 0, h.run_tag, 2, 1, 0, 0, 256 + 3 * 4, 256, 0, 1.0, 0)
        host, port = transports[0].address.rsplit(":", 1)
        writers = []
        for message in (nan_scale, negative, as_fp32, short):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(message)
            writers.append(writer)
            await writer.drain()
            await rec.wait_for(lambda c: sum(c.values()) >= len(writers))
        assert rec.counts == {"codec_bad_scale": 2, "wire_bad_dtype": 1, "wire_bad_size": 1}
        st = engines[0].inbox.next
        assert st.contrib_have[1] == 0 and st.contrib_gone[1] == 0b11  # both chunks refused, neither kept
        for w in writers:
            w.close()
        await stop_group(engines, transports)

    uvloop.run(main())
