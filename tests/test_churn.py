"""bench.churn: its fault schedule and its figures (pure functions, made-up records), then a short
churn scenario in the real lab, with its goodput bound written from measurement.

What the figures mean and the long runs: docs/benchmarks.md, "Goodput under churn".
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from bench.churn import availability, detection_s, goodput, longest_stall, scenario, schedule
from peerd.daemon.lab.runner import DAEMON_DEFAULTS, Event, Record, Sample
from peerd.daemon.lab.scenario import parse
from tests.helpers import ROOT, lab_sample
from tests.test_lab import leftovers, needs_lab


def args(**changes) -> argparse.Namespace:
    base = dict(hosts=4, seconds=90.0, every=15.0, freeze_for=20.0, steps_per_second=20.0, rate=100.0, loss=1.0)
    return argparse.Namespace(**{**base, "rtt_ms": 0.0, **changes})


def test_the_schedule_plays_each_kind_of_fault_in_turn_and_ends_with_every_host_whole():
    late, faults = schedule(4, 90.0, 15.0, 20.0)
    assert late == 52.5
    assert [(f["at"], f["action"], f.get("hosts")) for f in faults] == [
        (15.0, "kill", ["h0"]),
        (30.0, "restart", ["h0"]),
        (45.0, "freeze", ["h1"]),
        (60.0, "partition", ["h2"]),
        (65.0, "thaw", ["h1"]),
        (75.0, "heal", None),
    ]
    # The next cycle's targets turn over, the late joiner (h3, there from 52.5 s) among them; a pair
    # whose second half would fall after the end is left out whole.
    _, faults = schedule(4, 165.0, 15.0, 20.0)
    assert [(f["at"], f["action"], f.get("hosts")) for f in faults[6:]] == [
        (90.0, "kill", ["h1"]),
        (105.0, "restart", ["h1"]),
        (120.0, "freeze", ["h2"]),
        (135.0, "partition", ["h3"]),
        (140.0, "thaw", ["h2"]),
        (150.0, "heal", None),
    ]
    for n, seconds in ((3, 75.0), (4, 600.0), (8, 3600.0)):
        parse(scenario("f", args(hosts=n, seconds=seconds), True))  # the lab's own checks accept it
        s = parse(scenario("n", args(hosts=n, seconds=seconds), False))
        assert not s.faults and all(h.join_at == 0 for h in s.hosts)
    with pytest.raises(ValueError, match="at least 3 hosts"):
        schedule(2, 90.0, 15.0, 20.0)
    with pytest.raises(ValueError, match="freeze-for"):
        schedule(4, 90.0, 15.0, 45.0)  # a thaw after the next cycle's kill of the same host


def test_detection_is_the_labs_peer_ttl_refresh_and_dht_timeout():
    assert detection_s(["--peer-ttl", "4", "--refresh-interval", "0.5", "--dht-timeout", "2"]) == 6.5
    assert detection_s() == detection_s(DAEMON_DEFAULTS)


def made_up(faults: list[dict], hosts=("a", "b", "c")) -> Record:
    s = parse({"duration": 40, "host": [{"name": h} for h in hosts], "fault": faults})
    record = Record(s, "abcd")
    record.duration = 40.0
    return record


def sample(t, host, local_step, pid=1, averaged=0.0, samples=0.0) -> Sample:
    metrics = {"samples_averaged": averaged, "samples": samples}
    return lab_sample(t, host, (), local_step, 0, pid, divergence=float("nan"), metrics=metrics)


def test_goodput_sums_every_incarnation_from_the_schedules_start():
    record = made_up([{"at": 10, "action": "kill", "hosts": ["b"]}, {"at": 20, "action": "restart", "hosts": ["b"]}])
    record.samples = [
        sample(0, "a", 10, averaged=100, samples=150),  # counted before the schedule: left out
        sample(39, "a", 90, averaged=900, samples=950),
        sample(0, "b", 10, averaged=100, samples=150),
        sample(9, "b", 30, averaged=300, samples=350),  # killed at 10: what it averaged until then counts
        sample(25, "b", 30, pid=2, averaged=0, samples=320),  # restarted: a new counter, from its checkpoint
        sample(39, "b", 60, pid=2, averaged=200, samples=500),
    ]
    g = goodput(record)
    assert g["per_host"] == {"a": 800, "b": 200 + 200, "c": 0}
    assert g["samples_averaged"] == 1200 and g["per_second"] == 30.0
    assert g["samples_trained"] == (950 - 150) + (500 - 150)  # the restored counter: what b kept


def test_the_longest_stall_leaves_out_a_hosts_frozen_time_and_a_restarts_recovery():
    record = made_up(
        [
            {"at": 10, "action": "freeze", "hosts": ["a"]},
            {"at": 20, "action": "thaw", "hosts": ["a"]},
            {"at": 22, "action": "kill", "hosts": ["c"]},
            {"at": 24, "action": "restart", "hosts": ["c"]},
        ]
    )
    kinds = {f.action: f for f in record.scenario.faults}
    record.events = [Event(f.at, f, frozenset(), {}) for f in record.scenario.faults]
    assert kinds["freeze"].hosts == ("a",)
    record.samples = [
        # a: steps until 8, frozen 10-20 (not polled), steps again at 23: 3 s stood still while it ran.
        sample(7, "a", 70),
        sample(8, "a", 80),
        sample(21, "a", 80),
        sample(23, "a", 90),
        # b: stands still from 12 to 19.5 while the others fail: 7.5 s, after the freeze of a.
        sample(11, "b", 100),
        sample(12, "b", 110),
        sample(19.5, "b", 110),
        sample(20, "b", 120),
        # c's new incarnation takes until 34 for its first step (a recovery, not a stall).
        sample(25, "c", 50, pid=2),
        sample(34, "c", 50, pid=2),
        sample(35, "c", 60, pid=2),
    ]
    assert longest_stall(record) == {"seconds": 7.5, "host": "b", "t": 12.0, "after": "freeze a at 10.0 s"}
    # Of 3 x 40 host-seconds, a was frozen 10 and c down 2.
    assert availability(record) == pytest.approx(1 - 12 / 120)


@needs_lab
@pytest.mark.heavy(slots=2)
@pytest.mark.timeout(400)
def test_a_short_churn_run_keeps_its_goodput_and_loses_nothing():
    """bench.churn --quick: four hosts, 90 s, a kill and restart, a freeze, a late join and a cut
    and heal, beside the same run without faults. Measured (quiet machine, one core busy): goodput
    ratio 0.56 (see the bound below), longest stall 5.0 s."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.churn", "--quick", "--no-results"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    runs = {rec["run"]: rec for rec in lines if "run" in rec}
    faults, none = runs["faults"], runs["none"]
    assert [(f["action"], f["hosts"]) for f in faults["fault_times"]] == [
        ("kill", ["h0"]),
        ("restart", ["h0"]),
        ("freeze", ["h1"]),
        ("join", ["h3"]),
        ("partition", ["h2"]),
        ("thaw", ["h1"]),
        ("heal", []),
    ]
    # Nothing a host trained is lost: no step went back, every checkpoint verifies.
    for run in (faults, none):
        assert run["step_regressions"] == [] and run["torn_checkpoints"] == [] and run["checkpoints_verified"] > 0
    # Every host got samples into the run's model, the restarted one and the late joiner included.
    assert all(v > 0 for v in faults["samples_averaged_per_host"].values()), faults
    assert faults["incarnations"]["h0"] == 2
    *_, stall, headline = lines
    assert stall["metric"].startswith("longest stall") and headline["metric"].startswith("goodput")
    # The bound: measured 0.56 (quick run, both labs at once). Most of the loss is the schedule's, not
    # the protocol's: of 360 host-seconds, about 125 are a host down, frozen or not there yet.
    assert headline["ratio"] >= 0.4, headline
    assert headline["nothing_lost"] is True
    for lab_id in re.findall(r"lab pdlab-([0-9a-f]{4})", r.stderr):
        assert leftovers(lab_id) == []
