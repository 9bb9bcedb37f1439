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

Sending: one queue per link, drained by one task that takes one batch (at most 64 KiB) from each
link in turn, so that every destination gets an even share instead of bursts (three members
sending a whole chunk to one owner at once would overflow its downlink); the whole is paced by a
token bucket at `rate_bps`, so that peerd does not cause its own loss. Unpaced (None), the send buffer is kept small
(`send_buffer`): datagrams waiting in a local qdisc count against it, so a full one makes the
sender wait instead of the qdisc dropping (that paces to a bottleneck on the first hop, e.g. a
shaped veth); a bottleneck further away only `rate_bps` (the measured or configured link rate)
protects. The receive buffer is large (`socket_buffer`): a whole shard may arrive at once. `gso=True` hands the kernel up to 64 datagrams per syscall
(UDP_SEGMENT; about 3x the send rate here). On loopback and veth a GSO batch travels as one
packet, so netem or nftables drops it whole: emulated loss becomes bursts of up to 64 datagrams.
Receiving: the socket is read with recvmsg until empty (bounded per callback); UDP_GRO lets the
kernel hand over several datagrams per call when the sender used GSO; SO_RXQ_OVFL reports the
datagrams the kernel dropped because the receive buffer was full (`kernel_drops`).
`drop(address, header)` is the seam through which tests and benchmarks lose datagrams by rule.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import socket
import struct
from typing import Callable

from peers.collective.datagram import HEADER_SIZE as DGRAM_HEADER
from peers.collective.datagram import MAX_DATAGRAM, MIN_DATAGRAM, OVERHEAD, TAG_SIZE, DatagramCodec, DatagramError
from peers.collective.linkauth import LinkAuth
from peers.collective.tcp import TcpTransport, split_address
from peers.collective.transport import Action, Link, Sink, Transport
from peers.collective.wire import HEADER_SIZE, Header, Kind
from peers.events import PeerEvents

logger = logging.getLogger(__name__)

DEFAULT_DATAGRAM = 1472  # a 1500-byte path MTU minus IPv4 and UDP headers
SOCKET_BUFFER = 32 << 20  # SO_RCVBUF asked for: a whole shard of a round may be in flight to us
SEND_BUFFER = 128 << 10  # SO_SNDBUF (the kernel doubles it, and counts skb overhead): about 160 KB of
#                          1472-byte datagrams wait in local queues, under a 20 ms queue at 100 Mbit/s
DONE_COPIES = 2  # datagram copies of each DONE, besides the one over the reliable transport
READ_BURST = 512  # recvmsg calls per readiness callback, so other callbacks get their turn
READ_ALL = 1 << 20  # ... and before a control message: a socket buffer's worth, so nothing is left behind
YIELD_BYTES = 256 << 10  # unpaced, the sender yields to the loop after this many bytes (receives run)
WRITABLE_TIMEOUT = 1.0  # seconds a full send buffer may take to drain before the batch is dropped
BIND_ATTEMPTS = 8  # port-0 tries at a port free for both TCP and UDP
GSO_SEGMENTS = 64  # UDP_MAX_SEGMENTS of older kernels
SOL_UDP, UDP_SEGMENT, UDP_GRO, SO_RXQ_OVFL, SO_RCVBUFFORCE, SO_SNDBUFFORCE = 17, 103, 104, 40, 33, 32
MSG_TRUNC = int(socket.MSG_TRUNC)  # a plain int: the enum's & costs more than the rest of a read
_ANCILLARY = socket.CMSG_SPACE(4) * 2
_DATA_KINDS = (Kind.CONTRIBUTION, Kind.RESULT)


