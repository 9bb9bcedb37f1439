"""Matchmaking: the leader's pure decision, and real PeerNodes on loopback forming groups."""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import asynccontextmanager

import pytest

from peerd.peers.clock import now
from peerd.peers.envelope import RecordKind, seal
from peerd.peers.events import PeerEvents
from peerd.peers.matchmaking import (
    ENTRY_FORMAT_VERSION,
    JOIN_HANDLER,
    Entry,
    Matchmaker,
    MatchmakingSettings,
    Member,
    decide_group,
)
from peerd.peers.node import NodeSettings, PeerNode
from peerd.peers.run_ids import RunSecret
from peerd.protos import records_pb2 as pb

KEY, ROUND = "peerd/v1/run/mm/moshpit/4/0/*", 0
FAST = MatchmakingSettings(join_window=0.5, assemble_slack=0.5, join_timeout=3.0)


def entry(peer: str, *, t: float = 100.0, key: str = KEY, round_t: int = ROUND) -> Entry:
    return Entry(Member(peer, f"127.0.0.1:{1000 + len(peer)}", 1.0), key, round_t, t)


def decide(entries, *, now=100.0, cap=32):
    return decide_group(entries, key=KEY, round_t=ROUND, now=now, max_age=10.0, max_group_size=cap)


def test_decision_orders_by_peer_id_and_keeps_each_peers_latest_entry():
    members, reason = decide([entry("c"), entry("a"), entry("b", t=99.0), entry("b", t=99.5)])
    assert [m.peer_id for m in members] == ["a", "b", "c"]
    assert reason == "3 member(s)"


def test_decision_caps_at_max_group_size_by_peer_id_order():
    members, reason = decide([entry(p) for p in "edcba"], cap=3)
    assert [m.peer_id for m in members] == ["a", "b", "c"]
    assert "2 over max_group_size 3" in reason


def test_decision_excludes_stale_future_and_wrong_round_entries():
    entries = [
        entry("a"),
        entry("b", t=80.0),  # older than max_age
        entry("c", t=100.0 + 3600),  # beyond the clock skew allowed
        entry("d", round_t=ROUND + 1),
        entry("e", key=KEY + "x"),
    ]
    members, reason = decide(entries)
    assert [m.peer_id for m in members] == ["a"]
    assert "2 entry_wrong_round" in reason and "1 entry_stale" in reason and "1 record_future" in reason


def test_an_entry_with_a_pace_out_of_range_is_refused(tmp_path):
    """A step or round figure that is negative, NaN or over a day fails the entry's checks."""
    from peerd.peers.envelope import RecordRejected
    from peerd.peers.identity import Identity
    from peerd.peers.matchmaking import open_entry

    identity = Identity.load_or_create(tmp_path / "id")

    def sealed(**pace) -> bytes:
        body = pb.GroupEntry(
            format_version=ENTRY_FORMAT_VERSION, group_key=KEY, engine_addr="127.0.0.1:7000", timestamp=1.0, **pace
        )
        return seal(RecordKind.GROUP_ENTRY, body.SerializeToString(), identity, None, "mm")

    good = open_entry(sealed(step_seconds=0.25, round_seconds=3.0), namespace="mm", secret=None, subkey=None)
    assert (good.member.step_seconds, good.member.round_seconds) == (0.25, 3.0)
    for bad in ({"step_seconds": -1.0}, {"round_seconds": float("nan")}, {"step_seconds": 1e6}):
        with pytest.raises(RecordRejected, match="step_seconds or round_seconds out of range"):
            open_entry(sealed(**bad), namespace="mm", secret=None, subkey=None)


def test_settings_refuse_a_join_timeout_shorter_than_the_assembly():
    with pytest.raises(ValueError):
        MatchmakingSettings(assemble_slack=2.0, join_timeout=1.0)


