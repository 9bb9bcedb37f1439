"""Smoke tests of benchmarks (bench.attach_handoff, bench.daemon_costs, bench.dear, bench.diloco_sim,
bench.engine_allreduce, bench.engine_costs, bench.round_cost, bench.vs_peers): each runs to the end
and prints the promised JSON lines, the last one its headline. bench.round_cost and bench.vs_peers
need the network lab (root, namespaces) and skip without.

No figure is asserted: timings on a shared CI machine say nothing, and docs/benchmarks.md holds the
measured ones.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT = 240.0  # seconds for the --quick run (about 50 s): 7 daemon starts, 10 s idling, one peer TTL
REQUIRED = {"bench", "metric", "ours", "baseline", "ratio", "unit"}
VS_PEERS_TIMEOUT = 420.0  # seconds for bench.vs_peers --quick (2-3 minutes): four labs, set-ups and evaluations


@pytest.mark.heavy
def test_daemon_costs_quick_prints_json_lines():
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.daemon_costs", "--quick"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the benchmark then kills the daemons it started, which live in their own sessions.
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"bench.daemon_costs --quick took over {RUN_TIMEOUT:.0f} s; stderr:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err[-3000:]}"
    lines = out.splitlines()
    assert lines, f"no output; stderr:\n{err[-3000:]}"
    records = [json.loads(line) for line in lines]
    for r in records:
        assert REQUIRED <= r.keys(), r
    assert records[-1]["bench"] == "daemon_costs"
    assert records[-1]["metric"] == "start_to_ready_s"


@pytest.mark.parametrize("backend", ["gloo", "peerd"])
def test_dear_quick_prints_json_lines_with_the_headline_last(backend):
    """bench.dear --quick: a small MLP, two ranks on loopback, every schedule (a few seconds)."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.dear", "--quick", "--skip-emulated", "--backend", backend],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records and all(REQUIRED <= r.keys() for r in records), records
    assert records[-1]["bench"] == "dear" and records[-1]["metric"] == "steps_per_second_vs_ddp25", records[-1]
    assert records[-1].get("backend", "gloo") == backend, records[-1]


@pytest.mark.parametrize(
    "argv, headline",
    [
        (["bench.engine_allreduce", "--quick", "--skip-hivemind"], "bus_bandwidth_vs_gloo"),
        (["bench.engine_costs", "--quick", "--parts", "digest_sums,bare,contract"], "bus_bandwidth_with_contract"),
        (["bench.dear_loop", "--mib", "2", "--ops", "5"], "loop_lateness_p99_ms_own_vs_shared"),
    ],
)
def test_engine_benchmarks_quick_print_json_lines_with_the_headline_last(argv, headline):
    """bench.engine_allreduce and bench.engine_costs --quick: 4 processes, 4 MiB, a few rounds; every
    peerd round completed with agreeing digests (both exit 1 otherwise). bench.dear_loop: the engine
    on its own loop and on another's (EngineCollective(loop=)) all-reduces, closes and reports."""
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records and all(REQUIRED <= r.keys() for r in records), records
    assert records[-1]["bench"] == argv[0].split(".")[1] and records[-1]["metric"] == headline, records[-1]


@pytest.mark.heavy
def test_attach_handoff_quick_prints_json_lines_with_the_headline_last():
    """bench.attach_handoff --quick: one real daemon, an attached peerd.torch.Optimizer and a second
    process over a 1M-value vector, 3 phases (about 25 s on a loaded 2-core machine); it leaves no
    shared file behind and appends nothing to bench/results."""
    results = ROOT / "bench" / "results" / "attach_handoff.jsonl"
    size = results.stat().st_size if results.exists() else None
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attach_handoff", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records and all(REQUIRED <= r.keys() for r in records), records
    assert [r["metric"] for r in records[:4]] == ["script_write_s", "daemon_read_s", "daemon_write_s", "script_read_s"]
    assert records[-1]["bench"] == "attach_handoff" and records[-1]["metric"] == "outer_step_handoff_s", records[-1]
    assert records[-1]["params"] == 1_000_000 and records[-1]["ratio"] > 0
    # Its processes' shared files are gone (other tests' daemons may hold theirs meanwhile).
    pids = records[-1]["shared_file_pids"]
    assert len(pids) == 2 and not [p for pid in pids for p in Path("/dev/shm").glob(f"peerd-{pid}-*")], pids
    assert (results.stat().st_size if results.exists() else None) == size


