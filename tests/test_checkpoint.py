"""Checkpoints: atomic, verified, and a torn file is never loaded."""

import os

import pytest
import torch

from peerd.daemon.checkpoint import CheckpointStore, CorruptCheckpoint


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 10)}, "optimizer": {"lr": 0.1}, "step": step}


def test_round_trip_and_pruning(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30):
        store.save(step, state(step))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000000000020.peerd", "ckpt-000000000030.peerd"]
    latest = store.load_latest()
    assert latest.step == 30 and torch.equal(latest.state["model"]["w"], state(30)["model"]["w"])


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # torn: the tail never reached the disk
        lambda data: data[:20],  # shorter than the header
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),  # one flipped bit
        lambda data: b"XXXXXXXX" + data[8:],  # not ours
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path, damage):
    seen = []
    store = CheckpointStore(tmp_path, keep=3, on_corrupt=lambda path, why: seen.append(path.name))
    store.save(1, state(1))
    newest = store.save(2, state(2))
    newest.write_bytes(damage(newest.read_bytes()))
    with pytest.raises(CorruptCheckpoint):
        CheckpointStore.read(newest)
    latest = store.load_latest()
    assert latest.step == 1
    assert seen == [newest.name]


def test_a_crash_mid_write_leaves_only_a_temp_file_that_is_ignored(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(5, state(5))
    # What write_atomic leaves behind if the process dies before the rename.
    (tmp_path / ".ckpt-000000000006.peerd.tmp").write_bytes(b"PEERDCK1partial")
    assert store.load_latest().step == 5


def test_no_checkpoint(tmp_path):
    assert CheckpointStore(tmp_path / "missing").load_latest() is None
    os.makedirs(tmp_path / "empty")
    assert CheckpointStore(tmp_path / "empty").load_latest() is None


def identity(**changes) -> dict:
    return {"run_id": "r", "task": "digits-mlp", "hparams": {"lr": "0.003"}, "layout": "abc", **changes}


def test_checkpoints_of_another_identity_are_never_loaded_nor_pruned(tmp_path):
    theirs, ours = identity(hparams={"lr": "0.5"}), identity()
    store = CheckpointStore(tmp_path, keep=2)
    for step in (500, 510):
        store.save(step, state(step), theirs)
    for step in (10, 20, 30, 40):
        store.save(step, state(step), ours)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"ckpt-{s:012d}.peerd" for s in (30, 40, 500, 510)]
    latest = store.load_latest(ours)
    assert latest.step == 40 and latest.identity == ours
    assert [(p.name, why) for p, why in store.passed_over] == [
        ("ckpt-000000000510.peerd", "hyper-parameters lr=0.5 (now 0.003)"),
        ("ckpt-000000000500.peerd", "hyper-parameters lr=0.5 (now 0.003)"),
    ]
    assert store.load_latest(identity(task="charlm")) is None
    assert store.passed_over[0][1] == "task 'digits-mlp', not 'charlm'"
    assert store.load_latest(identity(layout="other")) is None
    assert "layout" in store.passed_over[-1][1] and len(store.passed_over) == 4


def test_a_first_format_checkpoint_loads_when_the_model_layout_matches(tmp_path):
    import hashlib
    import io
    import struct

    from peerd.daemon.checkpoint import layout_of

    buffer = io.BytesIO()
    torch.save(state(7), buffer)
    payload = buffer.getvalue()
    header = struct.pack("<8sQQ24s", b"PEERDCK1", 7, len(payload), hashlib.blake2b(payload, digest_size=24).digest())
    (tmp_path / "ckpt-000000000007.peerd").write_bytes(header + payload)
    store = CheckpointStore(tmp_path, keep=1)
    assert store.load_latest(identity(layout="no")) is None
    assert "older release" in store.passed_over[0][1]
    ours = identity(layout=layout_of(state(7)["model"]))
    old = store.load_latest(ours)
    assert old.step == 7 and old.identity is None and torch.equal(old.state["model"]["w"], state(7)["model"]["w"])
    store.save(8, state(8), ours)  # supersedes the one it loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000008.peerd"]


def test_temp_files_of_interrupted_writes_are_removed_when_the_data_dir_is_opened(tmp_path):
    from peerd.daemon.datadir import DataDir

    ckpts = tmp_path / "runs" / "r" / "checkpoints"
    ckpts.mkdir(parents=True)
    leftovers = [ckpts / ".ckpt-000000000006.peerd.tmp", ckpts.parent / ".manifest.tmp", tmp_path / ".ready.json.tmp"]
    for path in leftovers:
        path.write_bytes(b"partial")
    (ckpts / "ckpt-000000000005.peerd").write_bytes(b"kept")
    d = DataDir(tmp_path)
    d.open()
    try:
        assert not any(p.exists() for p in leftovers)
        assert (ckpts / "ckpt-000000000005.peerd").exists()
    finally:
        d.close()


def test_a_step_of_another_identity_on_disk_is_not_overwritten(tmp_path):
    store = CheckpointStore(tmp_path, keep=1)
    theirs = store.save(10, state(1), identity(task="charlm"))
    ours = store.save(10, state(2), identity())
    assert ours != theirs and CheckpointStore.read(theirs).identity == identity(task="charlm")
    assert store.load_latest(identity()).path == ours
    store.save(20, state(3), identity())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000010.peerd", "ckpt-000000000020.peerd"]
