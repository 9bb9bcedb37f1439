"""bench.scale's pure parts: histogram quantiles, CPU shares, and the paced task's registration.

The benchmark's machinery with eight daemons: tests/test_scale.py (docs/benchmarks.md, "Scale").
"""

from __future__ import annotations

import importlib.metadata
import math

import pytest

from bench import paced_task
from bench.scale import cpu_share, histogram_quantiles, register_paced_task
from peerd.daemon.tasks.base import HparamsError


def test_histogram_quantiles_interpolate_inside_a_bucket_as_promql_does():
    buckets = {0.01: 0.0, 0.1: 50.0, 1.0: 90.0, 10.0: 100.0, math.inf: 100.0}
    q = histogram_quantiles(buckets)
    assert q["p50"] == pytest.approx(0.1)
    assert q["p90"] == pytest.approx(1.0)
    assert q["p99"] == pytest.approx(1.0 + 9.0 * 0.9)
    assert histogram_quantiles({0.1: 0.0, math.inf: 0.0}) == {"p50": None, "p90": None, "p99": None}
    assert histogram_quantiles({0.1: 0.0, math.inf: 4.0})["p50"] == 0.1  # all above the top bound


def test_cpu_share_counts_a_process_started_in_the_window_from_zero():
    before = {1: ("daemon", 10.0), 2: ("p2pd", 4.0)}
    after = {1: ("daemon", 11.0), 2: ("p2pd", 4.5), 3: ("training", 2.0)}
    assert cpu_share(before, after, 10.0) == {"daemon": 0.1, "p2pd": 0.05, "training": 0.2, "tree": 0.35}


def test_the_paced_task_is_found_through_its_entry_point(tmp_path):
    folder = register_paced_task(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(folder)])
    (ep,) = [ep for ep in dist.entry_points if ep.group == "peerd.tasks"]
    assert ep.name == paced_task.NAME and ep.load() is paced_task.PacedDigits
    task = paced_task.PacedDigits()
    assert task.parse_hparams({"steps_per_second": 5.0}).steps_per_second == 5.0
    with pytest.raises(HparamsError):
        task.parse_hparams({"steps_per_second": 0.0})