def test_wan_training_builds_valid_lab_scenarios_for_every_setup():
    """bench.wan_training needs root and minutes; here only its scenarios are checked, as the lab
    would check them before building anything (daemon/lab/scenario.py)."""
    import argparse

    from bench.wan_training import scenario
    from peerd.daemon.lab.scenario import parse

    args = argparse.Namespace(
        hosts=3, seconds=120.0, rate=100.0, rtt_ms=50.0, loss=1.0, task="charlm", every=50, curve=0.0
    )
    for name, settings in (
        ("a", {"averaging.algorithm": "diloco", "averaging.average_every": 50}),
        ("b", {"averaging.algorithm": "state", "averaging.average_every": 10}),
    ):
        s = parse(scenario(name, args, settings), name)
        assert len(s.hosts) == 3 and s.run.task == "charlm" and s.duration == 120.0
        assert s.run.settings["averaging.algorithm"] == settings["averaging.algorithm"]
    groups = parse(scenario("g", args, {"averaging.algorithm": "diloco"}, daemon_args=("--train-processes", "2")), "g")
    assert groups.run.args[-2:] == ["--train-processes", "2"] and not groups.run.isolated  # --extra local_groups
    assert parse(scenario("c", args, {"averaging.algorithm": "state"}, isolated=True), "c").run.isolated  # (c) alone
    assert s.run.checkpoint_every == 100_000  # only the stop checkpoints
    args.curve = 15.0  # --curve: every phase's end checkpoints, the model the curve evaluates
    assert parse(scenario("c", args, {"averaging.average_every": 50}), "c").run.checkpoint_every == 50


def test_local_groups_same_host_builds_one_daemon_of_two_processes_and_two_daemons_of_one():
    """bench.local_groups --same-host needs root and minutes; here only its scenarios are checked,
    as the lab would check them: (a) one host training in two processes, (b) two hosts of one,
    both DiLoCo with the same H, and no WAN shaping (one machine's loopback)."""
    import argparse

    from bench.local_groups import same_host_setups
    from peerd.daemon.lab.scenario import parse

    args = argparse.Namespace(seconds=150.0, task="charlm", every=50, against="two-daemons")
    (a_name, a), (b_name, b) = ((name, parse(data, name)) for name, data in same_host_setups(args))
    assert (a_name, len(a.hosts)) == ("a_one_daemon", 1) and (b_name, len(b.hosts)) == ("b_two_daemons", 2)
    assert a.run.args[-2:] == ["--train-processes", "2"] and "--train-processes" not in b.run.args
    # --against no-dear: the same one daemon of two processes, with DeAR and without.
    args.against = "no-dear"
    (d_name, d), (c_name, c) = ((name, parse(data, name)) for name, data in same_host_setups(args))
    assert (d_name, len(d.hosts), c_name, len(c.hosts)) == ("a_dear", 1, "b_no_dear", 1)
    assert d.run.args[-3:] == ["--train-processes", "2", "--dear"]
    assert c.run.args[-3:] == ["--train-processes", "2", "--no-dear"]
    for s in (a, b, c, d):
        assert s.duration == 150.0 and s.run.settings == {"averaging.average_every": "50"} and not s.run.isolated
        assert all((h.link.rate_mbit, h.link.rtt_ms, h.link.loss_pct) == (0, 0, 0) for h in s.hosts)


@pytest.mark.heavy
def test_round_cost_quick_prints_a_line_per_rtt_and_the_headline_last():
    """bench.round_cost --quick: 3 lab hosts, each a PeerNode, membership and averager, at 0 and 50 ms
    RTT, 6 rounds of each system (about a minute); some round of ours completed in each cell (exit 1 otherwise)."""
    from peerd.daemon.lab.netns import environment_problem

    problem = environment_problem() if sys.platform == "linux" else "not Linux"
    if problem:
        pytest.skip(f"network lab unavailable: {problem}")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.round_cost", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert records and all(REQUIRED <= r.keys() for r in records), records
    assert [r["added_rtt_ms"] for r in records] == [0, 50, 50]
    assert records[-1]["bench"] == "round_cost" and records[-1]["metric"] == "round fixed cost at 50 ms RTT"
    assert records[-1]["ours_rtts"] is not None and records[-1]["gloo_rtts"] is not None


