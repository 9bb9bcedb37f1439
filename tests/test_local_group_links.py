"""Local groups by measured links (`--local-group auto`, docs/dear.md): `plan_group` over link
reports as peers publish them, with a made-up clock; then three real daemons on loopback that
measure each other (RTT, packet-train bandwidth), share the reports in their records and form one
DeAR group from them."""

from __future__ import annotations

import pytest

from peerd.peers.dear.localgroup import LocalGroupRules
from peerd.peers.dear.member import AUTO, GroupPeer, plan_group
from peerd.peers.linkprobe import LinkReport
from tests.helpers import scrape
from tests.test_local_group import FAST_DISCOVERY, RUN_ARGS, wait_group

RULES = LocalGroupRules(both_directions=True)
NOW = 1_800_000_000.0  # DHT time: records' timestamps and reports' ages are on it


def fast(peer: str, **kw) -> LinkReport:
    return LinkReport(**{"peer_id": peer, "rtt": 0.0001, "bandwidth": 2.5e8, "loss": 0.0, "age": 5.0, **kw})


def peer(name: str, *reports: LinkReport, label: str = AUTO, at: float = NOW - 1) -> GroupPeer:
    return GroupPeer(name, label, f"127.0.0.1:{1000 + sum(map(ord, name))}", tuple(reports), at)


def plan(me: str, peers: dict[str, GroupPeer], now: float = NOW):
    return plan_group(peers[me], [p for n, p in peers.items() if n != me], set(peers), RULES, now)


def test_close_pairs_form_one_group_and_every_member_decides_the_same():
    peers = {n: peer(n, *(fast(m) for m in "abc" if m != n)) for n in "abc"}
    peers["d"] = peer("d", label="")  # not opted in: never in a group by links, though its links are fast
    plans = {n: plan(n, peers) for n in "abc"}
    assert all(p.form and p.members == ("a", "b", "c") for p in plans.values()), plans
    assert [plans[n].rank for n in "abc"] == [0, 1, 2] and "by links" in plans["a"].reason


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(fast("c", loss=0.05), id="lossy"),
        pytest.param(fast("c", bandwidth=25e6), id="slow"),  # 200 Mbit/s: a tbf in the lab
        pytest.param(fast("c", rtt=0.02), id="far"),
        pytest.param(fast("c", age=70.0), id="stale"),  # measured 71 s before NOW: older than max_age
    ],
)
def test_one_bad_or_stale_direction_breaks_the_pair(bad):
    """b's report on b -> c fails one threshold (c's on c -> b is fine): b and c are not close, so the
    greedy rule in peer-ID order puts a with b, and c trains alone (WAN averaging)."""
    peers = {n: peer(n, *(fast(m) for m in "abc" if m != n)) for n in "abc"}
    peers["b"] = peer("b", fast("a"), bad)
    assert plan("a", peers).members == ("a", "b") and plan("b", peers).form
    alone = plan("c", peers)
    assert alone.members == () and not alone.form and "c solo" in alone.reason, alone


def test_a_pair_needs_reports_from_both_sides():
    peers = {"a": peer("a", fast("b")), "b": peer("b")}  # b has not published its measurement of a yet
    assert not plan("a", peers).form and not plan("b", peers).form
    peers["b"] = peer("b", fast("a"))
    assert plan("a", peers).form and plan("b", peers).form


def test_a_dead_member_leaves_with_its_entry_and_reports_age_out():
    peers = {n: peer(n, *(fast(m) for m in "abc" if m != n)) for n in "abc"}
    del peers["c"]  # c died: the peer table dropped it after peer_ttl; a's and b's reports on c no longer matter
    assert plan("a", peers).members == ("a", "b") and plan("a", peers).form
    # Reports that are not refreshed (a prober that stopped) age out: 60 s after their measurement.
    later = NOW + RULES.max_age
    assert plan("a", peers, now=later).members == ()


def test_auto_is_not_an_ordinary_label():
    """An operator label still groups by label, and ignores auto peers and links."""
    peers = {n: peer(n, *(fast(m) for m in "abc" if m != n)) for n in "abc"}
    peers["r1"], peers["r2"] = peer("r1", label="rack"), peer("r2", label="rack")
    assert plan("r1", peers).members == ("r1", "r2")
    assert plan("a", peers).members == ("a", "b", "c")


# Training outlasts the wait: on a busy machine a link is measured late (or again 30 s later), and
# a group that forms then must still find the run training (300 steps used to end it first).
STEPS, EVERY = 100_000, 10


@pytest.mark.heavy
def test_three_daemons_on_loopback_form_a_group_by_measured_links(spawn):
    create = [
        "--task",
        "digits-mlp",
        "--set",
        f"averaging.average_every={EVERY}",
        "--set",
        "averaging.algorithm=state",
        "--set",
        "optimizer=sgd",
        "--set",
        "lr=0.05",
    ]
    args = [
        "--run",
        "la",
        "--local-group",
        AUTO,
        "--max-steps",
        str(STEPS),
        "--min-peers",
        "3",
        *RUN_ARGS,
        *FAST_DISCOVERY,
    ]
    a = spawn("la-a", [*args, *create])
    b, c = (spawn(f"la-{n}", [*args, "--initial-peers", a.maddrs[0]], wait=False) for n in "bc")
    b.wait_ready()
    c.wait_ready()
    daemons = [a, b, c]

    rs = wait_group(daemons, "la", 3, "the group of three forms by links", timeout=180)
    assert sorted(r.local_group_rank for r in rs) == [0, 1, 2] and all(r.local_group == AUTO for r in rs), rs
    assert all("by links" in r.local_group_reason for r in rs), [r.local_group_reason for r in rs]
    for d in daemons:
        m = scrape(d.metrics_url)
        assert m[("peerd_local_group_size", (("run", "la"),))] == 3
        assert m[("peerd_link_bandwidth_bytes_per_second_count", ())] >= 2, m  # it measured both peers
        assert m[("peerd_link_trains_total", (("result", "counted"),))] >= 2, m  # with a train that counted each
    for d in daemons:
        assert d.stop() == 0
