"""The simulated swarm at 1,000 peers (bench/swarm_sim.py): peerd's peer table, grid and matchmaking
for 1,024 peers on a virtual clock over an in-memory DHT, no sockets, a few seconds of CPU in all.

The bounds are the paper's figures where it has one (Moshpit SGD sec. 4.1: 2 rounds to 1e-9 without
failures, about 5 at 0.5 %) and otherwise the measured ones with a margin (docs/benchmarks.md, "A
swarm of 1,000 simulated peers"). Every run is seeded, so the figures repeat exactly.
"""

from __future__ import annotations

from bench.swarm_sim import SwarmSettings, simulate, summarize

# Per peer and minute, at most: heartbeats (30) and refreshes (60) at the daemon's defaults, three
# requests per round (the entry's store, the rendezvous's store and get) at 6 rounds a minute, and
# the start's own heartbeat and refresh, 2 in a run this short.
DHT_PER_PEER_MINUTE = 30 + 60 + 3 * 6 + 2


def test_a_full_grid_without_churn_is_exact_in_two_rounds_with_every_group_full():
    stats, swarm = simulate(SwarmSettings(peers=1024, rounds=4))
    summary = summarize(stats, swarm)
    assert summary.rounds_to_target == 2 and len(stats) == 2  # the paper's 2: a full 32x32 grid, d = 2
    for r in stats:
        assert r.views == 1  # every peer's table gave the same view
        assert r.full == r.as_planned == 1024 and r.no_group == 0 and set(r.got) == {32}
    # Views agreed, so every group formed on the direct path: one entry stored per peer and round,
    # no key read; one rendezvous poll per peer and round.
    ops = swarm.dht.by_op
    assert ops["entry_store"] == ops["rendezvous_store"] == ops["rendezvous_get"] == 2 * 1024
    assert ops["entry_get"] == 0
    per_minute = summary.by_op_per_peer_minute
    assert 29 <= per_minute["heartbeat"] <= 31 and 59 <= per_minute["refresh"] <= 61  # every 2 s and 1 s
    assert summary.requests_per_peer_minute <= DHT_PER_PEER_MINUTE  # measured 106.0


def test_half_a_percent_of_peers_frozen_per_round_slows_averaging_to_the_papers_five_rounds():
    stats, swarm = simulate(SwarmSettings(peers=1024, rounds=12, freeze_prob=0.005))
    summary = summarize(stats, swarm)
    assert 4 <= summary.rounds_to_target <= 6  # measured 5 (the paper: about 5; bench.moshpit_sim: 5-6)
    assert 0.003 <= summary.frozen_share <= 0.01  # the freezes happened: measured 0.0061
    # A frozen mate leaves its group one short (about 31 peers share each frozen one's fate): the
    # groups still form through matchmaking's timeouts, none is lost.
    assert 0.75 <= summary.full_share <= 0.92  # measured 0.830
    assert summary.as_planned_share == summary.full_share  # views agreed: a short group is a frozen mate
    assert summary.no_group_share == 0.0
    assert all(max(r.got) == 32 for r in stats)
    assert summary.requests_per_peer_minute <= DHT_PER_PEER_MINUTE  # measured 106.8


def test_a_volunteer_swarm_joining_leaving_and_freezing_still_forms_groups():
    settings = SwarmSettings(
        peers=1000, rounds=5, stop_at_target=False, join_rate=17.0, leave_rate=1 / 60, freeze_prob=0.005
    )
    stats, swarm = simulate(settings)
    summary = summarize(stats, swarm)
    joined = len(swarm.peers) - 1000
    left = sum(p.gone for p in swarm.peers.values())
    said_goodbye = swarm.dht.by_op["leave"]  # the others crashed
    assert joined >= 5 and said_goodbye >= 2 and left - said_goodbye >= 2  # measured 18, 6 and 5
    # Measured at this seed 0.856 full, 0.856 as planned, none without a group; over seeds 0-3
    # 0.66-0.86, 0.48-0.86 and 0-0.02. A joiner seen by some tables and not yet by others shifts
    # the coordinates of about half the peers in those views: their groups differ from the plan,
    # and peers that reach a leader after it decided get none (LATE, GROUP_FULL). A crashed peer
    # leaves its group one short until the tables drop it, peer_ttl after its last heartbeat.
    assert summary.full_share >= 0.6
    assert summary.as_planned_share >= 0.4
    assert summary.no_group_share <= 0.04
    # The tables at the end: every peer that joined a heartbeat and a refresh ago is in them, no peer
    # that left (said goodbye, or crashed peer_ttl and a refresh ago) is.
    d, t = settings.discovery, swarm.clock()
    settled = {
        p
        for p, peer in swarm.peers.items()
        if not peer.gone and peer.joined < t - d.heartbeat_interval * 2 - d.refresh_interval
    }
    departed = {p for p, peer in swarm.peers.items() if peer.gone and peer.left < t - d.peer_ttl - d.refresh_interval}
    tables = [v.table for v in swarm.views if any(not swarm.peers[p].frozen for p in v.holders)]
    for table in tables:
        ids = {e.peer_id for e in table.entries()}
        assert settled <= ids and not departed & ids
    assert summary.max_views <= 3  # joiners' tables catch up within a refresh or two: measured 1
    assert all(max(r.got) <= 32 for r in stats)  # matchmaking caps a group at G even when views differ
    assert summary.final_error <= 1e-6  # averaging goes on through the churn: measured 1.2e-8
    assert summary.requests_per_peer_minute <= DHT_PER_PEER_MINUTE  # measured 106.9
