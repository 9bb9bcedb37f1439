"""UDP datagrams for the bulk of a loss-tolerant round, a reliable transport for its few control messages.

    transport = UdpTransport("127.0.0.1", 0, secret=engine_key, session=group_key)
    address = await transport.start()          # "host:port": UDP and the control TCP share the port
    engine = LossyAllReduce(group, transport, numel)

Which message goes where. CONTRIBUTION and RESULT payloads are cut into datagrams of at most
`max_datagram` bytes (datagram.py: header, payload, GMAC tag) and never retransmitted. DONE ("I
sent you all I will of this phase", a few bytes) goes both ways: as `DONE_COPIES` datagrams right
behind the data, and over `control`, a reliable transport (by default a TcpTransport on the same
port; the daemon may pass its FallbackTransport). Why both: a DONE that never arrives costs a whole
deadline (seconds); the datagram copies arrive in order behind the data and almost always first
(both lost: 1 % per link and phase at 10 % loss), while TCP delivers a lone small message only
after a retransmission timeout when its first try is lost (200 ms or more), but surely. Other
control messages (VERDICT) go over `control` only. Order: a link sends in the order it was queued
(a DONE leaves after the datagrams before it were handed to the kernel), and before a message of
`control` reaches the sink every datagram waiting in the UDP socket is read first.

Sending (udpsend.py): per-link queues taken in turn, paced at `rate_bps`, optionally with GSO;
the send buffer is small (`send_buffer`) so that a full local queue makes the sender wait rather
than drop. Receiving: the socket is read here with recvmsg until empty (bounded per callback), not
through the event loop's datagram endpoint (CPython's reads one datagram per wake-up, the likely
cause of the 60-85 % loss measured with the stdlib loop; read this way, neither loop lost any here,
and the daemon runs uvloop anyway); the receive buffer is large (`socket_buffer`: a whole shard may
arrive at once); UDP_GRO lets the kernel hand over several datagrams per read when the sender used
GSO; SO_RXQ_OVFL reports what the kernel dropped for a full buffer (`kernel_drops`: loss peerd
caused itself). `drop(address, header)` is the seam through which tests and benchmarks lose
datagrams by rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import struct
from typing import Callable

from peerd.peers.collective.datagram import HEADER_SIZE as DGRAM_HEADER
from peerd.peers.collective.datagram import MAX_DATAGRAM, MIN_DATAGRAM, OVERHEAD, TAG_SIZE, DatagramCodec, DatagramError
from peerd.peers.collective.linkauth import LinkAuth
from peerd.peers.collective.tcp import TcpTransport, split_address
from peerd.peers.collective.transport import Action, Link, Sink, Transport
from peerd.peers.collective.udpsend import DatagramLink, PacedSender, StreamPacketLink
from peerd.peers.collective.wire import Header
from peerd.peers.events import PeerEvents

DEFAULT_DATAGRAM = 1472  # a 1500-byte path MTU minus IPv4 and UDP headers
SOCKET_BUFFER = 32 << 20  # SO_RCVBUF asked for: a whole shard of a round may be in flight to us
SEND_BUFFER = 128 << 10  # SO_SNDBUF (the kernel doubles it, and counts skb overhead): about 160 KB of
#                          1472-byte datagrams wait in local queues, under a 20 ms queue at 100 Mbit/s
READ_BURST = 512  # recvmsg calls per readiness callback, so other callbacks get their turn
READ_ALL = 1 << 20  # ... and before a control message: a socket buffer's worth, so nothing is left behind
BIND_ATTEMPTS = 8  # port-0 tries at a port free for both TCP and UDP
SOL_UDP, UDP_SEGMENT, UDP_GRO, SO_RXQ_OVFL, SO_RCVBUFFORCE, SO_SNDBUFFORCE = 17, 103, 104, 40, 33, 32
MSG_TRUNC = int(socket.MSG_TRUNC)  # a plain int: the enum's & costs more than the rest of a read
_ANCILLARY = socket.CMSG_SPACE(4) * 2


class UdpTransport(Transport):
    """Datagrams on host:port, control messages on `control` (which must listen on the same port).

    control: the reliable transport for DONE messages; by default a TcpTransport on the same port
    with `auth` (a secret run's LinkAuth), re-bound if the OS gave it a port some UDP socket holds.
    secret: the run secret's engine key (None in an open run: datagrams are then checked for integrity,
    not origin); session: shared by every member of the group and never reused with the same round
    numbers (the Moshpit group key); both key the datagram tags (datagram.py). max_datagram: bytes
    per datagram, UDP header excluded; every member of a group must use the same value (it fixes the
    packet grid). rate_bps: send rate in bits/s, None for unpaced; may be changed at any time.
    datagrams(address) -> bool: whether data to that member goes as datagrams (None: always); where
    not, it goes over the member's control link, cut into the same packets (StreamPacketLink).
    socket_buffer, send_buffer: SO_RCVBUF and SO_SNDBUF in bytes (forced past the sysctl limits when
    the process may). Call start() before attach()."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        session: bytes | str = b"",
        control: Transport | None = None,
        auth: LinkAuth | None = None,
        max_datagram: int = DEFAULT_DATAGRAM,
        rate_bps: float | None = None,
        socket_buffer: int = SOCKET_BUFFER,
        send_buffer: int = SEND_BUFFER,
        gso: bool = False,
        events: PeerEvents | None = None,
        drop: Callable[[str, Header], bool] | None = None,
        datagrams: Callable[[str], bool] | None = None,
    ):
        if not MIN_DATAGRAM <= max_datagram <= MAX_DATAGRAM:
            raise ValueError(f"max_datagram must be {MIN_DATAGRAM} to {MAX_DATAGRAM} bytes, not {max_datagram}")
        self.host, self.port, self.max_datagram = host, port, max_datagram
        self.packet_elements = (max_datagram - OVERHEAD) // 4  # part of the wire contract (packet grid)
        self.socket_buffer, self.send_buffer = socket_buffer, send_buffer
        self.events = events or PeerEvents()
        self.codec = DatagramCodec(secret, session)
        self.sender = PacedSender(
            self.codec, self.packet_elements, rate_bps=rate_bps, gso=gso, events=self.events, drop=drop
        )
        self._own_control, self.auth = control is None, auth
        self.datagrams = datagrams
        self.data_paths: dict[str, str] = {}  # member address -> "udp", or "stream" (its data over `control`)
        self.control = control or TcpTransport(host, port, events=self.events, auth=auth)
        self.address = ""
        self.sock: socket.socket | None = None
        self.bytes_received = self.kernel_drops = 0
        self._sink: Sink | None = None
        self._inbound = _Datagrams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recv = memoryview(bytearray(1 << 16))

    @property
    def rate_bps(self) -> float | None:
        """Send rate in bits/s (None: unpaced); set it from the link's measured or configured rate."""
        return self.sender.rate_bps

    @rate_bps.setter
    def rate_bps(self, value: float | None) -> None:
        self.sender.rate_bps = value

    @property
    def packets_sent(self) -> int:
        return self.sender.packets_sent

    @property
    def bytes_sent(self) -> int:
        return self.sender.bytes_sent

    # ---- Transport ---------------------------------------------------------------------------------

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        for attempt in range(BIND_ATTEMPTS):
            address = await self.control.start()
            port = split_address(address.partition("|")[0])[1]
            try:
                self.sock = self._socket(port)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE or not self._own_control or self.port or attempt + 1 == BIND_ATTEMPTS:
                    raise
                await self.control.close()  # the OS gave TCP a port some UDP socket holds: try another
                self.control = TcpTransport(self.host, 0, events=self.events, auth=self.auth)
        self.address = address
        self.sender.sock, self.sender.loop = self.sock, self._loop
        return address

    def _socket(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            for force, plain, size in (
                (SO_RCVBUFFORCE, socket.SO_RCVBUF, self.socket_buffer),
                (SO_SNDBUFFORCE, socket.SO_SNDBUF, self.send_buffer),
            ):
                try:  # beyond net.core.rmem_max/wmem_max only with CAP_NET_ADMIN
                    sock.setsockopt(socket.SOL_SOCKET, force, size)
                except OSError:
                    sock.setsockopt(socket.SOL_SOCKET, plain, size)
            sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            with contextlib.suppress(OSError):  # Linux < 5.0: one datagram per read, which works as well
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            if self.sender.gso:  # every datagram but a message's last is max-sized: the socket's segment size
                sock.setsockopt(SOL_UDP, UDP_SEGMENT, self.sender.full_size)
            sock.bind((self.host, port))
        except OSError:
            sock.close()
            raise
        return sock

    def attach(self, sink: Sink) -> None:
        if self._sink is not None:
            raise RuntimeError("this transport already delivers to a sink")
        self._sink = sink
        self.control.attach(_ControlSink(self, sink))
        self._loop.add_reader(self.sock.fileno(), self.read_datagrams)  # until now datagrams wait in the socket

    async def connect(self, address: str) -> Link:
        host, port = split_address(address.partition("|")[0])
        info = await self._loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM, family=self.sock.family)
        control = await self.control.connect(address)
        if self.datagrams is not None and not self.datagrams(address):
            self.data_paths[address] = "stream"
            return StreamPacketLink(control, self.packet_elements, address)
        self.data_paths[address] = "udp"
        return DatagramLink(self.sender, info[0][4], address, control)

    async def close(self) -> None:
        await self.sender.close()
        if self.sock is not None:
            if self._sink is not None:
                self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
        await self.control.close()

    def bytes_by_transport(self) -> dict[str, tuple[int, int]]:
        """{transport: (bytes sent, bytes received)}: "udp" for datagrams, the control transport's own."""
        inner = getattr(self.control, "bytes_by_transport", None)
        control = inner() if inner else {"tcp": (self.control.bytes_sent, self.control.bytes_received)}
        return {"udp": (self.bytes_sent, self.bytes_received), **control}

    # ---- receiving ---------------------------------------------------------------------------------

    def read_datagrams(self, reads: int = READ_BURST) -> None:
        """Deliver what waits in the socket, in at most `reads` reads (readiness calls again for more)."""
        sock, buf = self.sock, self._recv
        for _ in range(reads):
            try:
                n, ancillary, flags, _ = sock.recvmsg_into([buf], _ANCILLARY)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # an ICMP error queued on the socket; the next read gets data again
            segment = n
            for level, kind, data in ancillary:
                if level == SOL_UDP and kind == UDP_GRO:
                    segment = struct.unpack("i", data[:4])[0]
                elif level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL:
                    self.kernel_drops = struct.unpack("I", data[:4])[0]
            if flags & MSG_TRUNC:
                self.events.packet_rejected("dgram_oversized")
                continue
            for start in range(0, max(n, 1), segment or 1):  # an empty datagram is delivered (and refused)
                self._deliver(buf[start : min(start + segment, n)])

    def _deliver(self, data: memoryview) -> None:
        if len(data) > self.max_datagram:
            self.events.packet_rejected("dgram_oversized")
            return
        try:
            h = self.codec.open(data)
        except DatagramError as e:
            self.events.packet_rejected(e.reason)
            return
        dest = self._sink.on_header(self._inbound, h)
        if isinstance(dest, Action):
            return  # the sink counted why
        dest[:] = data[DGRAM_HEADER:-TAG_SIZE]
        self.bytes_received += len(data)
        self._sink.on_payload(self._inbound, h)


class _Datagrams:
    """The Inbound every datagram arrives on: it speaks for no member (each datagram names its sender
    under the tag) and has nothing to close."""

    member = None
    datagram = True

    def discard_payload(self) -> None:
        pass

    def close(self) -> None:
        pass


class _ControlSink:
    """The sink as the control transport sees it: datagrams that wait in the UDP socket go first."""

    def __init__(self, owner: UdpTransport, sink: Sink):
        self.owner, self.sink = owner, sink

    def on_header(self, link, header: Header):
        self.owner.read_datagrams(READ_ALL)
        return self.sink.on_header(link, header)

    def on_payload(self, link, header: Header) -> None:
        self.sink.on_payload(link, header)

    def on_lost(self, link) -> None:
        self.sink.on_lost(link)
