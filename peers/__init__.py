"""What peers do with each other: discovery, membership, link probes, matchmaking, collectives, state sync.

Nothing here imports daemon/: the daemon hands plain values and callbacks in (see events.py).
"""

# Before any module here imports a hivemind submodule: skip what hivemind's package __init__.py
# files import and peerd does not use (averaging with scipy, moe, optim, and torch through
# hivemind.utils); hivemind_parts.py says why and how.
from peerd.peers import hivemind_parts as _hivemind_parts

_hivemind_parts.install()
