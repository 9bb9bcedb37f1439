"""`peerd lab`: scenario validation (fast, anywhere), then the real thing in network namespaces.

The real tests need root, `ip netns`, tc and nft; elsewhere they skip with the reason. They check
what the lab promises, measured, not assumed: a 10 % receive-side loss drops about 10 % of a UDP
burst, a rate limit holds a bulk TCP transfer to it, a partition cuts and a heal restores; nothing of
a lab remains after a run, after an exception half-way through a build, after SIGINT, and after a
SIGKILL of `peerd lab` followed by `peerd lab clean` (a delay line included); added RTT (rtt_ms,
the userspace delay line) is measured between hosts, carries a 100 Mbit/s transfer and can be changed
mid-run; and a short scenario of three daemons training
digits-mlp through a partition and a freeze gives a report whose figures hold together.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from peerd.daemon.lab import netns
from peerd.daemon.lab.netns import Host, LinkShape, render_rules
from peerd.daemon.lab.scenario import ScenarioError, load, parse
from tests.helpers import ROOT, lab_sample, peerd, wait_for

# ---- scenario validation: no root needed ---------------------------------------------------------------

BASE = {"duration": 30, "host": [{"name": "a"}, {"name": "b"}]}


def scenario(**changes):
    return parse({**BASE, **changes})


def refused(match: str, **changes):
    with pytest.raises(ScenarioError, match=match):
        scenario(**changes)


def test_the_shipped_scenarios_are_valid():
    paths = sorted((ROOT / "deploy" / "lab").glob("*.toml"))
    assert {p.name for p in paths} >= {"lossy-wan.toml", "churn.toml", "partition.toml"}
    for path in paths:
        s = load(path)
        assert s.hosts and s.duration > 0, path


def test_defaults_and_overrides():
    s = scenario(
        link={"rate_mbit": 100, "loss_pct": 5}, host=[{"name": "a"}, {"name": "b", "loss_pct": 1, "join_at": 10}]
    )
    assert s.host("a").link == LinkShape(rate_mbit=100, loss_pct=5)
    assert s.host("b").link == LinkShape(rate_mbit=100, loss_pct=1) and s.host("b").join_at == 10
    assert [h.name for h in s.first_hosts] == ["a"]
    assert s.congestion_control == "reno" and s.run.task == "digits-mlp"


def test_sites_are_named_numbered_and_bounded():
    s = scenario(host=[{"name": "a", "site": "west"}, {"name": "b", "site": "east"}, {"name": "c"}])
    assert s.sites == ["east", "west"] and s.host("a").site == "west" and s.host("c").site == ""
    refused("site 'West!'", host=[{"name": "a", "site": "West!"}])
    refused("more than 8 sites", host=[{"name": f"h{i}", "site": f"s{i}"} for i in range(9)])


def test_unknown_keys_are_refused_where_they_are():
    refused(r"top level: unknown key 'durations'", durations=3)
    refused(r"\[\[host\]\] 2: unknown key 'los_pct'", host=[{"name": "a"}, {"name": "b", "los_pct": 5}])
    refused(r"\[run\]: unknown key 'steps'", run={"steps": 3})
    refused(r"\[\[fault\]\] 1: unknown key 'host'", fault=[{"at": 1, "action": "kill", "host": "a"}])


def test_impossible_times_are_refused():
    refused(r"duration must be more than 0", duration=0)
    refused(r"at = 31.0 is outside the scenario", fault=[{"at": 31, "action": "kill", "hosts": ["a"]}])
    refused(r"at = -1.0 is outside", fault=[{"at": -1, "action": "kill", "hosts": ["a"]}])
    refused(r"join_at 30.0 is outside", host=[{"name": "a"}, {"name": "b", "join_at": 30}])
    refused(
        r"host 'b' is absent then, so it cannot be killed",
        host=[{"name": "a"}, {"name": "b", "join_at": 10}],
        fault=[{"at": 5, "action": "kill", "hosts": ["b"]}],
    )
    refused(r"host 'a' is running then, so it cannot be thawed", fault=[{"at": 5, "action": "thaw", "hosts": ["a"]}])
    refused(
        r"host 'a' is running then, so it cannot be restarted", fault=[{"at": 5, "action": "restart", "hosts": ["a"]}]
    )
    refused(
        r"host 'a' is killed then, so it cannot be frozen",
        fault=[{"at": 9, "action": "freeze", "hosts": ["a"]}, {"at": 5, "action": "kill", "hosts": ["a"]}],
    )
    refused(r"nothing to heal", fault=[{"at": 5, "action": "heal"}])
    refused(
        r"already partitioned",
        fault=[{"at": 5, "action": "partition", "hosts": ["a"]}, {"at": 6, "action": "partition", "hosts": ["b"]}],
    )
    refused(r"needs hosts on both sides", fault=[{"at": 5, "action": "partition", "hosts": ["a", "b"]}])


def test_a_schedule_that_can_happen_is_sorted_by_time():
    s = scenario(
        fault=[
            {"at": 20, "action": "restart", "hosts": ["a"]},
            {"at": 10, "action": "kill", "hosts": ["a"]},
            {"at": 12, "action": "freeze", "hosts": ["b"]},
            {"at": 14, "action": "thaw", "hosts": ["b"]},
            {"at": 15, "action": "partition", "hosts": ["b"]},
            {"at": 25, "action": "heal"},
            {"at": 26, "action": "link", "hosts": ["a", "b"], "loss_pct": 2.5, "rate_mbit": 10},
        ]
    )
    assert [f.action for f in s.faults] == ["kill", "freeze", "thaw", "partition", "restart", "heal", "link"]
    assert s.faults[-1].link == {"rate_mbit": 10.0, "loss_pct": 2.5}


def test_bad_hosts_and_values_are_refused():
    refused(r"unknown host 'z' \(hosts: a, b\)", fault=[{"at": 1, "action": "kill", "hosts": ["z"]}])
    refused(r"a second host named 'a'", host=[{"name": "a"}, {"name": "a"}])
    refused(r"name 'A b'", host=[{"name": "A b"}])
    refused(r"0 \[\[host\]\] tables: a lab has 1 to 64 hosts", host=[])
    refused(r"min_peers = 3, but only 2 hosts", run={"min_peers": 3})
    refused(r"isolated hosts train alone: min_peers must be 0 or 1", run={"isolated": True, "min_peers": 2})
    refused(r"isolated must be true or false", run={"isolated": "yes"})
    refused(r"loss_pct must be between 0 and 100", link={"loss_pct": 101})
    refused(r"loss_protocol must be one of all, tcp, udp", link={"loss_protocol": "icmp"})
    refused(r"loss_ports must be TCP/UDP ports", link={"loss_ports": [0]})
    refused(r"rate_mbit must be >= 0", link={"rate_mbit": -1})
    refused(r"duration must be a number, not 'x'", duration="x")
    refused(r"congestion_control must be one of reno, bbr, cubic", congestion_control="vegas")
    refused(r"action must be one of kill, freeze", fault=[{"at": 1, "action": "explode", "hosts": ["a"]}])
    refused(r"changes at least one of", fault=[{"at": 1, "action": "link", "hosts": ["a"]}])
    refused(r"link keys belong to action", fault=[{"at": 1, "action": "kill", "hosts": ["a"], "loss_pct": 3}])
    refused(r"name the hosts", fault=[{"at": 1, "action": "kill"}])


def test_rtt_ms_is_accepted_in_range_and_refused_outside():
    s = scenario(
        link={"rtt_ms": 50},
        host=[{"name": "a"}, {"name": "b", "rtt_ms": 0}],
        fault=[{"at": 1, "action": "link", "hosts": ["a"], "rtt_ms": 120}],
    )
    assert s.host("a").link.rtt_ms == 50 and s.host("b").link.rtt_ms == 0
    assert s.faults[0].link == {"rtt_ms": 120.0}
    for where in (
        {"link": {"rtt_ms": 2001}},
        {"host": [{"name": "a", "rtt_ms": -1}]},
        {"fault": [{"at": 1, "action": "link", "hosts": ["a"], "rtt_ms": 1e9}]},
    ):
        refused(r"rtt_ms = \S+ must be between 0 and 2000 ms \(the added round-trip time", **where)
    refused(r"\[link\]: rtt_ms must be a number, not '50ms'", link={"rtt_ms": "50ms"})
    assert scenario(link={"rtt_ms": 0}).host("a").link == LinkShape()


def test_load_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('duration = 10\n[[host]]\nname = "a"\n[[fault]]\nat = 11\naction = "kill"\nhosts = ["a"]\n')
    with pytest.raises(ScenarioError, match=r"^bad.toml: \[\[fault\]\] 1 \(kill\): at = 11.0 is outside"):
        load(bad)
    bad.write_text("duration = \n")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load(bad)
    r = peerd("lab", "run", str(bad))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not valid TOML" in r.stderr, r.stderr


def test_without_root_it_refuses_with_one_line(monkeypatch, capsys, tmp_path):
    from peerd.daemon.lab.cli import run_command

    path = tmp_path / "ok.toml"
    path.write_text('duration = 10\n[[host]]\nname = "a"\n')
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert run_command(str(path), None, None) == 2
    err = capsys.readouterr().err
    assert err == "peerd: error: peerd lab needs root (it creates network namespaces, links and nftables tables)\n"


def test_rules_cut_between_sides_and_drop_on_the_receiving_port():
    hosts = [Host(n, i, f"ns-{n}", f"10.0.0.{i}", f"p{i}") for i, n in enumerate("abc")]
    hosts[1].shape = LinkShape(loss_pct=12.5)
    hosts[2].shape = LinkShape(loss_pct=1, loss_protocol="udp", loss_ports=(9, 10))
    rules = render_rules("T", hosts, {"c": 1}).splitlines()
    assert rules[0] == "flush chain bridge T forward"
    assert 'add rule bridge T forward oifname "p0" iifname != { "p0", "p1" } counter name "cut-a" drop' in rules
    assert 'add rule bridge T forward oifname "p2" iifname != { "p2" } counter name "cut-c" drop' in rules
    # Loss is matched on the port that delivers to the lossy host: after the sender, on the wire.
    assert 'add rule bridge T forward oifname "p1" numgen random mod 10000 < 1250 counter name "loss-b" drop' in rules
    assert any(
        r.startswith('add rule bridge T forward oifname "p2" meta l4proto udp th dport { 9, 10 }') for r in rules
    )
    assert not any("iifname" in r and "loss-" in r for r in rules)
    assert render_rules("T", hosts[:1], {}) == "flush chain bridge T forward\n"


def test_report_times_faults_from_made_up_samples():
    """The report's arithmetic on a made-up record: no daemons, no clock."""
    from peerd.daemon.lab.report import build, table
    from peerd.daemon.lab.runner import Event, Record

    s = scenario(
        host=[{"name": "a"}, {"name": "b"}, {"name": "c"}], fault=[{"at": 10, "action": "kill", "hosts": ["c"]}]
    )
    ids = {"a": "Qa", "b": "Qb", "c": "Qc"}

    def sample(t, host, step, last_round, peers, pid=1, outcome="completed", **metrics):
        metrics = {"rounds_completed": last_round, **metrics}
        return lab_sample(t, host, peers, step, last_round, pid, outcome, 3, 0.1 * t, metrics)

    record = Record(s, "abcd", peer_ids=ids, final_state={"a": "running", "b": "running", "c": "killed"})
    record.events = [Event(10.0, s.faults[0], frozenset({"a", "b"}), {"a": 0, "b": 0, "c": 0})]
    record.samples = [
        sample(9, "a", 90, 9, {"Qb", "Qc"}),
        sample(9, "b", 90, 9, {"Qa", "Qc"}),
        sample(9, "c", 90, 9, {"Qa", "Qb"}),
        sample(12, "a", 100, 9, {"Qb"}),
        sample(13, "b", 100, 9, {"Qa", "Qc"}),
        sample(14, "b", 110, 10, {"Qa"}),
        sample(15, "a", 110, 10, {"Qb"}),
        sample(16, "a", 105, 10, {"Qb"}),  # a regression within one process
    ]
    r = build(record)
    (kill,) = r["faults"]
    assert kill["noticed_s"] == 4.0  # b dropped c at 14, a at 12: the slower counts
    assert kill["resumed_s"] == 5.0  # a's first round after the kill completed at 15, b's at 14
    assert r["hosts"]["a"]["step_regressions"] == ["step 110 -> 105 at t=16.0 s"] and not r["nothing_lost"]
    assert r["hosts"]["c"]["step"] == 90 and r["hosts"]["a"]["rounds"]["completed"] == 10
    assert r["max_param_divergence"] == {"value": 1.6, "host": "a", "t": 16.0}
    text = table(r)
    assert "kill c" in text and "4.0 s" in text and "5.0 s" in text and "nothing lost: NO" in text
    assert "added RTT: none;" in text and r["added_rtt"] == "none"  # nothing measured, nothing claimed


