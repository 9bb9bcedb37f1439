"""Local groups that span daemons (--local-group NAME; daemon/groupspan.py): real daemons on
loopback, real scripts (examples/your_loop.py, tests/attach_script.py)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import numpy as np
import pytest
import torch

from peerd.daemon import groupspan
from peerd.daemon.client import ControlClient
from peerd.daemon.groupspan import GroupSpan, Placement, place, plan_epoch, serve_lanes
from peerd.daemon.metrics import DaemonMetrics
from peerd.peers.averaging import RoundResult
from peerd.peers.collective.codec import Codec
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.dear.delegate import Refused, decode_answer, encode_request
from peerd.peers.dear.hierarchy import lane_bounds
from tests.helpers import drain, peerd as peerd_cli, scrape, wait_for
from tests.test_your_loop import EXAMPLE, finish, run_status, run_status_peer, script


# -- the coordination alone: real TCPStores on loopback, the daemons' callbacks by hand ----------


def test_the_epochs_list_the_daemons_with_a_process_coordinator_first_and_place_each():
    assert plan_epoch({"b": {"procs": 2}, "a": {"procs": 1}, "c": {"procs": 0}}, "b") == (("b", 2), ("a", 1))
    listed = [("b", 2), ("a", 1)]
    assert place(listed, "a", 7, "tcp://h:1") == Placement(7, 2, 1, 3, "tcp://h:1", ("b", "a"))
    assert place(listed, "b", 7, "tcp://h:1").base == 0 and place(listed, "c", 7, "tcp://h:1") is None


class Daemon:
    """A GroupSpan with the daemon's side by hand: its processes, its table, its placements."""

    def __init__(self, peer_id: str, table: dict):
        self.procs, self.after, self.placements, self.table = 1, 0, [], table
        self.span = GroupSpan(
            run_id="r",
            peer_id=peer_id,
            label="rack",
            host="127.0.0.1",
            peers=lambda: [(p, d.span.address) for p, d in self.table.items() if p != peer_id],
            local=lambda: (self.procs, self.after),
            placed=self.placements.append,
        )

    @property
    def placed(self) -> Placement | None:
        return self.placements[-1] if self.placements else None


def tick_all(daemons, times: int = 3) -> None:
    for _ in range(times):
        for d in daemons:
            d.span.tick()


def test_a_span_places_every_daemon_follows_comings_and_goings_and_survives_its_coordinator(monkeypatch):
    monkeypatch.setattr(groupspan, "STALE", 0.3)
    table = {}
    a, b, c = (table.setdefault(p, Daemon(p, table)) for p in ("a", "b", "c"))
    tick_all([a, b, c])
    e = a.placed.epoch
    assert [d.placed.epoch for d in (a, b, c)] == [e] * 3 and a.placed.daemons == ("a", "b", "c")
    assert [(d.placed.base, d.placed.size) for d in (a, b, c)] == [(0, 3), (1, 3), (2, 3)]
    assert a.placed.store == b.placed.store == f"tcp://{a.span.address}"
    b.procs = 2  # a second process on b: a new epoch, c's ranks move up
    tick_all([a, b, c])
    assert a.placed.epoch > e and (b.placed.procs, c.placed.base, c.placed.size) == (2, 3, 4)
    e = c.placed.epoch
    c.after = e  # one of c's processes saw the group break: an epoch after e, the same daemons
    tick_all([a, b, c])
    assert c.placed.epoch > e and c.placed.daemons == ("a", "b", "c")
    e = c.placed.epoch
    time.sleep(0.4)  # c stops beating (its daemon died): out after STALE
    tick_all([a, b])
    time.sleep(0.4)
    tick_all([a, b])
    assert b.placed.epoch > e and b.placed.daemons == ("a", "b")
    # a, the coordinator, dies: b and c (back) coordinate on b's store, above every epoch held
    del table["a"]
    held = b.placed.epoch
    tick_all([b, c], 4)
    assert b.placed.epoch > held and c.placed.epoch == b.placed.epoch and b.placed.daemons == ("b", "c")
    assert b.placed.store == f"tcp://{b.span.address}" and b.span.coordinator == "b"


