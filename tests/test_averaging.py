"""Who a round's matchmaking looks for: the planned mates that its rendezvous did not find behind or
gone (`seek`), and no matchmaking at all when that is nobody. Pure function, then MoshpitAverager
with a fake rendezvous and a fake matchmaker (no network)."""

from __future__ import annotations

import asyncio

import torch

from peerd.peers.averaging import MoshpitAverager, RoundResult, seek
from peerd.peers.matchmaking import Matched
from peerd.peers.membership import Roll


def test_seek_leaves_out_the_mates_away_and_skips_matchmaking_when_none_is_left():
    planned = ["b", "c", "d"]
    assert seek(planned, Roll()) == (planned, "")
    assert seek(planned, Roll(gone=("x",))) == (planned, "")  # a peer away that was no mate of this lane
    assert seek(planned, Roll(gone=("c",))) == (["b", "d"], "2 of 3 planned mates (1 gone)")
    assert seek(planned, Roll(behind=("b",), gone=("d",))) == (["c"], "1 of 3 planned mates (1 behind, 1 gone)")
    here, why = seek(planned, Roll(behind=("b", "c"), gone=("d",)))
    assert here == [] and why == "every planned mate is away (2 behind, 1 gone): matchmaking skipped"
    assert seek([], Roll(gone=("b",))) == ([], "")  # alone in the run: not this function's case


class Matchmaker:
    """Records the mates each form_group is given; finds a group with none of them."""

    def __init__(self):
        self.mates: list[frozenset[str]] = []

    async def form_group(self, namespace, secret, round_t, key, me, mates=()):
        self.mates.append(frozenset(mates))
        return Matched(None, "alone: nobody joined")


def averager(roll: Roll, lanes: int = 1) -> tuple[MoshpitAverager, Matchmaker, list[list[str]]]:
    asked: list[list[str]] = []

    async def rendezvous(round_t: int, mates: list[str]) -> Roll:
        asked.append(mates)
        return roll

    matchmaker = Matchmaker()
    a = MoshpitAverager(
        run_id="r",
        secret=None,
        peer_id="me",
        matchmaker=matchmaker,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        max_group_size=16,
        rendezvous=rendezvous,
        lanes=lanes,
    )
    return a, matchmaker, asked


LIVE = {"b": (0, ""), "c": (0, ""), "d": (0, "")}


def average(a: MoshpitAverager, vector: torch.Tensor) -> list[RoundResult]:
    return asyncio.run(a.average(vector, 1.0, 7, LIVE))


def test_a_round_matches_only_with_the_mates_its_rendezvous_found():
    a, matchmaker, asked = averager(Roll(behind=("c",), gone=("d",)))
    [result] = average(a, torch.zeros(8))
    assert asked == [["b", "c", "d"]]  # every planned mate is waited for (the grid: one group of 4)
    assert matchmaker.mates == [frozenset({"b"})]
    assert result.reason == "no group: alone: nobody joined (1 of 3 planned mates (1 behind, 1 gone))"
    assert (result.planned, result.stragglers, result.skipped) == (3, 1, False)


def test_a_round_whose_planned_mates_are_all_away_runs_no_matchmaking_and_is_owed():
    from peerd.daemon.diloco import owed
    from peerd.daemon.metrics import DaemonMetrics

    vector = torch.arange(8, dtype=torch.float32)
    a, matchmaker, _ = averager(Roll(behind=("b",), gone=("c", "d")), lanes=2)
    results = average(a, vector)
    assert matchmaker.mates == []  # neither lane looked: nobody it could meet was expected
    assert [(r.lane, r.group_size, r.outcome, r.skipped, r.planned) for r in results] == [
        (0, 1, None, True, 3),
        (1, 1, None, True, 3),
    ]
    assert results[0].reason == "no group: every planned mate is away (1 behind, 2 gone): matchmaking skipped"
    assert results[0].stragglers == 1 and not results[0].interrupted
    assert torch.equal(vector, torch.arange(8, dtype=torch.float32))
    assert owed(results)  # the grid planned mates: its samples go into the next round, as for any missed round
    m = DaemonMetrics(version="t", states=("READY",), peers_by_run=dict)
    for r in results:
        m.observe_round("r", r)
    assert m.registry.get_sample_value("peerd_matchmaking_skipped_total", {"run": "r"}) == 2.0
    assert m.registry.get_sample_value("peerd_rounds_missed_total", {"run": "r"}) == 2.0


def test_without_a_rendezvous_every_planned_mate_is_looked_for():
    a, matchmaker, _ = averager(Roll())
    a.rendezvous = None
    [result] = average(a, torch.zeros(8))
    assert matchmaker.mates == [frozenset({"b", "c", "d"})]
    assert result.reason == "no group: alone: nobody joined" and not result.skipped
