"""The single-process baseline: one model, one process, the same task and sample budget as a run."""

from __future__ import annotations

import dataclasses

from peerd.daemon.tasks.base import EvalResult, Hparams, Task


def train_single_process(task: Task, hparams: Hparams, steps: int, batch_size: int, seed: int) -> EvalResult:
    """Train a model built with `seed` for `steps` steps of `batch_size` samples, then evaluate it.

    The model sees steps * batch_size training samples, drawn from `task.data` with peer seed
    `seed`; `batch_size` replaces hparams.batch_size. To compare with a run of N peers that each
    took S steps of b samples, call it with steps=S and batch_size=N*b.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    hparams = dataclasses.replace(hparams, batch_size=batch_size)
    model, optimizer = task.build(hparams, seed)
    model.train()
    batches = task.data(hparams, seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        task.loss(model, next(batches)).backward()
        optimizer.step()
    return task.evaluate(model, hparams)