def test_a_thaw_is_noticed_by_the_hosts_on_its_side_of_a_partition():
    """A host cut off from a thawed one sees it only after the heal, which counts that wait itself."""
    from peerd.daemon.lab.report import build
    from peerd.daemon.lab.runner import Event, Record

    s = scenario(
        host=[{"name": "a"}, {"name": "b"}, {"name": "c"}],
        fault=[
            {"at": 2, "action": "freeze", "hosts": ["a"]},
            {"at": 5, "action": "partition", "hosts": ["c"]},
            {"at": 10, "action": "thaw", "hosts": ["a"]},
        ],
    )
    ids = {"a": "Qa", "b": "Qb", "c": "Qc"}

    def sample(t, host, peers):
        return lab_sample(t, host, peers, t, t, group_size=2)

    record = Record(s, "abcd", peer_ids=ids, final_state={n: "running" for n in ids})
    # c is cut off from a and b: it never sees a again before the end.
    record.events = [Event(10.0, s.faults[2], frozenset(ids), {"a": 0, "b": 0, "c": 1})]
    record.samples = [sample(12, "b", {"Qa"}), sample(12, "c", set()), sample(13, "a", {"Qb"})]
    (thaw,) = build(record)["faults"]
    assert thaw["noticed_s"] == 2.0


