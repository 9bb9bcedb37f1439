"""Operator-labelled local groups: DeAR among daemons with the same --local-group (docs/dear.md,
"In the daemon"). The decision `plan_group` is tested with made-up tables; the daemon test starts
three real daemons on loopback, checks that they form the group and take DeAR steps, kills one
(SIGKILL) and checks that the others fall back, keep training, re-form as two, and end with the same
parameters and an accuracy in line with tests/test_cluster_training.py's.
"""

from __future__ import annotations

import signal
import time

import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.tasks import get_task, train_single_process
from peerd.peers.dear.localgroup import LocalGroupRules
from peerd.peers.dear.member import OP_TIMEOUT, GroupPeer, plan_group
from tests.helpers import peerd, scrape, wait_for

RULES = LocalGroupRules()


def test_a_group_forms_only_when_every_member_was_in_the_round_and_announced_its_engine():
    me = GroupPeer("b", "rack", "127.0.0.1:2")
    peers = [GroupPeer("a", "rack", "127.0.0.1:1"), GroupPeer("c", "rack", ""), GroupPeer("d", "other", "127.0.0.1:4")]
    plan = plan_group(me, peers, {"a", "b", "c", "d"}, RULES, now=100.0)
    assert plan.members == ("a", "b", "c") and plan.rank == 1 and not plan.form, plan  # c has no address yet
    peers[1] = GroupPeer("c", "rack", "127.0.0.1:http")
    assert not plan_group(me, peers, {"a", "b", "c"}, RULES, now=100.0).form  # nor a valid one
    peers[1] = GroupPeer("c", "rack", "127.0.0.1:3")
    plan = plan_group(me, peers, {"a", "b", "c"}, RULES, now=100.0)
    assert plan.form and plan.addresses == ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"), plan
    assert not plan_group(me, peers, {"a", "b"}, RULES, now=100.0).form  # c missed the round
    assert not plan_group(
        GroupPeer("b", "", "127.0.0.1:2"), peers, {"a", "b", "c"}, RULES, now=100.0
    ).form  # unlabelled
    alone = plan_group(GroupPeer("d", "other", "x:4"), peers, {"a", "b", "c", "d"}, RULES, now=100.0)
    assert alone.members == () and not alone.form, alone  # the only member of its label


STEPS, EVERY, BATCH = 400, 10, 32
RUN_ARGS = ["--eval-every", "100000", "--checkpoint-every", "100000", "--torch-threads", "1"]
FAST_DISCOVERY = ["--heartbeat-interval", "1", "--refresh-interval", "0.5", "--peer-ttl", "4", "--dht-timeout", "2"]


def status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def wait_group(daemons, run: str, size: int, what: str, *, timeout: float = 40, shown=None):
    """Wait until each of `daemons` trains in a DeAR group of `size`; returns their statuses. On
    timeout, fail with the status and log of each of `shown` (default: `daemons`)."""

    def formed():
        rs = [status(d, run) for d in daemons]
        return all(r.local_group_size == size and r.dear_steps > 0 for r in rs) and rs

    try:
        return wait_for(formed, timeout=timeout, interval=0.05, what=what)
    except AssertionError as e:
        shown = shown or daemons
        raise AssertionError(
            "\n".join([str(e), str([status(d, run) for d in shown])] + [d.log_tail(60) for d in shown])
        ) from None


