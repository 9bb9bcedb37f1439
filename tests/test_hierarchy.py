"""The hierarchy (peers/dear/hierarchy.py): a local group averages its state over the WAN as one big
peer, each member its own lanes, between a reduce-scatter and an all-gather of peerd's engine.

The lane arithmetic is tested as pure functions. The round itself runs on real EngineCollectives
(one uvloop thread each, TCP on 127.0.0.1) with one trainer thread per member; the WAN rounds are
a stand-in that writes known values into the member's lanes (the real rounds are the daemons' in
tests/test_local_group.py), so the test can check exactly what each member ends with.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from peerd.peers.dear.engine import EngineCollective
from peerd.peers.dear.hierarchy import (
    LaneExchange,
    delegated_mask,
    group_id,
    hierarchical_round,
    lane_bounds,
    lane_view,
    owned_lanes,
)

OP_TIMEOUT = 1.0  # the DeAR ops' own limit in these tests


@pytest.mark.parametrize("n, lanes", [(10, 1), (10, 3), (1001, 64), (64, 64)])
def test_lanes_cut_the_vector_into_near_equal_contiguous_slices(n, lanes):
    bounds = lane_bounds(n, lanes)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) == lanes
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_bad_lane_arguments_are_refused():
    with pytest.raises(ValueError):
        lane_bounds(3, 4)
    with pytest.raises(ValueError):
        lane_bounds(10, 0)
    with pytest.raises(ValueError):
        owned_lanes(4, 2, 2)


@pytest.mark.parametrize("lanes, size", [(1, 3), (4, 3), (8, 2), (2, 5)])
def test_every_lane_has_exactly_one_owner_in_a_group_and_the_others_delegate_it(lanes, size):
    owners = [owned_lanes(lanes, size, r) for r in range(size)]
    assert sorted(lane for o in owners for lane in o) == list(range(lanes))
    for r in range(size):
        mask = delegated_mask(lanes, size, r)
        assert all((mask >> lane & 1) == (lane not in owners[r]) for lane in range(lanes))
        assert mask >> lanes == 0
    if size > lanes:
        assert owners[-1] == ()  # a member beyond the lanes averages nothing over the WAN


def test_a_lane_view_leaves_out_the_peers_that_delegated_it_to_a_live_owner():
    g = group_id(["b", "c"])
    assert g == group_id(["c", "b"]) and g != group_id(["b", "c", "d"])
    peers = {"a": (0, ""), "b": (0b10, g), "c": (0b01, g)}  # group {b, c}: b delegated lane 1 to c, c lane 0 to b
    assert lane_view("me", (0, 1), "", peers, 0) == ["a", "b", "me"]
    assert lane_view("me", (0, 1), "", peers, 1) == ["a", "c", "me"]
    assert lane_view("me", (1,), "", peers, 0) == ["a", "b"]  # nor does this daemon, if it does not average it
    # b's group broke (or b is b: it is no longer in the group): c's delegation of lane 0 has no
    # taker any more, so c counts, alone, until its next heartbeat says so.
    alone = {"a": (0, ""), "c": (0b01, g)}
    assert lane_view("b", (0, 1), "", alone, 0) == ["a", "b", "c"]
    assert lane_view("b", (0,), g, alone, 0) == ["a", "b"]  # b still in the group: it averages lane 0 for c


def _group(k: int, timeout: float = OP_TIMEOUT) -> list[EngineCollective]:
    members = [EngineCollective(rank=r, world=k, timeout=timeout) for r in range(k)]
    addresses = [m.start() for m in members]
    for m in members:
        m.join(addresses)
    return members


def _run_members(k: int, target) -> list:
    out: list = [None] * k
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, target(r))) for r in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize("k, lanes", [(3, 4), (3, 2), (2, 1)])
def test_each_owner_averages_the_groups_mean_of_its_lanes_and_everyone_ends_with_every_lane(k, lanes):
    """Members start from different vectors (their mean is what an owner sends to the WAN) and
    weights (the group's sum is the WAN weight). The stand-in WAN round of lane l writes 100 + l
    into it; one owner takes longer than the DeAR op timeout, which the all-gather must wait out."""
    n = 1000
    bounds = lane_bounds(n, lanes)
    collectives = _group(k)
    vectors = [torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(k)]
    mean = sum(v.double() for v in vectors) / k
    weights = [10.0 * (r + 1) for r in range(k)]
    seen: dict[int, tuple] = {}

    def member(rank: int):
        exchange = LaneExchange(n, lanes, k)

        def wan(vector, weight, mine):
            seen[rank] = (weight, [vector[s:e].clone() for s, e in (bounds[lane] for lane in mine)], tuple(mine))
            if rank == 0:
                time.sleep(OP_TIMEOUT * 2)  # the others wait at the all-gather beyond the op timeout
            for lane in mine:
                s, e = bounds[lane]
                vector[s:e] = 100.0 + lane
            return [f"lane {lane}" for lane in mine]

        return hierarchical_round(
            collectives[rank], exchange, rank, vectors[rank], weights[rank], wan, gather_timeout=10.0
        )

    try:
        done = _run_members(k, member)
    finally:
        for c in collectives:
            c.close()
    want = torch.cat([torch.full((e - s,), 100.0 + lane) for lane, (s, e) in enumerate(bounds)])
    for rank in range(k):
        assert done[rank].gathered and not done[rank].error, done[rank]
        assert torch.equal(vectors[rank], want), rank  # every lane, from its owner, on every member
        mine = owned_lanes(lanes, k, rank)
        if not mine:
            assert rank not in seen and done[rank].results == []
            continue
        weight, slices, lanes_seen = seen[rank]
        assert lanes_seen == mine and weight == pytest.approx(sum(weights))
        for (s, e), got in zip((bounds[lane] for lane in mine), slices):
            assert torch.allclose(got.double(), mean[s:e], rtol=1e-6)


def test_a_member_that_dies_during_the_wan_rounds_breaks_the_group_and_the_others_keep_their_own_lanes():
    n, lanes, k = 600, 3, 3
    bounds = lane_bounds(n, lanes)
    collectives = _group(k)
    vectors = [torch.full((n,), float(r)) for r in range(k)]
    # Member 2 dies once every member is in its WAN rounds: its own reduce-scatter can finish while
    # its last chunk is still on the way to another member, and closing then fails the reduce-scatter.
    in_wan = threading.Barrier(k, timeout=OP_TIMEOUT)

    def member(rank: int):
        exchange = LaneExchange(n, lanes, k)

        def wan(vector, weight, mine):
            in_wan.wait()
            if rank == 2:
                collectives[2].close()  # dies: its connections close
            for lane in mine:
                s, e = bounds[lane]
                vector[s:e] = 100.0 + lane
            return []

        return hierarchical_round(collectives[rank], exchange, rank, vectors[rank], 1.0, wan, gather_timeout=10.0)

    try:
        started = time.monotonic()
        done = _run_members(k, member)
        took = time.monotonic() - started
    finally:
        for c in collectives:
            c.close()
    assert took < OP_TIMEOUT + 5, took  # a closed connection fails the all-gather at once, not at 10 s
    for rank in (0, 1):
        assert not done[rank].gathered and "all-gather" in done[rank].error, done[rank]
        s, e = bounds[rank]
        assert torch.equal(vectors[rank][s:e], torch.full((e - s,), 100.0 + rank))  # its own lane: averaged
        other = bounds[1 - rank]
        assert torch.equal(
            vectors[rank][other[0] : other[1]], torch.full((other[1] - other[0],), float(rank))
        )  # the rest: as it was


def test_a_per_op_timeout_is_refused_where_the_backend_cannot_honour_it():
    from peerd.peers.dear.fake import FakeFabric  # noqa: PLC0415 - only this test needs the fake

    fake = FakeFabric(world=2).endpoint(0)
    rs = fake.reduce_scatter(torch.zeros(4))
    with pytest.raises(ValueError, match="per-op timeout"):
        fake.all_gather(rs, timeout=5.0)
    collective = EngineCollective(rank=0, world=1, timeout=1.0)  # honours one, but not a nonsensical one
    with pytest.raises(ValueError, match="per-op timeout"):
        collective.all_gather(rs, timeout=-1.0)


def test_a_lane_whose_round_fails_is_a_result_not_an_error_and_the_other_lanes_go_on():
    """MoshpitAverager with a matchmaker that fails for lane 0 only: lane 0's result says why, lane
    1 finds nobody (a solo round), and the vector is untouched."""
    import asyncio  # noqa: PLC0415 - only this test runs a loop

    from peerd.peers.averaging import MoshpitAverager  # noqa: PLC0415
    from peerd.peers.matchmaking import Matched  # noqa: PLC0415

    class Matchmaker:
        async def form_group(self, namespace, secret, round_t, key, me, mates=()):
            if namespace.endswith("/lane0"):
                raise RuntimeError("matchmaking broke")
            return Matched(None, "alone: nobody joined")

    averager = MoshpitAverager(
        run_id="r",
        secret=None,
        peer_id="me",
        matchmaker=Matchmaker(),
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        max_group_size=16,
        lanes=2,
    )
    vector = torch.arange(10, dtype=torch.float32)
    results = asyncio.run(averager.average(vector, 1.0, 3, {"other": (0, "")}))
    assert [r.lane for r in results] == [0, 1]
    assert "lane 0 failed: RuntimeError: matchmaking broke" in results[0].reason and not results[0].applied
    assert results[1].reason.startswith("no group") and results[1].outcome is None
    assert torch.equal(vector, torch.arange(10, dtype=torch.float32))
    assert results[0].seconds >= 0 and math.isnan(results[1].seconds)  # the round's time, counted once