def test_report_states_the_rtt_as_set_and_as_measured():
    from peerd.daemon.lab.report import added_rtt, build, table
    from peerd.daemon.lab.runner import Record

    s = scenario(link={"rtt_ms": 50})
    record = Record(s, "abcd", final_state={"a": "running", "b": "running"})
    record.rtt = {
        "a": {"to": "b", "set_ms": 50.0, "median_ms": 50.8, "min_ms": 50.5, "max_ms": 52.0, "probes": 10},
        "b": {"to": "a", "set_ms": 50.0, "median_ms": 50.6, "min_ms": 50.4, "max_ms": 51.0, "probes": 10},
    }
    r = build(record)
    assert r["added_rtt"] == "50 ms (userspace TUN delay line, measured 50.7 ms median, 50.6-50.8 over 2 host pairs)"
    assert r["hosts"]["a"]["rtt_ms"] == 50 and r["hosts"]["a"]["measured_rtt"]["median_ms"] == 50.8
    assert "added RTT: 50 ms (userspace TUN delay line, measured 50.7 ms median" in table(
        r
    ) and "50.8 to b (50)" in table(r)
    record.rtt = {}
    assert added_rtt(record) == "50 ms (userspace TUN delay line, not measured)"
    mixed = Record(
        scenario(
            host=[{"name": "a", "rtt_ms": 50}, {"name": "b"}],
            fault=[{"at": 1, "action": "link", "hosts": ["b"], "rtt_ms": 10}],
        ),
        "abcd",
    )
    mixed.rtt = {"a": {"to": "b", "set_ms": 25.0, "median_ms": 25.4, "min_ms": 25.1, "max_ms": 26.0, "probes": 10}}
    assert added_rtt(mixed) == (
        "per host (a 50, b 0 ms; between two hosts the mean of theirs), userspace TUN delay line, "
        "measured 25.4 ms median; changed by link faults (see the events)"
    )


