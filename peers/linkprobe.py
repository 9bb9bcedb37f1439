"""Link probes: does a UDP path to a peer work, and how lossy and how far away is it.

    prober = LinkProber("0.0.0.0", 0, events=events)
    address = await prober.start()                 # "host:port"; announced in the member record
    stats = await prober.measure(peer_id, address) # PROBE_COUNT probes, answered or lost
    prober.passes(peer_id)                         # the latest measurement passed (see below)

Each daemon answers probes on one UDP port for as long as it runs. A probe is a 44-byte datagram:
magic, version, kind (PROBE or ECHO), a random 8-byte nonce per measurement, a sequence number and
the sender's send time; an ECHO is the probe sent back with the kind changed. The prober counts only
echoes that carry its own nonce, from the address it probed, with a sequence number it sent and has
not seen yet: an off-path sender cannot fake an answer without guessing the nonce. An echo is no
larger than the probe and the answering side echoes at most ECHO_RATE per second (a token bucket),
so the port is no amplifier. Malformed datagrams are dropped and counted in
`peerd_rejected_packets_total{reason="probe_*"}`.

**What it decides.** A measurement sends PROBE_COUNT probes PROBE_GAP apart and waits ECHO_WAIT
after the last: the link's loss is the share never echoed, its RTT the median over the echoes. The
UDP path *passes* when at least PASS_SHARE of the probes came back: UDP that a firewall or NAT
drops (nothing returns) fails, a lossy path (even 20 % each way, 64 % back) passes, because the
loss-tolerant engine is made for it. `LinkStats` keeps the latest measurement and a running loss
(an exponential average over measurements) for status and for the local-group rule.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import struct
import time
from dataclasses import dataclass

from peers.events import PeerEvents

MAGIC = b"PDLP"
VERSION = 1
PROBE, ECHO = 1, 2
FORMAT = struct.Struct("!4sBB8sHd")  # magic, version, kind, nonce, seq, sent_at (sender's monotonic clock)
SIZE = FORMAT.size + 16  # padding up to 44 bytes: room for a tag in a later version, no amplification now
PROBE_COUNT = 20  # probes per measurement: 1 lost probe = 5 % loss
PROBE_GAP = 0.002  # seconds between two probes of one measurement
ECHO_WAIT = 0.5  # seconds after the last probe before the unanswered ones count as lost
PASS_SHARE = 0.25  # a UDP path passes when at least this share of the probes came back
LOSS_SMOOTHING = 0.3  # weight of the newest measurement in LinkStats.loss
ECHO_RATE = 2000.0  # echoes per second this daemon sends at most (and a burst of as many)


@dataclass(slots=True)
class LinkStats:
    """What the probes found on the link to one peer."""

    address: str
    rtt: float  # seconds, median over the latest measurement's echoes (nan when none came back)
    loss: float  # share of probes lost, averaged over measurements (LOSS_SMOOTHING)
    last_loss: float  # share lost in the latest measurement
    passes: bool  # the latest measurement passed (PASS_SHARE)
    measured_at: float  # time.monotonic() of the latest measurement
    measurements: int = 1


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, prober: LinkProber):
        self.prober = prober

    def datagram_received(self, data: bytes, addr) -> None:
        self.prober._received(data, addr)

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable: the probe is lost
        pass


class LinkProber:
    """Answers probes on host:port and measures links to peers (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, events: PeerEvents | None = None,
                 echo_rate: float = ECHO_RATE):  # fmt: skip
        self.host, self.port, self.echo_rate = host, port, echo_rate
        self.events = events or PeerEvents()
        self.stats: dict[str, LinkStats] = {}  # peer ID -> latest measurement
        self.address = ""
        self._transport: asyncio.DatagramTransport | None = None
        self._pending: dict[bytes, tuple[tuple, dict[int, float], dict[int, float]]] = {}  # nonce -> (addr, sent, rtts)
        self._tokens, self._stamp = echo_rate, time.monotonic()

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=(self.host, self.port), family=family
        )
        self.port = self._transport.get_extra_info("sockname")[1]
        self.address = f"{self.host}:{self.port}"
        return self.address

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def announced(self, advertise_host: str) -> str:
        """The address peers should probe: this port on the host they can reach."""
        return f"{advertise_host}:{self.port}" if self.port else ""

    def passes(self, peer_id: str) -> bool:
        s = self.stats.get(peer_id)
        return s is not None and s.passes

    async def measure(self, peer_id: str, address: str, *, count: int = PROBE_COUNT, gap: float = PROBE_GAP,
                      wait: float = ECHO_WAIT) -> LinkStats:  # fmt: skip
        """Probe `address` ("host:port") `count` times and record the result under `peer_id`.
        Bounded: count * gap + wait seconds, plus one name lookup. Raises ValueError for an address
        that is not host:port."""
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"probe address {address!r} is not host:port")
        if self._transport is None:
            raise RuntimeError("the prober is not started")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
        addr = infos[0][4]
        nonce = os.urandom(8)
        sent: dict[int, float] = {}
        rtts: dict[int, float] = {}
        self._pending[nonce] = (addr[:2], sent, rtts)
        try:
            for seq in range(count):
                t = time.monotonic()
                sent[seq] = t
                self._transport.sendto(FORMAT.pack(MAGIC, VERSION, PROBE, nonce, seq, t).ljust(SIZE, b"\0"), addr)
                if gap:
                    await asyncio.sleep(gap)
            deadline = loop.time() + wait
            while len(rtts) < count and loop.time() < deadline:
                await asyncio.sleep(min(0.01, max(deadline - loop.time(), 0.0)))
        finally:
            del self._pending[nonce]
        answered = len(rtts)
        self.events.link_probes(answered, count - answered)
        last_loss = 1 - answered / count
        old = self.stats.get(peer_id)
        loss = last_loss if old is None else (1 - LOSS_SMOOTHING) * old.loss + LOSS_SMOOTHING * last_loss
        rtt = statistics.median(rtts.values()) if rtts else float("nan")
        if rtts:
            self.events.link_rtt(rtt)
        stats = LinkStats(address, rtt, loss, last_loss, answered >= PASS_SHARE * count, time.monotonic(),
                          (old.measurements + 1) if old else 1)  # fmt: skip
        self.stats[peer_id] = stats
        return stats

    def forget(self, keep: set[str]) -> None:
        """Drop the stats of peers not in `keep` (they left every run)."""
        for peer_id in [p for p in self.stats if p not in keep]:
            del self.stats[peer_id]

    def _received(self, data: bytes, addr) -> None:
        if len(data) != SIZE:
            self.events.packet_rejected("probe_bad_size")
            return
        magic, version, kind, nonce, seq, sent_at = FORMAT.unpack_from(data)
        if magic != MAGIC or version != VERSION or kind not in (PROBE, ECHO):
            self.events.packet_rejected("probe_bad_header")
            return
        if kind == PROBE:
            now = time.monotonic()
            self._tokens = min(self.echo_rate, self._tokens + (now - self._stamp) * self.echo_rate)
            self._stamp = now
            if self._tokens < 1:
                self.events.packet_rejected("probe_rate_limited")
                return
            self._tokens -= 1
            self._transport.sendto(FORMAT.pack(MAGIC, VERSION, ECHO, nonce, seq, sent_at).ljust(SIZE, b"\0"), addr)
            return
        pending = self._pending.get(nonce)
        if pending is None or pending[0] != addr[:2] or seq not in pending[1] or seq in pending[2]:
            self.events.packet_rejected("probe_unexpected_echo")
            return
        pending[2][seq] = time.monotonic() - pending[1][seq]