@asynccontextmanager
async def started(n: int, tmp_path, rejected: list[str]):
    """n PeerNodes on loopback, each with a started Matchmaker; every node shut down on exit."""
    events = PeerEvents(rejected=rejected.append)

    def settings(i: int, initial: list[str]) -> NodeSettings:
        return NodeSettings(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=tmp_path / f"n{i}.key", initial_peers=initial
        )

    nodes: list[PeerNode] = []
    try:
        nodes.append(await PeerNode.start(settings(0, []), events))
        first = (await nodes[0].visible_maddrs())[0]
        for node in await asyncio.gather(*(PeerNode.start(settings(i, [first]), events) for i in range(1, n))):
            nodes.append(node)
        matchmakers = [Matchmaker(node, FAST) for node in nodes]
        for m in matchmakers:
            await m.start()
        yield matchmakers
    finally:
        await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)


def me(m: Matchmaker, weight: float = 1.0) -> Member:
    """Each member proposes its own gather_timeout and says its own pace (peers/pace.py): the group's
    members must carry them all, the same on every member."""
    address = f"127.0.0.1:{7000 + hash(m.node.peer_id) % 1000}"
    return Member(m.node.peer_id, address, weight, 3.0 + weight, 0.1 * (1 + weight), 2.0 + weight)


async def form(matchmakers, key: str, secret=None, namespace="mm"):
    calls = (m.form_group(namespace, secret, ROUND, key, me(m, i)) for i, m in enumerate(matchmakers))
    return await asyncio.gather(*calls)


def assert_one_group(results, matchmakers, key):
    groups = [r.group for r in results]
    assert all(g is not None for g in groups), [r.reason for r in results]
    expected = tuple(sorted((me(m, i) for i, m in enumerate(matchmakers)), key=lambda x: x.peer_id))
    for m, g in zip(matchmakers, groups):
        assert (g.key, g.round_t, g.members, g.leader) == (key, ROUND, expected, expected[0].peer_id)
        assert g.members[g.my_index].peer_id == m.node.peer_id


