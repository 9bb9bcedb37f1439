"""paced-digits: digits-mlp whose steps are paced to a fixed rate, a training load of known CPU.

bench.scale registers it for the daemons it starts (an entry point in a temporary dist-info on
their PYTHONPATH); it is not installed with peerd. Each step is a digits-mlp step (about 0.5 ms of
one core at --torch-threads 1: 418 steps/s measured unpaced at 0.23 of a core, 4 daemons on 2
cores), and the stream of batches waits so that a step starts at most `steps_per_second` times a
second: at 20 steps/s a training process costs about 1-2 % of a core for its steps, whatever N is,
until the machine is too busy to keep the pace (then it steps slower, as an unpaced task would).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from peerd.daemon.tasks.base import Batch
from peerd.daemon.tasks.digits import DigitsHparams, DigitsMLP

NAME = "paced-digits"
ENTRY_POINT = f"{NAME} = bench.paced_task:PacedDigits"


@dataclass(kw_only=True, slots=True, frozen=True)
class PacedHparams(DigitsHparams):
    steps_per_second: float = 20.0  # most steps a second; the batches wait, the steps are digits-mlp's

    def __post_init__(self) -> None:
        DigitsHparams.__post_init__(self)
        self.check_positive("steps_per_second")


class PacedDigits(DigitsMLP):
    name = NAME
    hparams_type = PacedHparams

    def data(self, hparams: PacedHparams, peer_seed: int) -> Iterator[Batch]:
        """digits-mlp's batches, each handed out no sooner than 1 / steps_per_second after the last;
        a late step moves the schedule (no burst to catch up)."""
        period = 1.0 / hparams.steps_per_second
        due = time.monotonic()
        for batch in DigitsMLP.data(self, hparams, peer_seed):
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            due = max(due, time.monotonic() - period) + period
            yield batch
