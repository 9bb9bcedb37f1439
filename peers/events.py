"""Callbacks through which peers/ reports what happened, without knowing about metrics.

The daemon passes an implementation that updates Prometheus metrics; tests pass a recorder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _ignore(*_args: object) -> None:
    return None


@dataclass(kw_only=True, slots=True)
class PeerEvents:
    # A DHT request finished: op is "get" or "store"; result is "ok", "error" or "timeout".
    dht_request: Callable[[str, str], None] = field(default=_ignore)
    # A heartbeat of this daemon was stored ("ok") or not ("error").
    heartbeat: Callable[[str], None] = field(default=_ignore)
    # Input from the network was refused; reason is a short snake_case word (see docs/metrics.md).
    rejected: Callable[[str], None] = field(default=_ignore)
    # A UDP datagram of the collective engine was dropped unread; reason as in docs/loss-tolerance.md.
    packet_rejected: Callable[[str], None] = field(default=_ignore)
    # n datagrams were handed to the kernel (or dropped by an emulation rule, standing for path loss).
    packets_sent: Callable[[int], None] = field(default=_ignore)
    # n datagrams a member expected in a round never arrived in time (gaps in the packet grid).
    packets_lost: Callable[[int], None] = field(default=_ignore)
    # An owner reduced `packets` packets of its shard each holding `fraction` of the group's
    # contributions (k/size); called once per distinct fraction per round, not per packet.
    shard_coverage: Callable[[float, int], None] = field(default=_ignore)
    # A link measurement ended: `answered` probes came back, `lost` did not (peers/linkprobe.py).
    link_probes: Callable[[int, int], None] = field(default=_ignore)
    # An echo of a measurement that had ended came (counted lost then; it answers the measurement now).
    link_probe_late: Callable[[], None] = field(default=_ignore)
    # The median round-trip time of one link measurement, in seconds.
    link_rtt: Callable[[float], None] = field(default=_ignore)
    # The bandwidth of one link measurement (packet trains), in bytes per second; 0 when unmeasurable.
    link_bandwidth: Callable[[float], None] = field(default=_ignore)
    # One packet train of a bandwidth measurement ended: "counted", "paused" (the sender was
    # descheduled where it spoils the train) or "unanswered" (too few echoes).
    link_train: Callable[[str], None] = field(default=_ignore)
