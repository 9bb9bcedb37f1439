"""A real Prometheus server scrapes the three daemons; peerd_peers is read back through its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest

from tests.conftest import CLUSTER_RUN
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="needs the prometheus server (`./dev setup` installs Debian's, as root)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prometheus(cluster, tmp_path):
    targets = [urllib.parse.urlsplit(d.metrics_url).netloc for d in cluster]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: peerd\n    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
    except OSError:
        return []  # not up yet
    return body["data"]["result"] if body.get("status") == "success" else []


def test_prometheus_scrapes_every_daemon(cluster, prometheus):
    def peers_by_instance():
        result = query(prometheus, f'peerd_peers{{run="{CLUSTER_RUN}"}}')
        return {r["metric"]["instance"]: float(r["value"][1]) for r in result}

    seen = wait_for(
        lambda: len(peers_by_instance()) == 3 and peers_by_instance(), timeout=30, interval=0.5, what="3 scraped series"
    )
    assert sorted(seen.values()) == [2.0, 2.0, 2.0]
    up = query(prometheus, 'up{job="peerd"}')
    assert sorted(float(r["value"][1]) for r in up) == [1.0, 1.0, 1.0]
