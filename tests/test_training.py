"""Real daemons train a real task: manifests, trainer, metrics, checkpoints and restarts.

Training together (averaging, failures, late joiners) is in tests/test_cluster_training.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from peerd.daemon.client import ControlClient
from peerd.peers.clock import now
from peerd.peers.envelope import RecordKind, seal
from peerd.peers.events import PeerEvents
from peerd.peers.manifest import MANIFEST_FORMAT_VERSION
from peerd.peers.node import NodeSettings, PeerNode
from peerd.peers.run_ids import run_dht_key
from peerd.protos import records_pb2
from tests.helpers import peerd, scrape, wait_for


TRAIN = ["--task", "digits-mlp", "--max-steps", "300", "--eval-every", "50", "--checkpoint-every", "100"]


def run_status(d, run: str):
    with ControlClient(d.control) as c:
        return next(r for r in c.status().runs if r.run_id == run)


def test_a_daemon_trains_checkpoints_and_resumes(spawn):
    d = spawn("trainer", ["--run", "digits", *TRAIN])
    r = wait_for(lambda: (s := run_status(d, "digits")).train_state == "FINISHED" and s, timeout=120, what="300 steps")
    assert (r.task, r.step) == ("digits-mlp", 300)
    assert r.eval_metric == "accuracy" and r.eval_score >= 0.9, r
    m = scrape(d.metrics_url)
    assert m[("peerd_train_step", (("run", "digits"),))] == 300
    assert m[("peerd_samples_total", (("run", "digits"),))] == 300 * 32
    assert m[("peerd_samples_averaged_total", (("run", "digits"),))] == 0  # alone: no round had a mate
    assert m[("peerd_eval_score", (("run", "digits"),))] == pytest.approx(r.eval_score)
    assert d.stop() == 0
    checkpoints = sorted((d.data_dir / "runs" / "digits" / "checkpoints").glob("ckpt-*.peerd"))
    assert [p.name for p in checkpoints] == ["ckpt-000000000200.peerd", "ckpt-000000000300.peerd"]

    # A restart resumes from the newest checkpoint: already at max steps, nothing to redo.
    d.start()
    r = wait_for(lambda: (s := run_status(d, "digits")).train_state == "FINISHED" and s, timeout=60, what="resumed")
    assert r.step == 300 and r.eval_score >= 0.9
    assert d.stop() == 0

    # A torn newest checkpoint (a crash mid-write on a disk that lied) is never loaded.
    newest = checkpoints[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    d.start()
    r = wait_for(lambda: (s := run_status(d, "digits")).train_state == "FINISHED" and s, timeout=60, what="re-trained")
    # It resumed from the one before, and the torn file is counted (status and metrics, not the log).
    assert r.step == 300 and r.resumed_from == 200, r
    assert scrape(d.metrics_url)[("peerd_rejected_total", (("reason", "checkpoint_corrupt"),))] == 1
    assert d.stop() == 0


@pytest.mark.heavy
def test_a_joiner_trains_the_runs_task_and_a_mismatch_is_refused(spawn):
    creator = spawn("creator", ["--run", "shared", *TRAIN])
    joiner = spawn("joiner", ["--run", "shared", "--max-steps", "20", "--initial-peers", creator.maddrs[0]])
    r = wait_for(
        lambda: (s := run_status(joiner, "shared")).train_state == "FINISHED" and s, timeout=60, what="joiner trains"
    )
    # It trains the run's task; the creator is far ahead, so it downloads the run's state first.
    assert r.task == "digits-mlp" and r.step >= 20
    # The run exists: another task, or hyper-parameters, cannot be imposed on it.
    bad = peerd("join", "shared", "--task", "charlm", "--control", joiner.control)
    assert bad.returncode == 2 and "trains" in bad.stderr, bad
    late = peerd(
        "start",
        "--data-dir",
        str(joiner.data_dir.parent / "late"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--run",
        "shared",
        "--task",
        "charlm",
        "--initial-peers",
        creator.maddrs[0],
    )
    assert late.returncode == 2 and "trains task 'digits-mlp', not 'charlm'" in late.stderr, late.stderr
    for d in (creator, joiner):
        assert d.stop() == 0


def test_status_json_shows_training(spawn):
    # H divides --max-steps: a training process's step moves by whole phases (docs/your-loop.md).
    args = ["--run", "j", "--task", "digits-mlp", "--max-steps", "10", "--eval-every", "5"]
    d = spawn("json", [*args, "--set", "averaging.average_every=5"])
    wait_for(lambda: run_status(d, "j").train_state == "FINISHED", timeout=60, what="10 steps")
    out = json.loads(peerd("status", "--json", "--control", d.control).stdout)
    (run,) = out["runs"]
    assert run["task"] == "digits-mlp" and run["step"] == 10 and run["eval_metric"] == "accuracy"
    assert d.stop() == 0


def test_a_missing_task_or_an_invalid_manifest_is_refused_and_changes_nothing(spawn, tmp_path):
    d = spawn("refuser", [])
    missing = peerd("join", "fresh", "--task", "no-such-task", "--control", d.control)
    assert missing.returncode == 2 and "no-such-task" in missing.stderr and "Traceback" not in missing.stderr, missing

    # Mallory publishes, under her own slot, a manifest of a format this daemon does not know.
    async def publish_bad() -> bool:
        node = await PeerNode.start(
            NodeSettings(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                identity_path=tmp_path / "mallory.key",
                initial_peers=[d.maddrs[0]],
            ),
            PeerEvents(),
        )
        try:
            body = records_pb2.RunManifest(
                format_version=MANIFEST_FORMAT_VERSION + 1,
                run_id="bad",
                task="digits-mlp",
                creator=node.peer_id,
                created_at=now(),
            ).SerializeToString()
            data = seal(RecordKind.MANIFEST, body, node.identity, None, "bad")
            return await node.store(run_dht_key("bad", None, "manifest"), node.peer_id, data, now() + 60)
        finally:
            await node.shutdown()

    assert asyncio.run(publish_bad())
    for args in (["join", "bad"], ["join", "bad", "--task", "digits-mlp"]):
        out = peerd(*args, "--control", d.control)
        assert out.returncode == 2 and "none is valid" in out.stderr and "record_version" in out.stderr, out
    with ControlClient(d.control) as c:
        assert list(c.status().runs) == []
    assert scrape(d.metrics_url)[("peerd_rejected_total", (("reason", "record_version"),))] >= 2
    assert d.stop() == 0