class UdpTransport(Transport):
    """Datagrams on host:port, control messages on `control` (which must listen on the same port).

    control: the reliable transport for DONE messages; by default a TcpTransport on the same port
    with `auth` (a secret run's LinkAuth), re-bound if the OS gave it a port some UDP socket holds.
    secret: the run secret's engine key (None in an open run: datagrams are then checked for integrity,
    not origin); session: shared by every member of the group and never reused with the same round
    numbers (the Moshpit group key); both key the datagram tags (datagram.py). max_datagram: bytes
    per datagram, UDP header excluded; every member of a group must use the same value (it fixes the
    packet grid). rate_bps: send rate in bits/s, None for unpaced; may be changed at any time.
    socket_buffer, send_buffer: SO_RCVBUF and SO_SNDBUF in bytes (forced past the sysctl limits when
    the process may). Call start() before attach()."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None, session: bytes | str = b"",
        control: Transport | None = None, auth: LinkAuth | None = None, max_datagram: int = DEFAULT_DATAGRAM,
        rate_bps: float | None = None, socket_buffer: int = SOCKET_BUFFER, send_buffer: int = SEND_BUFFER,
        gso: bool = False, events: PeerEvents | None = None, drop: Callable[[str, Header], bool] | None = None,
    ):  # fmt: skip
        if not MIN_DATAGRAM <= max_datagram <= MAX_DATAGRAM:
            raise ValueError(f"max_datagram must be {MIN_DATAGRAM} to {MAX_DATAGRAM} bytes, not {max_datagram}")
        self.host, self.port, self.max_datagram, self.rate_bps = host, port, max_datagram, rate_bps
        self.packet_elements = (max_datagram - OVERHEAD) // 4  # part of the wire contract (packet grid)
        self.full_size = OVERHEAD + 4 * self.packet_elements  # every datagram of a message but its last
        self.socket_buffer, self.send_buffer, self.gso, self.drop = socket_buffer, send_buffer, gso, drop
        self.events = events or PeerEvents()
        self.codec = DatagramCodec(secret, session)
        self._own_control, self.auth = control is None, auth
        self.control = control or TcpTransport(host, port, events=self.events, auth=auth)
        self.address = ""
        self.sock: socket.socket | None = None
        self.packets_sent = self.bytes_sent = self.bytes_received = self.kernel_drops = 0
        self._sink: Sink | None = None
        self._inbound = _Datagrams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: collections.deque[_UdpLink] = collections.deque()  # links with something queued, in turn
        self._flusher: asyncio.Task | None = None
        self._tokens, self._stamp = 0.0, 0.0
        self._send = memoryview(bytearray(MAX_DATAGRAM + 1))
        self._recv = memoryview(bytearray(1 << 16))

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
        return address

    def _socket(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            for force, plain, size in ((SO_RCVBUFFORCE, socket.SO_RCVBUF, self.socket_buffer),
                                       (SO_SNDBUFFORCE, socket.SO_SNDBUF, self.send_buffer)):  # fmt: skip
                try:  # beyond net.core.rmem_max/wmem_max only with CAP_NET_ADMIN
                    sock.setsockopt(socket.SOL_SOCKET, force, size)
                except OSError:
                    sock.setsockopt(socket.SOL_SOCKET, plain, size)
            sock.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            with contextlib.suppress(OSError):  # Linux < 5.0: one datagram per read, which works as well
                sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            if self.gso:  # every datagram but a message's last is max-sized: the socket's segment size
                sock.setsockopt(SOL_UDP, UDP_SEGMENT, self.full_size)
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
        return _UdpLink(self, info[0][4], address, control)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        for link in self._ready:
            link._discard()
        self._ready.clear()
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

    # ---- sending -----------------------------------------------------------------------------------

    def datagrams(self, count: int) -> int:
        """Datagrams a message of `count` elements travels in."""
        return max(1, -(-count // self.packet_elements))

    def _enqueue(self, link: _UdpLink, header: Header, payload: memoryview | None) -> None:
        if not link.queue:
            self._ready.append(link)
        link.queue.append((header, payload))
        if self._flusher is None:
            self._flusher = self._loop.create_task(self._flush())

    async def _flush(self) -> None:
        """Send what the links queued: a batch of one link's head message per turn, links in turn."""
        since_yield = 0
        try:
            while self._ready:
                link = self._ready.popleft()
                if link._closed:
                    link._discard()
                    continue
                h, payload = link.queue[0]
                if h.kind in _DATA_KINDS:
                    nbytes, segments = self._batch(link, h, payload)
                    if self.rate_bps:
                        await self._pace(nbytes)
                    elif since_yield >= YIELD_BYTES:
                        since_yield = 0
                        await asyncio.sleep(0)
                    since_yield += nbytes
                    await self._transmit(link, nbytes, segments)
                else:
                    if h.kind is Kind.DONE:
                        await self._transmit(link, *self._copies(link, h, DONE_COPIES))
                    link.control.send(h, payload)
                if h.kind not in _DATA_KINDS or link.done_elements >= h.count:
                    link._pop()
                if link.queue:
                    self._ready.append(link)
        finally:
            self._flusher = None

    def _batch(self, link: _UdpLink, h: Header, payload: memoryview) -> tuple[int, list[tuple[int, int]]]:
        """Seal the next datagrams of the link's head message into the send buffer: (bytes,
        [(start, size)]), as many as one UDP_SEGMENT send takes (sent one by one without GSO)."""
        stride, buf = self.packet_elements, self._send
        limit = min(GSO_SEGMENTS * self.full_size, MAX_DATAGRAM)  # one GSO send, or one burst of sendto
        pos, segments = 0, []
        while link.done_elements < h.count and pos + self.full_size <= limit:
            e0 = link.done_elements
            e1 = min(e0 + stride, h.count)
            link.done_elements = e1
            if self.drop is not None and self._dropped(link, h._replace(offset=h.offset + e0, count=e1 - e0)):
                continue
            size = self.codec.seal_into(buf, pos, h, h.offset + e0, payload[e0 * 4 : e1 * 4])
            segments.append((pos, size))
            pos += size
            if size < self.full_size:
                break  # a short datagram can only be the last segment of a GSO send
        return pos, segments

    def _copies(self, link: _UdpLink, h: Header, copies: int) -> tuple[int, list[tuple[int, int]]]:
        """Seal `copies` datagrams of a message without payload (DONE) into the send buffer."""
        segments, pos = [], 0
        for _ in range(copies):
            if self._dropped(link, h):
                continue
            segments.append((pos, self.codec.seal_into(self._send, pos, h, h.offset, memoryview(b""))))
            pos += OVERHEAD
        return pos, segments

    def _dropped(self, link: _UdpLink, h: Header) -> bool:
        """The emulation seam: a datagram it drops stands for one lost on the path, so it counts as sent."""
        if self.drop is None or not self.drop(link.address, h):
            return False
        self.packets_sent += 1
        self.events.packets_sent(1)
        return True

    async def _pace(self, nbytes: int) -> None:
        """Token bucket: at most a 2 ms (and 64 KiB) burst above rate_bps."""
        rate, now = self.rate_bps / 8, self._loop.time()
        burst = max(rate * 0.002, 1 << 16)
        self._tokens, self._stamp = min(burst, self._tokens + (now - self._stamp) * rate), now
        if self._tokens < nbytes:
            await asyncio.sleep((nbytes - self._tokens) / rate)
            now = self._loop.time()
            self._tokens, self._stamp = self._tokens + (now - self._stamp) * rate, now
        self._tokens -= nbytes

    async def _transmit(self, link: _UdpLink, nbytes: int, segments: list[tuple[int, int]]) -> None:
        if not segments or link._closed:
            return
        sends = [(0, nbytes)] if self.gso and len(segments) > 1 and segments[0][1] == self.full_size else segments
        for start, size in sends:
            for _ in range(2):  # the second try after the send buffer had room again
                try:
                    self.sock.sendto(self._send[start : start + size], link.addr)
                    break
                except BlockingIOError:
                    if not await self._writable():
                        break
                except OSError as e:  # e.g. ENOBUFS, unreachable: like loss on the path
                    logger.debug("udp send to %s failed: %s", link.address, e)
                    break
        self.packets_sent += len(segments)
        self.bytes_sent += nbytes
        self.events.packets_sent(len(segments))

    async def _writable(self) -> bool:
        ready = self._loop.create_future()
        self._loop.add_writer(self.sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            async with asyncio.timeout(WRITABLE_TIMEOUT):
                await ready
            return True
        except TimeoutError:
            return False
        finally:
            self._loop.remove_writer(self.sock.fileno())

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


class _UdpLink(Link):
    """Data kinds as datagrams, everything else over the member's control link, all in queue order."""

    def __init__(self, owner: UdpTransport, addr: tuple, address: str, control: Link):
        self.owner, self.addr, self.address, self.control = owner, addr, address, control
        self.queue: collections.deque[tuple[Header, memoryview | None]] = collections.deque()
        self.done_elements = 0  # of the message at the head of the queue, already sent
        self._idle: asyncio.Future | None = None
        self._closed = False

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self.closed:
            return 0
        if header.kind in _DATA_KINDS:
            if header.length > len(payload or b"") or not header.count:
                raise ValueError("a datagram message needs a payload of header.count elements")
            size = self.owner.datagrams(header.count) * OVERHEAD + header.length
        else:
            size = HEADER_SIZE + header.length + (DONE_COPIES * OVERHEAD if header.kind is Kind.DONE else 0)
        self.owner._enqueue(self, header, payload)
        return size

    def _pop(self) -> None:
        self.queue.popleft()
        self.done_elements = 0
        if not self.queue:
            self._wake()

    def _discard(self) -> None:
        self.queue.clear()
        self._wake()

    def _wake(self) -> None:
        """Release drain(): the queue is empty, or the link closed."""
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def drain(self) -> None:
        if self.queue and not self._closed:
            if self._idle is None or self._idle.done():
                self._idle = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._idle)
        await self.control.drain()

    @property
    def closed(self) -> bool:
        return self._closed or self.control.closed

    def close(self) -> None:
        self._closed = True  # the flusher drops what is still queued
        self._wake()
        self.control.close()
