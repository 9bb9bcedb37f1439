"""How the suite runs on a 2-core machine (issue 24), loaded with `-p tests.suite_rules` (pyproject.toml):
which tests may be retried once and how a retry is put on record, which tests are heavy and how many of
those run at once, and the order pytest-xdist hands tests out in. tests/FLAKY.md is the ledger."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import time
from pathlib import Path

import pytest

# Tests that build a network lab (namespaces, a bridge, nftables tables) run one after another on one
# pytest-xdist worker (`--dist loadgroup`, ./dev test): two labs built at once could pick the same
# free subnet (daemon/lab/netns.py), and their timings assume no other lab shares the link.
LAB_FILES = {"test_lab.py", "test_dear_lab.py", "test_linkprobe_lab.py", "test_churn.py"}

# Files whose tests start real processes (daemons, p2pd, training children, gloo ranks, torchrun, a
# lab, a benchmark, promtool). Each such test may be retried once, never silently: tests/FLAKY.md.
PROCESS_FILES = LAB_FILES | {
    "test_alerts.py",
    "test_auto_every.py",
    "test_bench_smoke.py",
    "test_cluster_training.py",
    "test_collective.py",
    "test_compose.py",
    "test_control_abuse.py",
    "test_daemon.py",
    "test_dear.py",
    "test_dear_engine.py",
    "test_dht_churn.py",
    "test_diloco_training.py",
    "test_group_span.py",
    "test_health.py",
    "test_hivemind_parts.py",
    "test_late_answers.py",
    "test_linkprobe.py",
    "test_links.py",
    "test_local_group.py",
    "test_local_group_links.py",
    "test_matchmaking.py",
    "test_membership.py",
    "test_membership_clock.py",
    "test_node_bootstrap.py",
    "test_node_requests.py",
    "test_plan.py",
    "test_progress.py",
    "test_prometheus.py",
    "test_restart.py",
    "test_scale.py",
    "test_start_checks.py",
    "test_statesync.py",
    "test_stopping.py",
    "test_supervisor.py",
    "test_tasks.py",
    "test_train_process.py",
    "test_training.py",
    "test_udp.py",
    "test_udp_training.py",
    "test_your_loop.py",
}
# A test that starts several daemons, a lab or a benchmark's processes is marked `heavy` by hand: at
# most HEAVY_SLOTS of them run at once across the xdist workers, and the rest of the suite spreads
# over the workers meanwhile. Two: three at once on 2 cores is what made tests that pass on a quiet
# machine fail on a busy one (tests/FLAKY.md). A test with one daemon (and its p2pd and training
# child) is not heavy: slots for those made the heavy tests the whole suite's critical path. Tests
# that start several processes but mostly wait (scripts of slow steps, a lease running out) stay
# heavy: their timing needs the cores (run 22 in tests/FLAKY.md freed six of them: slower, 2 retries).
HEAVY_SLOTS = 2
# The longest a heavy test waits for a slot (two of the longest heavy tests run back to back
# take about 150 s on a busy machine); past it the test fails, naming the wait.
HEAVY_WAIT_S = 900
TRACEBACK_LINES = 12  # of each retried test's first try, printed under its RETRIED line
LEDGER = Path(__file__).parent / "FLAKY.md"  # --flaky-ledger PATH writes another file (tests of these rules)


def pytest_addoption(parser):
    parser.addoption("--flaky-ledger", default=str(LEDGER), help="the ledger a retry is appended to (tests/FLAKY.md)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in LAB_FILES or "round_cost" in item.name or "vs_peers" in item.name:
            item.add_marker(pytest.mark.xdist_group("lab"))
        if item.path.name in PROCESS_FILES:
            item.add_marker(pytest.mark.flaky(reruns=1))
    # pytest-xdist hands out tests in this order (the lab's group first, as the largest): heavy tests
    # spread over the first half of the others, so two of them run while the third worker takes
    # light tests, and no heavy test is left to the end with two workers idle.
    heavy = [item for item in items if item.get_closest_marker("heavy")]
    light = [item for item in items if not item.get_closest_marker("heavy")]
    every = max(1, len(light) // 2 // max(1, len(heavy)))
    spread = []
    for i, item in enumerate(light):
        if i % every == 0 and heavy:
            spread.append(heavy.pop(0))
        spread.append(item)
    items[:] = spread + heavy


def _slot_dir(config) -> Path | None:
    """A folder every xdist worker of this run shares (the parent of the workers' own temporary
    folders, which pytest prunes as it prunes them); None when the tests run in one process."""
    if not hasattr(config, "workerinput"):
        return None
    # The tmp_path_factory fixture's object: the hook that takes the slot runs before any fixture.
    return config._tmp_path_factory.getbasetemp().parent


@contextlib.contextmanager
def _heavy_slots(config, nodeid: str, count: int):
    """Hold `count` of HEAVY_SLOTS flock()ed files for the test's whole protocol (retry included);
    the kernel drops the locks if the worker dies. A test that takes them all holds the slots it got
    while it waits for the rest, and looks more often than a one-slot test, so that a stream of
    those does not keep it waiting."""
    folder = _slot_dir(config)
    if folder is None:
        yield
        return
    deadline = time.monotonic() + HEAVY_WAIT_S
    held: dict[int, object] = {}
    try:
        while True:
            for i in range(HEAVY_SLOTS):
                if i in held or len(held) == count:
                    continue
                f = open(folder / f"slot{i}", "a")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    f.close()
                    continue
                held[i] = f
            if len(held) == count:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{nodeid}: {count} heavy-test slot(s) not free within {HEAVY_WAIT_S} s")
            time.sleep(0.2 if count == 1 else 0.05)
        yield
    finally:
        for f in held.values():
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Outside pytest-timeout's wrapper: the wait for a slot is not part of the test's 300 s.
    marker = item.get_closest_marker("heavy")
    if marker is None:
        return (yield)
    # heavy(slots=2): a test that loads the machine as two heavy tests do runs with no other beside it.
    with _heavy_slots(item.config, item.nodeid, min(HEAVY_SLOTS, int(marker.kwargs.get("slots", 1)))):
        return (yield)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Every retry in the run's last lines, and appended to the ledger: a defect on record."""
    if hasattr(terminalreporter.config, "workerinput"):
        return  # an xdist worker: its controller reports for the run
    retried = [r for r in terminalreporter.stats.get("rerun", []) if r.when == "call" or r.failed]
    if not retried:
        return
    terminalreporter.write_sep(
        "=",
        f"{len(retried)} test(s) needed their retry: on record in {terminalreporter.config.getoption('flaky_ledger')}",
        red=True,
    )
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    lines = []
    for r in retried:
        crash = getattr(r.longrepr, "reprcrash", None)
        why = (crash.message if crash else str(r.longrepr)).strip().splitlines()[0][:300]
        terminalreporter.write_line(f"RETRIED {r.nodeid} ({r.when}): {why}", red=True)
        for line in str(r.longrepr).splitlines()[-TRACEBACK_LINES:]:  # where: CI's output is all there is
            terminalreporter.write_line(f"    {line}")
        lines.append(f"| {stamp} | `{r.nodeid}` ({r.when}) | {why.replace('|', '/')} |\n")
    with Path(terminalreporter.config.getoption("flaky_ledger")).open("a") as f:
        f.writelines(lines)
