"""What a task is: the interface every training task implements, and the values that cross it.

A run's manifest names a task and gives its hyper-parameters as a plain mapping; `Task.parse_hparams`
turns that mapping into the task's typed `Hparams` (or raises `HparamsError` naming the key) before
anything is built from it. Every other method takes the parsed `Hparams`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Mapping

import torch

from peerd.daemon.typed import Mismatch, coerce

MAX_BATCH_SIZE = 65536  # a manifest asking for more is a mistake or an attempt to exhaust memory


class HparamsError(ValueError):
    """Hyper-parameters are unusable; the message names the key and what is wrong with it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Hparams:
    """Base of every task's hyper-parameters: one typed, frozen dataclass per task.

    Fields may only be int, float, bool or str, so that a manifest can carry them as plain values.
    Subclasses add fields with defaults and check ranges in `__post_init__`, calling
    `Hparams.__post_init__(self)` first (zero-argument super() fails in slots dataclasses).
    """

    batch_size: int = 32  # samples in one batch of `Task.data`, i.e. one peer's local step

    def __post_init__(self) -> None:
        self.check_positive("batch_size")
        self.require("batch_size", self.batch_size <= MAX_BATCH_SIZE, f"at most {MAX_BATCH_SIZE}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> typing.Self:
        """Defaults overridden by `values`; raises HparamsError on an unknown key or a wrong type.

        An int is accepted for a float field (JSON and msgpack do not keep 1.0 apart from 1); a bool
        is never accepted for a number, nor a float for an int; non-finite floats are refused.
        """
        if not isinstance(values, Mapping):
            raise HparamsError(f"hyper-parameters must be a mapping of names to values, got {type(values).__name__}")
        types = typing.get_type_hints(cls)
        known = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in values.items():
            if key not in known:
                raise HparamsError(f"unknown hyper-parameter {key!r}; known: {', '.join(sorted(known))}")
            kwargs[key] = _coerce(key, value, types[key])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def require(self, name: str, ok: bool, requirement: str) -> None:
        """Raise HparamsError saying that field `name` must be `requirement`, unless ok."""
        if not ok:
            raise HparamsError(f"hyper-parameter {name!r} must be {requirement}, got {getattr(self, name)!r}")

    def check_positive(self, *names: str) -> None:
        for name in names:
            self.require(name, getattr(self, name) > 0, "positive")  # NaN fails this too


def _coerce(key: str, value: Any, expected: type) -> Any:
    """A manifest's value as the declared type (daemon/typed.py, exact: an int is a float, nothing else
    converts); floats must be finite."""
    if expected not in (bool, int, float, str):
        raise TypeError(
            f"hyper-parameter {key!r} is declared as {expected!r}; only int, float, bool and str are allowed"
        )
    try:
        value = coerce(value, expected, text=False)
    except Mismatch:
        raise HparamsError(
            f"hyper-parameter {key!r} must be {expected.__name__}, got {type(value).__name__} {value!r}"
        ) from None
    if expected is float and not math.isfinite(value):
        raise HparamsError(f"hyper-parameter {key!r} must be finite, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch of training samples; row i of `inputs` goes with row i of `targets`."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def samples(self) -> int:
        """How many samples the batch holds: the weight of this batch's gradient when peers average."""
        return self.targets.shape[0]


@dataclass(frozen=True, slots=True)
class EvalResult:
    score: float  # the task's headline metric on its held-out set
    metric: str  # the score's name, e.g. "accuracy" or "bits_per_char"
    higher_is_better: bool
    loss: float  # mean training loss (the same function as Task.loss) on the held-out set

    def better_than(self, other: EvalResult) -> bool:
        if self.metric != other.metric:
            raise ValueError(f"cannot compare {self.metric} with {other.metric}")
        return self.score > other.score if self.higher_is_better else self.score < other.score


class Task(abc.ABC):
    """A training task: data, model, optimizer, loss and evaluation, all built on this machine.

    A task is looked up by `name` (see registry.py). Implementations must be deterministic: the same
    hyper-parameters and seeds give the same model, the same batches and the same evaluation on
    every peer that runs the same code. Seeds are ints in [0, 2**64). A task object keeps no
    training state between calls; it may cache its read-only data set.
    """

    name: ClassVar[str]  # letters, digits, '.', '_' and '-'; how manifests refer to the task
    hparams_type: ClassVar[type[Hparams]]  # this task's hyper-parameter dataclass

    def default_hparams(self) -> dict[str, Any]:
        """Every hyper-parameter with its default value."""
        return self.hparams_type().to_dict()

    def parse_hparams(self, values: Mapping[str, Any] | None = None) -> Hparams:
        """Defaults overridden by `values` (e.g. a manifest's), typed and range-checked.

        Raises HparamsError naming the task and the key: unknown key, wrong type, out of range.
        """
        try:
            return self.hparams_type.from_dict(values or {})
        except HparamsError as e:
            raise HparamsError(f"task {self.name!r}: {e}") from None

    @abc.abstractmethod
    def build(self, hparams: Hparams, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A freshly initialized model and its optimizer; the same seed gives the same weights.

        Must not change the caller's global RNG state (use `seeded`).
        """

    @abc.abstractmethod
    def data(self, hparams: Hparams, peer_seed: int) -> Iterator[Batch]:
        """An endless stream of training batches of `hparams.batch_size` samples for one peer.

        The stream is a pure function of (hparams, peer_seed): different seeds give different
        samples, so peers that use different seeds do not all train on the same batches. Held-out
        samples never appear in it.
        """

    @abc.abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The mean loss over the batch's `samples`, as a scalar tensor ready for backward()."""

    @abc.abstractmethod
    def evaluate(self, model: torch.nn.Module, hparams: Hparams) -> EvalResult:
        """Score the model on the task's fixed held-out set, without gradients.

        The model is left in the train/eval mode it was in; it is not modified.
        """


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with torch's global CPU RNG seeded, and restore the caller's RNG state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no gradients inside; the model's previous mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def generator(seed: int) -> torch.Generator:
    """A CPU generator for one data stream, independent of every other RNG."""
    return torch.Generator().manual_seed(seed)
