"""digits-mlp: an MLP on scikit-learn's bundled 8x8 handwritten digits; no download.

1,797 images of 64 pixels (0..16, scaled to [0, 1]), 10 classes. Every fifth image (index % 5 == 0,
360 images) is the held-out test set, the other 1,437 are the training set: a split that needs
no RNG, so it is the same for every version of every library. The score is test accuracy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from peerd.daemon.tasks.base import Batch, EvalResult, Hparams, Task, evaluating, generator, seeded

TEST_EVERY = 5  # every fifth image is held out


@dataclass(kw_only=True, slots=True, frozen=True)
class DigitsHparams(Hparams):
    hidden: int = 128  # width of the one hidden layer
    optimizer: str = "adam"  # "adam" or "sgd"
    lr: float = 3e-3
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        Hparams.__post_init__(self)
        self.check_positive("hidden", "lr")
        self.require("hidden", self.hidden <= 4096, "at most 4096")
        self.require("optimizer", self.optimizer in ("adam", "sgd"), "'adam' or 'sgd'")
        self.require("momentum", 0.0 <= self.momentum < 1.0, "in [0, 1)")
        self.require("weight_decay", self.weight_decay >= 0.0, ">= 0")


@functools.cache
def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y); read-only, shared by every caller."""
    rows = _digits_rows()
    x = torch.tensor(rows[:, :-1], dtype=torch.float32) / 16.0
    y = torch.tensor(rows[:, -1], dtype=torch.long)
    test = torch.arange(len(y)) % TEST_EVERY == 0
    return x[~test], y[~test], x[test], y[test]


def _digits_rows():
    """The data set as scikit-learn ships it: one row per image, 64 pixels then the label. Read
    from its file without importing scikit-learn, whose import (scipy with it) cost 1.3 s of CPU, a
    third of a training process's start; load_digits reads the same file."""
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():  # another layout: ask scikit-learn itself
        from sklearn.datasets import load_digits

        digits = load_digits()
        return np.column_stack([digits.data, digits.target])
    return np.loadtxt(path, delimiter=",")


class DigitsMLP(Task):
    name = "digits-mlp"
    hparams_type = DigitsHparams

    def build(self, hparams: DigitsHparams, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        with seeded(seed):
            model = nn.Sequential(nn.Linear(64, hparams.hidden), nn.ReLU(), nn.Linear(hparams.hidden, 10))
        if hparams.optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=hparams.lr, weight_decay=hparams.weight_decay)
        else:
            opt = torch.optim.SGD(
                model.parameters(), lr=hparams.lr, momentum=hparams.momentum, weight_decay=hparams.weight_decay
            )
        return model, opt

    def data(self, hparams: DigitsHparams, peer_seed: int) -> Iterator[Batch]:
        """Epoch after epoch over the training set, each epoch in a fresh order drawn from peer_seed."""
        x, y, _, _ = load_split()
        g = generator(peer_seed)
        pending = torch.empty(0, dtype=torch.long)
        while True:
            # Batches run across epoch boundaries, so every training image is seen once per epoch.
            pending = torch.cat([pending, torch.randperm(len(y), generator=g)])
            while len(pending) >= hparams.batch_size:
                idx, pending = pending[: hparams.batch_size], pending[hparams.batch_size :]
                yield Batch(x[idx], y[idx])

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch.inputs), batch.targets)

    def evaluate(self, model: nn.Module, hparams: DigitsHparams) -> EvalResult:
        _, _, x, y = load_split()
        with evaluating(model):
            logits = model(x)
            loss = F.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
        return EvalResult(score=accuracy, metric="accuracy", higher_is_better=True, loss=loss)
