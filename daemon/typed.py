"""The one way a setting's value becomes the type its dataclass declares: pydantic's validation.

Every reader of settings goes through `coerce`: the daemon's config tree (flags, PEERD_* variables,
the TOML file), a task's hyper-parameters (a manifest's values, or `--set` text), a run's
`averaging.*` settings, a lab scenario's TOML and the benchmarks. Two modes:

* text=True, for what a user typed (a flag, a variable, KEY=VALUE): a string is parsed, "8" -> 8,
  "0.5" -> 0.5, "on"/"off" -> True/False, "a,b c" -> ["a", "b", "c"] for a list of strings; a value
  that already has a type (a TOML number, a flag's True) must have the declared one;
* text=False, for typed values (a manifest, a scenario's TOML): the value must have the declared
  type, except that an int is a float (JSON and TOML do not keep 1.0 apart from 1).

In both, a bool is never a number and a number never a string. What does not fit raises Mismatch,
whose message says what was expected and what came; the caller puts the setting's name in front,
as the user types it (a flag, a variable, a TOML key, a hyper-parameter).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, get_args, get_origin


class Mismatch(ValueError):
    """A value that is not of (and, for text, does not parse as) the declared type."""

    def __init__(self, value: Any, kind: Any):
        self.value, self.kind, self.expected = value, kind, describe(kind)
        super().__init__(f"expected {self.expected}, got {value!r}")


def coerce(value: Any, kind: Any, *, text: bool) -> Any:
    """`value` as type `kind` (int, float, bool, str, Path, list[str], list[int], dict); see the module
    docstring for the two modes. Raises Mismatch."""
    if text and isinstance(value, str) and get_origin(kind) is list:
        value = [part for part in value.replace(",", " ").split() if part]
    # Lax validation parses strings; strict validation takes only the declared type (int for float).
    lax = text and isinstance(value, str)
    from pydantic import ValidationError  # imported on first use: `peerd status` and friends never coerce

    try:
        return _adapter(kind).validate_python(value, strict=not lax)
    except ValidationError:
        raise Mismatch(value, kind) from None


def describe(kind: Any) -> str:
    """What a value of type `kind` is, in words: "an integer", "a list of strings"."""
    if get_origin(kind) is list:
        (item,) = get_args(kind) or (Any,)
        return {str: "a list of strings", int: "a list of integers"}.get(item, "a list")
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", Path: "a path"}
    return words.get(
        kind, "a table" if kind is dict or get_origin(kind) is dict else getattr(kind, "__name__", str(kind))
    )


@functools.cache
def _adapter(kind: Any):
    from pydantic import TypeAdapter

    return TypeAdapter(kind)