def test_the_leader_asks_another_daemon_for_its_lanes_through_that_daemons_store():
    """A leader's lane request reaches the other daemon's store, is averaged there (by hand: each
    value doubled) and answered; a request for a lane that daemon does not own is answered with
    the reason (counted), not left to time out. Real stores, in one process."""
    table = {}
    a, b = Daemon("a", table), Daemon("b", table)
    table.update(a=a, b=b)
    n, lanes, rounds, refused, at = 10, 2, [], [], []
    on_grid = np.arange(5, dtype=np.float32)
    Codec("int8").roundtrip(on_grid)  # as DiLoCo's error feedback leaves a lane: it travels as int8
    ok = encode_request("a", 4, [1], 2.0, "int8", [on_grid])

    async def average(vector, weight, round_t, which, payload):
        (s, e), done = (
            lane_bounds(n, lanes)[1],
            Outcome(Status.COMPLETED, "", round_t, ("b", "c"), (1.0,), 1, 1, 0.1, b""),
        )
        vector[s:e] *= weight
        return [RoundResult(round_t, 2, done, "by hand", lane=lane) for lane in which]

    async def main():
        served = asyncio.create_task(
            serve_lanes(b.span, lambda: (1,), n, lanes, average, at.append, rounds.append, refused.append, 5)
        )
        try:
            answered = await asyncio.to_thread(a.span.ask, b.span.address, ok, 10.0)
            wrong = encode_request("a", 4, [0], 2.0, "int8", [on_grid])
            return answered, await asyncio.to_thread(a.span.ask, b.span.address, wrong, 10.0)
        finally:
            served.cancel()

    answered, refusal = asyncio.run(main())
    ((result, values),) = decode_answer(answered, n, lanes, [1], 4, "int8")
    assert result.delegated and result.applied and values.tolist() == (2 * on_grid).tolist()
    assert b'"values": "int8"' in ok and b'"values": "int8"' in answered
    assert [r.lane for r in rounds] == [1] and len(refused) == 1 and "not among the lanes" in refused[0]
    assert at == [4]  # the daemon announced round 4's boundary before averaging its lane
    with pytest.raises(Refused, match="refused: lanes \\[0\\]"):
        decode_answer(refusal, n, lanes, [0], 4, "int8")
    a.span.close()
    b.span.close()


def test_a_new_coordinator_waits_for_the_labels_beats_and_takes_no_old_beat_for_a_fresh_one():
    """A daemon that takes over as coordinator (the last one left its table) issues no epoch while a
    label peer in its table has not beaten to it (within STALE s), and a beat written to its store
    long ago (while it coordinated before) does not count: its first epoch lists both daemons, not
    itself alone (a kill test's survivor trained the run alone that way)."""
    table = {}
    a, b = Daemon("a", table), Daemon("b", table)
    table.update(a=a, b=b)
    stale = {"beat": 7, "procs": 0, "held": 0, "after": 0, "t": time.time() - 60}
    a.span._store.set("d/b", json.dumps(stale))  # b's beat from a's first term as coordinator
    a.span.coordinator = "x"  # x coordinated; it is gone from the table now
    a.span.tick()
    assert a.placed is None  # b has not beaten to a since: no epoch of a alone
    b.span.tick()  # b's table lost x too: it beats to a, with its process
    a.span.tick()
    assert a.placed is not None and a.placed.daemons == ("a", "b"), a.placements
    a.span.close()
    b.span.close()


