"""averaging.average_every=auto with real daemons: two daemons of a run fit H from the pace their
round's group agreed (peers/pace.py), and give each phase the same H; status, the metric and
`peerd status` show it. The decision's arithmetic has exact-value tests in tests/test_plan.py, the
agreement rule in tests/test_pace.py and tests/test_attached.py. Assertions are about agreement and
bounds, never a timing figure: which H the figures give depends on the machine's load."""

from __future__ import annotations

import pytest

from peerd.daemon.client import ControlClient
from tests.helpers import peerd, scrape, wait_for

pytestmark = pytest.mark.heavy

LOW, HIGH = 4, 4096  # auto's bounds: wide, so that the figures (not a bound) pick H
FAST_DISCOVERY = ["--heartbeat-interval", "1", "--refresh-interval", "0.5", "--peer-ttl", "4", "--dht-timeout", "2"]
# The run's step moves by the schedule's phase (up to HIGH) at each phase's end: no evaluation or
# checkpoint on the run's step count during the test.
QUIET = ["--eval-every", "1000000000", "--checkpoint-every", "1000000000", "--torch-threads", "1"]


def run_status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def test_two_daemons_fit_the_same_h_from_their_groups_pace(spawn):
    """Two daemons train digits-mlp under average_every=auto. Status is polled on both; each
    decision taken from a round's group pace names that round. For every round both were seen
    deciding from, the H is the same; every H is within the bounds; the processes end their phases
    there (the run's step, the schedule's, runs ahead of the steps computed); peerd_average_every
    and `peerd status` show the decision."""
    create = ["--task", "digits-mlp", "--set", "averaging.average_every=auto"]
    create += ["--set", f"averaging.average_every_min={LOW}", "--set", f"averaging.average_every_max={HIGH}"]
    create += ["--set", "averaging.inner_budget=0"]  # no straggler budget: only auto ends a phase early
    args = ["--run", "auto", "--min-peers", "2", *QUIET, *FAST_DISCOVERY]
    a = spawn("auto-a", [*args, *create])
    b = spawn("auto-b", [*args, "--initial-peers", a.maddrs[0]])
    seen: dict[str, dict[int, int]] = {"a": {}, "b": {}}

    def poll() -> bool:
        for name, d in (("a", a), ("b", b)):
            r = run_status(d, "auto")
            assert r.average_every_auto, r
            assert LOW <= r.average_every <= HIGH, r
            if r.average_every_round:  # from that round's group pace, not this daemon's own figures
                assert r.average_every_reason.startswith(f"round {r.average_every_round}'s group of 2: "), r
                seen[name][r.average_every_round] = r.average_every
        common = seen["a"].keys() & seen["b"].keys()
        return len(common) >= 3

    wait_for(poll, timeout=90, interval=0.05, what="both daemons deciding from three common rounds")
    common = sorted(seen["a"].keys() & seen["b"].keys())
    print(f"H by round: a {seen['a']}, b {seen['b']}")
    assert [seen["a"][r] for r in common] == [seen["b"][r] for r in common], seen
    # The processes end their phases at H: the run's step (the schedule's, phases of up to HIGH)
    # runs ahead of the steps computed. Without the cut both would be equal.
    for d in (a, b):
        wait_for(lambda: (r := run_status(d, "auto")).step - r.local_step >= HIGH // 4, timeout=60, what="phases cut")
    before = run_status(a, "auto").average_every
    metric = scrape(a.metrics_url)[("peerd_average_every", (("run", "auto"),))]
    assert metric in (before, run_status(a, "auto").average_every), metric  # a decision may come between
    out = peerd("status", "--data-dir", str(a.data_dir))
    assert out.returncode == 0 and "auto: average_every=auto: H=" in out.stdout, out.stdout
