"""Local groups across machines in the network lab: two sites of two hosts, each site one local group
(one WAN peer), against the same four hosts as four DiLoCo peers and against the hosts alone, with
the same wall-clock budget.

    sudo .venv/bin/python -m bench.local_groups [--quick] [--seconds 150] [--rate 100] [--rtt-ms 50]
                                                [--loss 1] [--every 50] [--task charlm]

Every host's link to the others (the lab's bridge) is limited to --rate Mbit/s, --rtt-ms and --loss %
(the WAN). The hosts of a site also share a second link, unshaped and apart (the lab's `site`: a
rack's fast network): their daemons run with `--local-group SITE --local-group-host <their address
there>`, so the group's processes average gradients over it at every step and its leader averages
the group's pseudo-gradient over the WAN (docs/algorithms.md, "With a local group of processes").

  (a) sites      h0, h1 in site s0 and h2, h3 in site s1: two local groups under DiLoCo
  (b) peers      the same four hosts, each its own DiLoCo peer (the run's defaults)
  (c) alone      the same hosts, each its own run (the lab's `isolated`)

Per host, as bench.wan_training reports it (bench/wan_training.py `run_setup`): steps, compute
fraction, MB the round engine sent per 1,000 samples, and the eval loss of the host's final
checkpoint. WAN bytes are what the round engine sends (the sites' own links carry the group's
gradients and are not counted); a setup's WAN bytes per sample are its hosts' bytes over its
samples, each group's counted once (by its leading daemon). Headline: WAN bytes per sample, (a) over
(b). `--lanes 2`: each group's two hosts average one lane each over their own WAN links
(peers/dear/delegate.py); the summary lists each host's WAN MB. Needs root (namespaces). The hosts share this machine's cores: every setup has the same four
hosts training, so the comparison is within one CPU budget.
"""

from __future__ import annotations

import argparse
import math
import sys

from pathlib import Path

from bench.common import emit, progress as _progress, result
from bench.wan_training import ALONE_EVERY, line, run_setup, scenario, untrained

BENCH = "local_groups"
SITES = {"h0": "s0", "h1": "s0", "h2": "s1", "h3": "s1"}


def progress(message: str) -> None:
    _progress(BENCH, message)


def wan_mb(host: dict) -> float:
    """MB a host's round engine sent (bench.wan_training reports it per 1,000 samples)."""
    return host["mb_per_1000_samples"] * max(host["samples"], 1) / 1000


def wan_bytes_per_1000(setup: dict) -> float:
    """MB the round engines of a setup's hosts sent per 1,000 samples its hosts trained on."""
    hosts = setup["hosts"].values()
    mb = sum(wan_mb(h) for h in hosts)
    samples = sum(h["samples"] for h in hosts)
    return mb / max(samples, 1) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.local_groups", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short check: 60 s per setup, no (c)")
    p.add_argument("--seconds", type=float, default=150.0, help="training per setup (default 150)")
    p.add_argument("--rate", type=float, default=100.0, help="each host's WAN link, Mbit/s (default 100)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="added round-trip time on the WAN (default 50)")
    p.add_argument("--loss", type=float, default=1.0, help="%% of the WAN's packets dropped (default 1)")
    p.add_argument("--every", type=int, default=50, help="H, inner steps per phase (default 50)")
    p.add_argument("--task", default="charlm")
    p.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="averaging.lanes of (a) and (b): with 2, each of a group's hosts averages one",
    )
    p.add_argument("--logs", type=Path, default=None, help="keep each host's daemon log under this directory")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 60.0
    # What bench.wan_training's scenario() reads.
    args.hosts, args.curve = len(SITES), 0.0
    diloco = {"averaging.average_every": args.every, "averaging.lanes": args.lanes}
    sites = scenario("a_sites", args, diloco)
    for host in sites["host"]:
        host["site"] = SITES[host["name"]]
    setups = [("a_sites", sites), ("b_peers", scenario("b_peers", args, diloco))]
    if not args.quick:
        alone = {"averaging.algorithm": "state", "averaging.average_every": ALONE_EVERY, "averaging.first_phase": 0}
        setups.append(("c_alone", scenario("c_alone", args, alone, isolated=True)))  # as bench.wan_training's (c)
    lines = {name: run_setup(name, data, logs=args.logs) for name, data in setups}
    if failed := untrained(lines, args.task):
        for why in failed:
            progress(f"FAILED: {why}")
        return 1
    a, b = lines["a_sites"], lines["b_peers"]
    ours, base = wan_bytes_per_1000(a), wan_bytes_per_1000(b)
    summary = {
        "bench": BENCH,
        "setup": "summary",
        "wan_mb_per_1000_samples": {"a": round(ours, 4), "b": round(base, 4)},
        "lanes": args.lanes,
        # How (a)'s WAN bytes spread over its hosts' links: with lanes, each group's hosts share them.
        "wan_mb_by_host_a": {name: round(wan_mb(h), 3) for name, h in a["hosts"].items()},
    }
    for name, out in lines.items():  # means over the hosts
        for key in ("eval", "compute_fraction", "steps"):
            values = [h[key] for h in out["hosts"].values() if not math.isnan(h[key])]
            summary[f"{key}_{name}"] = round(sum(values) / max(len(values), 1), 4)
    line(summary)
    emit(result(BENCH, "WAN bytes per sample, two sites' local groups over four peers", ours, base, "MB/1000 samples"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