def test_a_coordinator_whose_store_nobody_listens_at_counts_a_failure_and_places_nothing():
    """The table's smallest peer ID (the coordinator) publishes a store address where a socket is
    bound but does not listen: the tick's connection is refused, nothing is placed, and the daemon's
    peerd_local_group_store_failures_total counts it."""
    metrics = DaemonMetrics(version="test", states=(), peers_by_run=dict)
    placements = []
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # held, not listening: no one else can take the port meanwhile
        span = GroupSpan(
            run_id="r",
            peer_id="b",
            label="rack",
            host="127.0.0.1",
            peers=lambda: [("a", f"127.0.0.1:{closed.getsockname()[1]}")],
            local=lambda: (1, 0),
            placed=placements.append,
            failed=metrics.local_group_store_failures.labels("r").inc,
        )
        span.tick()
    assert span.coordinator == "a" and placements == []
    assert metrics.registry.get_sample_value("peerd_local_group_store_failures_total", {"run": "r"}) == 1
    span.close()


def roles(daemon, run: str) -> dict[str, str]:
    with ControlClient(daemon.control) as c:
        return {p.peer_id: p.role for p in c.list_peers(run).peers}


@pytest.mark.heavy
def test_two_daemons_of_one_label_train_as_one_wan_peer_beside_a_third(spawn, tmp_path):
    """Daemons a and b with --local-group rack, one script each, and c on the WAN side with its own:
    a and b's processes are one group (the same parameters at every phase's end: the digest check
    raises otherwise), c rounds with the group's leader only, the follower announces itself as such,
    the loss falls, and at the end all three models are one θ. The scripts attach seconds apart on a
    loaded machine: --min-peers 3 holds the first one's first step until all three train."""
    run = ["--run", "span", "--min-peers", "3"]
    a = spawn("span-a", [*run, "--local-group", "rack"])
    b = spawn("span-b", [*run, "--local-group", "rack", "--initial-peers", a.maddrs[0]])
    c = spawn("span-c", [*run, "--initial-peers", a.maddrs[0]])
    common = ["span", "--steps", 160, "--every", 20]
    procs = [
        script(*common, "--daemon", d.data_dir, "--seed", i, "--save", tmp_path / f"{i}.pt", path=EXAMPLE)
        for i, d in enumerate((a, b, c))
    ]
    try:
        check(a, b, c, procs, tmp_path)
    finally:
        for p in procs:
            p.kill()


def check(a, b, c, procs, tmp_path):
    ids = [run_status_peer(d) for d in (a, b, c)]
    leader, follower = (0, 1) if ids[0] < ids[1] else (1, 0)
    wait_for(
        lambda: (
            run_status((a, b)[leader], "span").local_group_size == 2
            and run_status((a, b)[follower], "span").local_group_rank == 1
            and roles(c, "span").get(ids[follower]) == "follower"
        ),
        timeout=120,
        what="a and b's processes one group, the follower announced",
    )
    assert roles(c, "span")[ids[leader]] == "trainer"
    st = run_status((a, b)[follower], "span")
    assert st.local_group == "rack" and st.local_group_size == 2 and st.local_group_rank == 1, st
    shown = peerd_cli("status", "--control", (a, b)[follower].control).stdout
    assert "span: local group rack  processes 2  first rank here 1" in shown, shown
    assert f"follows {ids[leader]}" in shown, shown
    outs = [finish(p, 300) for p in procs]
    evals = []
    for out in outs:
        first = float(re.search(r"attached at run step \d+ \(rank \d of \d\); eval ([\d.]+)", out).group(1))
        evals.append(float(re.search(r"done: run step 160; eval ([\d.]+)", out).group(1)))
        assert evals[-1] < first - 1.0, out
    status = run_status(c, "span")
    assert status.last_round_outcome == "completed" and status.group_size == 2, status  # c and the group's leader
    assert set(status.last_round_group) == {ids[2], ids[leader]}, status
    # The group's two processes hold one model; c's θ is the group's but for rounds that one side
    # completed without the other (DiLoCo does not re-sync θ: repair rounds do).
    ma, mb = (torch.load(tmp_path / f"{i}.pt", weights_only=True) for i in range(2))
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    assert abs(evals[2] - evals[0]) < 0.2, evals


