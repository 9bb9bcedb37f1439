"""The round rendezvous over real DHT nodes: a trainer waits for the group mates still in the previous
round, and only for them, and never longer than its patience."""

from __future__ import annotations

import asyncio
import time

from peerd.peers.membership import Announcement, DiscoverySettings, Roll, RunMembership
from tests.helpers import peer_nodes

EVERY = 10


async def _members(nodes) -> list[RunMembership]:
    # Heartbeats every 30 s: a step is seen only when the rendezvous announces it, never by chance.
    settings = DiscoverySettings(heartbeat_interval=30.0, refresh_interval=30.0, peer_ttl=90.0)
    members = [RunMembership(n, "rv", None, settings, version="test") for n in nodes]
    for m in members:
        await m.start()
    for m in members:
        await m.refresh()
    return members


def test_rendezvous_waits_for_a_mate_in_the_previous_round_until_it_arrives(tmp_path):
    async def scenario():
        async with peer_nodes(3, tmp_path) as nodes:
            a, b, c = members = await _members(nodes)
            try:
                steps = {a: 20, b: 15, c: 3}  # b is in the previous round; c two rounds behind (downloads instead)
                for m in members:
                    m.announcement = lambda m=m: Announcement(step=steps[m])
                    await m.heartbeat()
                await a.refresh()
                assert {e.peer_id: e.step for e in a.peers()} == {b.node.peer_id: 15, c.node.peer_id: 3}

                async def b_arrives():
                    await asyncio.sleep(1.0)
                    steps[b] = 20
                    return await b.rendezvous([a.node.peer_id], 20, 10, timeout=5.0)

                started = time.monotonic()
                roll_a, roll_b = await asyncio.gather(
                    a.rendezvous([b.node.peer_id, c.node.peer_id], 20, 20 - EVERY, timeout=8.0), b_arrives()
                )
                waited = time.monotonic() - started
                assert roll_a == Roll(gone=(c.node.peer_id,)) and roll_b == Roll()  # c will not be at this round
                assert 1.0 <= waited < 4.0, waited  # b's announcement was seen at one of a's next polls
            finally:
                await asyncio.gather(*(m.leave() for m in members), return_exceptions=True)

    asyncio.run(scenario())


def test_rendezvous_gives_up_on_a_stuck_mate_after_its_patience(tmp_path):
    async def scenario():
        async with peer_nodes(2, tmp_path) as nodes:
            a, b = members = await _members(nodes)
            try:
                a.announcement, b.announcement = (lambda: Announcement(step=30)), (lambda: Announcement(step=25))
                await b.heartbeat()
                started = time.monotonic()
                roll = await a.rendezvous([b.node.peer_id], 30, 20, timeout=1.5)
                assert roll == Roll(behind=(b.node.peer_id,))
                assert 1.5 <= time.monotonic() - started < 4.0
                # A mate that is not in the table (gone, or never seen) is not waited for.
                started = time.monotonic()
                assert await a.rendezvous(["QmNotAPeerOfThisRun"], 30, 20, timeout=5.0) == Roll(
                    gone=("QmNotAPeerOfThisRun",)
                )
                assert time.monotonic() - started < 1.0
            finally:
                await asyncio.gather(*(m.leave() for m in members), return_exceptions=True)

    asyncio.run(scenario())


def test_sketches_travel_in_heartbeats_and_every_member_finds_the_same_divergence(tmp_path):
    """Each member's latest sketch reaches the others through the DHT; a member whose latest
    sketch is of an older step is left out of the comparison, but reports the same figure from the
    others'. A figure holds until one of a newer step replaces it; a member compares a peer's
    latest sketch with its own of the same step, even when it has taken newer ones since."""
    from peerd.peers.sketch import ParamSketch

    async def scenario():
        async with peer_nodes(3, tmp_path) as nodes:
            a, b, c = members = await _members(nodes)
            try:
                sketches = {
                    a: (ParamSketch(20, 2, (0.0, 0.0)),),
                    b: (ParamSketch(20, 2, (3.0, 4.0)),),
                    c: (ParamSketch(10, 2, (0.0, 90.0)),),
                }
                for m in members:
                    m.announcement = lambda m=m: Announcement(step=sketches[m][-1].step, sketches=sketches[m])
                    await m.heartbeat()
                await asyncio.gather(*(m.refresh() for m in members))
                views = [m.divergence() for m in members]
                assert [(d.value, d.step, d.peers) for d in views] == [(5.0, 20, 2)] * 3, views
                # b takes the next round's sketch first: no step has two latest sketches for a
                # heartbeat or so, and the figure stays; once a follows, the new step's replaces it.
                sketches[b] += (ParamSketch(30, 2, (0.0, 1.0)),)
                await b.heartbeat()
                await a.refresh()
                assert (a.divergence().value, a.divergence().step) == (5.0, 20)
                sketches[a] += (ParamSketch(30, 2, (0.0, 3.0)), ParamSketch(40, 2, (0.0, 7.0)))
                assert (a.divergence().value, a.divergence().step) == (2.0, 30)
            finally:
                await asyncio.gather(*(m.leave() for m in members), return_exceptions=True)

    asyncio.run(scenario())