def test_four_peers_under_one_key_all_receive_the_same_group(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with started(4, tmp_path, rejected) as mms:
            secret = RunSecret.from_bytes(b"s" * 32, "mm")
            results = await form(mms, KEY, secret, namespace="opaque-ns")
            assert_one_group(results, mms, KEY)
            assert sum(r.reason.startswith("leader") for r in results) == 1
        assert rejected == []

    asyncio.run(scenario())


def test_two_keys_form_two_disjoint_groups(tmp_path):
    async def scenario():
        async with started(4, tmp_path, []) as mms:
            other = KEY.replace("*", "1.*")
            first, second = await asyncio.gather(form(mms[:2], KEY), form(mms[2:], other))
            assert_one_group(first, mms[:2], KEY)
            assert_one_group(second, mms[2:], other)

    asyncio.run(scenario())


def test_a_follower_that_dies_after_publishing_is_left_out(tmp_path):
    async def scenario():
        async with started(4, tmp_path, []) as mms:
            mms.sort(key=lambda m: m.node.peer_id)
            dead = mms.pop()  # the largest peer ID: never the leader
            await dead.publish("mm", None, ROUND, KEY, me(dead))
            await dead.node.shutdown()
            assert dead.node.peer_id in await mms[0].node.get(KEY)  # its entry outlives it
            assert_one_group(await form(mms, KEY), mms, KEY)

    asyncio.run(scenario())


def test_when_the_elected_leader_dies_every_survivor_gets_none(tmp_path):
    async def scenario():
        async with started(3, tmp_path, []) as mms:
            mms.sort(key=lambda m: m.node.peer_id)
            dead = mms.pop(0)  # the smallest peer ID: everyone elects it
            await dead.publish("mm", None, ROUND, KEY, me(dead))
            await dead.node.shutdown()
            results = await form(mms, KEY)
            assert [r.group for r in results] == [None, None]
            assert all(dead.node.peer_id in r.reason for r in results), [r.reason for r in results]

    asyncio.run(scenario())


def test_a_forged_join_is_refused_and_counted(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with started(3, tmp_path, rejected) as mms:
            a, b, mallory = mms
            leader = min(a, b, key=lambda m: m.node.peer_id)
            victim = b if leader is a else a
            forming = [
                asyncio.create_task(m.form_group("mm", None, ROUND, KEY, me(m, i))) for i, m in enumerate([a, b])
            ]
            await asyncio.sleep(0)  # each task has run to its first await: its session is open
            # An entry signed by the victim, sent by Mallory: the signer is not the caller.
            body = pb.GroupEntry(
                format_version=ENTRY_FORMAT_VERSION,
                group_key=KEY,
                round=ROUND,
                engine_addr="10.0.0.1:1",
                weight=1e9,
                timestamp=now(),
            )
            forged = seal(RecordKind.GROUP_ENTRY, body.SerializeToString(), victim.node.identity, None, "mm")
            calls = [
                pb.JoinGroupRequest(group_key=KEY, round=ROUND, envelope=forged),
                pb.JoinGroupRequest(group_key=KEY + "/nope", round=ROUND, envelope=forged),
            ]
            for call in calls:
                answer = await mallory.node.call(leader.node.peer_id, JOIN_HANDLER, call, pb.JoinGroupResponse, 5.0)
                assert answer.status == pb.JOIN_STATUS_REFUSED
            results = await asyncio.gather(*forming)
            assert_one_group(results, [a, b], KEY)
        assert Counter(rejected) == {"record_forged": 1, "join_unknown_group": 1}

    asyncio.run(scenario())


def test_mates_from_the_view_form_the_group_directly_without_the_join_window(tmp_path):
    """With the view's mates, nobody waits for the window: the group forms in a few round trips, far
    inside a 10 s window (without mates this very call sleeps the window first)."""

    async def scenario():
        rejected: list[str] = []
        async with started(3, tmp_path, rejected) as mms:
            for m in mms:
                m.settings = MatchmakingSettings(join_window=10.0, assemble_slack=0.5, join_timeout=11.0)
            ids = [m.node.peer_id for m in mms]
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            calls = (m.form_group("mm", None, ROUND, KEY, me(m, i), mates=ids) for i, m in enumerate(mms))
            results = await asyncio.gather(*calls)
            took = loop.time() - t0
            assert_one_group(results, mms, KEY)
            assert took < 5.0, took
        assert rejected == []

    asyncio.run(scenario())


def test_the_direct_path_does_not_wait_for_the_entrys_dht_store(tmp_path):
    """Stores held back until the groups formed: the view's group needs no DHT (a store is about 2
    RTTs of every round), and the held entries still land afterwards, for views that fall back."""

    async def scenario():
        async with started(3, tmp_path, []) as mms:
            release, held = asyncio.Event(), []
            for m in mms:

                async def store(key, subkey, value, expiration, real=m.node.store):
                    held.append(subkey)
                    await release.wait()
                    return await real(key, subkey, value, expiration)

                m.node.store = store
            ids = [m.node.peer_id for m in mms]
            async with asyncio.timeout(10):  # awaiting the held stores would never end
                results = await asyncio.gather(
                    *(m.form_group("mm", None, ROUND, KEY, me(m, i), mates=ids) for i, m in enumerate(mms))
                )
            assert_one_group(results, mms, KEY)
            assert sorted(held) == sorted(ids)  # every store started, none finished
            release.set()
            await asyncio.gather(*(t for m in mms for t in list(m._stores)))
            assert sorted(await mms[0].node.get(KEY)) == sorted(ids)

    asyncio.run(scenario())


def test_a_view_that_disagrees_falls_back_to_the_dht_read(tmp_path):
    """One peer's view lacks the leader: it joins the wrong leader, which refuses it, then reads the
    key at the end of the window and joins the real group; everyone ends in one group."""

    async def scenario():
        async with started(3, tmp_path, []) as mms:
            ids = sorted(m.node.peer_id for m in mms)
            leader = ids[0]
            views = {m.node.peer_id: [p for p in ids if p != leader] if m.node.peer_id == ids[2] else ids for m in mms}
            calls = (
                m.form_group("mm", None, ROUND, KEY, me(m, i), mates=views[m.node.peer_id]) for i, m in enumerate(mms)
            )
            results = await asyncio.gather(*calls)
            groups = [r.group for r in results]
            # The two that agree form directly; the third is refused by its view's leader and falls back.
            assert sum(g is not None and len(g.members) >= 2 for g in groups) >= 2, [r.reason for r in results]

    asyncio.run(scenario())
