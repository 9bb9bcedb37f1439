"""Turn a lab Record into figures: a JSON-ready dict, and a readable table. Pure functions.

For each join or fault:
* noticed: seconds until every other running host's peer table showed it (a killed, frozen or
  cut-off host gone from it; a joined, restarted or thawed host, or the far side of a healed
  partition, in it; a host cut off from a joined, restarted or thawed one is not waited for: the
  heal counts it). None for a link change, or when it did not happen before the end.
* resumed: seconds until every host concerned (after a kill, freeze, partition, heal or link change:
  every running host; after a join, restart or thaw: that host) completed an averaging round that
  it had not completed before the event, or, for a host with no running partner on its side of a
  partition, took a training step.
Times count from the moment the lab acted: for a join or restart, from the spawn of the new daemon,
so its start-up is included (ready_s: until it first answered).

Added latency is reported as set and as measured (TCP SYN/RST round trips from each host to the
next one of the scenario when the lab was built, and after a link fault that set rtt_ms); the
report never states an RTT it did not measure.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from peerd.daemon.lab.runner import Event, Record, Sample
from peerd.daemon.tables import columns

DELAY_LINE = "userspace TUN delay line"


def added_rtt(record: Record) -> str:
    """One line: the added RTT as set, how it was made, and as measured when the lab was built."""
    s = record.scenario
    sets = {h.name: h.link.rtt_ms for h in s.hosts}
    later = any("rtt_ms" in f.link for f in s.faults)
    medians = [m["median_ms"] for m in record.rtt.values() if m.get("median_ms") is not None]
    measured = f"measured {statistics.median(medians):.1f} ms median" if medians else "not measured"
    if len(medians) > 1:
        measured += f", {min(medians):.1f}-{max(medians):.1f} over {len(medians)} host pairs"
    if not any(sets.values()):
        text = f"none ({measured})" if medians else "none"
    elif len(set(sets.values())) == 1:
        text = f"{next(iter(sets.values())):g} ms ({DELAY_LINE}, {measured})"
    else:
        each = ", ".join(f"{n} {v:g}" for n, v in sets.items())
        text = f"per host ({each} ms; between two hosts the mean of theirs), {DELAY_LINE}, {measured}"
    return text + ("; changed by link faults (see the events)" if later else "")


def build(record: Record) -> dict[str, Any]:
    by_host: dict[str, list[Sample]] = {h.name: [] for h in record.scenario.hosts}
    for s in sorted(record.samples, key=lambda s: s.t):
        by_host[s.host].append(s)
    hosts = {name: _host(record, name, samples) for name, samples in by_host.items()}
    faults = [_fault(record, e, by_host) for e in record.events]
    divergences = [(s.divergence, s.host, s.t) for s in record.samples if not math.isnan(s.divergence)]
    worst = max(divergences, default=None)
    regressions = [f"{name}: {r}" for name, h in hosts.items() for r in h["step_regressions"]]
    torn = [f"{name}: {t}" for name, c in record.checkpoints.items() for t in c["torn"]]
    s = record.scenario
    return {
        "scenario": s.name,
        "lab": f"pdlab-{record.lab_id}",
        "run": s.run.id,
        "task": s.run.task,
        "startup_s": round(record.started_at, 2),
        "duration_s": round(record.duration, 2),
        "congestion_control": record.congestion_control,
        "added_rtt": added_rtt(record),
        "rtt_model": f"{DELAY_LINE}: a host with rtt_ms holds what it sends to other hosts for rtt_ms / 2; "
        "RTT between two hosts = the mean of their rtt_ms (docs/lab.md)",
        "loss_model": "random drop of packets delivered to a host (nftables numgen in the bridge's forward hook)",
        "hosts": hosts,
        "faults": faults,
        "max_param_divergence": None
        if worst is None
        else {"value": worst[0], "host": worst[1], "t": round(worst[2], 2)},
        "step_regressions": regressions,
        "torn_checkpoints": torn,
        "checkpoints_verified": sum(len(c["steps"]) for c in record.checkpoints.values()),
        "nothing_lost": not regressions and not torn,
        # Every poll: [t, global step, loss, last round, its outcome, peers in the table].
        "timeline": {
            name: [[round(x.t, 2), x.step, round(x.loss, 4), x.last_round, x.outcome, len(x.peers)] for x in samples]
            for name, samples in by_host.items()
        },
    }


def _host(record: Record, name: str, samples: list[Sample]) -> dict[str, Any]:
    last = samples[-1] if samples else None
    # Counters restart with each process: sum the last value each incarnation reported.
    per_pid: dict[int, Sample] = {}
    for s in samples:
        per_pid[s.pid] = s
    totals: dict[str, float] = {}
    for s in per_pid.values():
        for k, v in s.metrics.items():
            totals[k] = totals.get(k, 0.0) + v
    regressions = [
        f"step {a.step} -> {b.step} at t={b.t:.1f} s"
        for a, b in zip(samples, samples[1:])
        if a.pid == b.pid and b.step < a.step
    ]
    dropped = record.dropped.get(name, {})
    link = record.link_stats.get(name, {})
    return {
        "state": record.final_state.get(name, "not started"),
        "incarnations": record.incarnations.get(name, 0),
        "exit_codes": record.exit_codes.get(name, []),
        "step": last.step if last else None,
        "local_step": last.local_step if last else None,
        "loss": last.loss if last else None,
        "eval_score": last.eval_score if last else None,
        "rounds": {o: int(totals.get(f"rounds_{o}", 0)) for o in ("completed", "partial", "aborted", "no_group")},
        "engine_sent_bytes": int(totals.get("sent_bytes", 0)),
        "engine_received_bytes": int(totals.get("received_bytes", 0)),
        "state_sync_bytes": int(totals.get("state_sync_bytes", 0)),
        "link_tx_bytes": link.get("tx_bytes"),
        "link_rx_bytes": link.get("rx_bytes"),
        "lost_packets": dropped.get("loss", 0) + dropped.get("cut", 0),
        "lost_packets_random": dropped.get("loss", 0),
        "lost_packets_partition": dropped.get("cut", 0),
        "tcp_retransmitted_segments": link.get("tcp_retransmitted_segments"),
        "congestion_control": record.congestion_control.get(name),
        "rtt_ms": record.scenario.host(name).link.rtt_ms,
        "measured_rtt": record.rtt.get(name),  # to the next host, when the lab was built
        "delay_line": record.delay_lines.get(name),
        "checkpoint_steps": record.checkpoints.get(name, {}).get("steps", []),
        "step_regressions": regressions,
        # average_every=auto: the H each decision from a round's group pace gave, by that round
        # (JSON keys are strings); empty without auto
        "average_every_by_round": {
            str(s.average_every_round): s.average_every for s in samples if s.average_every_round
        },
    }


def _fault(record: Record, e: Event, by_host: dict[str, list[Sample]]) -> dict[str, Any]:
    f, ids = e.fault, record.peer_ids
    targets = set(f.hosts)
    target_ids = {ids[n] for n in targets if n in ids}
    others = sorted(e.running - targets)
    if f.action in ("kill", "freeze"):
        wants = {o: _sees_none_of(target_ids) for o in others}
    elif f.action in ("join", "restart", "thaw"):
        # Hosts cut off from the target cannot see it before the heal: that is the heal's to count.
        near = {e.side.get(n, 0) for n in targets}
        wants = {o: _sees_all_of(target_ids) for o in others if e.side.get(o, 0) in near}
    elif f.action == "partition":
        wants = {
            o: _sees_none_of({ids[n] for n in e.side if e.side[n] != e.side[o] and n in ids}) for o in sorted(e.running)
        }
    elif f.action == "heal":
        wants = {o: _sees_all_of({ids[n] for n in e.running if n != o and n in ids}) for o in sorted(e.running)}
    else:
        wants = {}
    concerned = sorted(targets & e.running) if f.action in ("join", "restart", "thaw") else sorted(e.running)
    resumed = {p: _progressed(p, e, by_host) for p in concerned}
    return {
        "t": round(e.t, 2),
        "at": f.at,
        "action": f.action,
        "hosts": list(f.hosts),
        "what": f.describe(),
        "noticed_s": _slowest({o: _first(by_host[o], e.t, want) for o, want in wants.items()}, e.t),
        "resumed_s": _slowest({p: _first(by_host[p], e.t, want) for p, want in resumed.items()}, e.t),
        "ready_s": _slowest({n: _first(by_host[n], e.t, lambda s: True) for n in targets}, e.t)
        if f.action in ("join", "restart")
        else None,
        "measured_rtt": e.rtt or None,
    }


def _sees_none_of(peer_ids: set[str]):
    return lambda s: not (s.peers & peer_ids)


def _sees_all_of(peer_ids: set[str]):
    return lambda s: peer_ids <= s.peers


def _progressed(p: str, e: Event, by_host: dict[str, list[Sample]]):
    """p completed a round it had not completed at the event; with no partner on its side, a step."""
    before = [s for s in by_host[p] if s.t <= e.t]
    last_round = before[-1].last_round if before else -1
    step = before[-1].step if before else -1
    partners = [n for n in e.running if n != p and e.side.get(n, 0) == e.side.get(p, 0)]
    if partners:
        return lambda s: s.outcome == "completed" and s.last_round > last_round
    return lambda s: s.step > step


def _first(samples: list[Sample], t: float, want) -> float | None:
    return next((s.t for s in samples if s.t >= t and want(s)), None)


def _slowest(times: dict[str, float | None], t: float) -> float | None:
    """The latest of the hosts' times, from t; None if there is none or one never got there."""
    if not times or any(v is None for v in times.values()):
        return None
    return round(max(times.values()) - t, 2)


