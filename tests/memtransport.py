"""A stream transport in memory, for the engine's tests on virtual time (bench/vclock.py).

Members of one `Hub` reach each other by address ("mem:0", "mem:1", ...). A link delivers its
messages in order, each on a later turn of the loop, through the sink's contract as a stream
transport would: on_header says where the payload goes (a buffer, SKIP or DROP), the payload is
copied there, then on_payload. Nothing waits on a socket, so on virtual time a round's timeouts
decide instantly and exactly. What a real transport adds (partial reads, back-pressure, a kernel's
buffers) is tests/test_collective.py's business over TCP.
"""

from __future__ import annotations

import asyncio

from peerd.peers.collective.transport import Action, Link, Sink, Transport
from peerd.peers.collective.wire import HEADER_SIZE, Header


class Hub:
    """The address space: one MemoryTransport per address."""

    def __init__(self) -> None:
        self.transports: dict[str, MemoryTransport] = {}

    def transport(self) -> MemoryTransport:
        t = MemoryTransport(self, f"mem:{len(self.transports)}")
        self.transports[t.address] = t
        return t


class MemoryTransport(Transport):
    def __init__(self, hub: Hub, address: str):
        self.hub, self.address = hub, address
        self.sink: Sink | None = None
        self.closed = False
        self.inbound: list[_Inbound] = []

    async def start(self) -> str:
        return self.address

    def attach(self, sink: Sink) -> None:
        self.sink = sink

    async def connect(self, address: str) -> Link:
        peer = self.hub.transports.get(address)
        if peer is None or peer.closed:
            raise ConnectionRefusedError(f"nobody at {address}")
        inbound = _Inbound(peer)
        peer.inbound.append(inbound)
        link = _MemoryLink(inbound)
        inbound.link = link
        return link

    async def close(self) -> None:
        """As a process that exits: every connection to or from it closes."""
        self.closed = True
        for inbound in self.inbound:
            inbound.link.close()


class _Inbound:
    """The receiving end of one link, as the sink sees it (transport.Inbound)."""

    def __init__(self, transport: MemoryTransport):
        self.transport, self.member, self.link = transport, None, None
        self.ended = False  # nothing more is delivered; on_lost was called or is on its way

    def discard_payload(self) -> None:  # payloads arrive whole, within one call: nothing is half-received
        pass

    def close(self) -> None:
        """The receiver drops the connection: nothing more arrives, and its sender's link closes."""
        self.end()
        self.link.close()

    def deliver(self, header: Header, payload: bytes) -> None:
        sink = self.transport.sink
        if self.ended or sink is None:
            return
        dest = sink.on_header(self, header)
        if dest is Action.DROP:
            self.close()
        elif dest is not Action.SKIP:
            if len(dest) != len(payload):
                raise ValueError(f"sink gave a {len(dest)}-byte buffer for a {len(payload)}-byte payload")
            dest[:] = payload
            sink.on_payload(self, header)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            asyncio.get_running_loop().call_soon(self._lost)

    def _lost(self) -> None:
        if self.transport.sink is not None:
            self.transport.sink.on_lost(self)


class _MemoryLink(Link):
    def __init__(self, inbound: _Inbound):
        self.inbound, self._closed = inbound, False

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self._closed:
            return 0
        data = bytes(payload) if payload is not None else b""  # the caller may reuse its buffer after drain
        asyncio.get_running_loop().call_soon(self.inbound.deliver, header, data)
        return HEADER_SIZE + len(data)

    async def drain(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            asyncio.get_running_loop().call_soon(self.inbound.end)  # after what was sent before it
            self._notify_closed()