# ---- the real lab: root and network namespaces ----------------------------------------------------------

PROBLEM = netns.environment_problem() if sys.platform == "linux" else "not Linux"
needs_lab = pytest.mark.skipif(PROBLEM is not None, reason=f"network lab unavailable: {PROBLEM}")


def leftovers(lab_id: str, tmp: Path | None = None) -> list[str]:
    """Every trace of one lab: namespaces, links, nft tables, processes in them, its work dir."""
    name = f"pdlab-{lab_id}"
    work = Path(tmp or tempfile.gettempdir()) / name
    found = [f"dir {work}"] if work.exists() else []
    found += [f"netns {n}" for n in netns.sh("ip", "netns", "list").split() if n.startswith(name)]
    found += [
        f"link {line.split(':')[1].strip()}"
        for line in netns.sh("ip", "-o", "link", "show").splitlines()
        if f" {name}" in line
    ]
    found += [f"nft {t}" for t in netns.sh("nft", "list", "tables").splitlines() if t.endswith(name)]
    found += [
        f"process {p}" for p in subprocess.run(["pgrep", "-f", name], capture_output=True, text=True).stdout.split()
    ]
    return found


def in_ns(host: Host, code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([*host.exec_prefix(), sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)


UDP_RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 5000))
# 8 MiB (SO_RCVBUFFORCE, root: the lab needs it anyway): all 4000 datagrams fit even if this process is
# not scheduled for a while on a loaded machine, so that only the loss rule drops (a CI run lost 8 of
# 4000 on a clean link with the default buffer)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)
# The wait ends 2 s after the last datagram; the first may take long: the sender is a new process
# in another namespace, which a loaded machine starts slowly (run 28 in tests/FLAKY.md: 0 received).
print("ready", flush=True); n = 0
s.settimeout(30.0)
try:
    while True:
        if s.recv(2048) == b"end": break
        n += 1
        s.settimeout(2.0)
except socket.timeout: pass
print(n, flush=True)
"""
UDP_SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[2])):
    s.sendto(b"x" * 100, (sys.argv[1], 5000))
    if i % 100 == 0: time.sleep(0.001)  # stay far below the socket buffers: only the rule may drop
time.sleep(0.2)
for _ in range(50): s.sendto(b"end", (sys.argv[1], 5000))
"""
TCP_RECEIVER = """
import socket, sys, time
l = socket.create_server((sys.argv[1], 5001)); print("ready", flush=True)
c, _ = l.accept(); n, want = 0, int(sys.argv[2]); b = c.recv(1 << 16); t0 = time.perf_counter(); n = len(b)
while n < want and b:
    b = c.recv(1 << 16); n += len(b)
print(n * 8 / (time.perf_counter() - t0) / 1e6, flush=True)
"""
TCP_SENDER = "import socket, sys; s = socket.create_connection((sys.argv[1], 5001), timeout=30); s.sendall(b'x' * int(sys.argv[2])); s.close()"
CONNECT = "import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], 5001), timeout=float(sys.argv[2])).close(); print('open')\nexcept OSError as e: print(type(e).__name__)"


def udp_delivered(sender: Host, receiver: Host, count: int) -> int:
    rx = in_ns(receiver, UDP_RECEIVER, receiver.ip)
    assert rx.stdout.readline().strip() == "ready"
    in_ns(sender, UDP_SENDER, receiver.ip, str(count)).wait(60)
    out, _ = rx.communicate(timeout=30)
    return int(out)


@pytest.fixture
def lab():
    net = netns.Network().create()
    yield net
    net.destroy()
    assert leftovers(net.id) == []


