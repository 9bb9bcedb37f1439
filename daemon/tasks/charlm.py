"""charlm: a small byte-level transformer language model trained on the Python standard library.

The corpus is text every machine with Python has, so nothing is downloaded: the top-level `*.py`
files of `sysconfig.get_paths()["stdlib"]`, sorted by name, concatenated and cut at
`corpus_bytes`. Bytes are the tokens (vocabulary 256), so there is no tokenizer. The last
HOLDOUT_FRACTION of the corpus is held out; evaluation reads EVAL_WINDOWS fixed, evenly spaced
windows of it. The score is bits per character (lower is better); the loss is in nats per character.

The corpus depends on the Python version (the standard library changes between releases), so
peers of one run should run the same Python minor version.
"""

from __future__ import annotations

import functools
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from peerd.daemon.tasks.base import Batch, EvalResult, Hparams, Task, evaluating, generator, seeded

VOCAB = 256  # one token per byte
HOLDOUT_FRACTION = 0.05  # the corpus's tail, never in a training batch
EVAL_WINDOWS = 256  # held-out windows scored by evaluate(), each `context` characters long
EVAL_BATCH = 64  # windows per forward pass in evaluate(), to bound its memory
MIN_CORPUS_BYTES = 256 * 1024  # below this the held-out slice is too small to mean anything
MAX_CORPUS_BYTES = 64 * 1024 * 1024


@dataclass(kw_only=True, slots=True, frozen=True)
class CharLMHparams(Hparams):
    context: int = 64  # characters a sample predicts, each from the ones before it
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    lr: float = 3e-3  # AdamW
    weight_decay: float = 0.01
    corpus_bytes: int = 2_000_000  # bytes of standard-library source read, held-out tail included

    def __post_init__(self) -> None:
        Hparams.__post_init__(self)
        self.check_positive("context", "d_model", "n_layers", "n_heads", "lr")
        self.require("context", self.context <= 1024, "at most 1024")
        self.require("d_model", self.d_model <= 2048, "at most 2048")
        self.require("n_layers", self.n_layers <= 48, "at most 48")
        self.require("n_heads", self.d_model % self.n_heads == 0, f"a divisor of d_model ({self.d_model})")
        self.require("weight_decay", self.weight_decay >= 0.0, ">= 0")
        self.require(
            "corpus_bytes",
            MIN_CORPUS_BYTES <= self.corpus_bytes <= MAX_CORPUS_BYTES,
            f"in [{MIN_CORPUS_BYTES}, {MAX_CORPUS_BYTES}]",
        )


@functools.cache
def load_corpus(max_bytes: int) -> torch.Tensor:
    """The corpus as a read-only uint8 tensor of at most max_bytes bytes; the same on every call."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py"), key=lambda p: p.name):
        if total >= max_bytes:
            break
        chunk = path.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
    if total < MIN_CORPUS_BYTES:
        raise RuntimeError(
            f"only {total} bytes of Python sources under {root}; charlm needs at least {MIN_CORPUS_BYTES}"
        )
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_corpus(hparams: CharLMHparams) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held_out): the corpus's head and its last HOLDOUT_FRACTION."""
    corpus = load_corpus(hparams.corpus_bytes)
    cut = len(corpus) - int(len(corpus) * HOLDOUT_FRACTION)
    return corpus[:cut], corpus[cut:]


def windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> Batch:
    """Inputs text[s : s+context] and targets shifted by one character, for every start s."""
    chars = text[starts[:, None] + torch.arange(context + 1)].long()
    return Batch(chars[:, :-1], chars[:, 1:])


class Block(nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MLP, each added to the residual stream."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """(batch, time) byte values -> (batch, time, 256) logits of the next byte."""

    def __init__(self, h: CharLMHparams):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h.d_model)
        self.pos = nn.Parameter(torch.randn(h.context, h.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(h.d_model, h.n_heads) for _ in range(h.n_layers))
        self.norm = nn.LayerNorm(h.d_model)
        self.head = nn.Linear(h.d_model, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CharLM(Task):
    name = "charlm"
    hparams_type = CharLMHparams

    def build(self, hparams: CharLMHparams, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        with seeded(seed):
            model = CharTransformer(hparams)
        opt = torch.optim.AdamW(model.parameters(), lr=hparams.lr, weight_decay=hparams.weight_decay)
        return model, opt

    def data(self, hparams: CharLMHparams, peer_seed: int) -> Iterator[Batch]:
        """Windows of the training text at uniformly random offsets drawn from peer_seed."""
        train, _ = split_corpus(hparams)
        g = generator(peer_seed)
        while True:
            starts = torch.randint(0, len(train) - hparams.context, (hparams.batch_size,), generator=g)
            yield windows(train, starts, hparams.context)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Cross-entropy in nats per character, averaged over every position of every sample."""
        logits = model(batch.inputs)
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch.targets.reshape(-1))

    def evaluate(self, model: nn.Module, hparams: CharLMHparams) -> EvalResult:
        _, held_out = split_corpus(hparams)
        starts = torch.linspace(0, len(held_out) - hparams.context - 1, EVAL_WINDOWS).long()
        total = 0.0
        with evaluating(model):
            for chunk in starts.split(EVAL_BATCH):
                total += self.loss(model, windows(held_out, chunk, hparams.context)).item() * len(chunk)
        nats = total / EVAL_WINDOWS
        return EvalResult(score=nats / math.log(2), metric="bits_per_char", higher_is_better=False, loss=nats)
