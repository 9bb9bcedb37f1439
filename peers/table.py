"""The live peer table of one run: pure bookkeeping, with the clock passed in by the caller."""

from __future__ import annotations

import copy

from dataclasses import dataclass

from peerd.peers.records import LinkReport, MemberRecord, MemberState, ParamSketch


@dataclass(slots=True)
class PeerEntry:
    peer_id: str
    maddrs: tuple[str, ...]
    version: str
    role: str
    timestamp: float  # the newest record timestamp seen (the peer's clock)
    last_seen: float  # our clock when that record was first seen
    step: int = 0  # the peer's global step in its newest record
    local_group: str = ""  # its --local-group label
    dear_address: str = ""  # its DeAR engine's "host:port"; "" when none
    probe_address: str = ""  # where it answers link probes, "host:port"; "" when none
    delegated_lanes: int = 0  # lanes another member of its local group averages for it (a bit mask)
    dear_group: str = ""  # ID of its active DeAR group; "" when none
    links: tuple[LinkReport, ...] = ()  # its link reports, as of `timestamp` (each report's age counts from it)
    sketch: ParamSketch | None = None  # its latest parameter sketch (peers/sketch.py); None before its first round


class PeerTable:
    """Which peers of a run are alive, as far as this daemon knows.

    A peer is alive while its heartbeat timestamp keeps advancing; it is dropped `ttl` seconds after
    the last advance, or at once when it announces that it left. Records older than a departure are
    ignored, so a stale DHT copy cannot resurrect a peer that left.
    """

    def __init__(self, self_peer_id: str, ttl: float):
        self.self_peer_id = self_peer_id
        self.ttl = ttl
        self._entries: dict[str, PeerEntry] = {}
        self._departed: dict[str, float] = {}  # peer ID -> timestamp of its LEFT record

    def observe(self, record: MemberRecord, now: float) -> str:
        """Apply one checked record; returns what it did: "self", "stale", "left", "new", "refreshed"."""
        if record.peer_id == self.self_peer_id:
            return "self"
        if record.timestamp <= self._departed.get(record.peer_id, float("-inf")):
            return "stale"
        if record.state is MemberState.LEFT:
            self._departed[record.peer_id] = record.timestamp
            self._entries.pop(record.peer_id, None)
            return "left"
        entry = self._entries.get(record.peer_id)
        if entry is None:
            # First sight: trust the record's age only as far as it makes the peer look older.
            age = min(max(now - record.timestamp, 0.0), self.ttl)
            self._entries[record.peer_id] = PeerEntry(
                record.peer_id,
                record.maddrs,
                record.version,
                record.role,
                record.timestamp,
                now - age,
                record.step,
                record.local_group,
                record.dear_address,
                record.probe_address,
                record.delegated_lanes,
                record.dear_group,
                record.links,
                record.sketch,
            )
            return "new"
        if record.timestamp <= entry.timestamp:
            return "stale"
        entry.maddrs, entry.version, entry.role, entry.step = record.maddrs, record.version, record.role, record.step
        entry.local_group, entry.dear_address = record.local_group, record.dear_address
        entry.probe_address, entry.delegated_lanes = record.probe_address, record.delegated_lanes
        entry.dear_group, entry.links, entry.sketch = record.dear_group, record.links, record.sketch
        entry.timestamp, entry.last_seen = record.timestamp, now
        return "refreshed"

    def expire(self, now: float) -> list[str]:
        """Drop peers not heard from for more than ttl; returns their IDs."""
        gone = [pid for pid, e in self._entries.items() if now - e.last_seen > self.ttl]
        for pid in gone:
            del self._entries[pid]
        return gone

    def entries(self) -> list[PeerEntry]:
        return sorted(self._entries.values(), key=lambda e: e.peer_id)

    def __len__(self) -> int:
        return len(self._entries)

    def copy(self) -> "PeerTable":
        """A copy that this table's later observations and expiries leave alone."""
        out = PeerTable(self.self_peer_id, self.ttl)
        out._entries = {pid: copy.copy(e) for pid, e in self._entries.items()}
        out._departed = dict(self._departed)
        return out
