"""Import the parts of hivemind peerd uses without running hivemind's package `__init__.py` files.

peerd uses hivemind's p2p, DHT node, record validation, utils and protos. Three `__init__.py`
files import far more: `hivemind/` imports averaging (which pulls in scipy.optimize), moe and
optim; `hivemind/utils/` and `hivemind/dht/` import torch (through utils/mpfuture.py and
utils/tensor_descr.py), which none of the parts peerd uses needs. In a daemon that trains nothing
the first costs 46 MiB of resident memory, torch 207 MiB, together about a second of start-up
(docs/benchmarks.md, "Daemon costs"); a daemon whose run trains imports torch itself.

`install()` puts these three packages into `sys.modules` empty, made from hivemind's own import
specs, so their `__path__` is the real one and `import hivemind.dht.node` loads the real
submodule. A name the package's `__init__.py` would bind is resolved on first access (PEP 562
module `__getattr__`): if `__init__.py` binds it with `from <submodule> import <name>`, that one
submodule is imported (so `from hivemind.utils import get_dht_time` does not import torch);
any other missing name runs the real `__init__.py` in the package, which then is the ordinary
package. So `import hivemind; hivemind.DHT` or `from hivemind import Optimizer` anywhere else in
the process still works and sees the same submodule objects. A package already imported is left
as it is.

This relies on hivemind (pinned ==1.1.12 in pyproject.toml) keeping to two habits: package
`__init__.py` files that only re-export names, and submodules that import what they need.
tests/test_hivemind_parts.py checks both in a fresh interpreter and fails if an upgrade breaks them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import threading
import types

PACKAGES = ("hivemind", "hivemind.utils", "hivemind.dht")  # parents first

_lock = threading.RLock()  # one thread runs an __init__.py; RLock: __init__.py imports re-enter


def install() -> None:
    """Register the lazy packages that are not imported yet. Idempotent."""
    for name in PACKAGES:
        if name not in sys.modules:
            _install(name)


def is_lazy(name: str = "hivemind") -> bool:
    """True while the package's `__init__.py` has not run (the package is our lazy one)."""
    module = sys.modules.get(name)
    return module is not None and "_peerd_lazy" in module.__dict__


def _install(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None or not spec.origin:
        raise ImportError(f"{name} is not installed as a package")
    package = importlib.util.module_from_spec(spec)
    with open(spec.origin, encoding="utf-8") as f:
        exports = _exports(ast.parse(f.read()), name)

    def __getattr__(attr: str):
        # Dunders are not bound by hivemind's __init__.py files (but __version__, and __all__ is
        # what a star import reads first); tools probe them (inspect, pickle, pytest) and must not
        # pull the package in.
        if attr.startswith("__") and attr.endswith("__") and attr not in ("__version__", "__all__"):
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        # A submodule still being imported is not an attribute of its parent yet; `import a.b.c
        # as d` inside it looks it up here, as IMPORT_FROM's own fallback to sys.modules would.
        submodule = sys.modules.get(f"{name}.{attr}")
        if submodule is not None:
            return submodule
        with _lock:
            if attr in package.__dict__:  # another thread resolved it while we waited
                return package.__dict__[attr]
            if attr in exports and "_peerd_lazy" in package.__dict__:
                source, original = exports[attr]
                value = getattr(importlib.import_module(source), original)
                setattr(package, attr, value)
                return value
            _run_init(package, spec)
        return getattr(package, attr)  # a real AttributeError if __init__.py does not bind it

    package.__getattr__ = __getattr__
    package._peerd_lazy = True
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)  # as the import system does for a subpackage


def _exports(tree: ast.Module, package: str) -> dict[str, tuple[str, str]]:
    """{name: (submodule, name there)} for every `from <submodule of package> import <name>` at
    the top of an `__init__.py`. Anything else it binds is left to running it."""
    exports = {}
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.startswith(package + ".")
        ):
            for alias in node.names:
                if alias.name != "*":
                    exports[alias.asname or alias.name] = (node.module, alias.name)
    return exports


def _run_init(package: types.ModuleType, spec) -> None:
    """Run the real `__init__.py` in the lazy package (under _lock), once."""
    if not package.__dict__.pop("_peerd_lazy", False):
        return
    # Without the hook, a name __init__.py reads from the half-initialised package fails as it
    # would in a normal import, instead of recursing.
    del package.__getattr__
    spec.loader.exec_module(package)
