"""Which tasks are installed on this machine: the built-ins, and those of the `peerd.tasks` entry points.

A manifest only names a task; the code always comes from this machine. A package registers a task
with an entry point in the `peerd.tasks` group whose name is the task's name and whose value is
a Task subclass ("package.module:ClassName"). A built-in name cannot be taken over by a package.
Listing reads package metadata only; get_task imports the one task asked for.
"""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint, entry_points

from peerd.daemon.tasks.base import Task

ENTRY_POINT_GROUP = "peerd.tasks"
# The same rule as run IDs: letters, digits, '.', '_' and '-', starting with a letter or digit.
TASK_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# Loaded like entry points, so that listing tasks imports neither torch models nor scikit-learn.
_BUILTINS = {
    "charlm": "peerd.daemon.tasks.charlm:CharLM",
    "digits-mlp": "peerd.daemon.tasks.digits:DigitsMLP",
}


class InvalidTaskName(ValueError):
    pass


class TaskNotFound(LookupError):
    """No installed task has the name; the message lists the installed ones."""


class TaskLoadError(RuntimeError):
    """An installed task's code failed to import or is not a usable Task."""


def validate_task_name(name: str) -> str:
    """Return name unchanged, or raise InvalidTaskName saying what is wrong with it."""
    if not isinstance(name, str) or not TASK_NAME_PATTERN.fullmatch(name):
        raise InvalidTaskName(
            f"task name {str(name)[:64]!r} is not 1 to 64 letters, digits, '.', '_' or '-' starting with a letter or digit"
        )
    return name


def _installed() -> dict[str, list[EntryPoint]]:
    """Every installed task's name and the entry points that claim it; more than one is an error.

    Entry points that reuse a built-in's name or have an invalid name are ignored.
    """
    found = {name: [EntryPoint(name, value, ENTRY_POINT_GROUP)] for name, value in _BUILTINS.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTINS or not TASK_NAME_PATTERN.fullmatch(ep.name):
            continue
        claims = found.setdefault(ep.name, [])
        if all(claim.value != ep.value for claim in claims):  # the same package seen twice is one claim
            claims.append(ep)
    return found


def available_tasks() -> list[str]:
    """Names of the installed tasks, sorted. Reads package metadata; imports no task code."""
    return sorted(_installed())


def get_task(name: str) -> Task:
    """A new instance of the installed task called `name`.

    Raises InvalidTaskName for a malformed name, TaskNotFound (listing the installed tasks) when
    nothing is installed under it, and TaskLoadError when its code fails to import, is not a Task
    subclass, declares a different name, or when two packages register the same name.
    """
    validate_task_name(name)
    installed = _installed()
    claims = installed.get(name)
    if not claims:
        raise TaskNotFound(
            f"no task named {name!r} is installed; installed tasks: {', '.join(sorted(installed))}. "
            f"A task is built in or registered by a Python package through the {ENTRY_POINT_GROUP!r} entry-point group."
        )
    if len(claims) > 1:
        # Refuse to guess: peers that picked differently would train different code under one name.
        raise TaskLoadError(f"task {name!r} is registered more than once: {', '.join(ep.value for ep in claims)}")
    ep = claims[0]
    try:
        cls = ep.load()
    except Exception as e:  # an installed package's import can fail in any way; report which one
        raise TaskLoadError(f"task {name!r} ({ep.value}) failed to load: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskLoadError(f"task {name!r} ({ep.value}) is not a subclass of peerd.daemon.tasks.Task")
    if getattr(cls, "name", None) != name:
        raise TaskLoadError(f"task {name!r} ({ep.value}) declares the name {getattr(cls, 'name', None)!r}")
    try:
        return cls()
    except TypeError as e:  # e.g. an abstract method left unimplemented
        raise TaskLoadError(f"task {name!r} ({ep.value}) cannot be instantiated: {e}") from e
