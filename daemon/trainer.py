"""The trainer host: trains one run's task in a named worker thread owned by the daemon.

Compute runs in the thread so the event loop stays free for the network. The loop reads the
trainer's counters (plain attributes, written by the thread only) for status and metrics.

Every `average_every` steps the thread hands a flat copy of the parameters to `average` (a Moshpit
round run on the event loop, see peers/averaging.py) and waits for it; a COMPLETED round's result
replaces the parameters, anything else leaves them as they were (docs/algorithms.md).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from enum import Enum
from typing import Callable

import torch

from daemon.checkpoint import CheckpointStore
from daemon.tasks import EvalResult, Hparams, Task

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 30.0  # seconds to wait for the thread: one step, one evaluation and one checkpoint


class TrainState(Enum):
    LOADING = "LOADING"  # building the model, loading a checkpoint
    TRAINING = "TRAINING"  # taking optimizer steps
    FINISHED = "FINISHED"  # reached max_steps; the model is kept
    STOPPED = "STOPPED"  # stopped by leave or drain
    FAILED = "FAILED"  # the task raised; see `error`


def seed_from(*parts: str) -> int:
    """A 63-bit seed every peer derives the same way from the same strings."""
    return int.from_bytes(hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest(), "little") >> 1


class Trainer:
    def __init__(
        self,
        *,
        run_id: str,
        task: Task,
        hparams: Hparams,
        init_seed: int,
        peer_seed: int,
        store: CheckpointStore,
        manifest_digest: str,
        threads: int,
        checkpoint_every: int,
        eval_every: int,
        max_steps: int,
        average_every: int = 0,
        average: Callable[[torch.Tensor, float, int], object] | None = None,
        on_round: Callable[[object], None] | None = None,
        ready_to_train: Callable[[], bool] | None = None,
        ready_timeout: float = 0.0,
    ):
        self.ready_to_train, self.ready_timeout = ready_to_train, ready_timeout
        self.run_id, self.task, self.hparams = run_id, task, hparams
        self.average_every, self.average = average_every, average
        self.on_round = on_round or (lambda result: None)
        self.last_round = None  # the RoundResult of the latest averaging round
        self._flat: torch.Tensor | None = None  # reused by every round: no allocation per round
        self._samples_since_round = 0
        self.init_seed, self.peer_seed = init_seed, peer_seed
        self.store, self.manifest_digest = store, manifest_digest
        self.threads, self.checkpoint_every, self.eval_every, self.max_steps = threads, checkpoint_every, eval_every, max_steps
        self.state = TrainState.LOADING
        self.step = 0
        self.resumed_from = 0
        self.loss = math.nan
        self.samples = 0
        self.samples_per_second = 0.0
        self.eval: EvalResult | None = None
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"trainer:{run_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Ask the thread to stop after its current step (it then checkpoints), and join it."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("run %s: trainer did not stop within %.0f s", self.run_id, timeout)

    def _run(self) -> None:
        try:
            torch.set_num_threads(self.threads)
            model, optimizer = self.task.build(self.hparams, self.init_seed)
            checkpoint = self.store.load_latest()
            if checkpoint is not None and checkpoint.state.get("manifest") == self.manifest_digest:
                model.load_state_dict(checkpoint.state["model"])
                optimizer.load_state_dict(checkpoint.state["optimizer"])
                self.step = self.resumed_from = checkpoint.step
                self.samples = checkpoint.state.get("samples", 0)
                logger.info("run %s: resumed from checkpoint at step %d", self.run_id, self.step)
            self._train(model, optimizer)
        except Exception as e:  # a task bug must not take the daemon down; it is shown in status
            logger.exception("run %s: trainer failed", self.run_id)
            self.error = f"{type(e).__name__}: {e}"
            self.state = TrainState.FAILED

    def _train(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        data = self.task.data(self.hparams, self.peer_seed)
        if self.ready_to_train is not None:  # e.g. enough peers: a lone creator would run ahead
            deadline = time.monotonic() + self.ready_timeout
            while not self.ready_to_train() and time.monotonic() < deadline and not self._stop.wait(0.2):
                pass
        self.state = TrainState.TRAINING
        window_start, window_samples = time.monotonic(), 0
        while not self._stop.is_set():
            if self.max_steps and self.step >= self.max_steps:
                self.state = TrainState.FINISHED
                break
            batch = next(data)
            model.train()
            loss = self.task.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            self.step += 1
            self.samples += batch.samples
            self._samples_since_round += batch.samples
            window_samples += batch.samples
            self.loss = float(loss.detach())  # CPU tensors: no device sync to avoid
            elapsed = time.monotonic() - window_start
            if elapsed >= 2.0:
                self.samples_per_second = window_samples / elapsed
                window_start, window_samples = time.monotonic(), 0
            if self.average is not None and self.step % self.average_every == 0:
                self._average_round(model)
            if self.step % self.eval_every == 0:
                self.eval = self.task.evaluate(model, self.hparams)
            if self.step % self.checkpoint_every == 0:
                self._checkpoint(model, optimizer)
        if self.state is TrainState.TRAINING:
            self.state = TrainState.STOPPED
        if self.eval is None or self.step % self.eval_every:
            self.eval = self.task.evaluate(model, self.hparams)
        if self.step > self.resumed_from:
            self._checkpoint(model, optimizer)

    @torch.no_grad()
    def _average_round(self, model: torch.nn.Module) -> None:
        params = list(model.parameters())
        if self._flat is None:
            self._flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
        offset = 0
        for p in params:
            self._flat[offset : offset + p.numel()].copy_(p.view(-1))
            offset += p.numel()
        result = self.average(self._flat, float(self._samples_since_round), self.step // self.average_every)
        self.last_round = result
        if getattr(result, "completed", False):
            offset = 0
            for p in params:
                p.view(-1).copy_(self._flat[offset : offset + p.numel()])
                offset += p.numel()
            self._samples_since_round = 0  # otherwise they count toward the next round's weight
        self.on_round(result)

    def _checkpoint(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "manifest": self.manifest_digest,
            "samples": self.samples,
        }
        self.store.save(self.step, state)
