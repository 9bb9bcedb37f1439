"""Tables in the terminal: `peerd status`, `peerd peers` and the lab's report print through here.

Left-aligned columns two spaces apart, each as wide as its widest cell, nothing wrapped or cut. Not
rich: its tables wrap to the terminal's width, and to 80 columns when the output is piped into a
file or a CI log, where these tables are read most; for left-aligned text columns it would add a
dependency and settings against that. `peerd demo`'s rows are printed as they come, so they keep
fixed widths of their own (daemon/demo.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def columns(header: Sequence[object], rows: Sequence[Sequence[object]]) -> list[str]:
    """The header and the rows as lines of text."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (header, *rows)]
