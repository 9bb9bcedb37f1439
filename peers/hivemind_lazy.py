"""Import the parts of hivemind peerd uses without running `hivemind/__init__.py` first.

peerd uses hivemind's p2p, DHT node, record validation, utils and protos. `hivemind/__init__.py`
also imports hivemind.averaging (which pulls in scipy.optimize), hivemind.moe and hivemind.optim,
which peerd never uses: about 46 MiB of resident memory and 0.3 s of start-up in every daemon
(docs/benchmarks.md, "Daemon costs").

`install()` puts an empty `hivemind` package into `sys.modules`, made from hivemind's own import
spec (so its `__path__` is the real one and `import hivemind.p2p` loads the real submodule). The
package runs its real `__init__.py` on the first access to a name it does not yet have (PEP 562
module `__getattr__`), so `import hivemind; hivemind.DHT` or `from hivemind import Optimizer`
anywhere else in the process still works and sees the same submodule objects. If hivemind is
already imported, `install()` does nothing.

This relies on one property of hivemind (pinned ==1.1.12 in pyproject.toml): that its submodules
import what they need themselves rather than through names `hivemind/__init__.py` binds.
tests/test_hivemind_lazy.py checks it in a fresh interpreter, and fails if an upgrade breaks it.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types

_lock = threading.Lock()  # two threads' first accesses run __init__.py once


def install() -> None:
    """Register the lazy `hivemind` package, unless hivemind is already imported. Idempotent."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        raise ImportError("hivemind is not installed as a package")
    package = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        # Dunders other than __version__ are not defined by hivemind's __init__.py; tools probe
        # them (inspect, pickle, pytest) and must not pull the whole package in.
        if name.startswith("__") and name.endswith("__") and name != "__version__":
            raise AttributeError(f"module 'hivemind' has no attribute {name!r}")
        # A submodule still being imported is not yet an attribute of its parent;
        # `import hivemind.p2p.x as y` inside it looks it up here (as IMPORT_FROM's fallback would).
        submodule = sys.modules.get(f"hivemind.{name}")
        if submodule is not None:
            return submodule
        _run_init(package, spec)
        return getattr(package, name)  # a real AttributeError if __init__.py does not define it

    package.__getattr__ = __getattr__
    package._peerd_lazy = True  # for tests and for whoever wonders why DHT is missing from dir()
    sys.modules["hivemind"] = package


def _run_init(package: types.ModuleType, spec) -> None:
    with _lock:
        if not package.__dict__.pop("_peerd_lazy", False):
            return  # another thread ran it while we waited
        # Without the hook, a name __init__.py reads from the half-initialised package fails as it
        # would in a normal import instead of recursing.
        del package.__getattr__
        spec.loader.exec_module(package)


def is_lazy() -> bool:
    """True while `hivemind/__init__.py` has not run (the package is our empty one)."""
    module = sys.modules.get("hivemind")
    return module is not None and getattr(module, "_peerd_lazy", False)