@needs_lab
@pytest.mark.timeout(90)
@pytest.mark.heavy
def test_loss_rate_and_partition_are_real(lab):
    a = lab.add_host("a", congestion_control="reno")
    b = lab.add_host("b", LinkShape(loss_pct=10), congestion_control="reno")
    assert lab.congestion_control(a) == "reno"
    # 10 % of the packets delivered to b are dropped (binomial: 4000 +- 60 of 4000 x 0.9 = 3600).
    count = 4000
    got = udp_delivered(a, b, count)
    dropped = lab.dropped()["b"]["loss"]
    assert 0.07 * count < count - got < 0.13 * count, got
    assert count - got <= dropped <= count - got + 55  # the counter also saw some of the 50 end markers, and ARP
    assert udp_delivered(b, a, count) == count  # a's link is clean: loss is per receiving host
    # A 20 Mbit/s rate on a: a bulk TCP transfer to it runs at about that, not at veth speed.
    lab.shape("a", LinkShape(rate_mbit=20))
    lab.shape("b", LinkShape())
    size = 4_000_000  # 1.6 s at 20 Mbit/s
    rx = in_ns(a, TCP_RECEIVER, a.ip, str(size))
    assert rx.stdout.readline().strip() == "ready"
    in_ns(b, TCP_SENDER, a.ip, str(size)).wait(30)
    mbit = float(rx.communicate(timeout=30)[0])
    assert 15 < mbit < 21, mbit
    # A partition cuts a from b (a connect times out), a heal restores it.
    lab.partition([{"a"}])
    rx = in_ns(a, TCP_RECEIVER, a.ip, "1")
    assert rx.stdout.readline().strip() == "ready"
    assert in_ns(b, CONNECT, a.ip, "1.5").communicate(timeout=20)[0].strip() == "TimeoutError"
    assert lab.dropped()["a"]["cut"] > 0
    lab.heal()
    assert in_ns(b, CONNECT, a.ip, "5").communicate(timeout=20)[0].strip() == "open"
    rx.kill()
    rx.wait()


def transfer_mbit(sender: Host, receiver: Host, size: int, ip: str = "") -> float:
    rx = in_ns(receiver, TCP_RECEIVER, ip or receiver.ip, str(size))
    assert rx.stdout.readline().strip() == "ready"
    in_ns(sender, TCP_SENDER, ip or receiver.ip, str(size)).wait(30)
    return float(rx.communicate(timeout=30)[0])


@needs_lab
@pytest.mark.timeout(60)
def test_a_site_link_is_apart_from_the_shaped_one_and_goes_with_the_lab(lab):
    """Two hosts of one site (bench.local_groups): their lab links at 10 Mbit/s, their site link
    unshaped beside it, so a transfer to the other's site address is not held to 10 Mbit/s; the
    site's bridge and veths are the lab's, removed with it (the fixture checks)."""
    a = lab.add_host("a", LinkShape(rate_mbit=10))
    b = lab.add_host("b", LinkShape(rate_mbit=10))
    site_a, site_b = lab.add_site_link("a", 0), lab.add_site_link("b", 0)
    assert site_a.startswith("10.78.") and site_b.startswith("10.78.") and site_a != site_b
    size = 2_000_000  # 1.6 s at 10 Mbit/s
    assert transfer_mbit(a, b, size) < 12
    assert transfer_mbit(a, b, size, ip=site_b) > 30


@needs_lab
@pytest.mark.timeout(60)
@pytest.mark.heavy
def test_added_rtt_is_real_carries_100_mbit_and_changes_mid_run(lab):
    """rtt_ms: each delayed host holds what it sends for rtt_ms / 2 (its delay line), so two hosts at 50
    measure about 50 ms, one at 50 and one at 0 about 25, two at 0 well under 1 ms; the delay line
    carries a TCP transfer near a 100 Mbit/s rate limit; a new rtt_ms takes effect at once."""
    a = lab.add_host("a", LinkShape(rate_mbit=100, rtt_ms=50), congestion_control="bbr")
    b = lab.add_host("b", LinkShape(rate_mbit=100, rtt_ms=50), congestion_control="bbr")
    lab.add_host("c")
    lab.add_host("d")
    rtt = lab.measure_rtt([("a", "b"), ("b", "a"), ("a", "c"), ("c", "d")])
    assert all(m["probes"] == 10 for m in rtt.values()), rtt
    # Never early; late only by scheduling, which a loaded 2-core machine shows (medians of 56 ms seen).
    assert 49.5 < rtt["a", "b"]["min_ms"] and rtt["a", "b"]["median_ms"] < 60, rtt
    assert 49.5 < rtt["b", "a"]["min_ms"] and rtt["b", "a"]["median_ms"] < 60, rtt
    assert 24.7 < rtt["a", "c"]["min_ms"] and rtt["a", "c"]["median_ms"] < 32, rtt
    assert rtt["c", "d"]["median_ms"] < 1, rtt
    assert netns.sh("ip", "-n", a.netns, "link", "show", "dl0") and "dl0" not in netns.sh(
        "ip", "-n", lab.hosts["c"].netns, "link", "show"
    )
    # 100 Mbit/s through both delay lines (the data through a's, the ACKs through b's): 20 MB, 1.6 s at the rate.
    before = lab.delay_stats()
    mbit = transfer_mbit(a, b, 20_000_000)
    assert 60 < mbit < 101, mbit
    after = wait_for(
        lambda: (s := lab.delay_stats())["a"]["packets"] - before["a"]["packets"] > 13_000 and s,
        timeout=3,
        what="delay line counters",
    )
    assert after["a"]["dropped_overflow"] == 0 and after["b"]["dropped_overflow"] == 0, after
    # A link change sets a new delay (the delay line re-reads it on SIGHUP); 0 leaves the delay line in place, idle.
    lab.shape("a", LinkShape(rate_mbit=100, rtt_ms=150))
    lab.shape("b", LinkShape(rate_mbit=100, rtt_ms=0))
    # Ten probes, as above, and the same 20 % for scheduling as at 50 ms (a CI run's median of five was
    # 85.6 ms, its min 75.6, its max 132).
    rtt = lab.measure_rtt([("a", "b"), ("b", "c")], probes=10)
    assert 74.5 < rtt["a", "b"]["min_ms"] and rtt["a", "b"]["median_ms"] < 90, rtt
    # b's delay line stays in place with no delay: well under the 25 ms it held before (a loaded machine
    # adds a few ms of scheduling to each pass through the userspace line; 3.3 ms seen in CI).
    assert rtt["b", "c"]["median_ms"] < 10, rtt


