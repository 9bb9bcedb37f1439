"""One training path, and a round awaited on the daemon's loop (issue 26): no thread trainer; on the
round's path in daemon/ (the EndPhase handler, the trainer's phase end, DiLoCo's outer loop, the
run's bounded round) no thread is started, no coroutine is handed to the loop from another thread
and no executor of its own runs the round; and, run, a round and its landing take place on the
loop's thread, with no thread but the loop's and asyncio's workers (the arithmetic around it)."""

from __future__ import annotations

import ast
import math
import threading
from pathlib import Path

import pytest
import torch

from peerd.daemon.algorithms import DiLoCo
from peerd.daemon.attached import AttachedTrainer
from peerd.daemon.checkpoint import CheckpointStore
from peerd.daemon.diloco import OuterSettings
from peerd.peers.averaging import RoundResult
from peerd.peers.manifest import TensorSpec
from peerd.peers.phases import Phases
from peerd.shared_file import LANDED_OFFSET
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
# What the round's path may not call: a thread of its own, a hand-over to the loop from a thread,
# an executor of its own (asyncio.to_thread, for the arithmetic over the vector, is the loop's).
FORBIDDEN = {"Thread", "run_coroutine_threadsafe", "ThreadPoolExecutor", "run_in_executor"}
# The round's path, top to bottom: module -> the classes' methods (None: every one) and functions.
ROUND_PATH = {
    "daemon/control.py": {"ControlServicer": ["EndPhase"]},
    "daemon/attached.py": {
        "AttachedTrainer": [
            "end_phase",
            "_held",
            "_phase_ends",
            "_phase_closed",
            "_round",
            "_record",
            "_round_done",
            "_land",
            "_land_locked",
        ]
    },
    "daemon/algorithms.py": {"DiLoCo": ["bind", "round"], "StateAveraging": ["round", "_settle"]},
    "daemon/diloco.py": {"OuterLoop": None},
    "daemon/joining.py": {"": ["bounded_round"]},
    "daemon/app.py": {"Daemon": ["_train"]},  # its run_round, the round the trainer awaits
}


def called_names(node: ast.AST) -> set[str]:
    """The names every call in `node` calls: `f(...)` gives f, `a.b.f(...)` gives f."""
    names = set()
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        f = call.func
        names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def definitions(path: str, owners: dict) -> dict[str, ast.AST]:
    tree = ast.parse((ROOT / path).read_text())
    found = {}
    for owner, names in owners.items():
        scope = tree.body
        if owner:
            [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
            scope = cls.body
        for n in scope:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and (names is None or n.name in names):
                found[f"{owner}.{n.name}"] = n
        if names is not None:
            missing = set(names) - {k.split(".")[-1] for k in found}
            assert not missing, f"{path}: {missing} not found: update ROUND_PATH with the code"
    return found


def test_the_rounds_path_starts_no_thread_and_hands_no_coroutine_over_from_one():
    for path, owners in ROUND_PATH.items():
        for name, node in definitions(path, owners).items():
            bad = called_names(node) & FORBIDDEN
            assert not bad, f"{path} {name} calls {sorted(bad)}"
    source = (ROOT / "daemon/diloco.py").read_text()
    assert "concurrent.futures" not in source and "round_bridge" not in source


def test_there_is_one_training_path():
    """The daemon's thread trainer is gone: training happens in attached processes (a script's, or
    a task's child)."""
    for directory in ("daemon", "peers", "peerd"):
        for path in (ROOT / directory).rglob("*.py"):
            tree = ast.parse(path.read_text())
            classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
            assert "Trainer" not in classes, path
    assert not any((ROOT / "daemon").rglob("trainer.py"))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_round_and_its_landing_run_on_the_loops_thread(tmp_path, loop_thread, overlap):
    on: list[str] = []

    async def average(vector, weight, round_t, lanes=None, restore=True, payload="fp32"):
        on.append(threading.current_thread().name)
        vector.mul_(0.5)
        return [RoundResult(round_t, 2, None, "emulated")]

    t = AttachedTrainer(
        run_id="path",
        layout=(TensorSpec("w", (4,), "torch.float32"),),
        creator=True,
        store=CheckpointStore(tmp_path / "checkpoints"),
        algorithm=DiLoCo(OuterSettings(lr=0.5, momentum=0.0, payload="fp32", overlap=overlap)),
        phases=Phases(2),
        round_timeout=10.0,
        checkpoint_every=10_000,
        shared_dir=tmp_path,
        average=average,
    )
    before = {th.ident for th in threading.enumerate()}
    try:
        info = t.attach(pid=0, device="cpu", step=0)
        t._shared.tensor.copy_(torch.ones(4))
        loop_thread.run(t.end_phase(info.session, 0, 0.0, math.nan, 0.0))  # the upload: θ
        for phase in (1, 2):
            t._shared.tensor.sub_(0.5)
            loop_thread.run(t.end_phase(info.session, 2, 8.0, 1.0, 0.1))
            if overlap:
                wait_for(lambda: t._shared.count(LANDED_OFFSET) == phase, timeout=10, what=f"round {phase} landed")
        assert on == ["test-loop", "test-loop"]
        assert t.last_round is not None and t.last_round.round_t == 2
        new = [th.name for th in threading.enumerate() if th.ident not in before]
        # The loop's workers (daemon/app.worker_threads), nothing else.
        assert all(name.startswith("peerd-worker") for name in new), new
    finally:
        t.stop()
