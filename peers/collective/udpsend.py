"""The sending side of the UDP transport: per-link queues, taken in turn, cut into datagrams, paced.

One queue per link, drained by one task that takes one batch (at most 64 KiB) from each link in
turn, so every destination gets an even share instead of bursts (three members sending a whole
chunk to one owner at once would overflow its downlink). A link sends its messages in the order
they were queued; a DONE leaves only after the datagrams queued before it were handed to the kernel.

Pacing, so that peerd does not cause its own loss: a token bucket at `rate_bps` (bits/s, may be
changed at any time). Unpaced (None), the transport keeps its send buffer small: datagrams waiting
in a local qdisc count against it, so a full one makes the sender wait (for writability) instead of
the qdisc dropping, which paces to a bottleneck on the first hop (e.g. a shaped veth); a bottleneck
further away only `rate_bps`, the measured or configured link rate, protects.

GSO (`gso=True`): up to 64 datagrams per syscall (UDP_SEGMENT, about 3x the send rate here). On
loopback and veth a GSO batch travels as one packet, so netem or nftables drops it whole: emulated
loss becomes bursts of up to 64 datagrams. `drop(address, header)` is the seam through which tests
and benchmarks lose datagrams by rule; a datagram it drops stands for one lost on the path and
counts as sent.

Compressed payloads (codec.py): a message's header says its format; it is cut into datagrams of
as many values as fit in the bytes of `packet_elements` float32 ones (`packet_stride`: whole int8
blocks of 64), so that a lost datagram spoils only its own blocks. GSO applies to float32 messages
only (the socket's segment size is the float32 datagram's).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from typing import Callable

from peerd.peers.collective.datagram import MAX_DATAGRAM, OVERHEAD, DatagramCodec
from peerd.peers.collective.transport import Link, WrappedLink
from peerd.peers.collective.wire import HEADER_SIZE, DType, Header, Kind, payload_fit, payload_size
from peerd.peers.events import PeerEvents

logger = logging.getLogger(__name__)

DONE_COPIES = 2  # datagram copies of each DONE, besides the one over the reliable transport
YIELD_BYTES = 256 << 10  # unpaced, the sender yields to the loop after this many bytes (receives run)
WRITABLE_TIMEOUT = 1.0  # seconds a full send buffer may take to drain before a batch is given up
GSO_SEGMENTS = 64  # UDP_MAX_SEGMENTS of older kernels
DATA_KINDS = (Kind.CONTRIBUTION, Kind.RESULT)


def packet_stride(packet_elements: int, dtype: DType) -> int:
    """Values per datagram of a message in `dtype` (the packet grid's stride), when a float32
    datagram holds `packet_elements`: as many as fit in the same bytes, whole int8 blocks."""
    return packet_elements if dtype is DType.FLOAT32 else payload_fit(dtype, 4 * packet_elements)


class PacedSender:
    """Sends what DatagramLinks queue on one socket (set by the transport once it is bound)."""

    def __init__(
        self,
        codec: DatagramCodec,
        packet_elements: int,
        *,
        rate_bps: float | None,
        gso: bool,
        events: PeerEvents,
        drop: Callable[[str, Header], bool] | None,
    ):
        self.codec, self.packet_elements, self.rate_bps, self.gso = codec, packet_elements, rate_bps, gso
        self.events, self.drop = events, drop
        self.full_size = OVERHEAD + 4 * packet_elements  # every datagram of a message but its last
        self.sock: socket.socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.packets_sent = self.bytes_sent = 0
        self._ready: collections.deque[DatagramLink] = collections.deque()  # links with something queued, in turn
        self._flusher: asyncio.Task | None = None
        self._tokens, self._stamp = 0.0, 0.0
        self._buf = memoryview(bytearray(MAX_DATAGRAM + 1))

    def datagrams(self, count: int, dtype: DType = DType.FLOAT32) -> int:
        """Datagrams a message of `count` elements in `dtype` travels in."""
        return max(1, -(-count // packet_stride(self.packet_elements, dtype)))

    def enqueue(self, link: DatagramLink, header: Header, payload: memoryview | None) -> None:
        if not link.queue:
            self._ready.append(link)
        link.queue.append((header, payload))
        if self._flusher is None:
            self._flusher = self.loop.create_task(self._flush())

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
        for link in self._ready:
            link.discard()
        self._ready.clear()

    async def _flush(self) -> None:
        """Send what the links queued: a batch of one link's head message per turn, links in turn."""
        since_yield = 0
        try:
            while self._ready:
                link = self._ready.popleft()
                if link._closed:
                    link.discard()
                    continue
                h, payload = link.queue[0]
                if h.kind in DATA_KINDS:
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
                if h.kind not in DATA_KINDS or link.done_elements >= h.count:
                    link.pop()
                if link.queue:
                    self._ready.append(link)
        finally:
            self._flusher = None

    def _batch(self, link: DatagramLink, h: Header, payload: memoryview) -> tuple[int, list[tuple[int, int]]]:
        """Seal the next datagrams of the link's head message into the send buffer: (bytes,
        [(start, size)]), as many as one UDP_SEGMENT send takes (sent one by one without GSO)."""
        stride, buf, dtype = packet_stride(self.packet_elements, h.dtype), self._buf, h.dtype
        full = OVERHEAD + payload_size(dtype, stride)  # a message's datagrams but its last
        limit = min(GSO_SEGMENTS * self.full_size, MAX_DATAGRAM)
        pos, segments = 0, []
        while link.done_elements < h.count and pos + self.full_size <= limit:
            e0 = link.done_elements
            e1 = min(e0 + stride, h.count)
            link.done_elements = e1
            if self.drop is not None and self._dropped(link, h._replace(offset=h.offset + e0, count=e1 - e0)):
                continue
            if dtype is DType.FLOAT32:
                size = self.codec.seal_into(buf, pos, h, h.offset + e0, payload[e0 * 4 : e1 * 4])
            else:
                piece = payload[payload_size(dtype, e0) : payload_size(dtype, e1)]
                size = self.codec.seal_into(buf, pos, h, h.offset + e0, piece, e1 - e0)
            segments.append((pos, size))
            pos += size
            if size < full:
                break  # a short datagram can only be the last segment of a GSO send
        return pos, segments

    def _copies(self, link: DatagramLink, h: Header, copies: int) -> tuple[int, list[tuple[int, int]]]:
        """Seal `copies` datagrams of a message without payload (DONE) into the send buffer."""
        segments, pos = [], 0
        for _ in range(copies):
            if self._dropped(link, h):
                continue
            segments.append((pos, self.codec.seal_into(self._buf, pos, h, h.offset, memoryview(b""))))
            pos += OVERHEAD
        return pos, segments

    def _dropped(self, link: DatagramLink, h: Header) -> bool:
        if self.drop is None or not self.drop(link.address, h):
            return False
        self.packets_sent += 1
        self.events.packets_sent(1)
        return True

    async def _pace(self, nbytes: int) -> None:
        """Token bucket: at most a 2 ms (and 64 KiB) burst above rate_bps."""
        rate, now = self.rate_bps / 8, self.loop.time()
        burst = max(rate * 0.002, 1 << 16)
        self._tokens, self._stamp = min(burst, self._tokens + (now - self._stamp) * rate), now
        if self._tokens < nbytes:
            await asyncio.sleep((nbytes - self._tokens) / rate)
            now = self.loop.time()
            self._tokens, self._stamp = self._tokens + (now - self._stamp) * rate, now
        self._tokens -= nbytes

    async def _transmit(self, link: DatagramLink, nbytes: int, segments: list[tuple[int, int]]) -> None:
        if not segments or link._closed:
            return
        gso = self.gso and len(segments) > 1 and segments[0][1] == self.full_size
        for start, size in [(0, nbytes)] if gso else segments:
            for _ in range(2):  # the second try after the send buffer had room again
                try:
                    self.sock.sendto(self._buf[start : start + size], link.addr)
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
        ready = self.loop.create_future()
        self.loop.add_writer(self.sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            async with asyncio.timeout(WRITABLE_TIMEOUT):
                await ready
            return True
        except TimeoutError:
            return False
        finally:
            self.loop.remove_writer(self.sock.fileno())


class DatagramLink(Link):
    """A link of the UDP transport: data kinds as datagrams to `addr`, everything else over the
    member's control link (DONE both ways), all in the order queued."""

    def __init__(self, sender: PacedSender, addr: tuple, address: str, control: Link):
        self.sender, self.addr, self.address, self.control = sender, addr, address, control
        self.queue: collections.deque[tuple[Header, memoryview | None]] = collections.deque()
        self.done_elements = 0  # of the message at the head of the queue, already sent
        self._idle: asyncio.Future | None = None
        self._closed = False

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self.closed:
            return 0
        if header.kind in DATA_KINDS:
            if header.length > len(payload or b"") or not header.count:
                raise ValueError("a datagram message needs a payload of header.count elements")
            size = self.sender.datagrams(header.count, header.dtype) * OVERHEAD + header.length
        else:
            size = HEADER_SIZE + header.length + (DONE_COPIES * OVERHEAD if header.kind is Kind.DONE else 0)
        self.sender.enqueue(self, header, payload)
        return size

    def pop(self) -> None:
        self.queue.popleft()
        self.done_elements = 0
        if not self.queue:
            self._wake()

    def discard(self) -> None:
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
        self._closed = True  # the sender drops what is still queued
        self._wake()
        self.control.close()

    def on_close(self, callback) -> None:
        self.control.on_close(callback)  # close() closes the control link, and `closed` follows it


class StreamPacketLink(WrappedLink):
    """A link of the UDP transport whose data goes over the member's reliable link instead (its UDP
    path failed the probe, or `--transport reliable`): each data message is cut into the same
    packets as datagrams would be (the packet grid is part of the wire contract), sent in order and
    never lost; DONE goes once, behind the data. The receiving inbox checks them as datagrams."""

    def __init__(self, control: Link, packet_elements: int, address: str):
        super().__init__(control)
        self.packet_elements, self.address = packet_elements, address

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self.closed:
            return 0
        if header.kind not in DATA_KINDS:
            return self.inner.send(header, payload)
        if header.length > len(payload or b"") or not header.count:
            raise ValueError("a data message needs a payload of header.count elements")
        size, dtype = 0, header.dtype
        stride = packet_stride(self.packet_elements, dtype)
        for e0 in range(0, header.count, stride):
            e1 = min(e0 + stride, header.count)
            piece = payload[payload_size(dtype, e0) : payload_size(dtype, e1)]
            size += self.inner.send(header._replace(offset=header.offset + e0, count=e1 - e0), piece)
        return size