def applied(measured: dict, set_ms: float) -> bool:
    """The RTT the lab set is on the path: the fastest probe takes it (a missing delay reads about
    0.05 ms, a doubled one twice it). The median also holds the userspace delay line's scheduling,
    which a loaded machine adds (27.2 ms for 20 in run 25 of tests/FLAKY.md, min 20.6)."""
    low = measured["min_ms"]
    return (
        measured["set_ms"] == set_ms and set_ms - 0.3 < low < set_ms + 5 and low <= measured["median_ms"] < 2 * set_ms
    )


@needs_lab
@pytest.mark.timeout(60)
@pytest.mark.heavy
def test_a_lab_measures_the_rtt_of_its_scenario_and_after_a_change():
    """The runner's part, without daemons: the RTT measured when the lab is built, and again after a
    link fault that sets rtt_ms; the report states both."""
    import time

    from peerd.daemon.lab.report import build, table
    from peerd.daemon.lab.runner import Lab
    from peerd.daemon.lab.scenario import Fault

    s = parse(
        {"duration": 5, "link": {"rtt_ms": 40}, "host": [{"name": "a"}, {"name": "b", "rtt_ms": 0}, {"name": "c"}]}
    )
    lab = Lab(s)
    try:
        lab._build()
        rtt = lab.record.rtt
        assert rtt["a"]["to"] == "b" and applied(rtt["a"], 20) and rtt["c"]["to"] == "a" and applied(rtt["c"], 40), rtt
        lab.t0 = time.monotonic()
        lab._apply(Fault(at=0, action="link", hosts=("b",), link={"rtt_ms": 40.0}))
        lab.probes[0].join(30)
        after = lab.record.events[0].rtt["b"]
        assert after["to"] == "c" and applied(after, 40), after
        lab.record.delay_lines = lab.net.delay_stats()
        assert set(lab.record.delay_lines) == {"a", "c", "b"}  # b has one since the change
    finally:
        lab.net.destroy()
    assert leftovers(lab.net.id) == []
    report = build(lab.record)
    assert report["added_rtt"].startswith(
        "per host (a 40, b 0, c 40 ms; between two hosts the mean of theirs), userspace TUN delay line, measured "
    )
    assert report["faults"][0]["measured_rtt"]["b"]["median_ms"] == after["median_ms"]
    assert f"RTT b: {after['median_ms']:.1f} to c (40)" in table(report)


@needs_lab
@pytest.mark.timeout(60)
def test_nothing_remains_after_an_exception_half_way_through_a_build():
    from peerd.daemon.lab.runner import Lab

    s = parse({"duration": 5, "congestion_control": "cubic", "host": [{"name": "a"}, {"name": "b"}]})
    lab = Lab(s)
    with pytest.raises(netns.LabError, match="cannot use TCP congestion control 'cubic' inside a network namespace"):
        lab.run()  # cubic: allowed on the host, refused inside a namespace by this kernel
    assert leftovers(lab.net.id) == []


ONE_HOST = 'duration = 60\nstart_timeout = 60\n[[host]]\nname = "a"\n'


def start_lab(tmp_path, text: str) -> tuple[subprocess.Popen, str]:
    """`peerd lab run` as a user runs it, with its work dir under tmp_path; returns it and its lab id
    once a process runs in its namespace."""
    path = tmp_path / "s.toml"
    path.write_text(text)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "peerd.daemon.cli", "lab", "run", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    work = wait_for(lambda: list(tmp_path.glob("pdlab-*")), timeout=30, what="the lab's work dir")[0]
    lab_id = work.name.removeprefix("pdlab-")
    wait_for(
        lambda: netns.sh("ip", "netns", "pids", f"pdlab-{lab_id}-a", check=False).strip(),
        timeout=30,
        what="a daemon in the lab",
    )
    return proc, lab_id


