"""Link bandwidth in the network lab (root and network namespaces; skipped elsewhere with the
reason): packet trains between two lab hosts, one behind a real tbf, measure that host's links below
the local-group threshold of 1 Gb/s, near the rate it was given, both ways; between two unshaped
hosts they read above it. The lab and its processes are gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from daemon.lab import netns
from peers.dear.localgroup import LocalGroupRules

PROBLEM = netns.environment_problem() if sys.platform == "linux" else "not Linux"
needs_lab = pytest.mark.skipif(PROBLEM is not None, reason=f"network lab unavailable: {PROBLEM}")
RATE_MBIT = 200  # the lab's tbf: burst 100 KB, a third of a train (peers/linkprobe.py)

# One lab host: answer probes on its eth0 address, measure each host named on the command line
# (RTT first, then bandwidth) three times, print the figures as JSON, keep answering until stdin closes.
_PROBER = """
import asyncio, json, sys
from peers.linkprobe import LinkProber

async def main():
    prober = LinkProber(sys.argv[1], 7400)
    await prober.start()
    await asyncio.sleep(1.0)  # the other hosts' probers are up by then
    out = {}
    for target in sys.argv[2:]:
        address = f"{target}:7400"
        figures = []
        for _ in range(3):
            await prober.measure(target, address)
            figures.append(await prober.measure_bandwidth(target, address))
        out[target] = figures
    print(json.dumps(out), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    prober.close()

asyncio.run(main())
"""


@needs_lab
def test_a_tbf_limited_host_measures_below_the_threshold_and_unshaped_hosts_above():
    net = netns.Network().create()
    procs = []
    try:
        hosts = {
            n: net.add_host(n, netns.LinkShape(rate_mbit=RATE_MBIT if n == "slow" else 0)) for n in ("a", "b", "slow")
        }
        plan = {"a": [hosts["b"].ip, hosts["slow"].ip], "b": [], "slow": [hosts["a"].ip]}
        for name, h in hosts.items():
            procs.append(
                subprocess.Popen(
                    [*h.exec_prefix(), sys.executable, "-c", _PROBER, h.ip, *plan[name]],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=netns._ROOT,
                )
            )
        results = {}
        for name, p in zip(hosts, procs):
            if plan[name]:
                results[name] = json.loads(p.stdout.readline())
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        net.destroy()
    print(
        json.dumps({f"{k} -> {t}": [round(f * 8e-6) for f in v] for k, r in results.items() for t, v in r.items()})
    )  # Mbit/s
    threshold = LocalGroupRules().min_bandwidth
    rate = RATE_MBIT * 1e6 / 8
    # Into the shaped host (its downlink tbf) and out of it (its uplink tbf): below the threshold,
    # and within a factor 2 of the rate given (UDP payload: a little below it; a burst: above it).
    for figures in (results["a"][hosts["slow"].ip], results["slow"][hosts["a"].ip]):
        assert all(0 < f < threshold for f in figures), figures
        assert rate / 2 < max(figures) < rate * 2, figures
    assert max(results["a"][hosts["b"].ip]) > threshold, results
    assert net.id not in netns.labs()