@pytest.mark.heavy
@pytest.mark.timeout(VS_PEERS_TIMEOUT + 90)
def test_vs_peers_quick_prints_a_line_per_system_and_the_headline_last():
    """bench.vs_peers --quick: two lab hosts, 8 s of training for each of peerd, hivemind, torchft and
    the hosts alone (2 minutes on a quiet machine, 3 on a busy one: four labs, four set-ups); peerd and alone train (their hosts end better than the untrained
    model), every other system trains or says why not, and nothing is appended to bench/results."""
    from peerd.daemon.lab.netns import environment_problem

    problem = environment_problem() if sys.platform == "linux" else "not Linux"
    if problem:
        pytest.skip(f"network lab unavailable: {problem}")
    results = ROOT / "bench" / "results" / "vs_peers.jsonl"
    size = results.stat().st_size if results.exists() else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.vs_peers", "--quick"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=VS_PEERS_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the benchmark then removes its lab, killing what it started
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"bench.vs_peers --quick took over {VS_PEERS_TIMEOUT:.0f} s; stderr:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{err[-3000:]}"
    records = [json.loads(line) for line in out.splitlines()]
    systems = {r["system"]: r for r in records[:-1]}
    assert list(systems) == ["peerd", "hivemind", "torchft", "alone"], records
    for name, r in systems.items():
        assert r["bench"] == "vs_peers" and (r["failed"] is None or isinstance(r["failed"], str)), r
        if r["failed"] is None:
            assert set(r["hosts"]) == {"h0", "h1"} and r["eval"] < r["untrained_eval"], r
            assert all(h["steps"] > 0 and h["mb_per_1000_samples"] is not None for h in r["hosts"].values()), r
            assert r["curve"] and r["curve"][-1][0] == r["seconds"], r
    assert systems["peerd"]["failed"] is None and systems["alone"]["failed"] is None, records
    # Where the time goes: each loop's account, the CPU by kind of process, and peerd's daemons' own
    # (with overlap on: the bench's peerd settings, which a script's run must ask for).
    for r in (systems["peerd"], systems["alone"]):
        assert {"loop", "other", "machine"} <= r["cpu_cores"].keys(), r["cpu_cores"]
        assert all({"compute_s", "step_s", "cpu_loop_thread_s"} <= h.keys() for h in r["hosts"].values()), r
    assert {"daemon", "p2pd"} <= systems["peerd"]["cpu_cores"].keys(), systems["peerd"]["cpu_cores"]
    daemons = [h["daemon"] for h in systems["peerd"]["hosts"].values()]
    assert all(d["overlap"] is True and 0 <= d["compute_fraction"] <= 1 for d in daemons), daemons
    assert REQUIRED <= records[-1].keys() and records[-1]["bench"] == "vs_peers", records[-1]
    assert records[-1]["metric"] == "time to the best competitor's final eval, peerd vs that competitor"
    assert (results.stat().st_size if results.exists() else None) == size


def test_vs_peers_cpu_split_counts_each_kind_from_its_start_and_the_rest_as_other():
    """bench.vs_peers's CPU split: cores per kind over the window; a process that started in it
    counts from 0; what the machine did besides is `other`."""
    from bench.vs_peers import cpu_split

    before = {("loop", 1, 0.0): 10.0, ("daemon", 2, 0.0): 1.0, "machine": 100.0}
    after = {("loop", 1, 0.0): 30.0, ("loop", 3, 5.0): 10.0, ("daemon", 2, 0.0): 2.0, "machine": 150.0}
    assert cpu_split(before, after, 20.0) == {"daemon": 0.05, "loop": 1.5, "other": 0.95, "machine": 2.5}


def test_vs_peers_curve_is_in_time_order_each_tick_at_its_last_hosts_snapshot():
    """bench.vs_peers's eval curve: a host whose tick-2 snapshot came late (a long round) and that
    skipped tick 3 neither puts tick 3 before tick 2 nor credits tick 2 early; time_to reads it in
    order."""
    from bench.vs_peers import curve_of, time_to

    ticks = {2: {"a": (20.1, 3.0), "b": (27.0, 2.8)}, 3: {"a": (30.0, 2.6)}, 1: {"a": (10.0, 3.4), "b": (10.2, 3.2)}}
    curve = curve_of(ticks, [2.5, 2.3], 40.0)
    assert curve == [(10.2, 3.3), (27.0, 2.9), (30.0, 2.6), (40.0, 2.4)], curve
    assert time_to(curve, 2.9) == 27.0 and time_to(curve, 2.0) is None


def test_diloco_sim_in_process_prints_setups_then_the_headline(capsys):
    """bench.diloco_sim on a tiny model: both setups with the real outer loop, then the headline."""
    from bench import diloco_sim

    argv = [
        "--steps",
        "6",
        "--every",
        "3",
        "--land-after",
        "1",
        "--workers",
        "2",
        "--d-model",
        "16",
        "--n-layers",
        "1",
        "--context",
        "8",
        "--batch",
        "4",
        "--eval-every",
        "1",
    ]
    assert diloco_sim.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("setup") for r in records] == ["sync", "overlap", None]
    assert REQUIRED <= records[-1].keys(), records[-1]
    for r in records[:2]:
        assert len(set(r["evals"])) == 1, r  # every worker ends with the same θ


