"""Small helpers shared by tests: bounded waiting, scraping, CLI calls."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll predicate until it returns a truthy value; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout} s (last value: {last!r})")


def drain(proc: subprocess.Popen, log: Path) -> subprocess.Popen:
    """Copy a script's output to `log` as it comes (a line per phase: a full pipe would stop it)."""

    def copy() -> None:
        with open(log, "a") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()

    threading.Thread(target=copy, name="drain", daemon=True).start()
    return proc


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """One /metrics scrape as {(sample name, sorted label items): value}."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def families(url: str) -> dict[str, tuple[str, frozenset[str] | None]]:
    """Metric family names on an endpoint (counters named with _total) with their types and label
    names; the label names are None for a family with no series yet (the text format shows none)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for f in text_string_to_metric_families(text):
        labels = {k for s in f.samples for k in s.labels if k not in ("le", "quantile")}  # a histogram's own
        out[f.name + "_total" if f.type == "counter" else f.name] = (f.type, frozenset(labels) if f.samples else None)
    return out


def peerd(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """`peerd ARGS` to its exit. `timeout` bounds a hang only: a refused `peerd start` boots its node
    first, which took over 30 s beside the suite and three benchmarks on 2 cores (run 72)."""
    return subprocess.run(
        [sys.executable, "-m", "peerd.daemon.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def peer_ids(daemon, run: str) -> list[str]:
    """The run's peer table over the control API, in-process (fast enough to poll)."""
    from peerd.daemon.client import ControlClient

    with ControlClient(daemon.control) as c:
        return sorted(p.peer_id for p in c.list_peers(run).peers)


def peers_json(daemon, run: str) -> list[str]:
    """The same through `peerd peers --json`, as a user would run it."""
    r = peerd("peers", "--control", daemon.control, "--run", run, "--json")
    assert r.returncode == 0, r.stderr
    return sorted(p["peer_id"] for p in json.loads(r.stdout)[run])


@asynccontextmanager
async def peer_nodes(n: int, tmp_path, events=None):
    """n real PeerNodes (p2pd + DHT) on loopback, node 0 first and the others bootstrapped to it;
    all shut down on exit."""
    from peerd.peers.events import PeerEvents
    from peerd.peers.node import NodeSettings, PeerNode

    def settings(i: int, initial: list[str]) -> NodeSettings:
        # Each start spawns p2pd twice (hivemind first checks that the identity is free): 15 s, the
        # default, ran out while other tests loaded both cores.
        return NodeSettings(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=tmp_path / f"n{i}.key",
            initial_peers=initial,
            startup_timeout=60,
        )

    events = events or PeerEvents()
    nodes: list[PeerNode] = []
    try:
        nodes.append(await PeerNode.start(settings(0, []), events))
        first = (await nodes[0].visible_maddrs())[0]
        nodes += await asyncio.gather(*(PeerNode.start(settings(i, [first]), events) for i in range(1, n)))
        yield nodes
    finally:
        await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)


def lab_sample(
    t, host, peers, step, last_round, pid=1, outcome="completed", group_size=3, divergence=0.0, metrics=None
):
    """A collector's sample of one host (daemon/lab/runner.py), for tests of the lab's report and of
    bench.churn."""
    from peerd.daemon.lab.runner import Sample

    return Sample(
        t=t,
        host=host,
        pid=pid,
        step=step,
        local_step=step,
        loss=0.5,
        last_round=last_round,
        outcome=outcome,
        group_size=group_size,
        peers=frozenset(peers),
        divergence=divergence,
        eval_score=0.9,
        metrics=metrics or {},
    )


class LoopThread:
    """An event loop in a thread of its own: the daemon's loop for code under test (a trainer's
    rounds run there), which the test drives from its own thread, as the daemon's worker threads do."""

    def __init__(self):
        from peerd.daemon.app import worker_threads

        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(worker_threads())  # as the daemon's (daemon/cli.py)
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        """Run `coro` on the loop; its result (bounded by `timeout`)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def together(self, *calls, timeout: float = 30.0) -> list:
        """Run the coroutines `calls()` make at once on the loop, as several daemons would; their results in order."""

        async def gathered():
            return await asyncio.gather(*(call() for call in calls))

        return self.run(gathered(), timeout)

    def close(self) -> None:
        async def cancel_the_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


_LOOP: LoopThread | None = None  # the loop_thread fixture's (tests/conftest.py) while a test holds it


def on_loop(coro, timeout: float = 30.0):
    """Await `coro` on the loop_thread fixture's loop from the test's thread, as the daemon's worker
    threads and its control handlers wait (the test asks for the fixture: `usefixtures`)."""
    return _LOOP.run(coro, timeout)


def together(*calls, timeout: float = 30.0) -> list:
    """LoopThread.together on the loop_thread fixture's loop."""
    return _LOOP.together(*calls, timeout=timeout)
