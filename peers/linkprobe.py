"""Link probes: does a UDP path to a peer work, how lossy, how far away and how fast is it.

    prober = LinkProber("0.0.0.0", 0, events=events)
    address = await prober.start()                 # "host:port"; announced in the member record
    stats = await prober.measure(peer_id, address) # PROBE_COUNT probes, answered or lost
    await prober.measure_bandwidth(peer_id, address)   # the median of TRAINS packet trains (below)
    prober.passes(peer_id)                         # the latest measurement passed (see below)
    prober.reports()                               # fresh measurements, for the member record

Each daemon answers probes on one UDP port for as long as it runs. A probe is a 40-byte datagram:
magic, version, kind (PROBE or ECHO), a random 8-byte nonce per measurement, a sequence number and
the sender's send time; an ECHO is the probe sent back with the kind changed and, in what was
padding, how long the answering side held it (from the kernel's receive time to the echo's send,
in ns). The prober counts only echoes that carry its own nonce, from the address it probed, with a
sequence number it sent and has not seen yet: an off-path sender cannot fake an answer without
guessing the nonce. An echo is no larger than the probe and the answering side echoes at most
ECHO_RATE per second (a token bucket), so the port is no amplifier. Malformed datagrams are dropped
and counted in `peerd_rejected_packets_total{reason="probe_*"}`.

**Timestamps come from the kernel** (SO_TIMESTAMPNS, when the receive time of every datagram is
read with it; elsewhere the time it is read): a busy event loop (a training thread holding the GIL)
then delays neither side's figures. RTT = echo received - probe sent - the peer's hold time (a
hold longer than the whole round trip is ignored); the hold is the peer's own claim.

**What it decides.** A measurement sends PROBE_COUNT probes PROBE_GAP apart and waits ECHO_WAIT
after the last: the link's loss is the share never echoed, its RTT the median over the echoes. The
UDP path *passes* when at least PASS_SHARE of the probes came back: UDP that a firewall or NAT
drops (nothing returns) fails, a lossy path (even 20 % each way, 64 % back) passes, because the
loss-tolerant engine is made for it. One failed measurement does not fail a path that passed
(FAIL_AFTER in a row do: a peer whose loop was busy for all of ECHO_WAIT answers late, and its
rounds would leave datagrams for a while for nothing), and a failed one is repeated soon
(`due`: RETRY_AFTER, doubling) rather than at the usual interval. `LinkStats` keeps the latest
measurement and a running loss (an exponential average over measurements) for status and for the
local-group rule.

**A busy loop is not a lossy link.** An echo waiting in this host's socket when the wait ends is
an answer, even if this loop was too busy to read it before the deadline: the socket is read once
more before the count (and after a train). An echo the peer sent late (its loop was busy through
ECHO_WAIT) still answers its measurement when it comes, until the next measurement of that peer
starts: the peer's LinkStats is judged again in place (RTT net of the hold, loss, passes), while
`peerd_link_probes_total` keeps what the measurement counted when it ended (lost) and counts the
echo again as `late`. Without either, a
loaded machine's first measurements read up to 100 % loss, and the running loss kept a pair of
its daemons out of a local group (LocalGroupRules.max_loss) for minutes.

**Bandwidth** (`measure_bandwidth`, only for `--local-group auto`): packet trains of TRAIN_COUNT
datagrams of TRAIN_SIZE bytes sent back to back; the answering side echoes each with a 40-byte
TRAIN_ECHO carrying the kernel's receive time of the train packet on *its* clock (so the
dispersion is measured on one clock, and no state is kept there), under the same ECHO_RATE bucket.
A train's figure (`train_rate`, pure) is the UDP payload bytes of a window of it over their
receive spread: its last quarter (a shaper's burst lets the first packets through at line rate,
see below), unless the sender was *descheduled* on the way. The sender notes when each datagram
left; more than PAUSE between two (not spent waiting for room in its own queue) is a pause of the
CPU, not of the link: a shaper's bucket refills meanwhile and lets what follows through at line
rate (the train reads high: issue 17), an unshaped link idles (it reads low). So the window starts
three quarters of a train after the last pause before it (`train_window`) and ends at the first
pause inside it; a train whose window keeps fewer than a sixteenth of the train answered does
not count, and its sender stops it at the pause. A measurement sends trains until TRAINS count or
MAX_TRAINS were sent and reports the *median* of those that count (of an even number the lower
middle one; 0 when none counts): a train spoiled in a way no rule sees (a shaper's late timer, a
busy receiver) does not decide. Whether the link or this host set the pace shows in the window:
a link that limits the rate spreads the datagrams apart (receive spread > LINK_SPREAD x send
spread) or holds the sender back (its window went out LINK_SPREAD x slower than the train's first
quarter, sent at once: in the lab a veth's shaper pushes back into the sender's sendto, which then
returns at the link's pace, and the two spreads match): `LinkStats.bandwidth_link_bound`. A link
that does neither passes the datagrams as they were sent, and the figure is what this host sent,
a lower bound. Trains by outcome: `PeerEvents.link_train`.
Cost per peer and measurement: TRAINS trains (921 KB, answered by 768 echoes of 40 bytes), up to
MAX_TRAINS (1.8 MB) on a busy sender; at most MAX_TRAINS * 2 * TRAIN_WAIT seconds (3 s), a few
ms a train on a fast link. When the sender's own queue is full (its link is the slow one) it waits
for room, so its qdisc paces the train as the link does (that wait is no pause; one that outlasts
the queue's drain goes unseen). Limits:
* The figure is at most what one Python thread sends back to back (about 2 Gb/s on loopback here,
  1.1-1.3 Gb/s on the lab's veths, 0.7 when other work slows the CPU itself): a lower bound on a
  faster path, enough to tell it from the 1 Gb/s threshold (peers/dear/localgroup.py) while the
  sender keeps up.
* A token-bucket shaper lets its burst through at line rate. The train (307 KB) is sized against
  the lab's tbf (burst max(4 ms of traffic, 16 KiB), daemon/lab/netns.py): its last quarter is all
  shaped while the burst holds at most three quarters of it, i.e. up to about 460 Mbit/s; it reads
  high between that and 600 Mbit/s (the burst eats into the quarter), and a shaper whose burst
  holds the whole train (about 600 Mbit/s and up in the lab; a cloud's burst credits always) reads
  as the sender's line rate. Only a sustained transfer would see through a large burst.
* The sockets ask for buffers of 1 MiB (the kernel caps them at net.core.rmem_max / wmem_max,
  often 208 KB): a receiver busy for longer than its buffer holds loses the train's tail, and a
  window with fewer than a sixteenth of the train answered does not count, never reads high. So do
  trains from several peers that exhaust the ECHO_RATE bucket together; trains arriving at once
  share the receiver's downlink and read low.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from peerd.peers.events import PeerEvents

MAGIC = b"PDLP"
VERSION = 1
PROBE, ECHO, TRAIN, TRAIN_ECHO = 1, 2, 3, 4
FORMAT = struct.Struct("!4sBB8sHd")  # magic, version, kind, nonce, seq, sent_at (sender's monotonic clock)
REPLY = struct.Struct("!4sBB8sHdQ")  # FORMAT + ns: ECHO: the answering side's hold; TRAIN_ECHO: its receive time
SIZE = FORMAT.size + 16  # padding up to 40 bytes: room for REPLY's field (8) and a tag in a later version
PROBE_COUNT = 20  # probes per measurement: 1 lost probe = 5 % loss
PROBE_GAP = 0.002  # seconds between two probes of one measurement
ECHO_WAIT = 0.5  # seconds after the last probe before the unanswered ones count as lost
PASS_SHARE = 0.25  # a UDP path passes when at least this share of the probes came back
FAIL_AFTER = 2  # measurements in a row that must fail before a path that passed stops passing
RETRY_AFTER = 2.0  # seconds before a failed measurement is repeated, doubled with each failure in a row
LOSS_SMOOTHING = 0.3  # weight of the newest measurement in LinkStats.loss
ECHO_RATE = 2000.0  # echoes per second this daemon sends at most (and a burst of as many)
TRAIN_SIZE = 1200  # bytes of one train datagram: below every usual path MTU, no fragments
TRAIN_COUNT = 256  # datagrams per train: 307 KB, twice the lab's tbf burst at 300 Mbit/s (module docstring)
TRAINS = 3  # trains that count per bandwidth measurement; the figure is their median
MAX_TRAINS = 6  # trains sent at most per bandwidth measurement, when pauses spoil some
TRAIN_WAIT = 0.25  # seconds after a train's last datagram before its missing echoes count as lost
PAUSE = 0.0005  # seconds between two datagrams of a train (not waiting for room): the sender was descheduled
ROOM_WAIT = 0.0005  # seconds between two tries to send a train datagram while the socket's buffer is full
LINK_SPREAD = 1.2  # receive spread / send spread of a window above which the link set its pace
SOCKET_BUFFER = 1 << 20  # bytes of receive and send buffer asked for: a whole train while a loop is busy
READ_BATCH = 512  # datagrams read per wake-up at most, so one flood cannot starve the loop
DRAIN_BATCHES = 4  # READ_BATCHes read at most when a measurement's wait ends (LinkProber._drain)
MAX_REPORTS = 64  # link reports in one member record (peers/records.py MAX_LINKS)
REPORT_MAX_AGE = 60.0  # seconds after which a measurement is no longer reported (LocalGroupRules.max_age)
# SO_TIMESTAMPNS: the kernel's receive time of every datagram (Linux; Python names it only in 3.13+).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform == "linux" else None)
_TIMESPEC = struct.Struct("@ll")


@dataclass(slots=True)
class LinkStats:
    """What the probes found on the link to one peer."""

    address: str
    rtt: float  # seconds, median over the latest measurement's echoes (nan when none came back)
    loss: float  # share of probes lost, averaged over measurements (LOSS_SMOOTHING)
    last_loss: float  # share lost in the latest measurement
    passes: bool  # the path works: a measurement passed (PASS_SHARE) and FAIL_AFTER have not failed since
    measured_at: float  # time.monotonic() of the latest measurement
    measurements: int = 1
    failures: int = 0  # measurements in a row that did not pass
    bandwidth: float = 0.0  # bytes per second, the latest train measurement (0: none, or unmeasurable)
    bandwidth_at: float = float("-inf")  # time.monotonic() of that measurement
    bandwidth_link_bound: bool = False  # the link spread that measurement's median train (else this host set its pace)


def _judge(stats: LinkStats, old: LinkStats | None, rtts: Mapping[int, float], count: int) -> None:
    """Set what a measurement of `count` probes with echoes `rtts` (seq -> RTT) says, after `old`
    (the peer's measurement before it, or None): RTT, loss, running loss, passes, failures."""
    same = old is not None and old.address == stats.address
    stats.last_loss = 1 - len(rtts) / count
    stats.loss = stats.last_loss if old is None else (1 - LOSS_SMOOTHING) * old.loss + LOSS_SMOOTHING * stats.last_loss
    stats.rtt = statistics.median(rtts.values()) if rtts else math.nan
    passed = len(rtts) >= PASS_SHARE * count
    stats.failures = 0 if passed else (old.failures + 1 if same else 1)
    stats.passes = passed or (same and old.passes and stats.failures < FAIL_AFTER)


@dataclass(frozen=True, slots=True)
class TrainRate:
    """What one packet train measured (`train_rate`)."""

    rate: float  # bytes per second: UDP payload over the receive spread of the train's window
    link_bound: bool  # the link spread the window or held the sender back (LINK_SPREAD); else the sender's pace


@dataclass(frozen=True, slots=True)
class LinkReport:
    """One fresh measurement as this daemon publishes it (peers/records.py validates what arrives)."""

    peer_id: str  # the peer measured
    rtt: float  # seconds
    bandwidth: float  # bytes per second
    loss: float  # in [0, 1]
    age: float  # seconds since the older of its RTT and bandwidth measurements


class LinkProber:
    """Answers probes on host:port and measures links to peers (see the module docstring)."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, events: PeerEvents | None = None, echo_rate: float = ECHO_RATE
    ):
        self.host, self.port, self.echo_rate = host, port, echo_rate
        self.events = events or PeerEvents()
        self.stats: dict[str, LinkStats] = {}  # peer ID -> latest measurement
        self.address = ""
        self._sock: socket.socket | None = None
        self._kernel_time = False  # SO_TIMESTAMPNS is on: receive times come from the kernel
        # nonce -> (addr, the echo kind expected, sent, answers): ECHO: seq -> time.time_ns() sent,
        # seq -> RTT in s; TRAIN_ECHO: seq -> 0, seq -> the peer's receive time in ns
        self._pending: dict[bytes, tuple[tuple, int, dict[int, int], dict[int, float]]] = {}
        # A measurement that ended with echoes missing stays open until the peer's next one: peer ID ->
        # (nonce, its LinkStats, the one before, seq -> RTT, probes sent); nonce -> peer ID
        self._open: dict[str, tuple[bytes, LinkStats, LinkStats | None, dict[int, float], int]] = {}
        self._late: dict[bytes, str] = {}
        self._tokens, self._stamp = echo_rate, time.monotonic()

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            if SO_TIMESTAMPNS is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                    self._kernel_time = True
                except OSError:  # not this kernel: the time the datagram is read
                    pass
            sock.bind((self.host, self.port))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        loop.add_reader(sock.fileno(), self._readable)
        self.port = sock.getsockname()[1]
        self.address = f"{self.host}:{self.port}"
        return self.address

    def close(self) -> None:
        if self._sock is not None:
            try:
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            except RuntimeError:  # no loop running any more: the reader went with it
                pass
            self._sock.close()
            self._sock = None

    def announced(self, advertise_host: str) -> str:
        """The address peers should probe: this port on the host they can reach."""
        return f"{advertise_host}:{self.port}" if self.port else ""

    def passes(self, peer_id: str) -> bool:
        s = self.stats.get(peer_id)
        return s is not None and s.passes

    async def measure(
        self, peer_id: str, address: str, *, count: int = PROBE_COUNT, gap: float = PROBE_GAP, wait: float = ECHO_WAIT
    ) -> LinkStats:
        """Probe `address` ("host:port") `count` times and record the result under `peer_id`.
        Bounded: count * gap + wait seconds, plus one name lookup. Raises ValueError for an address
        that is not host:port."""
        addr = await self._resolve(address)
        loop = asyncio.get_running_loop()
        self._settle(peer_id)  # the previous measurement's echoes stop counting
        nonce = os.urandom(8)
        sent: dict[int, int] = {}
        rtts: dict[int, float] = {}
        self._pending[nonce] = (addr[:2], ECHO, sent, rtts)
        try:
            for seq in range(count):
                sent[seq] = time.time_ns()
                self._send(FORMAT.pack(MAGIC, VERSION, PROBE, nonce, seq, time.monotonic()).ljust(SIZE, b"\0"), addr)
                if gap:
                    await asyncio.sleep(gap)
            deadline = loop.time() + wait
            while len(rtts) < count and loop.time() < deadline:
                await asyncio.sleep(min(0.01, max(deadline - loop.time(), 0.0)))
            self._drain()  # echoes already here are answers, however late this loop got to them
        except BaseException:
            del self._pending[nonce]
            raise
        answered = len(rtts)
        self.events.link_probes(answered, count - answered)
        old = self.stats.get(peer_id)
        stats = LinkStats(address, math.nan, 0.0, 0.0, False, time.monotonic(), (old.measurements + 1) if old else 1)
        if old is not None and old.address == address:
            stats.bandwidth, stats.bandwidth_at = old.bandwidth, old.bandwidth_at
            stats.bandwidth_link_bound = old.bandwidth_link_bound
        _judge(stats, old, rtts, count)
        if rtts:
            self.events.link_rtt(stats.rtt)
        self.stats[peer_id] = stats
        if answered < count:  # echoes still on their way (a busy peer) answer this measurement when they come
            self._late[nonce] = peer_id
            self._open[peer_id] = (nonce, stats, old, rtts, count)
        else:
            del self._pending[nonce]
        return stats

    def _settle(self, peer_id: str) -> None:
        """The latest measurement of peer_id takes no more late echoes."""
        if (entry := self._open.pop(peer_id, None)) is not None:
            del self._pending[entry[0]], self._late[entry[0]]

    def _answered_late(self, nonce: bytes) -> None:
        """An echo of a measurement that had ended arrived: judge that measurement again, in place
        (its time, count and bandwidth stay), if it is still the peer's latest."""
        peer_id = self._late[nonce]
        _, stats, old, rtts, count = self._open[peer_id]
        if self.stats.get(peer_id) is stats:
            _judge(stats, old, rtts, count)

    async def measure_bandwidth(
        self,
        peer_id: str,
        address: str,
        *,
        trains: int = TRAINS,
        most: int = MAX_TRAINS,
        count: int = TRAIN_COUNT,
        wait: float = TRAIN_WAIT,
    ) -> float:
        """Send packet trains of `count` datagrams to `address` until `trains` of them count or `most`
        were sent (module docstring); returns the median of those that count in bytes per second
        (0.0: none did) and records it in the peer's LinkStats (which `measure` must have created).
        Bounded: most * count datagrams and most * 2 * wait seconds."""
        stats = self.stats.get(peer_id)
        if stats is None or stats.address != address:
            raise ValueError(f"measure the link to {peer_id} at {address} before its bandwidth")
        addr = await self._resolve(address)
        counted: list[TrainRate] = []
        for _ in range(most):
            rate = await self._train(addr, count, wait)
            if rate is not None:
                counted.append(rate)
                if len(counted) == trains:
                    break
        median = median_rate(counted)
        figure = median.rate if median else 0.0
        stats.bandwidth, stats.bandwidth_at = figure, time.monotonic()
        stats.bandwidth_link_bound = median is not None and median.link_bound
        self.events.link_bandwidth(figure)
        return figure

    async def _train(self, addr, count: int, wait: float) -> TrainRate | None:
        """Send one train to `addr`, wait for its echoes and return its figure (train_rate)."""
        loop = asyncio.get_running_loop()
        nonce = os.urandom(8)
        expected: dict[int, int] = {}
        received: dict[int, int] = {}
        self._pending[nonce] = (addr[:2], TRAIN_ECHO, expected, received)
        packets = [FORMAT.pack(MAGIC, VERSION, TRAIN, nonce, seq, 0.0).ljust(TRAIN_SIZE, b"\0") for seq in range(count)]
        sent = [0] * count  # time.monotonic_ns() when each datagram left (0: the train stopped before it)
        pauses: list[int] = []  # datagrams sent after a pause (PAUSE)
        now, pause = time.monotonic_ns, PAUSE * 1e9
        try:
            deadline = loop.time() + wait
            for seq, packet in enumerate(packets):  # back to back, without yielding: the train is the measurement
                expected[seq] = 0
                waited = False
                while not self._send(packet, addr, full=False) and loop.time() < deadline:
                    waited = True  # this host's own queue is full: its link paces the train
                    await asyncio.sleep(ROOM_WAIT)
                sent[seq] = now()
                if seq and not waited and sent[seq] - sent[seq - 1] > pause:  # descheduled, in sendto or between
                    pauses.append(seq)
                    window = train_window(count, pauses)
                    if window.stop <= seq or len(window) < _least(count):
                        break  # the window is over, or can no longer count: the rest would be sent for nothing
            deadline = loop.time() + wait
            while len(received) < len(expected) and loop.time() < deadline:
                await asyncio.sleep(min(0.005, max(deadline - loop.time(), 0.0)))
            self._drain()
        finally:
            del self._pending[nonce]
        rate = train_rate(sent, received, pauses)
        spoiled = len(train_window(count, pauses)) < _least(count)
        self.events.link_train("counted" if rate is not None else "paused" if spoiled else "unanswered")
        return rate

    def reports(self, now: float | None = None, limit: int = MAX_REPORTS) -> tuple[LinkReport, ...]:
        """The fresh measurements (RTT answered, bandwidth measured, neither older than
        REPORT_MAX_AGE), the freshest `limit` of them, by peer ID: what the member record carries."""
        now = time.monotonic() if now is None else now
        fresh = []
        for peer_id, s in self.stats.items():
            age = now - min(s.measured_at, s.bandwidth_at)
            if s.rtt == s.rtt and s.bandwidth > 0 and 0 <= age <= REPORT_MAX_AGE:
                fresh.append(LinkReport(peer_id, s.rtt, s.bandwidth, s.loss, age))
        fresh.sort(key=lambda r: r.age)
        return tuple(sorted(fresh[:limit], key=lambda r: r.peer_id))

    def due(self, peer_id: str, address: str, interval: float, now: float | None = None) -> bool:
        """Whether the link to `peer_id` at `address` needs a measurement: never measured (or at
        another address), `interval` after the latest one, or sooner after a failed one (RETRY_AFTER,
        doubled with each failure in a row, never beyond `interval`)."""
        s = self.stats.get(peer_id)
        if s is None or s.address != address:
            return True
        wait = interval if not s.failures else min(interval, RETRY_AFTER * 2 ** (s.failures - 1))
        return (time.monotonic() if now is None else now) - s.measured_at >= wait

    def forget(self, keep: set[str]) -> None:
        """Drop the stats of peers not in `keep` (they left every run)."""
        for peer_id in [p for p in self.stats if p not in keep]:
            del self.stats[peer_id]
            self._settle(peer_id)

    async def _resolve(self, address: str) -> tuple:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"probe address {address!r} is not host:port")
        if self._sock is None:
            raise RuntimeError("the prober is not started")
        infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
        return infos[0][4]

    def _send(self, data: bytes, addr, *, full: bool = True) -> bool:
        """Send one datagram; True when sent or lost on the way (an ICMP error reported on this send),
        False when the socket's buffer is full (then with `full` it counts as lost too)."""
        if self._sock is None:
            return True
        try:
            self._sock.sendto(data, addr)
        except BlockingIOError:
            return full
        except OSError:
            pass
        return True

    def _drain(self) -> None:
        """Read what waits in the socket now, before a measurement decides what was lost: a wait that
        ends after a stall of this loop (a callback that ran long, the CPU busy elsewhere) finds its
        deadline passed before the reader's turn comes, and echoes that did arrive in time would
        count as lost (and the running loss remembers them for minutes: LOSS_SMOOTHING). At most
        DRAIN_BATCHES reads of READ_BATCH, so a flood still cannot hold the loop."""
        for _ in range(DRAIN_BATCHES):
            if self._readable() < READ_BATCH:
                return

    def _readable(self) -> int:
        """Read up to READ_BATCH datagrams; returns how many were read (READ_BATCH: more may wait)."""
        ancillary = socket.CMSG_SPACE(_TIMESPEC.size) if self._kernel_time else 0
        for n in range(READ_BATCH):
            if self._sock is None:
                return n
            try:
                data, cmsgs, _flags, addr = self._sock.recvmsg(TRAIN_SIZE + 1, ancillary)
            except (BlockingIOError, InterruptedError):
                return n
            except OSError:  # e.g. ICMP port unreachable for an earlier probe: that probe is lost
                continue
            at = None
            for level, kind, payload in cmsgs:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
                    sec, nsec = _TIMESPEC.unpack_from(payload)
                    at = sec * 1_000_000_000 + nsec
            self._received(data, addr, time.time_ns() if at is None else at)
        return READ_BATCH

    def _received(self, data: bytes, addr, at: int) -> None:
        """One datagram that arrived at `at` (time.time_ns() clock, from the kernel when it can)."""
        if len(data) not in (SIZE, TRAIN_SIZE):
            self.events.packet_rejected("probe_bad_size")
            return
        magic, version, kind, nonce, seq, sent_at, extra = REPLY.unpack_from(data)
        if magic != MAGIC or version != VERSION or kind not in (PROBE, ECHO, TRAIN, TRAIN_ECHO):
            self.events.packet_rejected("probe_bad_header")
            return
        if (kind == TRAIN) != (len(data) == TRAIN_SIZE):
            self.events.packet_rejected("probe_bad_size")
            return
        if kind in (PROBE, TRAIN):
            if not self._take_token():
                self.events.packet_rejected("probe_rate_limited")
                return
            # An echo of a probe carries how long it was held here; that of a train packet, when it arrived.
            reply = (ECHO, time.time_ns() - at) if kind == PROBE else (TRAIN_ECHO, at)
            self._send(
                REPLY.pack(MAGIC, VERSION, reply[0], nonce, seq, sent_at, max(reply[1], 0)).ljust(SIZE, b"\0"), addr
            )
            return
        pending = self._pending.get(nonce)
        if (
            pending is None
            or pending[0] != addr[:2]
            or pending[1] != kind
            or seq not in pending[2]
            or seq in pending[3]
        ):
            self.events.packet_rejected("probe_unexpected_echo")
            return
        if kind == TRAIN_ECHO:
            pending[3][seq] = extra
            return
        raw = at - pending[2][seq]
        pending[3][seq] = (raw - extra if extra <= raw else raw) / 1e9  # a hold beyond the round trip is ignored
        if nonce in self._late:
            self.events.link_probe_late()
            self._answered_late(nonce)

    def _take_token(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.echo_rate, self._tokens + (now - self._stamp) * self.echo_rate)
        self._stamp = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def train_window(count: int, pauses: Sequence[int]) -> range:
    """The datagrams of a train of `count` whose receive spread makes its figure, given the datagrams
    sent after a pause (module docstring): from the last quarter, or three quarters of a train after
    a pause before that (the most a shaper's refilled bucket lets through at line rate, as the train
    is sized), up to the first pause after its start. Pure."""
    reach = count - count // 4
    start, end = reach, count
    for p in sorted(pauses):
        if p <= start:
            start = p + reach
        else:
            end = p
            break
    return range(start, max(start, end))


