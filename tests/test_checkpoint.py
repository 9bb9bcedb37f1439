"""Checkpoints: atomic, verified, and a torn file is never loaded."""

import os

import pytest
import torch

from daemon.checkpoint import CheckpointStore, CorruptCheckpoint


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
