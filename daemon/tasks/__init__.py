"""Training tasks: what a run trains. A run's manifest names a task; the code is installed locally.

See docs/tasks.md for the interface, the built-ins, and how a package registers its own task.
"""

from peerd.daemon.tasks.base import (
    MAX_BATCH_SIZE,
    Batch,
    EvalResult,
    Hparams,
    HparamsError,
    Task,
    evaluating,
    generator,
    seeded,
)
from peerd.daemon.tasks.baseline import train_single_process
from peerd.daemon.tasks.registry import (
    ENTRY_POINT_GROUP,
    InvalidTaskName,
    TaskLoadError,
    TaskNotFound,
    available_tasks,
    get_task,
    validate_task_name,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "MAX_BATCH_SIZE",
    "Batch",
    "EvalResult",
    "Hparams",
    "HparamsError",
    "InvalidTaskName",
    "Task",
    "TaskLoadError",
    "TaskNotFound",
    "available_tasks",
    "evaluating",
    "generator",
    "get_task",
    "seeded",
    "train_single_process",
    "validate_task_name",
]
