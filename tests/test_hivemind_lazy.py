"""peers/hivemind_lazy.py: peerd imports hivemind's parts without hivemind/__init__.py, and a later
`import hivemind` in the same process still gets the whole package.

Each check runs in a fresh interpreter: this test process may already have imported hivemind.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ["hivemind.averaging", "hivemind.moe", "hivemind.optim", "scipy"]


def run_fresh(code: str) -> None:
    """Run `code` in a new interpreter from the repo root; its failure (an assert) fails the test."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_peers_imports_what_it_needs_without_hivemind_init_then_import_hivemind_works():
    run_fresh(f"""
        import sys
        # Every module of peers/ and daemon/ that imports hivemind, and the app that imports them all.
        import peers.node, peers.validator, peers.identity, peers.clock, peers.averaging
        import peers.collective.p2p, peers.collective.fallback
        import daemon.app, daemon.cli
        from peers import hivemind_lazy
        assert hivemind_lazy.is_lazy(), "something ran hivemind/__init__.py while peerd was importing"
        loaded = [m for m in {SKIPPED!r} if m in sys.modules]
        assert not loaded, loaded

        # The names peerd uses are the real ones.
        from hivemind.p2p import P2P, P2PContext, PeerID
        from hivemind.dht.node import DHTNode
        from hivemind.dht.validation import DHTRecord, RecordValidatorBase
        from hivemind.utils import get_dht_time
        from hivemind.utils.serializer import MSGPackSerializer
        from hivemind.proto import crypto_pb2
        assert peers.node.P2P is P2P and peers.node.DHTNode is DHTNode

        # Tools that probe dunders do not pull the package in.
        import hivemind
        assert not hasattr(hivemind, "__all__") and hivemind_lazy.is_lazy()

        # The first name only __init__.py defines runs it, once, in the same package object.
        assert hivemind.__version__ == "1.1.12"
        assert not hivemind_lazy.is_lazy()
        from hivemind import DHT, Optimizer, DecentralizedAverager
        assert hivemind.DHT is DHT and sys.modules["hivemind"] is hivemind
        assert hivemind.p2p.P2P is P2P, "the full package must reuse the submodules peerd loaded"
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
        import peers.node
        from peers import hivemind_lazy
        hivemind_lazy.install()
        assert sys.modules["hivemind"] is full and not hivemind_lazy.is_lazy()
        assert peers.node.P2P is hivemind.p2p.P2P
    """)