# ---- the readable form ------------------------------------------------------------------------------


def table(report: dict[str, Any]) -> str:
    cc = sorted(set(report["congestion_control"].values()))
    lines = [
        f"peerd lab: {report['scenario']} ({report['lab']}), run {report['run']} ({report['task']}), "
        f"{len(report['hosts'])} hosts; schedule {report['duration_s']:.1f} s after {report['startup_s']:.1f} s of start-up",
        f"TCP congestion control: {', '.join(cc)}; added RTT: {report['added_rtt']}; loss: {report['loss_model']}",
        "",
    ]
    rows = [
        (
            name,
            h["state"],
            str(h["incarnations"]),
            _v(h["step"]),
            _v(h["local_step"]),
            _v(h["loss"], "{:.4f}"),
            _v(h["eval_score"], "{:.3f}"),
            "{completed}/{partial}/{aborted}/{no_group}".format(**h["rounds"]),
            _mb(h["engine_sent_bytes"]),
            _mb(h["engine_received_bytes"]),
            _mb(h["state_sync_bytes"]),
            f"{_mb(h['link_tx_bytes'])}/{_mb(h['link_rx_bytes'])}",
            f"{h['lost_packets_random']}+{h['lost_packets_partition']}",
            _v(h["tcp_retransmitted_segments"]),
            _rtt(h["measured_rtt"]),
        )
        for name, h in report["hosts"].items()
    ]
    header = (
        "HOST",
        "STATE",
        "RUNS",
        "STEP",
        "LOCAL",
        "LOSS",
        "EVAL",
        "ROUNDS C/P/A/N",
        "SENT MB",
        "RECV MB",
        "SYNC MB",
        "LINK TX/RX MB",
        "DROPPED RND+CUT",
        "TCP RETRANS",
        "RTT MS (SET)",
    )
    lines += columns(header, rows)
    if report["faults"]:
        lines.append("")
        rows = [
            (
                f"{f['t']:.1f}",
                f["what"] + "".join(f"; RTT {n}: {_rtt(m)}" for n, m in (f.get("measured_rtt") or {}).items()),
                _v(f["ready_s"], "{:.1f} s", ""),
                _v(f["noticed_s"], "{:.1f} s", "-"),
                _v(f["resumed_s"], "{:.1f} s", "not within the run"),
            )
            for f in report["faults"]
        ]
        lines += columns(("AT S", "EVENT", "READY AFTER", "NOTICED AFTER", "TRAINING WENT ON AFTER"), rows)
    d = report["max_param_divergence"]
    lines.append("")
    lines.append(
        "largest parameter divergence: "
        + (
            "none measured (no completed round)"
            if d is None
            else f"{d['value']:.4g} (host {d['host']} at t={d['t']:.1f} s)"
        )
    )
    lost = report["step_regressions"] + report["torn_checkpoints"]
    lines.append(
        f"nothing lost: {'yes' if report['nothing_lost'] else 'NO'} (global step regressions: "
        f"{len(report['step_regressions'])}; checkpoints verified: {report['checkpoints_verified']}, torn: "
        f"{len(report['torn_checkpoints'])})"
    )
    lines += [f"  {x}" for x in lost]
    return "\n".join(lines)


def _rtt(m: dict | None) -> str:
    """Measured RTT to the next host, and what the settings give: "50.6 to b (50)"."""
    if not m:
        return "-"
    got = "lost" if m["median_ms"] is None else f"{m['median_ms']:.1f}"
    return f"{got} to {m['to']} ({m['set_ms']:g})"


def _v(value, fmt: str = "{}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"