@pytest.mark.heavy
def test_three_daemons_train_with_dear_and_survive_a_kill(spawn, secret_file):
    """A secret run, so that the DeAR links open with the secret's hello too."""
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
        "lg",
        "--run-secret-file",
        str(secret_file),
        "--local-group",
        "rack",
        "--max-steps",
        str(STEPS),
        "--min-peers",
        "3",
        *RUN_ARGS,
        *FAST_DISCOVERY,
    ]
    a = spawn("lg-a", [*args, *create])
    b, c = (spawn(f"lg-{n}", [*args, "--initial-peers", a.maddrs[0]], wait=False) for n in "bc")
    b.wait_ready()
    c.wait_ready()
    daemons = [a, b, c]

    rs = wait_group(daemons, "lg", 3, "the local group of three forms")
    assert sorted(r.local_group_rank for r in rs) == [0, 1, 2], rs
    assert all(r.local_group == "rack" and r.dear_buckets >= 1 and r.dear_bucket_bytes >= 64 * 1024 for r in rs), rs
    # One lane (the default): rank 0 averages the whole state over the WAN for the group.
    assert sorted(r.wan_share for r in rs) == [0.0, 0.0, 1.0], rs
    assert all(r.train_state == "TRAINING" for r in rs), rs  # killed mid-run, not after
    out = peerd("status", "--control", a.control).stdout
    assert "lg: local group rack  size 3  rank " in out and "DeAR buckets " in out, out

    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(10)
    killed_at = max(status(d, "lg").step for d in (a, b))
    t0 = time.monotonic()
    # A dead member fails the next DeAR op at once (its connections close): both fall back to
    # training alone between rounds (size 0), within the op timeout at worst; if the kill lands in
    # the group's averaging round, once the rank averaging over the WAN for the group is done.
    wait_for(
        lambda: all(status(d, "lg").local_group_size != 3 for d in (a, b)),
        timeout=OP_TIMEOUT + 15,
        interval=0.05,
        what="a and b drop the group of three",
    )
    fell_back = time.monotonic() - t0
    wait_for(
        lambda: all(status(d, "lg").step >= killed_at + 3 * EVERY for d in (a, b)),
        timeout=30,
        what="a and b train on after the kill",
    )
    # Once c left their tables (peer ttl 4 s), the next round with both re-forms the group as two.
    before = {d.data_dir.name: status(d, "lg").dear_steps for d in (a, b)}
    rs = wait_group((a, b), "lg", 2, "a and b re-form a group of two")
    # (Not read from `peerd status` text here: training may have reached --max-steps and left the
    # group by the time it runs; the text is checked while the group of three trains, above.)
    assert sorted(r.local_group_rank for r in rs) == [0, 1], rs

    for d in (a, b):
        wait_for(lambda: status(d, "lg").train_state == "FINISHED", timeout=90, what=f"{d.data_dir.name} finishes")
    finals = [status(d, "lg") for d in (a, b)]
    for r, d in zip(finals, (a, b)):
        assert r.step == STEPS, r
        assert r.dear_steps > before[d.data_dir.name], (r, before)
        assert 0.0 <= r.dear_overlap_ratio <= 1.0, r
        m = scrape(d.metrics_url)
        assert m[("peerd_dear_steps_total", (("run", "lg"),))] == r.dear_steps
        assert ("peerd_local_group_size", (("run", "lg"),)) in m
        assert ("peerd_dear_bucket_bytes", (("run", "lg"),)) in m
        assert ("peerd_dear_overlap_ratio", (("run", "lg"),)) in m
        assert m.get(("peerd_rejected_total", (("reason", "wire_bad_hello"),)), 0) == 0
    # Members of a DeAR group hold the same bytes step after step: nothing for the group's
    # reduce-scatter to average (plain local SGD between rounds: about 0.1,
    # tests/test_cluster_training.py), and the same final evaluation. With nobody outside the
    # group, its WAN round (rank 0's, for the group) finds no group; rank 1 delegated its lane.
    assert sorted(r.last_round_outcome for r in finals) == ["delegated", "no_group"], finals
    assert all(r.param_distance_to_group_mean < 1e-3 for r in finals), finals
    assert finals[0].eval_score == finals[1].eval_score, finals
    # The fusion tuner runs in the daemon: every RETUNE_EVERY DeAR steps the members re-tune together.
    assert all("retune at step" in d.log_tail(100000) for d in (a, b)), a.log_tail(40)
    task = get_task("digits-mlp")
    h = task.parse_hparams({"optimizer": "sgd", "lr": 0.05})
    single = sum(train_single_process(task, h, steps=STEPS, batch_size=2 * BATCH, seed=s).score for s in range(2)) / 2
    assert finals[0].eval_score >= single - 0.02, (finals[0].eval_score, single)
    print(
        f"fell back {fell_back:.2f} s after the kill; final accuracy {finals[0].eval_score:.4f} (single {single:.4f})"
    )
    for d in (a, b):
        assert d.stop() == 0