@pytest.mark.heavy
@pytest.mark.parametrize("label, payload", [("rack", "int8"), ("auto", "int8"), ("rack", "arctopk")])
def test_a_task_run_with_a_local_group_trains_under_diloco_in_children_as_one_wan_peer(spawn, label, payload):
    """A built-in task's run with --local-group on two daemons trains in their children (no thread),
    under DiLoCo, as one WAN peer beside a third daemon, each of the group's daemons averaging one of
    the run's two lanes over its own link (peers/dear/delegate.py): the follower announces itself
    and the lane it averages, the third daemon's rounds of lane 0 have the group's leader as their
    only mate, both of the group's daemons complete rounds (lane 1's are the follower's), and every
    daemon ends at the run's last step with a trained model. The group by its label, or by the links
    its daemons measured between them (`auto`: loopback passes the thresholds; c, unlabelled, is no
    member). With ARC-Top-K (`arctopk`) each lane's rows travel back with its mean."""
    task = ["--run", "spantask", "--task", "digits-mlp", "--set", "averaging.average_every=10", "--max-steps", "120"]
    task += ["--set", "averaging.lanes=2", "--set", f"averaging.payload={payload}"]
    common = [*task, "--min-peers", "3", "--eval-every", "1000", "--torch-threads", "1"]
    a = spawn("spant-a", [*common, "--local-group", label])
    b = spawn("spant-b", [*common, "--local-group", label, "--initial-peers", a.maddrs[0]])
    c = spawn("spant-c", [*common, "--initial-peers", a.maddrs[0]])
    ids = [run_status_peer(d) for d in (a, b, c)]
    leader, follower = ((a, 0), (b, 1)) if ids[0] < ids[1] else ((b, 1), (a, 0))

    def grouped():
        """While the group trains (its end changes epochs as processes exit): c sees the follower and
        the lanes each of the two averages, the follower's status its place, and c's latest round of
        lane 0 was with the leader alone."""
        with ControlClient(c.control) as client:
            said = {p.peer_id: p for p in client.list_peers("spantask").peers}
        f, r = run_status((a, b)[follower[1]], "spantask"), run_status(c, "spantask")
        return (
            said.get(ids[follower[1]]) is not None
            and said[ids[follower[1]]].role == "follower"
            and said[ids[follower[1]]].delegated_lanes == 0b01
            and said.get(ids[leader[1]]) is not None
            and said[ids[leader[1]]].delegated_lanes == 0b10
            and (f.local_group, f.local_group_rank) == (label, 1)
            and ("by links" in f.local_group_reason) == (label == "auto")
            and set(r.last_round_group) == {ids[2], ids[leader[1]]}
            and r.last_round_outcome == "completed"
        )

    # auto: both sides' link reports, bandwidth included, must be in the records first
    wait_for(grouped, timeout=180, what="the group trains, the follower announced with its lane")
    done = [
        wait_for(
            lambda: (s := run_status(d, "spantask")).train_state == "FINISHED" and s, timeout=180, what="120 steps"
        )
        for d in (a, b, c)
    ]
    for r in done:
        assert r.step == 120 and r.algorithm == "diloco" and r.train_process_state == "EXITED", r
        assert r.eval_metric == "accuracy" and r.eval_score > 0.5, r
    assert done[follower[1]].local_group == label, done[follower[1]]
    completed = ("peerd_rounds_total", (("outcome", "completed"), ("run", "spantask")))
    rounds = [scrape(d.metrics_url) for d in (a, b, c)]
    # c averages both lanes every round; each of the group's daemons one, counted where it ran.
    assert rounds[follower[1]].get(completed, 0) >= 3 and rounds[leader[1]].get(completed, 0) >= 3, rounds
    assert not any(k[0] == "peerd_rounds_total" and ("outcome", "delegated") in k[1] for m in rounds for k in m)
    # Every answer the leader got checked out (none refused: its lanes took the follower's means).
    assert rounds[leader[1]].get(("peerd_rejected_total", (("reason", "lane_answer"),)), 0) == 0, rounds[leader[1]]
    assert done[follower[1]].last_round > 0 and done[follower[1]].last_round_outcome, done[follower[1]]  # its lane's