def test_diloco_sim_arctopk_keeps_every_worker_on_one_theta(capsys):
    """bench.diloco_sim --payload arctopk on a tiny model: both setups run, every worker ends with the
    same θ, and θ moved (the rows sent are applied)."""
    from bench import diloco_sim

    argv = ["--setups", "sync,overlap", "--payload", "arctopk", "--density", "0.25", "--values", "int4", "--steps", "8"]
    argv += ["--every", "4", "--land-after", "1", "--workers", "2", "--d-model", "16", "--n-layers", "1"]
    argv += ["--context", "8", "--batch", "4", "--eval-every", "1"]
    assert diloco_sim.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("setup") for r in records] == ["sync", "overlap", None]
    for r in records[:2]:
        assert r["density"] == 0.25 and r["values"] == "int4" and len(set(r["evals"])) == 1, r
        assert r["curve"][0][1] != r["curve"][-1][1], r


def test_diloco_sim_phases_are_the_runs_and_the_anytime_headline_compares_them(capsys):
    """bench.diloco_sim's phase schedule (a run's, peers/phases.py: exact lengths), the rule that reads when a run's θ stays
    at or below alone, and a run of both schedules with the anytime curve and its headline."""
    from bench import diloco_sim

    assert diloco_sim.phase_lengths(50, 5, 200) == [5, 10, 20, 15, 50, 50, 50]
    assert diloco_sim.phase_lengths(50, 0, 120) == [50, 50, 50]
    alone = [(10, 4.0), (20, 3.5), (30, 3.2), (40, 3.0)]
    assert diloco_sim.behind_until([(10, 8.3), (20, 3.4), (30, 3.3), (40, 2.9)], alone) == 40  # behind at 30
    assert diloco_sim.behind_until([(10, 3.9), (20, 3.5), (30, 3.1), (40, 2.9)], alone) == 10  # never behind
    assert diloco_sim.behind_until([(10, 3.9), (20, 3.6)], alone[:2]) == 21  # behind at its last sample
    argv = ["--setups", "alone,overlap", "--first-phase", "0,2", "--curve-every", "2", "--steps", "8"]
    argv += ["--every", "4", "--land-after", "1", "--workers", "2", "--d-model", "16", "--n-layers", "1"]
    argv += ["--context", "8", "--batch", "4", "--eval-every", "0"]
    assert diloco_sim.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r.get("setup"), r.get("first_phase")) for r in records] == [
        ("alone", None),
        ("overlap", 0),
        ("overlap", 2),
        (None, None),
    ]
    assert [t for t, _ in records[0]["anytime"]] == [2, 4, 6, 8]
    assert [t for t, _ in records[1]["anytime"]] == [2, 4, 6, 8]
    assert records[1]["anytime"][0][1] == records[1]["anytime"][1][1]  # θ has not moved in the first phase
    assert records[2]["anytime"][0][1] != records[2]["anytime"][1][1]  # a first phase of 2 steps moved it
    # Worker 0's inner model is alone's until the first round lands (same seed, same batches), after
    # which it holds the landed θ plus its own progress.
    assert records[1]["anytime_inner"][:2] == records[0]["anytime"][:2], (records[1], records[0])
    assert records[1]["anytime_inner"][2:] != records[0]["anytime"][2:], (records[1], records[0])
    assert records[-1]["metric"] == "step_times_until_at_or_below_alone_overlap_first_phase_2_vs_0", records[-1]


def test_vs_peers_runs_peerd_once_per_settings_the_first_as_peerd():
    """--peerd-settings given twice: two peerd lines in --systems' place of peerd, each over overlap=true;
    the first is "peerd" (the headline's), the other named by its settings; a name given twice is refused."""
    from bench.vs_peers import Entrant, entrants

    assert entrants(["peerd", "alone"], [""]) == [
        Entrant("peerd", "peerd", "overlap=true"),
        Entrant("alone", "alone"),
    ]
    assert entrants(["hivemind", "peerd"], ["", "payload=int2", "overlap=false"]) == [
        Entrant("hivemind", "hivemind"),
        Entrant("peerd", "peerd", "overlap=true"),
        Entrant("peerd:payload=int2", "peerd", "overlap=true,payload=int2"),
        Entrant("peerd:overlap=false", "peerd", "overlap=false"),
    ]
    with pytest.raises(ValueError):
        entrants(["peerd"], ["", "payload=int2", "payload=int2"])
