"""PeerTable with a made-up clock."""

from peerd.peers.records import MemberRecord, MemberState
from peerd.peers.table import PeerTable


def rec(peer: str, ts: float, state=MemberState.ACTIVE) -> MemberRecord:
    return MemberRecord(
        run_id="r",
        peer_id=peer,
        maddrs=(f"/ip4/127.0.0.1/tcp/1/p2p/{peer}",),
        version="0",
        role="trainer",
        state=state,
        timestamp=ts,
    )


def test_peer_expires_ttl_after_its_heartbeat_stops_advancing():
    t = PeerTable("me", ttl=10)
    assert t.observe(rec("p", 100), now=100) == "new"
    assert t.observe(rec("p", 100), now=105) == "stale"  # the same heartbeat read again
    assert t.expire(now=110) == []
    assert t.expire(now=110.5) == ["p"]
    assert len(t) == 0


def test_advancing_heartbeat_keeps_peer():
    t = PeerTable("me", ttl=10)
    for i in range(10):
        t.observe(rec("p", 100 + 2 * i), now=100 + 2 * i)
        assert t.expire(now=100 + 2 * i + 1) == []
    assert [e.peer_id for e in t.entries()] == ["p"]


def test_first_sight_of_an_old_record_counts_its_age():
    t = PeerTable("me", ttl=10)
    t.observe(rec("p", 92), now=100)  # heartbeat 8 s old when first seen
    assert t.expire(now=102.5) == ["p"]


def test_left_removes_at_once_and_older_records_cannot_resurrect():
    t = PeerTable("me", ttl=10)
    t.observe(rec("p", 100), now=100)
    assert t.observe(rec("p", 101, MemberState.LEFT), now=101) == "left"
    assert len(t) == 0
    assert t.observe(rec("p", 100.5), now=102) == "stale"
    assert len(t) == 0
    assert t.observe(rec("p", 130), now=130) == "new"  # a later restart with the same ID comes back


def test_self_is_never_listed():
    t = PeerTable("me", ttl=10)
    assert t.observe(rec("me", 100), now=100) == "self"
    assert len(t) == 0


def test_a_copy_keeps_its_entries_and_departures_while_the_original_moves_on():
    t = PeerTable("me", ttl=10)
    t.observe(rec("p", 100), now=100)
    t.observe(rec("q", 100), now=100)
    t.observe(rec("q", 101, MemberState.LEFT), now=101)
    c = t.copy()
    t.observe(rec("p", 105), now=105)  # p's entry moves in the original only
    assert t.expire(now=112) == [] and c.expire(now=112) == ["p"]
    assert c.observe(rec("q", 100.5), now=113) == "stale"  # q's departure was copied
    assert [e.peer_id for e in t.entries()] == ["p"] and len(c) == 0