@pytest.mark.heavy
def test_a_member_killed_on_either_daemon_leaves_the_group_the_other_goes_on_and_a_new_one_rejoins(spawn, tmp_path):
    """Two daemons of one label, a script on each (one group of two). The follower's process is
    killed mid-step: the leader's goes on alone within the op timeout plus a phase; a new process on
    the follower's daemon rejoins the group at a later phase. Then the leader's process is killed:
    the follower's daemon leads the group it is left with (its rounds go on). The run's step never
    goes backwards on either daemon."""
    a = spawn("spank-a", ["--run", "spank", "--local-group", "rack"])
    b = spawn("spank-b", ["--run", "spank", "--local-group", "rack", "--initial-peers", a.maddrs[0]])
    ids = [run_status_peer(d) for d in (a, b)]
    lead, follow = (a, b) if ids[0] < ids[1] else (b, a)
    common = ["--run", "spank", "--every", 10, "--sleep", 0.02, "--steps", 100_000]
    procs = [script(*common, "--daemon", lead.data_dir)]
    try:
        assert json.loads(procs[0].stdout.readline()) == {"attached": 0}
        drain(procs[0], tmp_path / "lead.out")
        procs.append(drain(script(*common, "--daemon", follow.data_dir), tmp_path / "follow-1.out"))
        seen = {id(lead): [], id(follow): []}

        def status(d, predicate):
            s = run_status(d, "spank")
            seen[id(d)].append(s.step)
            return predicate(s)

        wait_for(
            lambda: (
                status(lead, lambda s: s.local_group_size == 2) and status(follow, lambda s: s.local_group_rank == 1)
            ),
            timeout=60,
            what="one group of two",
        )
        wait_for(lambda: status(follow, lambda s: s.step >= seen[id(follow)][0] + 20), timeout=60, what="it trains")
        procs[1].kill()
        procs[1].wait()
        killed = time.monotonic()
        wait_for(lambda: status(lead, lambda s: s.local_group_size == 1), timeout=30, what="the leader alone")
        left = seen[id(lead)][-1]
        wait_for(lambda: status(lead, lambda s: s.step >= left + 20), timeout=60, what="the leader trains on")
        assert time.monotonic() - killed < 60 + 30  # GROUP_TIMEOUT plus slack: a kill is seen at once
        procs.append(drain(script(*common, "--daemon", follow.data_dir), tmp_path / "follow-2.out"))
        wait_for(
            lambda: (
                status(lead, lambda s: s.local_group_size == 2) and status(follow, lambda s: s.local_group_rank == 1)
            ),
            timeout=60,
            what="a new process on the follower's daemon rejoins",
        )
        joined = seen[id(follow)][-1]
        wait_for(lambda: status(follow, lambda s: s.step >= joined + 20), timeout=60, what="the group trains")
        procs[0].kill()
        procs[0].wait()
        wait_for(
            lambda: status(follow, lambda s: s.local_group_size == 1 and s.local_group_rank == 0),
            timeout=60,
            what="the follower's daemon leads",
        )
        left = seen[id(follow)][-1]
        wait_for(lambda: status(follow, lambda s: s.step >= left + 20), timeout=60, what="it trains on, leading")
        for d in (lead, follow):
            assert seen[id(d)] == sorted(seen[id(d)]), seen  # the run's step never went backwards
    finally:
        for p in procs:
            p.kill()