def _least(count: int) -> int:
    """Answered datagrams a train's window needs to count: a sixteenth of the train, and two."""
    return max(2, count // 16)


def train_rate(sent: Sequence[int], received: Mapping[int, int], pauses: Sequence[int] = ()) -> TrainRate | None:
    """One train's figure (pure; module docstring) from when each datagram left (`sent`, ns on the
    sender's clock, by seq), when the answering side got it (`received`, seq -> ns on its clock) and
    the datagrams sent after a pause: the payload of its window (train_window) over their receive
    spread. None when too few of the window were answered (_least) or their spread is zero."""
    window = train_window(len(sent), pauses)
    answered = [seq for seq in received if seq in window]
    if len(answered) < _least(len(sent)):
        return None
    arrivals = sorted(received[seq] for seq in answered)
    spread = arrivals[-1] - arrivals[0]
    if spread <= 0:
        return None
    first, last = min(answered), max(answered)
    paced = sent[last] - sent[first]
    spread_by_link = spread > LINK_SPREAD * paced
    head = len(sent) // 4  # sent before any shaper's bucket ran dry: the sender's own pace
    free = not any(0 < p < head for p in pauses) and sent[head - 1] > 0
    held = free and paced / (last - first) > LINK_SPREAD * (sent[head - 1] - sent[0]) / (head - 1)
    return TrainRate((len(answered) - 1) * TRAIN_SIZE / (spread / 1e9), spread_by_link or held)


def median_rate(counted: Sequence[TrainRate]) -> TrainRate | None:
    """A bandwidth measurement from the trains that counted (pure): the median train by rate, the
    lower middle one of an even number (of two, one spoiled high, the other); None when none counted."""
    if not counted:
        return None
    return sorted(counted, key=lambda r: r.rate)[(len(counted) - 1) // 2]
