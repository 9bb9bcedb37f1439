"""peers/hivemind_parts.py: peerd imports hivemind's parts without its packages' __init__.py files,
a later `import hivemind` in the same process still gets the whole package, and a daemon that
trains nothing imports no torch (docs/benchmarks.md, "Daemon costs").

Each check runs in a fresh interpreter: this test process may already have imported hivemind.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ["hivemind.averaging", "hivemind.moe", "hivemind.optim", "hivemind.utils.mpfuture", "scipy", "torch"]


def run_fresh(code: str) -> None:
    """Run `code` in a new interpreter from the repo root; its failure (an assert) fails the test."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_peers_imports_what_it_needs_without_hivemind_init_then_import_hivemind_works():
    run_fresh(f"""
        import sys
        # The daemon as `peerd start` imports it, with every module of peers/ that imports hivemind
        # and that it needs before a run trains.
        import peerd.daemon.app, peerd.daemon.cli
        import peerd.peers.node, peerd.peers.validator, peerd.peers.identity, peerd.peers.clock
        from peerd.peers import hivemind_parts
        for package in hivemind_parts.PACKAGES:
            assert hivemind_parts.is_lazy(package), f"something ran {{package}}/__init__.py while peerd was importing"
        loaded = [m for m in {SKIPPED!r} if m in sys.modules]
        assert not loaded, loaded

        # The names peerd uses are the real ones.
        from hivemind.p2p import P2P, P2PContext, PeerID
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import DHTRecord, RecordValidatorBase
        from hivemind.utils import get_dht_time
        from hivemind.utils.serializer import MSGPackSerializer
        from hivemind.proto import crypto_pb2
        assert peerd.peers.node.P2P is P2P and peerd.peers.node.DHTNode is DHTNode
        import hivemind.utils
        assert hivemind.utils.get_dht_time is get_dht_time and hivemind_parts.is_lazy("hivemind.utils")
        loaded = [m for m in {SKIPPED!r} if m in sys.modules]
        assert not loaded, loaded

        # Training code imports torch, and hivemind's packages stay lazy.
        import peerd.peers.averaging, peerd.peers.collective.p2p, peerd.peers.collective.fallback, peerd.daemon.attached
        assert "torch" in sys.modules and all(hivemind_parts.is_lazy(p) for p in hivemind_parts.PACKAGES)

        # Tools that probe dunders do not pull the package in.
        import hivemind
        assert not hasattr(hivemind, "__wrapped__") and hivemind_parts.is_lazy()  # inspect.unwrap probes it

        # The first name only __init__.py defines runs it, once, in the same package object.
        assert hivemind.__version__ == "1.1.12"
        assert not hivemind_parts.is_lazy()
        from hivemind import DHT, Optimizer, DecentralizedAverager
        assert hivemind.DHT is DHT and sys.modules["hivemind"] is hivemind
        assert hivemind.p2p.P2P is P2P, "the full package must reuse the submodules peerd loaded"
        assert hivemind.DHT is hivemind.dht.DHT and hivemind.dht.DHTNode is DHTNode
        from hivemind.utils import MPFuture, TensorDescriptor, nested_flatten
        assert hivemind.utils.nested.nested_flatten is nested_flatten  # a submodule __init__.py imports
        try:
            hivemind.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("a missing name must raise AttributeError")
    """)


def test_install_leaves_an_imported_hivemind_alone():
    run_fresh("""
        import sys
        import hivemind
        full = sys.modules["hivemind"]
        import peerd.peers.node
        from peerd.peers import hivemind_parts
        hivemind_parts.install()
        assert sys.modules["hivemind"] is full
        assert not any(hivemind_parts.is_lazy(package) for package in hivemind_parts.PACKAGES)
        assert peerd.peers.node.P2P is hivemind.p2p.P2P
    """)
