"""Weights out of a run's checkpoints: a plain state_dict that `torch.load(path, weights_only=True)`
reads and, for a task's run, `model.load_state_dict(..., strict=True)` loads (`peerd export`).

Which weights are the run's model depends on what wrote the checkpoint (Kind). Under DiLoCo it is
the outer parameters θ (the first half of the checkpoint's "outer" [θ; m], in the trainer's order
of the parameters), not the inner ones in "model": θ is what every member of a completed round
shares. A state_dict alone does not tell parameters from buffers, so the task's model is built (the
checkpoint's identity names the task and its hyper-parameters) and θ copied into its parameters;
buffers come from "model". A run trained by attached processes (a user's own script, or a task's
child) has no model in the daemon: its checkpoint carries the parameters' names, shapes and dtypes
("model_layout"), by which θ is cut; a task's child's buffers come from the file it keeps its
optimizer's state in.

Only files are read: the daemon may run or not. Checkpoints are renamed into place when complete
(daemon/datadir.write_atomic), so one being written is never half-read; one that does not verify is
skipped for the next newest, as a restart does, and the result says so.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from peerd.daemon.checkpoint import Checkpoint, CheckpointStore, CorruptCheckpoint, mismatch, step_of
from peerd.daemon.datadir import write_atomic
from peerd.daemon.flat import from_flat
from peerd.daemon.joining import hparams_from_text
from peerd.daemon.tasks import InvalidTaskName, TaskLoadError, TaskNotFound, get_task


class ExportError(ValueError):
    """The weights cannot be exported as asked; the message is one line meant for the operator."""


class Kind(Enum):
    DILOCO = "diloco"  # a task's run under DiLoCo: θ, the outer parameters, with the model's buffers
    STATE = "state"  # a task's run under averaging.algorithm=state: the model as the trainer held it
    SCRIPT = "script"  # a run trained by a user's own script: θ, cut by the script's model layout


@dataclass(frozen=True, slots=True)
class ExportResult:
    path: Path  # the file written
    step: int  # the run's global step of the checkpoint it came from
    parameters: int  # parameter values written, buffers not counted (an older release's file: counted)
    kind: Kind
    checkpoint: Path  # the checkpoint it came from
    warnings: tuple[str, ...] = ()  # newer checkpoints skipped, other models' checkpoints beside it


def export(data_dir: Path, run_id: str, out: Path, step: int | None = None) -> ExportResult:
    """Write the weights of run `run_id` at `step` (None: its newest checkpoint that verifies) to
    `out`, atomically, as a dict of tensor name to tensor. Raises ExportError (one line): no such
    run or step, no checkpoint that verifies, a checkpoint the installed task's model does not fit,
    or `out` cannot be written."""
    directory = data_dir / "runs" / run_id
    if not directory.is_dir():
        runs = sorted(p.name for p in (data_dir / "runs").glob("*") if p.is_dir())
        where = f"runs there: {', '.join(runs)}" if runs else "it has no runs: is it the daemon's --data-dir?"
        raise ExportError(f"no run {run_id!r} in {data_dir} ({where})")
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; give a file name, e.g. {out / 'model.pt'}")
    store = CheckpointStore(directory / "checkpoints")
    checkpoint, warnings = _pick(store, run_id, step)
    kind, weights, parameters = checkpoint_weights(checkpoint)
    weights = _with_process_buffers(directory, checkpoint, weights)
    warnings += _other_models(store, checkpoint)
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    try:
        write_atomic(out, buffer.getvalue())
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror}") from None
    return ExportResult(out, checkpoint.step, parameters, kind, checkpoint.path, tuple(warnings))


def _with_process_buffers(directory: Path, checkpoint: Checkpoint, weights: dict) -> dict:
    """A task's run trained in child processes: the model's buffers (BatchNorm's running statistics)
    are not parameters, neither averaged nor in the daemon's checkpoints (a `state` run's holds the
    daemon's copy of the model, whose buffers never trained): they are the training process's
    latest, saved with its optimizer's state (daemon/taskproc.py, STATE_FILE), for the same model.
    Without that file (or of another model), the weights are left as the checkpoint gives them."""
    from peerd.daemon.taskchild import STATE_FILE

    identity, path = checkpoint.identity, directory / STATE_FILE
    if identity is None or not identity.get("task") or not path.is_file():
        return weights
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:  # a torn or foreign file: the checkpoint's own weights stand
        return weights
    buffers = saved.get("buffers") if isinstance(saved, dict) else None
    if not isinstance(buffers, dict) or mismatch(identity, saved.get("identity") or {}):
        return weights
    model, _ = _build(identity, checkpoint.path.name)
    wanted = model.state_dict()
    parameters = {name for name, _ in model.named_parameters()}
    taken = {k: v for k, v in buffers.items() if k in wanted and k not in parameters and torch.is_tensor(v)}
    return {**weights, **taken}


def _pick(store: CheckpointStore, run_id: str, step: int | None) -> tuple[Checkpoint, list[str]]:
    """The checkpoint of `step`, or the newest that verifies, and what was skipped on the way."""
    paths = store.paths()
    if not paths:
        raise ExportError(
            f"run {run_id!r} has no checkpoint yet in {store.directory} (the trainer writes one "
            "every --checkpoint-every steps and when it stops)"
        )
    if step is not None:
        wanted = [p for p in paths if step_of(p) == step]
        if not wanted:
            kept = ", ".join(str(step_of(p)) for p in reversed(paths))
            raise ExportError(f"run {run_id!r} has no checkpoint of step {step} (steps kept: {kept})")
        paths = wanted
    skipped: list[tuple[str, str]] = []  # (file name, why)
    for path in paths:
        try:
            return store.read(path), [f"checkpoint {name} skipped: {why}" for name, why in skipped]
        except CorruptCheckpoint as e:
            skipped.append((path.name, str(e)))
        except FileNotFoundError:  # pruned by the running daemon since it was listed: a newer one exists
            skipped.append((path.name, "deleted while being read (the daemon wrote newer ones; export again)"))
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
    raise ExportError(f"run {run_id!r}: no checkpoint{'' if step is None else f' of step {step}'} verifies ({reasons})")


def checkpoint_weights(checkpoint: Checkpoint) -> tuple[Kind, dict[str, torch.Tensor], int]:
    """What the checkpoint holds as the run's model: its kind, the tensors by name, the parameter count."""
    state, identity, name = checkpoint.state, checkpoint.identity, checkpoint.path.name
    if "model_layout" in state:
        return Kind.SCRIPT, *_cut(state, name)
    if "outer" not in state and "model" not in state:
        raise ExportError(f"checkpoint {name} holds no model (keys: {', '.join(sorted(state))})")
    if identity is None:  # a first-format file: written before identities, and before DiLoCo
        if "outer" in state:
            raise ExportError(f"checkpoint {name} is of an older release that names no task: θ cannot be mapped")
        model = {k: v for k, v in state["model"].items() if torch.is_tensor(v)}
        return Kind.STATE, model, sum(v.numel() for v in model.values() if v.is_floating_point())
    model, optimizer = _build(identity, name)
    try:
        model.load_state_dict(state["model"])
    except (KeyError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(
            f"checkpoint {name} does not fit task {identity['task']!r}'s model as built here "
            f"(the task's code changed?): {first}"
        ) from None
    kind = Kind.STATE
    if "outer" in state:
        kind = Kind.DILOCO
        params = [p for group in optimizer.param_groups for p in group["params"]]  # the trainer's order (state_tensors)
        n, outer = sum(p.numel() for p in params), state["outer"]
        if not torch.is_tensor(outer) or outer.numel() != 2 * n:
            got = outer.numel() if torch.is_tensor(outer) else type(outer).__name__
            raise ExportError(
                f"checkpoint {name}: its outer state holds {got} values, not 2 x {n} for the task's model"
            )
        from_flat(outer[:n], params)
    return kind, dict(model.state_dict()), sum(p.numel() for p in model.parameters())


def _build(identity: dict[str, Any], name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The task's model and optimizer as the checkpoint's identity describes them (any seed: every
    tensor is overwritten)."""
    task_name = identity.get("task", "")
    try:
        task = get_task(task_name)
        return task.build(hparams_from_text(task, identity.get("hparams") or {}), 0)
    except (InvalidTaskName, TaskNotFound, TaskLoadError, ValueError, TypeError) as e:  # HparamsError is a ValueError
        raise ExportError(f"checkpoint {name} is of task {task_name!r}, which cannot be built here: {e}") from None


def _cut(state: dict[str, Any], name: str) -> tuple[dict[str, torch.Tensor], int]:
    """A script's parameters: θ cut in order by `model_layout` ([name, shape, dtype] each), each
    slice reshaped and cast to its dtype."""
    outer, layout = state.get("outer"), state["model_layout"]
    if not torch.is_tensor(outer) or outer.dim() != 1 or outer.numel() % 2:
        raise ExportError(f"checkpoint {name} has a model_layout but no outer state [θ; m] to cut")
    theta, weights, offset = outer[: outer.numel() // 2], {}, 0
    try:
        for key, shape, dtype_name in layout:
            dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{key}: unknown dtype {dtype_name!r}")
            shape = torch.Size(shape)
            weights[str(key)] = theta[offset : offset + shape.numel()].view(shape).to(dtype, copy=True)
            offset += shape.numel()
    except (TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise ExportError(f"checkpoint {name}: its model_layout does not cut its outer state: {e}") from None
    if offset != theta.numel():
        raise ExportError(
            f"checkpoint {name}: its model_layout holds {offset} values, its outer state 2 x {theta.numel()}"
        )
    return weights, offset


def _other_models(store: CheckpointStore, checkpoint: Checkpoint) -> list[str]:
    """A line naming checkpoints of another model (task, hyper-parameters, layout) kept beside this
    one, e.g. of an earlier run with the same ID: the newest step is not always the model wanted."""
    if checkpoint.identity is None:
        return []
    others = []
    for path in store.paths():
        try:
            theirs = store.read_identity(path)
        except (OSError, CorruptCheckpoint):
            continue
        if theirs is not None and (why := mismatch(checkpoint.identity, theirs)):
            others.append(f"{path.name} ({why})")
    if not others:
        return []
    return [
        f"checkpoints of another model are kept beside {checkpoint.path.name}: {', '.join(others)}; --step picks one"
    ]
