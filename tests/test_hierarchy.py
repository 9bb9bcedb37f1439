"""Lanes (peers/dear/hierarchy.py): the lane arithmetic as pure functions, how a local group's
daemons share the lanes out and how peers' views leave out delegated ones, and a lane's failed round
as a result. The rounds of a group's lanes are tests/test_delegate.py's and tests/test_group_span.py's.
"""

from __future__ import annotations

import math

import pytest
import torch

from peerd.peers.dear.engine import EngineCollective
from peerd.peers.dear.hierarchy import (
    delegated_mask,
    group_id,
    lane_bounds,
    lane_view,
    owned_lanes,
)


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
