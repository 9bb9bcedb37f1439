"""Local groups of a state run's daemons (--local-group): the training processes of the daemons with
the same label are one group, one WAN peer (daemon/groupspan.py), in children, as a DiLoCo run's
(tests/test_group_span.py). The decision `plan_group` is tested with made-up tables; the daemon
tests start real daemons on loopback: three form the group, one is killed (SIGKILL) and the others
re-form as two, train on and end with the same model and an accuracy in line with
tests/test_cluster_training.py's; two of four average one lane each over the WAN for the group.
"""

from __future__ import annotations

import signal

import grpc
import pytest

from peerd.daemon.client import ControlClient
from peerd.daemon.tasks import get_task, train_single_process
from peerd.peers.dear.localgroup import LocalGroupRules
from peerd.peers.dear.member import GroupPeer, plan_group
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


def test_a_failed_collective_holds_no_reference_to_its_op():
    """peerd/local_group.Collective._wait: the GroupBroke of a failed op does not keep the op (and
    through it the epoch's Gloo connections) alive while the process forms the next epoch: a member
    still inside that op, sending to this process, would wait out its timeout (60 s in a kill test)."""
    import gc
    import weakref

    from peerd.local_group import Collective, GroupBroke

    class FailedOp:  # what a Gloo work whose peer died does on wait()
        def wait(self):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1")

    op = FailedOp()
    gone = weakref.ref(op)
    with pytest.raises(GroupBroke, match="Connection closed by peer") as broke:
        Collective._wait(None, op)
    del op
    gc.collect()
    assert gone() is None, gc.get_referrers(gone())
    assert broke.value.__context__ is None  # nor the error that held the op's frame


STEPS, EVERY, BATCH = 400, 10, 32
RUN_ARGS = ["--eval-every", "100000", "--checkpoint-every", "100000", "--torch-threads", "1"]
FAST_DISCOVERY = ["--heartbeat-interval", "1", "--refresh-interval", "0.5", "--peer-ttl", "4", "--dht-timeout", "2"]


def status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def wait_group(daemons, run: str, size: int, what: str, *, timeout: float = 60, shown=None):
    """Wait until each of `daemons` trains in a local group of `size` processes, its child attached;
    returns their statuses. On timeout, fail with the status and log of each of `shown` (default:
    `daemons`)."""

    def formed():
        rs = [status(d, run) for d in daemons]
        return all(r.local_group_size == size and r.attached_pid and r.local_group_rank >= 0 for r in rs) and rs

    def shown_status(d):  # a daemon the test killed answers nothing
        try:
            return status(d, run)
        except grpc.RpcError as e:
            return f"{d.data_dir.name}: unreachable ({e.code().name})"

    try:
        return wait_for(formed, timeout=timeout, interval=0.05, what=what)
    except AssertionError as e:
        shown = shown or daemons
        raise AssertionError(
            "\n".join([str(e), str([shown_status(d) for d in shown])] + [d.log_tail(60) for d in shown])
        ) from None


@pytest.mark.heavy
def test_three_daemons_of_a_state_run_train_as_one_local_group_and_survive_a_kill(spawn, secret_file):
    """A secret run of the state algorithm, its daemons labelled alike: their children are one group
    (ranks 0, 1, 2; one WAN peer: the leader averages for it, the others follow); a killed daemon
    (its child goes with it) leaves the group, the two others re-form it, train on to the end and
    hold one model."""
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
    # The joiners name the run's task and settings too: they take a's manifest at start (the same,
    # or refused), not from the DHT, so their children start as soon as a's (runs 77, 78: a joiner's
    # child started after the others' --min-peers-timeout and found the run finished).
    b, c = (spawn(f"lg-{n}", [*args, *create, "--initial-peers", a.maddrs[0]], wait=False) for n in "bc")
    b.wait_ready()
    c.wait_ready()
    daemons = [a, b, c]

    rs = wait_group(daemons, "lg", 3, "the local group of three forms")
    assert sorted(r.local_group_rank for r in rs) == [0, 1, 2], rs
    assert all(r.local_group == "rack" and r.algorithm == "state" and r.train_process_state for r in rs), rs
    # --min-peers: the group's first epoch held all three (AttachedTrainer._assemble), none of them
    # trained alone first and downloaded the run's state later (runs 68, 77, 78, CI 41).
    assert all(r.synced_from == 0 for r in rs), rs
    # One lane (the default): the leader averages the whole state over the WAN for the group.
    assert sorted(r.wan_share for r in rs) == [0.0, 0.0, 1.0], rs
    assert all(r.train_state == "TRAINING" for r in rs), rs  # killed mid-run, not after
    out = peerd("status", "--control", a.control).stdout
    assert "lg: local group rack  processes 3  first rank here " in out, out

    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(10)
    killed_at = max(status(d, "lg").step for d in (a, b))
    # c stops beating: the coordinator lists a and b alone (groupspan.STALE after c's last beat; if
    # c coordinated, once a's and b's tables drop it), and their processes, whose collectives broke
    # at once, regroup there.
    # The bound is on a hang: on a loaded machine (run 76) the regroup outlasted 60 s.
    rs = wait_group((a, b), "lg", 2, "a and b re-form a group of two", shown=daemons, timeout=120)
    assert sorted(r.local_group_rank for r in rs) == [0, 1], rs
    # No survivor waited out an op's timeout to get there: the first to see the break closed the
    # broken epoch's connections as it regrouped (Collective._wait; a Gloo send to it had waited
    # 60 s for a reply that never came).
    for d in (a, b):
        assert "Timed out waiting" not in d.log_path.read_text(errors="replace"), d.log_tail(40)
    wait_for(
        lambda: all(status(d, "lg").step >= min(killed_at + 3 * EVERY, STEPS) for d in (a, b)),
        timeout=60,
        what="a and b train on after the kill",
    )
    for d in (a, b):
        wait_for(lambda: status(d, "lg").train_state == "FINISHED", timeout=120, what=f"{d.data_dir.name} finishes")
    finals = [status(d, "lg") for d in (a, b)]
    for r, d in zip(finals, (a, b)):
        assert r.step == STEPS, r
        m = scrape(d.metrics_url)
        assert ("peerd_local_group_size", (("run", "lg"),)) in m
        assert m.get(("peerd_rejected_total", (("reason", "wire_bad_hello"),)), 0) == 0
    # The group's processes hold the same model at every phase's end (the digest check raises
    # otherwise): the same final evaluation on both daemons.
    assert finals[0].eval_score == finals[1].eval_score, finals
    task = get_task("digits-mlp")
    h = task.parse_hparams({"optimizer": "sgd", "lr": 0.05})
    single = sum(train_single_process(task, h, steps=STEPS, batch_size=2 * BATCH, seed=s).score for s in range(2)) / 2
    assert finals[0].eval_score >= single - 0.02, (finals[0].eval_score, single)
    print(f"final accuracy {finals[0].eval_score:.4f} (single {single:.4f})")
    for d in (a, b):
        assert d.stop() == 0


@pytest.mark.heavy
def test_a_local_group_averages_over_the_wan_as_one_peer_each_daemon_its_own_lanes(spawn):
    """Two labelled daemons and two solo ones in a state run of two lanes (peers/dear/delegate.py).
    Once a and b's processes train as one group, each daemon averages one lane over the WAN for the
    group, with the solo daemons, which average both lanes; the group's members stay identical and
    the run converges as a whole."""
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
    join = [*create, "--initial-peers", a.maddrs[0]]  # a's manifest at start (as above)
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
    # each member half of it. Averaging rounds only: the group's own traffic (Gloo, lane requests) is not counted there.
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
