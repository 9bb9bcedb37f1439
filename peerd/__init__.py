"""peerd's public Python API: keep your own training loop, let the local daemon be the network.

    import peerd.torch
    opt = peerd.torch.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                run="my-run", daemon="/var/lib/peerd")   # the daemon's --data-dir
    for batch in loader:
        loss = model(batch)
        loss.backward()
        opt.step()          # an inner step; every average_every steps, the run's outer step
        opt.zero_grad()

docs/your-loop.md says what happens at attach, at an outer step and on failures. `peerd.torch`
imports torch; this module does not.
"""

import os as _os

# gRPC's fork handlers run in every fork of a process that holds gRPC channels or a server (a daemon
# starting its training child or p2pd, a script's DataLoader workers) and, with other threads inside
# gRPC, crash the forked child before it runs: a training child killed by SIGSEGV within a
# millisecond of its start (tests/FLAKY.md). No process of peerd uses gRPC in a forked child (each
# child execs), so the handlers are off unless the user's environment says otherwise. Set here: every
# module of peerd that imports grpc is imported after this one.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# The daemon's packages: an install puts daemon/, peers/ and protos/ inside this package as
# peerd.daemon, peerd.peers and peerd.protos (pyproject.toml, package-dir); a checkout keeps them
# beside it, so there the checkout's root is searched for them too (whatever is installed elsewhere).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "daemon")) and _os.path.isfile(
    _os.path.join(_root, "daemon", "__init__.py")
):
    __path__.append(_root)

from peerd.daemon import __version__  # noqa: E402


class PeerdError(RuntimeError):
    """The daemon refused or could not be reached within the bound; the message says what to do."""


def export(run: str, *, daemon, out, step: int | None = None):
    """Write run `run`'s weights, from the newest checkpoint in the daemon's data dir `daemon`, to
    `out` as a plain state_dict (`torch.load(out, weights_only=True)` reads it); as `peerd export`.
    Returns peerd.daemon.export.ExportResult; raises peerd.daemon.export.ExportError (a ValueError)."""
    from pathlib import Path

    from peerd.daemon.export import export as export_run

    return export_run(Path(daemon), run, Path(out), step)


__all__ = ["PeerdError", "__version__", "export"]
