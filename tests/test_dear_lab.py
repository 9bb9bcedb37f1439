"""DeAR in the network lab (root and network namespaces; skipped elsewhere with the reason): the
fusion tuner, fed only by the transfers of real training steps over tbf-shaped links, re-plans after
the lab lowers every link's rate sixteenfold, and the new bucket size is smaller, as its model predicts (a
higher per-byte cost beta with the same latency gives b* = sqrt(M alpha / 2 beta) smaller). The
lab and every rank process are gone afterwards."""

from __future__ import annotations

import sys

import pytest

from peerd.daemon.lab import netns

PROBLEM = netns.environment_problem() if sys.platform == "linux" else "not Linux"
needs_lab = pytest.mark.skipif(PROBLEM is not None, reason=f"network lab unavailable: {PROBLEM}")


@needs_lab
@pytest.mark.heavy
def test_tuner_replans_smaller_buckets_after_the_link_rate_drops():
    from bench.dear_tuner import parser, run

    args = parser().parse_args(
        [
            "--rate1",
            "400",
            "--rate2",
            "25",
            "--width",
            "128",
            "--depth",
            "32",
            "--batch",
            "64",
            "--retune-every",
            "4",
            "--steps-a",
            "16",
            "--steps-b",
            "20",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--min-kib",
            "16",
            "--timeout",
            "85",
        ]
    )
    report = run(args, emit_lines=False)
    assert report["lab_id"] not in netns.labs(), "the lab was not destroyed"  # other labs may come and go meanwhile
    a = [r for r in report["retunes"] if r["phase"] == "A"]
    b = [r for r in report["retunes"] if r["phase"] == "B"]
    assert a[-1]["mb_per_s"] and b[-1]["mb_per_s"], report["retunes"]
    # The fit followed the link: 16x less rate, the fitted bytes per second at least 4x lower (at
    # 400 Mbit/s the fit is noisier: rank skew weighs more where transfers are short).
    assert b[-1]["mb_per_s"] < a[-1]["mb_per_s"] / 4, (a[-1], b[-1])
    # The group re-planned after the change, and to smaller buckets than it used before it.
    replans = [r for r in b if r["replan"]]
    assert replans, b
    assert report["plan_b"] < report["plan_a"], (report["plan_a"], report["plan_b"], report["retunes"])
    # Smaller buckets: at least as many of them, each count the one the plan cuts (a bucket holds whole
    # layers, so two plans within one layer's bytes of each other cut the same count: CI saw 11 and 11).
    from bench.dear import _mlp
    from peerd.peers.dear.buckets import plan_buckets

    model = _mlp(128, 32)
    cut = {name: len(plan_buckets(model, report["plans"][name], 2).buckets) for name in ("tuned", "stale")}
    assert {name: report["buckets"][name] for name in cut} == cut, (report["plans"], report["buckets"])
    assert cut["tuned"] >= cut["stale"], (report["plan_a"], report["plan_b"])
