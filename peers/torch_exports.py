"""Package attributes loaded on first use (PEP 562), for the parts of peers/ that import torch.

A daemon that trains nothing imports peerd.peers.collective and peerd.peers.dear for their light modules
(tcp.py, group.py, localgroup.py, member.py) and never loads torch (docs/benchmarks.md, "Daemon
costs"); tests/test_hivemind_parts.py checks that it stays so.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence


def attributes(package: str, sources: Mapping[str, Sequence[str]]) -> Callable[[str], object]:
    """A module `__getattr__` for `package` that imports `sources` {submodule: names} on first use."""
    source = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        if name in source:
            return getattr(importlib.import_module(source[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
