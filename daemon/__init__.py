"""The peerd process: CLI, config, lifecycle, control server, metrics."""

from pathlib import Path

__version__ = "0.1.0"

# Where `import peerd` finds this code: a checkout's root, or the site-packages an install put it in.
# The daemon's own child processes (`python -m peerd...`) start there, so they run this very code;
# never in peerd/ itself, where its torch.py would shadow torch.
_here = Path(__file__).resolve().parent  # daemon/ in a checkout, .../site-packages/peerd/daemon/ in an install
SOURCE_ROOT = _here.parent if (_here.parent / "peerd").is_dir() else _here.parent.parent
