"""deploy/compose.yaml, which operators copy: every peer trains, no identity key is shared, and the
joiners' script finds peer0's ID the way it will in the containers (containers cannot run here)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.helpers import ROOT

COMPOSE = ROOT / "deploy" / "compose.yaml"


def services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]  # anchors and `<<` merges resolved


def peers() -> dict[str, dict]:
    return {name: s for name, s in services().items() if s.get("image") == "peerd:dev"}


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def test_every_peer_trains():
    by_peer = {name: s["command"] for name, s in peers().items()}
    assert len(by_peer) == 3
    trained = {run for args in by_peer.values() if flag_values(args, "--task") for run in flag_values(args, "--run")}
    for name, args in by_peer.items():
        runs = flag_values(args, "--run")
        assert runs, f"{name} joins no run"
        assert flag_values(args, "--task") or set(runs) <= trained, f"{name} joins {runs}, which nobody gives a --task"


def test_no_two_services_share_a_volume():
    owners: dict[str, list[str]] = {}
    for name, s in services().items():
        for mount in s.get("volumes", []):
            source = mount.split(":", 1)[0]
            if not source.startswith((".", "/")):  # a named volume, not a bind-mounted config file
                owners.setdefault(source, []).append(name)
    assert owners and all(len(names) == 1 for names in owners.values()), owners
    for name, s in peers().items():
        assert any(m.split(":")[1] == "/var/lib/peerd" for m in s["volumes"]), f"{name} has no data volume"


@pytest.mark.heavy
def test_the_joiner_script_reads_peer0s_id_from_its_metrics(spawn):
    peer0 = spawn("peer0")
    entrypoint = peers()["peer1"]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-ec"]
    script = (
        entrypoint[2]
        .replace("$$", "$")  # what compose does
        .replace("http://peer0:9400/metrics", peer0.metrics_url)
        .replace("exec peerd start", "echo")
    )
    argv = ["/bin/sh", "-ec", script, *entrypoint[3:], "--run", "demo"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r
    assert r.stdout.split() == ["--initial-peers", f"/dns4/peer0/tcp/31337/p2p/{peer0.peer_id}", "--run", "demo"], r
    assert peer0.stop() == 0
