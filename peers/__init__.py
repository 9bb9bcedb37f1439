"""What peers do with each other: discovery, membership, (later) links, matchmaking and collectives.

Nothing here imports daemon/: the daemon hands plain values and callbacks in (see events.py).
"""
