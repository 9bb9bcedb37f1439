"""DeAR over peerd's own engine: the reduce-scatter and all-gather primitives (peers/collective/halves.py)
and the EngineCollective backend (peers/dear/engine.py).

First the primitives alone: 3-4 members on one uvloop loop over real TCP on 127.0.0.1 (ports from
the OS); values are small integers, so every sum is exact in float32 and the mean can be checked bit
for bit. Faults through seams: a member that is never asked to run an op stays silent (frozen), a
transport closed under a member (dead), members that issue different ops. Then DeAR in real
processes (tests/test_dear.py's helpers, with backend="peerd"): every mode equals a plain all-reduce
over several steps on the digits MLP, and a peer that dies is an error, not a hang.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
import torch
import uvloop

from bench.dear import run_group
from peerd.peers.collective import Group, TcpTransport, shard_bounds
from peerd.peers.collective.fallback import FallbackTransport
from peerd.peers.collective.halves import Halves, HalvesSettings
from peerd.peers.collective.inbox import as_bytes
from peerd.peers.collective.transport import Link, Transport
from peerd.peers.collective.wire import HEADER_SIZE, Header, Kind
from peerd.peers.events import PeerEvents
from bench import vclock
from tests.memtransport import Hub
from tests.test_dear import EQUALITY_OP_TIMEOUT, OP_TIMEOUT, _equality_rank, _failure_rank

TIMEOUT = 0.5  # seconds one op may take in the in-process tests
# Tests that an error reaches every member at once run with a longer op timeout: an error found only
# by the timeout would take all of it, and half of it leaves room for a loaded machine's delays.
AT_ONCE_TIMEOUT = 4.0
RUN = "halves-test"


async def start_group(
    n: int,
    *,
    chunk: int = 512 * 1024,
    events: PeerEvents | None = None,
    fallback: bool = False,
    op_timeout: float = TIMEOUT,
):
    """n engines; `fallback`: over the daemon's FallbackTransport (direct TCP only: no p2pd here)."""
    if fallback:
        transports = [FallbackTransport("127.0.0.1", 0, p2p=None, mode="tcp", events=events) for _ in range(n)]
    else:
        transports = [TcpTransport("127.0.0.1", 0, events=events) for _ in range(n)]
    addresses = [await t.start() for t in transports]
    settings = HalvesSettings(op_timeout=op_timeout, connect_timeout=TIMEOUT, chunk_elements=chunk)
    members = [f"m{i}" for i in range(n)]
    halves = [
        Halves(Group(RUN, members, addresses, i), t, settings=settings, events=events) for i, t in enumerate(transports)
    ]
    return halves, transports


async def stop_group(halves, transports) -> None:
    for h in halves:
        await h.close()
    for t in transports:
        await t.close()


def integers(numel: int, seed: int) -> torch.Tensor:
    """Values whose weighted sums are exact in float32: the mean is then one correctly rounded division."""
    return torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(seed)).float()


def weighted_mean(xs, ws) -> torch.Tensor:
    return (sum(w * x.double() for w, x in zip(ws, xs)) / sum(ws)).float()


