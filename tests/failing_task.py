"""A plug-in task whose loss raises on the first step, for tests of how a FAILED trainer is shown.

tests/test_health.py registers it like any package would, through a `peerd.tasks` entry point
(a .dist-info directory on the daemon's PYTHONPATH), so the daemon finds it the real way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from peerd.daemon.tasks import Batch, EvalResult, Hparams, Task, seeded

NAME = "fail-on-step"
MESSAGE = "loss raised on purpose (tests/failing_task.py)"


class FailOnStep(Task):
    name = NAME
    hparams_type = Hparams

    def build(self, hparams: Hparams, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        with seeded(seed):
            model = nn.Linear(1, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def data(self, hparams: Hparams, peer_seed: int) -> Iterator[Batch]:
        while True:
            yield Batch(inputs=torch.zeros(hparams.batch_size, 1), targets=torch.zeros(hparams.batch_size, 1))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise RuntimeError(MESSAGE)

    def evaluate(self, model: nn.Module, hparams: Hparams) -> EvalResult:
        return EvalResult(score=0.0, metric="none", higher_is_better=True, loss=0.0)


def plugin_env(site: Path) -> dict[str, str]:
    """Environment for a daemon that has this task installed: a .dist-info under `site` declaring the entry point."""
    info = site / "peerd_test_failing_task-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: peerd-test-failing-task\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[peerd.tasks]\n{NAME} = tests.failing_task:FailOnStep\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