@pytest.mark.heavy
def test_a_local_group_averages_over_the_wan_as_one_peer_each_member_its_own_lanes(spawn):
    """Two labelled daemons and two solo ones in a run of two lanes (docs/dear.md, "The
    hierarchy"). Once a and b train as a DeAR group, each averages one lane over the WAN for both,
    with the solo daemons, which average both lanes; the group's members stay identical and the
    run converges as a whole."""
    create = [
        "--task",
        "digits-mlp",
        "--set",
        f"averaging.average_every={EVERY}",
        "--set",
        "averaging.algorithm=state",
        "--set",
        "averaging.lanes=2",
        "--set",
        "optimizer=sgd",
        "--set",
        "lr=0.05",
    ]
    base = ["--run", "hier", "--max-steps", str(STEPS), "--min-peers", "4", *RUN_ARGS, *FAST_DISCOVERY]
    a = spawn("h-a", [*base, "--local-group", "rack", *create])
    join = ["--initial-peers", a.maddrs[0]]
    others = [spawn("h-b", [*base, "--local-group", "rack", *join], wait=False)]
    others += [spawn(f"h-{n}", [*base, *join], wait=False) for n in "cd"]
    for d in others:
        d.wait_ready()
    b, c, d = others
    group, solo = (a, b), (c, d)

    rs = wait_group(group, "hier", 2, "a and b form their local group", timeout=60, shown=(a, b, c, d))
    assert sorted(r.wan_share for r in rs) == [0.5, 0.5], rs  # each owns one of the two lanes
    assert all(status(x, "hier").wan_share == 1.0 for x in solo)

    def met_on_the_wan():  # a round of a group member's own lane, with solo daemons in it
        rs = [status(x, "hier") for x in group]
        return (
            all(r.local_group_size == 2 and r.last_round_outcome == "completed" and r.group_size >= 2 for r in rs)
            and rs
        )

    rs = wait_for(
        met_on_the_wan,
        timeout=60,
        interval=0.05,
        what="each member of the group completes its lane's round with solo peers",
    )
    assert all(r.last_round_links for r in rs), rs

    # One big peer on the WAN: over the same rounds, the group's members together send about what
    # one solo daemon sends (each lane's group of three: the lane's owner and the two solo daemons),
    # each member half of it. Averaging rounds only: DeAR's traffic is not in peerd_sent_bytes_total.
    def sent(x):
        return sum(v for (name, _), v in scrape(x.metrics_url).items() if name == "peerd_sent_bytes_total")

    start = {x.data_dir.name: (sent(x), status(x, "hier").step) for x in (a, b, c, d)}
    wait_for(
        lambda: all(status(x, "hier").step >= min(start[x.data_dir.name][1] + 5 * EVERY, STEPS) for x in (a, b, c, d)),
        timeout=60,
        what="five more rounds",
    )
    held = all(status(x, "hier").local_group_size == 2 for x in group)
    delta = {x.data_dir.name: sent(x) - start[x.data_dir.name][0] for x in (a, b, c, d)}
    if held and start["h-a"][1] + 5 * EVERY <= STEPS:
        solo_sent = (delta["h-c"] + delta["h-d"]) / 2
        assert 0.6 * solo_sent <= delta["h-a"] + delta["h-b"] <= 1.4 * solo_sent, delta
        assert max(delta["h-a"], delta["h-b"]) <= 0.75 * solo_sent, delta
    print("bytes sent over five rounds:", delta, "group held" if held else "group dropped meanwhile: not compared")
    for x in (a, b, c, d):
        wait_for(lambda: status(x, "hier").train_state == "FINISHED", timeout=120, what=f"{x.data_dir.name} finishes")
    finals = {x.data_dir.name: status(x, "hier") for x in (a, b, c, d)}
    assert all(r.step == STEPS for r in finals.values()), finals
    for x in group:
        m = scrape(x.metrics_url)
        assert ("peerd_wan_share", (("run", "hier"),)) in m
    # The group's members ended identical (their last round gathered every lane), and the run as a
    # whole is one model: the solo daemons' accuracy is close to the group's.
    ga, gb = finals["h-a"], finals["h-b"]
    assert ga.eval_score == gb.eval_score, (ga, gb)
    for name in ("h-c", "h-d"):
        assert abs(finals[name].eval_score - ga.eval_score) < 0.05, finals
        assert finals[name].param_distance_to_group_mean < 1.0, finals[name]
    task = get_task("digits-mlp")
    h = task.parse_hparams({"optimizer": "sgd", "lr": 0.05})
    single = train_single_process(task, h, steps=STEPS, batch_size=2 * BATCH, seed=0).score
    assert ga.eval_score >= single - 0.03, (ga.eval_score, single)
    print(
        {k: (round(r.eval_score, 4), r.last_round_outcome, r.group_size) for k, r in finals.items()},
        f"single {single:.4f}",
    )
    for x in (a, b, c, d):
        assert x.stop() == 0