@pytest.mark.parametrize(
    "n, sizes, chunk, fallback",
    [
        (3, (1001, 12), 37, False),
        (4, (64 * 1024 + 3, 4), 4096, False),
        (3, (30, 6), 512 * 1024, False),
        (3, (1001, 12), 37, True),
    ],
)
def test_halves_give_each_owner_the_exact_mean_and_everyone_the_same_bytes(n, sizes, chunk, fallback):
    """Two buffers of different lengths, every op queued at once: RS(a), RS(b), AG(b), AG(a), three times."""

    async def main():
        halves, transports = await start_group(n, chunk=chunk, fallback=fallback)
        last = 0.0
        for r in range(3):
            xs = {numel: [integers(numel, 10 * r + i) for i in range(n)] for numel in sizes}
            ws = [1.0] * n if r < 2 else [float(i + 1) for i in range(n)]  # the last round weighted
            want = {numel: weighted_mean(x, ws) for numel, x in xs.items()}
            before = {numel: [x.clone() for x in x_] for numel, x_ in xs.items()}
            a, b = sizes
            ops = [
                [h.reduce_scatter(xs[a][i], ws[i]), h.reduce_scatter(xs[b][i], ws[i]), h.all_gather(xs[b][i])]
                for i, h in enumerate(halves)
            ]
            await asyncio.gather(*(o for member in ops for o in member))
            for i in range(n):  # after RS(a), before AG(a): the owner's shard is the mean, the others untouched
                for j, (start, end) in enumerate(shard_bounds(a, n)):
                    expect = want[a] if i == j else before[a][i]
                    assert torch.equal(xs[a][i][start:end], expect[start:end]), (r, i, j)
            gathers = [h.all_gather(xs[a][i]) for i, h in enumerate(halves)]
            await asyncio.gather(*gathers)
            for i in range(n):
                for numel in sizes:
                    assert torch.equal(xs[numel][i], want[numel]), (r, i, numel)
                member = [*ops[i], gathers[i]]
                assert [o.error for o in member] == [""] * 4
                assert [o.number for o in member] == [4 * r + k for k in range(4)]
                stamps = [t for o in member for t in (o.started, o.finished)]
                assert stamps == sorted(stamps) and stamps[0] >= last  # one after another, in call order
            last = max(g.finished for g in gathers)
        await stop_group(halves, transports)

    uvloop.run(main())


class HandDriven(Transport):
    """A transport the test drives by hand: what the member sends is recorded (`sent`), and the test
    hands the sink each header, then its payload, whenever it chooses. `send_raises`: every send
    raises, as a bug in a transport would; `connect_delay`: seconds each connect takes."""

    def __init__(self, *, send_raises: bool = False, connect_delay: float = 0.0):
        self.sink, self.send_raises, self.connect_delay = None, send_raises, connect_delay
        self.sent: list[Header] = []

    async def start(self) -> str:
        return "hand:0"

    def attach(self, sink) -> None:
        self.sink = sink

    async def connect(self, address: str) -> Link:
        await asyncio.sleep(self.connect_delay)
        return _Recorder(self.sent, self.send_raises)

    async def close(self) -> None:
        pass


