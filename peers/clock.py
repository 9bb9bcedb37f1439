"""The clock records are stamped with: hivemind's DHT time (wall-clock seconds).

Peers on different machines must agree on it within a few seconds (NTP); see docs/operations.md.
"""

from hivemind.utils import get_dht_time


def now() -> float:
    return get_dht_time()
