"""What peers do with each other: discovery, membership, (later) links, matchmaking and collectives.

Nothing here imports daemon/: the daemon hands plain values and callbacks in (see events.py).
"""

# Before any module here imports a hivemind submodule: skip hivemind/__init__.py's imports of
# averaging, moe and optim, which peerd does not use (see hivemind_lazy.py for why and how).
from peers import hivemind_lazy as _hivemind_lazy

_hivemind_lazy.install()
