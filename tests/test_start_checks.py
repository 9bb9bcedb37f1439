"""`peerd start` refuses, before it starts anything, addresses and ports it cannot use: exit 2, one line."""

from __future__ import annotations

import urllib.parse

import pytest

from tests.helpers import peerd


def start(tmp_path, *args: str):
    base = ["--data-dir", str(tmp_path / "d"), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    return peerd("start", *base, *args)  # later flags win


def assert_refused(r, tmp_path, *words: str) -> None:
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in r.stderr for w in words), r.stderr
    assert not (tmp_path / "d").exists()  # nothing was started: not even the data dir


@pytest.mark.parametrize(
    "maddr,words",
    [
        ("not-a-multiaddr", ["is not a multiaddr"]),
        ("/ip4/127.0.0.1/tcp/32951", ["does not end in /p2p/<peer ID>"]),
        ("/ip4/300.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", ["is not a multiaddr", "not IPv4"]),
    ],
)
def test_initial_peers_must_be_multiaddrs_with_a_peer_id(tmp_path, maddr, words):
    assert_refused(start(tmp_path, "--initial-peers", maddr), tmp_path, "initial_peers", repr(maddr), *words)


def test_a_port_in_use_is_refused_by_name(spawn, tmp_path):
    first = spawn("first")
    port = first.maddrs[0].split("/tcp/")[1].split("/")[0]
    r = peerd("start", "--data-dir", str(tmp_path / "d"), "--host", "127.0.0.1", "--port", port, "--metrics-port", "0")
    assert_refused(r, tmp_path, f"--port {port} ", "in use")
    metrics_port = str(urllib.parse.urlsplit(first.metrics_url).port)
    r = start(tmp_path, "--metrics-host", "127.0.0.1", "--metrics-port", metrics_port)  # later flags win
    assert_refused(r, tmp_path, f"--metrics-port {metrics_port} ", "in use")
    assert first.stop() == 0