class _Recorder(Link):
    def __init__(self, sent: list[Header], fails: bool):
        self.sent, self.fails, self._closed = sent, fails, False

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self.fails:
            raise RuntimeError("a transport bug")
        self.sent.append(header)
        return HEADER_SIZE + header.length

    async def drain(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._notify_closed()


class _From:
    """The connection a member's messages come in on (transport.Inbound)."""

    member = None

    def discard_payload(self) -> None:
        raise AssertionError("Halves never discards a payload it admitted")

    def close(self) -> None:  # Halves.close() closes the connections it was sent on
        pass


@pytest.fixture
def one_torch_thread():
    """As in DeAR's processes (bench/dear.py's run_group), where reduction.fold folds in one block."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_next_ops_chunk_whose_payload_lands_after_the_op_started_is_folded_in(one_torch_thread):
    """Ops are pipelined: member 1 finished op 0 and sent op 1's first chunk while member 0 was still
    in op 0. Its header is parked before op 1 starts here; its payload, spanning reads on a loaded
    machine, lands after. Op 1 opened with that sender's parked part still empty, and folding it
    (reduction.fold of nothing, on one torch thread) raised: the op's task died unresolved and DeAR
    hung ("the engine's loop did nothing"). The chunk must be folded in when it lands."""

    async def main():
        transport, link = HandDriven(), _From()
        group = Group(RUN, ["m0", "m1"], ["hand:0", "hand:1"], 0)
        halves = Halves(group, transport, settings=HalvesSettings(op_timeout=5.0, chunk_elements=2))
        mine = [integers(8, 0), integers(8, 1)]  # op 0 on one buffer, op 1 on another
        theirs = [integers(8, 10), integers(8, 11)]
        rs = [halves.reduce_scatter(x) for x in mine]
        (start, end), _ = shard_bounds(8, 2)  # member 0's shard: two chunks of 2 from member 1
        want = [weighted_mean([x, y], [1, 1])[start:end] for x, y in zip(mine, theirs)]

        def header(op: int, offset: int) -> Header:
            return Header(
                kind=Kind.CONTRIBUTION, run_tag=group.tag, round=op, sender=1, shard=0, offset=offset, count=2, weight=1
            )

        def deliver(h: Header, payload: bool = True) -> memoryview:
            dest = halves.inbox.on_header(link, h)
            assert isinstance(dest, memoryview), dest
            if payload:
                dest[:] = as_bytes(theirs[h.round][start + h.offset : start + h.offset + h.count])
                halves.inbox.on_payload(link, h)
            return dest

        async with asyncio.timeout(5):
            while not transport.sent:  # member 0 started op 0
                await asyncio.sleep(0)
        deliver(header(0, 0))
        deliver(header(0, 2))  # op 0 has all it needs: it ends once the loop runs its task
        early = header(1, 0)
        dest = deliver(early, payload=False)  # op 1's first header, before op 1 started here
        async with asyncio.timeout(5):
            await rs[0]
            while len(transport.sent) < 2:  # member 0 started op 1 (with the chunk above still arriving)
                await asyncio.sleep(0)
        dest[:] = as_bytes(theirs[1][start : start + 2])
        halves.inbox.on_payload(link, early)
        deliver(header(1, 2))
        async with asyncio.timeout(5):
            await rs[1]
        assert [op.error for op in rs] == ["", ""]
        for x, w in zip(mine, want):
            assert torch.equal(x[start:end], w)
        await halves.close()

    vclock.run(main())


def test_connecting_to_the_members_does_not_count_against_the_first_ops_limit():
    """The first op opens the links (connect_timeout bounds that), then its own limit starts: a
    connect slower than op_timeout, on a loaded machine, used to fail an op whose contributions all
    came in time."""

    async def main():
        transport, link = HandDriven(connect_delay=0.5), _From()
        group = Group(RUN, ["m0", "m1"], ["hand:0", "hand:1"], 0)
        settings = HalvesSettings(op_timeout=0.2, connect_timeout=5.0, chunk_elements=2)
        halves = Halves(group, transport, settings=settings)
        mine, theirs = integers(8, 0), integers(8, 1)
        (start, end), _ = shard_bounds(8, 2)
        want = weighted_mean([mine, theirs], [1, 1])[start:end]
        op = halves.reduce_scatter(mine)
        async with asyncio.timeout(5):
            while not transport.sent:  # connected (0.5 s), and the op started sending
                await asyncio.sleep(0.01)
        for offset in (0, 2):
            h = Header(
                kind=Kind.CONTRIBUTION, run_tag=group.tag, round=0, sender=1, shard=0, offset=offset, count=2, weight=1
            )
            halves.inbox.on_header(link, h)[:] = as_bytes(theirs[start + offset : start + offset + 2])
            halves.inbox.on_payload(link, h)
        async with asyncio.timeout(5):
            await op
        assert op.error == "" and torch.equal(mine[start:end], want), op.error
        await halves.close()

    vclock.run(main())


def test_an_exception_inside_an_op_fails_it_and_every_later_op_at_once():
    """Whatever raises in the engine's own code (here a link's send) ends the op with the exception's
    name as its error, at once: an op left unresolved would hold DeAR up until its watchdog."""

    async def main():
        group = Group(RUN, ["m0", "m1"], ["hand:0", "hand:1"], 0)
        halves = Halves(group, HandDriven(send_raises=True), settings=HalvesSettings(op_timeout=30.0))
        x = integers(8, 0)
        ops = [halves.reduce_scatter(x), halves.all_gather(x)]
        async with asyncio.timeout(5):
            await ops[1]
        assert ops[0].error == "reduce_scatter #0: RuntimeError: a transport bug", ops[0].error
        assert ops[1].error == ops[0].error
        await halves.close()

    vclock.run(main())


def test_a_silent_member_fails_the_op_exactly_at_its_limit_and_the_queued_op_with_it():
    """On virtual time (bench/vclock.py): the connect takes 0.5 s, then member 1 never sends. The op
    fails op_timeout after its connect, not a moment sooner, and the op queued behind it fails at
    the same instant: exact comparisons, no wall clock."""

    async def main():
        transport = HandDriven(connect_delay=0.5)
        group = Group(RUN, ["m0", "m1"], ["hand:0", "hand:1"], 0)
        settings = HalvesSettings(op_timeout=0.2, connect_timeout=5.0)
        halves = Halves(group, transport, settings=settings, clock=asyncio.get_running_loop().time)
        x = integers(8, 0)
        rs, ag = halves.reduce_scatter(x), halves.all_gather(x)
        await ag
        assert rs.error == "reduce_scatter #0: timed out after 0.2 s waiting for members [1]", rs.error
        assert ag.error == rs.error and ag.finished == rs.finished
        assert rs.finished - rs.started == pytest.approx(0.5 + 0.2, abs=1e-9)
        await halves.close()

    vclock.run(main())


def test_a_frozen_member_is_an_error_within_the_timeout_and_breaks_every_later_op():
    async def main():
        halves, transports = await start_group(3)
        xs = [integers(12, i) for i in range(3)]
        await asyncio.gather(*(h.reduce_scatter(x) for h, x in zip(halves, xs)))
        t0 = time.monotonic()
        ops = [(h.all_gather(x), h.reduce_scatter(x)) for h, x in zip(halves[:2], xs)]  # member 2 stays silent
        for ag, rs in ops:
            await rs
            assert "all_gather #1: timed out" in ag.error and "members [2]" in ag.error
            assert rs.error == ag.error and rs.finished - ag.finished < 0.1  # queued behind it: fails at once
        assert time.monotonic() - t0 < TIMEOUT + 0.3
        late = halves[0].all_gather(xs[0])
        assert (await late).error == ops[0][0].error
        await stop_group(halves, transports)

    uvloop.run(main())


def test_a_dead_member_fails_the_others_at_once():
    async def main():
        halves, transports = await start_group(3, op_timeout=AT_ONCE_TIMEOUT)
        xs = [integers(12, i) for i in range(3)]
        await asyncio.gather(*(h.reduce_scatter(x) for h, x in zip(halves, xs)))
        await transports[2].close()  # member 2's connections close, as when its process dies
        t0 = time.monotonic()
        ops = [h.all_gather(x) for h, x in zip(halves[:2], xs)]
        await asyncio.gather(*ops)
        assert all("closed" in op.error for op in ops), [op.error for op in ops]
        assert time.monotonic() - t0 < AT_ONCE_TIMEOUT / 2
        await stop_group(halves, transports)

    uvloop.run(main())


def test_on_virtual_time_a_dead_member_fails_the_others_without_any_time_passing():
    """test_a_dead_member_fails_the_others_at_once on the loop's clock made virtual and a transport in
    memory: "at once" is exact here, the op fails at the instant it started."""

    async def main():
        hub, loop = Hub(), asyncio.get_running_loop()
        transports = [hub.transport() for _ in range(3)]
        names = [f"m{i}" for i in range(3)], [t.address for t in transports]
        settings = HalvesSettings(op_timeout=AT_ONCE_TIMEOUT, connect_timeout=TIMEOUT, chunk_elements=4)
        halves = [
            Halves(Group(RUN, *names, i), t, settings=settings, clock=loop.time) for i, t in enumerate(transports)
        ]
        xs = [integers(12, i) for i in range(3)]
        await asyncio.gather(*(h.reduce_scatter(x) for h, x in zip(halves, xs)))
        await transports[2].close()
        t0 = loop.time()
        ops = [h.all_gather(x) for h, x in zip(halves[:2], xs)]
        await asyncio.gather(*ops)
        assert all("closed" in op.error for op in ops), [op.error for op in ops]
        assert loop.time() == t0 and all(op.finished == op.started for op in ops)
        await stop_group(halves, transports)

    vclock.run(main())


def test_a_member_that_dies_before_sending_anything_fails_the_op_at_once():
    """Member 1 never issues an op, so nothing arrives from it and only the link member 0 dialed to
    it can tell that it went: that link's close (Link.on_close) fails member 0's op at once, not at
    its timeout."""

    async def main():
        transports = [TcpTransport("127.0.0.1", 0) for _ in range(2)]
        addresses = [await t.start() for t in transports]
        settings = HalvesSettings(op_timeout=10.0, connect_timeout=TIMEOUT)
        halves = [
            Halves(Group(RUN, ["m0", "m1"], addresses, i), t, settings=settings) for i, t in enumerate(transports)
        ]
        op = halves[0].reduce_scatter(integers(12, 0))
        async with asyncio.timeout(5):
            while halves[0].links[1] is None or not transports[1]._inbound:  # member 0 has dialed and sent
                await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await transports[1].close()  # as when member 1's process dies
        await op
        assert "connection to member 1 closed" in op.error, op.error
        assert time.monotonic() - t0 < 1.0
        await stop_group(halves, transports)

    uvloop.run(main())


@pytest.mark.parametrize("fault", ["other_kind", "other_length", "nonfinite"])
def test_members_issuing_different_ops_or_nonfinite_values_fail_at_once_and_are_counted(fault):
    async def main():
        counts = collections.Counter()
        events = PeerEvents(rejected=lambda reason: counts.update([reason]))
        halves, transports = await start_group(3, events=events, op_timeout=AT_ONCE_TIMEOUT)
        xs = [integers(12, i) for i in range(3)]
        if fault == "nonfinite":
            xs[1][0] = float("nan")  # lands in member 0's shard
        t0 = time.monotonic()
        ops = [h.reduce_scatter(x) for h, x in zip(halves[:2], xs)]
        if fault == "other_kind":
            ops.append(halves[2].all_gather(xs[2]))
        else:
            ops.append(halves[2].reduce_scatter(integers(15, 2) if fault == "other_length" else xs[2]))
        after = [h.all_gather(xs[i]) for i, h in enumerate(halves)]  # the others may complete the first op
        await asyncio.gather(*ops, *after)
        assert ops[0].error and all(op.error for op in after), [op.error for op in ops + after]
        assert time.monotonic() - t0 < AT_ONCE_TIMEOUT / 2  # member 0 broke and closed its connections: nobody waits
        reason = {
            "other_kind": "wire_bad_kind",
            "other_length": "wire_bad_size",
            "nonfinite": "contribution_nonfinite",
        }[fault]
        assert counts[reason] >= 1, counts
        await stop_group(halves, transports)

    uvloop.run(main())


# ---- DeAR over EngineCollective in real processes -------------------------------------------------


@pytest.mark.timeout(180)  # a bound on a hang (as test_dear's Gloo equality test)
def test_dear_over_the_engine_equals_a_plain_all_reduce_over_several_steps():
    world = 3  # shards of unequal parameter boundaries, padded buckets
    results = run_group(_equality_rank, world, "peerd", timeout=160, op_timeout=EQUALITY_OP_TIMEOUT)
    assert all(status == "ok" for status, _ in results), results
    reports = [value for _, value in results]
    for name in ("dear", "dear_adam", "dear_nofusion_then_tuned", "ddp", "after_backward"):
        assert all(r[name]["err"] < 1e-5 for r in reports), (name, [r[name] for r in reports])
        assert len({r[name]["digest"] for r in reports}) == 1, name  # replicas bitwise identical
        assert len({str(r[name]["sizes"]) for r in reports}) == 1, name  # one plan on every rank
    assert reports[0]["dear_nofusion_then_tuned"]["sizes"][1] == reports[0]["dear"]["sizes"][0]  # re-planned


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "stop"])
def test_dear_over_the_engine_turns_a_dead_or_frozen_peer_into_an_error(how):
    results = run_group(_failure_rank, 3, how, "peerd", timeout=40, op_timeout=OP_TIMEOUT, wait_for=[0, 2])
    for status, report in (results[0], results[2]):
        assert status == "ok", report
        assert report["raised"] and report["again"].startswith("the group is broken"), report
        if how == "exit":  # its connections close: at once
            assert report["elapsed"] < 2.0 and "closed" in report["error"], report
        else:  # after the op timeout (on one member; the others see its connections close), plus the ops queued ahead
            assert report["elapsed"] < 3 * OP_TIMEOUT and (
                "timed out" in report["error"] or "closed" in report["error"]
            ), report
    assert results[1][0] == ("exited" if how == "exit" else "killed")
