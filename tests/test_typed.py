"""daemon/typed.py: the one coercion every settings reader uses (config, hyper-parameters, averaging.*,
lab scenarios, benchmarks)."""

from pathlib import Path

import pytest

from peerd.daemon.typed import Mismatch, coerce


@pytest.mark.parametrize(
    "value,kind,expected",
    [
        ("8", int, 8),
        ("0.5", float, 0.5),
        ("on", bool, True),
        ("false", bool, False),
        ("a, b c", list[str], ["a", "b", "c"]),
        ("/tmp/x", Path, Path("/tmp/x")),
        (8, int, 8),  # a typed value of the declared type
        (1, float, 1.0),  # an int is a float
        (True, bool, True),
        (["a"], list[str], ["a"]),
    ],
)
def test_text_is_parsed(value, kind, expected):
    assert coerce(value, kind, text=True) == expected


@pytest.mark.parametrize(
    "value,kind,message",
    [
        ("abc", int, "expected an integer, got 'abc'"),
        ("2.5", int, "expected an integer"),
        ("maybe", bool, "expected true or false, got 'maybe'"),
        (True, int, "expected an integer, got True"),  # a bool is never a number, even from a file
        (True, float, "expected a number, got True"),
        (8, str, "expected a string, got 8"),
        ([1], list[str], "expected a list of strings"),
    ],
)
def test_text_that_does_not_parse(value, kind, message):
    with pytest.raises(Mismatch, match=message):
        coerce(value, kind, text=True)


@pytest.mark.parametrize(
    "value,kind",
    [("8", int), ("0.5", float), ("true", bool), (8.0, int), (True, int), (True, float), (1, str), ([True], list[int])],
)
def test_exact_values_are_never_converted(value, kind):
    with pytest.raises(Mismatch):
        coerce(value, kind, text=False)


def test_exact_takes_an_int_for_a_float():
    assert coerce(3, float, text=False) == 3.0 and isinstance(coerce(3, float, text=False), float)
    assert coerce({"a": 1}, dict, text=False) == {"a": 1}
    assert coerce([1, 2], list[int], text=False) == [1, 2]


def test_the_client_commands_import_neither_pydantic_nor_torch():
    """`peerd status` and the other client commands start fast: the CLI module loads pydantic only
    when a value is coerced (`peerd start`), and torch never."""
    import subprocess
    import sys

    code = "import sys, peerd.daemon.cli; print(sorted(m for m in ('pydantic', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out