@needs_lab
@pytest.mark.timeout(90)
def test_sigint_removes_everything(tmp_path):
    proc, lab_id = start_lab(tmp_path, ONE_HOST)
    assert leftovers(lab_id, tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=40)
    assert proc.returncode == 130, err
    assert "interrupted; the lab was removed" in err
    assert leftovers(lab_id, tmp_path) == []


@needs_lab
@pytest.mark.timeout(90)
def test_sigkill_then_peerd_lab_clean_removes_everything(tmp_path):
    """With rtt_ms, so the host also has a delay line (a process, its TUN device, routes and rules)."""
    proc, lab_id = start_lab(tmp_path, ONE_HOST + "rtt_ms = 20\n")
    ns = f"pdlab-{lab_id}-a"
    wait_for(
        lambda: (
            "dl0" in netns.sh("ip", "-n", ns, "-o", "link", "show", check=False)
            and "fwmark 0x6c7 lookup main" in netns.sh("ip", "-n", ns, "rule", check=False)
            and "dev dl0" in netns.sh("ip", "-n", ns, "route", "show", "table", "77", check=False)
        ),
        timeout=20,
        what="the delay line's TUN device, route and rules",
    )
    proc.kill()
    proc.wait(10)
    pids = netns.sh("ip", "netns", "pids", ns, check=False).split()
    assert any(b"peerd.daemon.lab.delayline" in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids), pids
    assert leftovers(lab_id, tmp_path), "the daemon and the delay line outlive a SIGKILLed lab until `peerd lab clean`"
    r = peerd("lab", "clean", timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"removed netns pdlab-{lab_id}-a" in r.stdout and f"removed dir {tmp_path}/pdlab-{lab_id}" in r.stdout
    assert leftovers(lab_id, tmp_path) == []


@needs_lab
@pytest.mark.timeout(60)
def test_clean_keeps_the_lab_of_a_live_process(lab):
    lab.add_host("a")
    r = peerd("lab", "clean", timeout=60)
    assert r.returncode == 0 and f"kept pdlab-{lab.id}: its `peerd lab` process still runs" in r.stdout, r.stdout
    assert leftovers(lab.id)


def run_scenario(tmp_path, text: str) -> tuple[dict, str]:
    """`peerd lab run --json` as a user runs it; the report and the printed table."""
    path, out = tmp_path / "s.toml", tmp_path / "report.json"
    path.write_text(text)
    r = peerd("lab", "run", str(path), "--json", str(out), "--logs", str(tmp_path / "logs"), timeout=170)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    # No rtt_ms in these scenarios: no delay line, and the RTT measured when the lab was built.
    assert re.search(r"added RTT: none \(measured \d+\.\d ms median", r.stdout), r.stdout
    assert report["added_rtt"].startswith("none (measured ")
    assert leftovers(report["lab"].removeprefix("pdlab-")) == []
    for name, h in report["hosts"].items():
        assert h["state"] == "running" and h["exit_codes"] == [0], (name, h)
        assert h["step"] > report["timeline"][name][0][1], (name, h)  # every host progressed
        assert h["rounds"]["completed"] >= 1 and h["engine_sent_bytes"] > 0 and h["link_rx_bytes"] > 0, (name, h)
        assert h["checkpoint_steps"], (name, h)
    assert report["nothing_lost"] and report["step_regressions"] == [] and report["torn_checkpoints"] == []
    assert "nothing lost: yes" in r.stdout
    return report, r.stdout


LOSSY_FREEZE = """
name = "lab-test-freeze"
duration = 22
congestion_control = "reno"
[run]
id = "freeze"
settings = { "averaging.average_every" = 10, "averaging.algorithm" = "state" }
[link]
rate_mbit = 100
loss_pct = 5
[[host]]
name = "a"
[[host]]
name = "b"
[[host]]
name = "c"
[[fault]]
at = 4
action = "freeze"
hosts = ["b"]
[[fault]]
at = 12
action = "thaw"
hosts = ["b"]
"""


@needs_lab
@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_three_daemons_train_over_5_percent_loss_through_a_freeze(tmp_path):
    report, table = run_scenario(tmp_path, LOSSY_FREEZE)
    assert (
        report["congestion_control"] == {"a": "reno", "b": "reno", "c": "reno"}
        and "TCP congestion control: reno" in table
    )
    for name, h in report["hosts"].items():
        assert h["lost_packets_random"] > 0 and h["tcp_retransmitted_segments"] > 0, (name, h)
    freeze, thaw = report["faults"]
    assert (freeze["action"], freeze["hosts"], thaw["action"]) == ("freeze", ["b"], "thaw")
    # a and c drop b within peer TTL + refresh + DHT timeout (4 + 0.5 + 2 s, plus a poll), and average on without it.
    assert freeze["noticed_s"] is not None and freeze["noticed_s"] < 8, freeze
    assert freeze["resumed_s"] is not None, freeze
    assert thaw["noticed_s"] is not None and thaw["resumed_s"] is not None, thaw
    assert report["max_param_divergence"]["value"] >= 0


PARTITION = """
name = "lab-test-partition"
duration = 26
[run]
id = "split"
settings = { "averaging.average_every" = 10, "averaging.algorithm" = "state" }
[link]
rate_mbit = 100
[[host]]
name = "a"
[[host]]
name = "b"
[[host]]
name = "c"
[[fault]]
at = 3
action = "partition"
hosts = ["c"]
[[fault]]
at = 11
action = "heal"
"""


@needs_lab
@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_a_partition_cuts_both_sides_and_the_run_re_merges_after_the_heal(tmp_path):
    report, table = run_scenario(tmp_path, PARTITION)
    partition, heal = report["faults"]
    assert report["hosts"]["c"]["lost_packets_partition"] > 0 and report["hosts"]["a"]["lost_packets_partition"] > 0
    # Each side drops the other and trains on: a with b (rounds), c alone (steps).
    assert partition["noticed_s"] is not None and partition["resumed_s"] is not None, partition
    # After the heal the sides find each other again: the daemons re-dial peers that timed out
    # (peers/membership.py); without that they never did in some runs.
    assert heal["noticed_s"] is not None, (heal, table)
    if heal["resumed_s"] is None:
        # Seen once under a loaded CI machine: found again, but no round across the old cut in the
        # time left. Averaging across it depends on the cut-off host's lead (docs/lab.md, findings).
        pytest.xfail(
            f"sides found each other {heal['noticed_s']} s after the heal but did not average across the cut in time"
        )


@needs_lab
@pytest.mark.heavy
@pytest.mark.timeout(280)
def test_wan_training_quick_trains_every_setup_and_evaluates_what_it_trained():
    """bench.wan_training --quick: DiLoCo over the lab's WAN and the same hosts alone, 15 s each.
    The benchmark itself exits 1 where a host took no step or its checkpoint evaluates no better
    than the untrained model (the ceiling once evaluated its untrained parameters); no figure is
    asserted here beyond that (docs/benchmarks.md holds the measured ones)."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.wan_training", "--quick", "--hosts", "2", "--every", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=260,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = {rec.get("setup"): rec for rec in map(json.loads, r.stdout.splitlines())}
    for name in ("a_diloco", "c_alone"):
        hosts = records[name]["hosts"]
        assert sorted(hosts) == ["h0", "h1"], records[name]
        assert all(h["local_steps"] > 0 and h["eval"] < 6.0 for h in hosts.values()), records[name]  # bits/char
    assert records[None]["metric"] == "utilization: steps per host, diloco over alone", records[None]


@needs_lab
@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_lab_baselines_quick_prints_json_lines():
    """Smoke test of bench.lab_baselines: it runs to the end and prints the promised lines. No
    figure is asserted (docs/benchmarks.md holds the measured ones), only that every system ran."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.lab_baselines", "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=220
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(records) == 3, r.stdout
    for rec in records:
        assert {"bench", "metric", "ours", "baseline", "ratio", "unit"} <= rec.keys() and rec["unit"] == "s"
        assert rec["cc"] == "reno" and rec["added_rtt_ms"] == 0 and "no added latency" in rec["emulated"]
        assert rec["ours"] and rec["baseline"], rec  # peerd and gloo finished their rounds
        assert rec["peerd_outcomes"] == ["completed"]
    # hivemind finished its lossless round; under loss it sometimes does not (docs/benchmarks.md).
    assert records[0]["hivemind_s"], records[0]
    assert records[1]["packets_dropped"] > 0 and records[0]["packets_dropped"] == 0
    assert records[-1]["metric"] == "round_s_peerd_vs_gloo_reno_5pct"
    lab_id = re.search(r"lab pdlab-([0-9a-f]{4})", r.stderr).group(1)
    assert leftovers(lab_id) == []


AUTO_EVERY = """
name = "lab-test-auto-every"
duration = 12
[run]
id = "auto"
settings = { "averaging.average_every" = "auto", "averaging.average_every_min" = 4, "averaging.average_every_max" = 4096 }
[link]
rate_mbit = 2
[[host]]
name = "a"
[[host]]
name = "b"
"""


@needs_lab
@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_two_daemons_on_a_throttled_link_fit_the_same_h(tmp_path):
    """averaging.average_every=auto between two hosts on 2 Mbit/s links: every decision a host took
    from a round's group pace (the lab samples them twice a second) gives the same H as the other
    host's from that round, within the bounds. Agreement and bounds only: which H the link and the
    machine's load give is not asserted."""
    report, _ = run_scenario(tmp_path, AUTO_EVERY)
    a, b = (report["hosts"][n]["average_every_by_round"] for n in "ab")
    common = sorted(a.keys() & b.keys(), key=int)
    print(f"H by round: a {a}, b {b}")
    assert len(common) >= 2, (a, b)
    assert [a[r] for r in common] == [b[r] for r in common], (a, b)
    assert all(4 <= h <= 4096 for h in (*a.values(), *b.values())), (a, b)
