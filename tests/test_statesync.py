"""State sync: the choice rule alone, then real PeerNodes on loopback serving and fetching snapshots.

Faults are injected through a seam: the node a StateServer registers its handlers on can wrap the
chunk handler (flip bytes, kill the node after N chunks, hold answers back).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import torch

from peerd.peers.events import PeerEvents
from peerd.peers.run_ids import RunSecret, run_dht_key
from peerd.peers.state_tcp import TcpLink, parse_address
from peerd.peers.statesync import (
    CHUNK_HANDLER,
    HOLD_IDLE,
    INFO_HANDLER,
    Snapshot,
    StateServer,
    SnapshotInfo,
    choose_snapshot,
    fetch_state,
    state_tag,
)
from peerd.protos import state_pb2 as pb
from tests.helpers import peer_nodes as started

RUN = "sync"
CHUNK = 256 << 10
NUMEL = 3_000_000  # 12 MB: 46 chunks of 256 KiB, the last one shorter


def vector(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def info(step: int, seed: int) -> SnapshotInfo:
    return SnapshotInfo.of(Snapshot(step, vector(seed, 5000)), 4096)


def test_choice_takes_the_highest_step_then_the_id_most_donors_hold():
    a, b, c = info(7, 1), info(7, 2), info(5, 3)
    chosen, holders, reason = choose_snapshot({"d1": a, "d2": b, "d3": b, "d4": c}, min_step=0)
    assert (chosen, holders) == (b, ["d2", "d3"]) and "1 other id" in reason
    chosen, holders, reason = choose_snapshot({"d1": c}, min_step=6)
    assert chosen is None and holders == [] and "steps [5]" in reason
    assert a.consistent() and not SnapshotInfo(a.id, 8, a.numel, a.chunk_bytes, a.hashes).consistent()
    assert info(7, 1).id == a.id  # content-addressed: same bytes, same step, same id


def test_snapshots_and_servers_refuse_bad_shapes():
    with pytest.raises(ValueError):
        Snapshot(1, torch.zeros(4, 4))
    with pytest.raises(ValueError):
        Snapshot(1, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError):
        StateServer(object(), PeerEvents(), chunk_bytes=1000)


class HandlerSeam:
    """A PeerNode as a StateServer sees it, whose chunk handler goes through wrap(handler, node)."""

    def __init__(self, node, wrap):
        self._node, self._wrap = node, wrap

    def __getattr__(self, name):
        return getattr(self._node, name)

    async def add_handler(self, name, handler, request_type):
        if name == CHUNK_HANDLER:
            handler = self._wrap(handler, self._node)
        await self._node.add_handler(name, handler, request_type)


async def serve(node, provider, rejected: list[str], *, secret=None, wrap=None, keep=3, tcp=False) -> StateServer:
    events = PeerEvents(rejected=rejected.append)
    node = HandlerSeam(node, wrap) if wrap else node
    server = StateServer(node, events, chunk_bytes=CHUNK, keep=keep, tcp_host="127.0.0.1" if tcp else None)
    await server.start()
    server.serve(RUN, secret, provider)
    return server


def fixed(snapshot: Snapshot):
    return lambda: snapshot


def ids(nodes) -> list[str]:
    return [n.peer_id for n in nodes]


def test_three_donors_serve_one_fetcher_bit_identical_into_its_buffer(tmp_path):
    async def scenario():
        served: list[str] = []
        async with started(4, tmp_path) as (*donors, me):
            snapshot = Snapshot(42, vector(0))
            for d in donors:
                await serve(d, fixed(Snapshot(42, snapshot.tensor.clone())), served)
            out = torch.empty(NUMEL)
            r = await fetch_state(me, RUN, None, ids(donors), min_step=40, out=out, parallel=6, timeout=30)
            assert r.ok, r.reason
            assert r.tensor is out and torch.equal(out, snapshot.tensor)
            assert (r.step, r.bytes, r.partial) == (42, NUMEL * 4, None)
            assert len(r.donors_used) > 1, r.donors_used
        assert served == []

    asyncio.run(scenario())


def flip_bytes(handler, node):
    async def corrupt(request, context):
        response = await handler(request, context)
        response.data = bytes(b ^ 0xFF for b in response.data[:64]) + response.data[64:]
        return response

    return corrupt


def test_a_corrupted_donor_is_dropped_and_its_chunks_come_from_the_others(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with started(4, tmp_path) as (*donors, me):
            snapshot = Snapshot(3, vector(1))
            for i, d in enumerate(donors):
                await serve(d, fixed(snapshot), [], wrap=flip_bytes if i == 0 else None)
            events = PeerEvents(rejected=rejected.append)
            r = await fetch_state(me, RUN, None, ids(donors), parallel=6, timeout=30, events=events)
            assert r.ok, r.reason
            assert torch.equal(r.tensor, snapshot.tensor)
            assert donors[0].peer_id not in r.donors_used and "bad hash" in r.reason
        assert set(rejected) == {"state_bad_chunk"}

    asyncio.run(scenario())


def die_after(n: int, tasks: list):
    """The node answers n chunk requests, then shuts down; nothing it is asked meanwhile gets an answer."""

    def wrap(handler, node):
        count = 0

        async def dying(request, context):
            nonlocal count
            count += 1
            if count == n:
                tasks.append(asyncio.create_task(node.shutdown()))
            elif count > n:
                raise ConnectionResetError("shutting down")
            return await handler(request, context)

        return dying

    return wrap


def test_a_donor_that_dies_mid_download_is_dropped_and_the_others_finish(tmp_path):
    async def scenario():
        tasks: list = []
        async with started(4, tmp_path) as (*donors, me):
            snapshot = Snapshot(9, vector(2))
            for i, d in enumerate(donors):
                await serve(d, fixed(snapshot), [], wrap=die_after(3, tasks) if i == 0 else None)
            r = await fetch_state(me, RUN, None, ids(donors), parallel=6, request_timeout=5, timeout=30)
            assert r.ok, r.reason
            assert torch.equal(r.tensor, snapshot.tensor)
            assert donors[0].peer_id[:12] in r.reason and set(r.donors_used) - {donors[0].peer_id}
            await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_when_every_donor_dies_the_verified_chunks_are_kept_for_a_resume(tmp_path):
    """The first download ends by cancelling a worker whose request may be answered at that moment:
    the fetcher's p2p client must answer its later calls (peers/late_answers.py). A dead donor fails
    a request at once (connection refused or reset), so the request timeout is only a backstop, set
    well above what a healthy answer takes on a loaded machine."""

    async def scenario():
        tasks: list = []
        async with started(4, tmp_path) as (a, b, fresh, me):
            snapshot = Snapshot(9, vector(3))
            for d in (a, b):
                await serve(d, fixed(snapshot), [], wrap=die_after(5, tasks))
            first = await fetch_state(me, RUN, None, ids([a, b]), parallel=2, request_timeout=30, timeout=120)
            assert not first.ok and "every holder dropped" in first.reason
            kept = len(first.partial.verified)
            assert 0 < kept < 46 and first.tensor is None
            await serve(fresh, fixed(snapshot), [])
            donors = ids([a, b, fresh])  # the dead ones too: their info requests fail fast
            second = await fetch_state(me, RUN, None, donors, resume=first.partial, request_timeout=30, timeout=120)
            assert second.ok, second.reason
            assert torch.equal(second.tensor, snapshot.tensor) and second.tensor is first.partial.tensor
            assert f"{kept} kept from resume" in second.reason and second.bytes < NUMEL * 4
            await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_secret_run_serves_only_peers_that_hold_the_secret(tmp_path):
    async def scenario():
        rejected: list[str] = []
        secret = RunSecret.from_bytes(b"k" * 32, RUN)
        async with started(4, tmp_path) as (a, b, me, mallory):
            snapshot = Snapshot(5, vector(4, 200_000))
            for d in (a, b):
                await serve(d, fixed(snapshot), rejected, secret=secret)
            donors = ids([a, b])
            r = await fetch_state(me, RUN, None, donors, request_timeout=5, timeout=10)
            assert not r.ok and r.partial is None
            assert Counter(rejected) == {"state_unknown_run": 2}
            # Whoever reads the DHT knows key_id (it names the run's keys), but not the seal key.
            eavesdropper = RunSecret(key_id=secret.key_id, seal_key=b"x" * 32, engine_key=b"x" * 32)
            r = await fetch_state(me, RUN, eavesdropper, donors, request_timeout=5, timeout=10)
            assert not r.ok and Counter(rejected) == {"state_unknown_run": 2, "state_bad_tag": 2}
            # A request captured from `me` is refused when another peer sends it.
            tag = state_tag(secret, me.peer_id, a.peer_id, b"info")
            captured = pb.StateInfoRequest(run_key=run_dht_key(RUN, secret), tag=tag)
            answer = await mallory.call(a.peer_id, INFO_HANDLER, captured, pb.StateInfoResponse, 5)
            assert answer.status == pb.STATE_STATUS_REFUSED and rejected.count("state_bad_tag") == 3
            rejected.clear()
            r = await fetch_state(me, RUN, secret, donors, request_timeout=5, timeout=10)
            assert r.ok and torch.equal(r.tensor, snapshot.tensor), r.reason
        assert rejected == []

    asyncio.run(scenario())


def test_the_highest_step_wins_and_a_snapshot_replaced_mid_download_still_completes(tmp_path):
    async def scenario():
        rejected: list[str] = []
        old, new, newer = Snapshot(7, vector(5)), Snapshot(8, vector(6)), Snapshot(9, vector(7, 1000))
        current = {"snapshot": old}
        replaced, proceed = asyncio.Event(), asyncio.Event()

        def hold_old_chunks(handler, node):
            async def held(request, context):
                if request.snapshot_id == downloading[0]:
                    current["snapshot"] = new  # the trainer publishes the next round's state
                    replaced.set()
                    await proceed.wait()  # until a peer has been handed the new one
                return await handler(request, context)

            return held

        async with started(5, tmp_path) as (stale, a, b, me, other):
            downloading = [SnapshotInfo.of(old, CHUNK).id]
            await serve(stale, fixed(Snapshot(6, vector(8))), rejected)
            for d in (a, b):
                await serve(d, lambda: current["snapshot"], rejected, wrap=hold_old_chunks, keep=2)
            donors = ids([stale, a, b])
            fetching = asyncio.create_task(fetch_state(me, RUN, None, donors, request_timeout=10, timeout=30))
            await replaced.wait()
            second = await fetch_state(other, RUN, None, donors, min_step=8, timeout=30)
            assert second.ok and second.step == 8 and torch.equal(second.tensor, new.tensor), second.reason
            proceed.set()
            first = await fetching
            assert first.ok and first.step == 7 and torch.equal(first.tensor, old.tensor), first.reason
            assert stale.peer_id not in first.donors_used
            # keep=2: once a third snapshot is handed out, the first one is gone.
            current["snapshot"] = newer
            third = await fetch_state(other, RUN, None, ids([a]), timeout=10)
            assert third.ok and third.step == 9
            gone = pb.StateChunkRequest(run_key=run_dht_key(RUN, None), snapshot_id=downloading[0], index=0)
            answer = await me.call(a.peer_id, CHUNK_HANDLER, gone, pb.StateChunkResponse, 5)
            assert answer.status == pb.STATE_STATUS_GONE
        assert rejected == ["state_unknown_snapshot"]

    asyncio.run(scenario())


def test_bad_requests_are_refused_and_counted(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with started(2, tmp_path) as (donor, me):
            snapshot = Snapshot(1, vector(9, 100_000))
            await serve(donor, fixed(snapshot), rejected)
            key = run_dht_key(RUN, None)
            sid = SnapshotInfo.of(snapshot, CHUNK).id
            ask = pb.StateInfoRequest(run_key=key)  # a donor serves only the snapshots it has described
            described = await me.call(donor.peer_id, INFO_HANDLER, ask, pb.StateInfoResponse, 5)
            assert (described.snapshot_id, described.numel, len(described.chunk_hashes)) == (sid, 100_000, 2)
            calls = [
                (pb.StateChunkRequest(run_key=key, snapshot_id=sid, index=2), pb.STATE_STATUS_REFUSED),  # 2 chunks
                (pb.StateChunkRequest(run_key=key, snapshot_id=b"\1" * 16, index=0), pb.STATE_STATUS_GONE),
                (pb.StateChunkRequest(run_key=key, snapshot_id=b"\1" * 3, index=0), pb.STATE_STATUS_REFUSED),
                (pb.StateChunkRequest(run_key="peerd/v1/run/other/members", snapshot_id=sid), pb.STATE_STATUS_REFUSED),
                (pb.StateChunkRequest(run_key=key * 100, snapshot_id=sid), pb.STATE_STATUS_REFUSED),
            ]
            for request, status in calls:
                answer = await me.call(donor.peer_id, CHUNK_HANDLER, request, pb.StateChunkResponse, 5)
                assert (answer.status, answer.data) == (status, b"")
            ok = pb.StateChunkRequest(run_key=key, snapshot_id=sid, index=1)
            answer = await me.call(donor.peer_id, CHUNK_HANDLER, ok, pb.StateChunkResponse, 5)
            assert answer.status == pb.STATE_STATUS_OK and len(answer.data) == 100_000 * 4 - CHUNK
        assert rejected == [
            "state_bad_index",
            "state_unknown_snapshot",
            "state_malformed",
            "state_unknown_run",
            "state_malformed",
        ]

    asyncio.run(scenario())


def test_chunks_come_over_direct_tcp_where_donors_listen_and_a_corrupted_donor_is_dropped(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with started(4, tmp_path) as (*donors, me):
            snapshot = Snapshot(3, vector(10))
            copies = [Snapshot(3, snapshot.tensor.clone()) for _ in donors]
            servers = [await serve(d, fixed(c), rejected, tcp=True) for d, c in zip(donors, copies)]
            ask = pb.StateInfoRequest(run_key=run_dht_key(RUN, None))
            described = await me.call(donors[0].peer_id, INFO_HANDLER, ask, pb.StateInfoResponse, 5)
            assert described.tcp_address == servers[0].tcp_address and parse_address(described.tcp_address)
            copies[0].tensor[1::1000] += 1.0  # after it was described: its chunks no longer match their hashes
            out = torch.empty(NUMEL)
            events = PeerEvents(rejected=rejected.append)
            r = await fetch_state(me, RUN, None, ids(donors), out=out, parallel=6, timeout=30, events=events)
            assert r.ok and torch.equal(out, snapshot.tensor), r.reason
            assert r.direct_bytes == r.bytes == NUMEL * 4 and "over direct TCP" in r.reason
            assert donors[0].peer_id not in r.donors_used and "bad hash" in r.reason
            for server in servers:
                await server.stop()
        assert set(rejected) == {"state_bad_chunk"}

    asyncio.run(scenario())


def test_a_donor_whose_listener_is_gone_serves_through_p2pd(tmp_path):
    async def scenario():
        async with started(2, tmp_path) as (donor, me):
            snapshot = Snapshot(4, vector(11))
            server = await serve(donor, fixed(snapshot), [], tcp=True)
            await server.stop()  # still advertised: the fetcher's connect is refused
            r = await fetch_state(me, RUN, None, ids([donor]), parallel=4, timeout=30)
            assert r.ok and torch.equal(r.tensor, snapshot.tensor), r.reason
            assert r.direct_bytes == 0 and r.bytes == NUMEL * 4

    asyncio.run(scenario())


def test_direct_tcp_requests_are_checked_as_through_p2pd(tmp_path):
    async def scenario():
        rejected: list[str] = []
        secret = RunSecret.from_bytes(b"k" * 32, RUN)
        async with started(2, tmp_path) as (donor, me):
            snapshot = Snapshot(6, vector(12, 100_000))
            server = await serve(donor, fixed(snapshot), rejected, secret=secret, tcp=True)
            r = await fetch_state(me, RUN, secret, ids([donor]), timeout=10)
            assert r.ok and r.direct_bytes == r.bytes == 100_000 * 4, r.reason
            sid, key = r.snapshot_id, run_dht_key(RUN, secret)
            link = await TcpLink.open(*parse_address(server.tcp_address))
            into = memoryview(bytearray(CHUNK))

            async def ask(caller: str, tag_for: str, index: int = 0) -> int:
                tag = state_tag(secret, tag_for, donor.peer_id, b"chunk", sid, index)
                request = pb.StateChunkRequest(run_key=key, snapshot_id=sid, index=index, tag=tag, caller=caller)
                status, size = await link.ask(request.SerializeToString(), into)
                assert size == (CHUNK if status == pb.STATE_STATUS_OK else 0)
                return status

            assert await ask(me.peer_id, me.peer_id) == pb.STATE_STATUS_OK
            assert bytes(into) == bytes(memoryview(snapshot.tensor.numpy()).cast("B")[:CHUNK])
            # A request captured from `me`, sent in another peer's name, and one for a chunk past the end.
            assert await ask("QmMallory", me.peer_id) == pb.STATE_STATUS_REFUSED
            assert await ask(me.peer_id, me.peer_id, index=2) == pb.STATE_STATUS_REFUSED
            link.close()
            # A frame longer than any request ends the connection.
            reader, writer = await asyncio.open_connection(*parse_address(server.tcp_address))
            writer.write((1 << 20).to_bytes(4, "little"))
            assert await reader.read() == b""
            writer.close()
            await server.stop()
        assert rejected == ["state_bad_tag", "state_bad_index", "state_malformed"]

    asyncio.run(scenario())


def test_a_held_snapshot_no_request_touched_for_a_while_is_let_go_but_the_current_one_stays(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with started(2, tmp_path) as (donor, me):
            current = {"snapshot": Snapshot(1, vector(13, 10_000))}
            server = await serve(donor, lambda: current["snapshot"], rejected)
            key = run_dht_key(RUN, None)
            ask = pb.StateInfoRequest(run_key=key)
            old = (await me.call(donor.peer_id, INFO_HANDLER, ask, pb.StateInfoResponse, 5)).snapshot_id
            current["snapshot"] = Snapshot(2, vector(14, 10_000))  # the next round's
            new = (await me.call(donor.peer_id, INFO_HANDLER, ask, pb.StateInfoResponse, 5)).snapshot_id
            assert server.release_idle(time.monotonic() + HOLD_IDLE / 2) == 0  # a download may still want it
            assert server.release_idle(time.monotonic() + HOLD_IDLE + 1) == 1
            for sid, status in ((old, pb.STATE_STATUS_GONE), (new, pb.STATE_STATUS_OK)):
                request = pb.StateChunkRequest(run_key=key, snapshot_id=sid, index=0)
                answer = await me.call(donor.peer_id, CHUNK_HANDLER, request, pb.StateChunkResponse, 5)
                assert answer.status == status
            await server.stop()
        assert rejected == ["state_unknown_snapshot"]

    asyncio.run(scenario())
