"""Proof that whoever opens a reliable link (TCP or libp2p stream) holds the run's secret.

In a secret run, the first bytes a dialer writes on a link are a hello:

| offset | size | field | meaning                                                          |
|-------:|-----:|-------|------------------------------------------------------------------|
|      0 |    4 | magic | b"PDHL"                                                          |
|      4 |   16 | nonce | random, fresh per link                                           |
|     20 |   16 | tag   | HMAC-SHA256(round key, nonce + dialed address), first 16 bytes   |

The round key is HMAC(run secret's engine key, "link" + round's group key), so a hello is good only
for the round (and Moshpit group key) it was made for, and only toward the listener it was dialed
to (named by its port for TCP, its handler for libp2p). The listener reads nothing else from the link until the hello checks out; a bad one closes the
link and is counted (`wire_bad_hello`). This keeps off-path parties without the secret from
injecting contributions. It does not encrypt, and an on-path attacker who sees a hello can replay
it to the same listener within the same round (docs/security.md). Open runs (no secret) send no
hello: anyone who knows the run ID may take part in them anyway.
"""

from __future__ import annotations

import hashlib
import hmac
import os

HELLO_MAGIC = b"PDHL"
NONCE_SIZE = TAG_SIZE = 16
HELLO_SIZE = len(HELLO_MAGIC) + NONCE_SIZE + TAG_SIZE  # 36


class LinkAuth:
    """Makes and checks hellos for one round. `listener` names the listening end the same way on both
    sides: its TCP port, or its libp2p handler name."""

    def __init__(self, engine_key: bytes, group_key: str):
        self.key = hmac.new(engine_key, b"link\x00" + group_key.encode(), hashlib.sha256).digest()

    def _tag(self, nonce: bytes, listener: str) -> bytes:
        return hmac.new(self.key, nonce + listener.encode(), hashlib.sha256).digest()[:TAG_SIZE]

    def hello(self, listener: str) -> bytes:
        nonce = os.urandom(NONCE_SIZE)
        return HELLO_MAGIC + nonce + self._tag(nonce, listener)

    def check(self, raw: bytes | memoryview, listener: str) -> bool:
        raw = bytes(raw)
        if len(raw) != HELLO_SIZE or raw[:4] != HELLO_MAGIC:
            return False
        nonce, tag = raw[4 : 4 + NONCE_SIZE], raw[4 + NONCE_SIZE :]
        return hmac.compare_digest(tag, self._tag(nonce, listener))
