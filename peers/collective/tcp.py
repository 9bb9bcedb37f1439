"""Direct TCP between group members: one persistent connection per ordered pair, zero-copy both ways.

Sending: a message is handed to the event loop's transport as (header bytes, payload memoryview);
uvloop keeps a reference to the payload and writes from it, so nothing is copied in user space.
Receiving: `_Inbound` is a BufferedProtocol: the kernel copies each payload straight into the
buffer the sink chose (a slice of a preallocated tensor); headers go into a 72-byte buffer, and
skipped payloads into one scratch buffer shared by every connection (its contents are never read).

Each member dials every other member and only ever writes on the connections it dialed, so there
is no tie-breaking between simultaneous connects. A header that does not decode ends its
connection: after garbage, a stream cannot find the next header again.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from peerd.peers.collective.linkauth import HELLO_SIZE, LinkAuth
from peerd.peers.collective.transport import Action, Link, Sink, Transport
from peerd.peers.collective.wire import HEADER_SIZE, Header, WireError, decode
from peerd.peers.events import PeerEvents

logger = logging.getLogger(__name__)

SCRATCH_BYTES = 1 << 20  # where skipped payloads are read to; larger means fewer reads per skip


def _tune(sock: socket.socket | None, buffer_bytes: int | None) -> None:
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # headers and verdicts go out at once
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


class TcpTransport(Transport):
    """Listens on host:port (port 0: the OS picks one; `start()` returns the real address).

    socket_buffer: SO_SNDBUF/SO_RCVBUF in bytes, or None (the default) to leave the kernel's
    autotuning on. Setting it turns autotuning off, so it only helps when it is at least what
    autotuning reaches (here up to 4 MiB to send, 32 MiB to receive): on loopback, 4 MiB measured
    no faster than autotuning.

    auth: in a secret run, every link starts with a hello proving the dialer holds the secret
    (linkauth.py); inbound links with a bad one are closed before anything reaches the sink.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        events: PeerEvents | None = None,
        socket_buffer: int | None = None,
        auth: LinkAuth | None = None,
    ):
        self.host, self.port, self.socket_buffer, self.auth = host, port, socket_buffer, auth
        self.events = events or PeerEvents()
        self.address = ""
        self.bytes_sent = 0  # headers and payloads queued on dialed connections, for per-transport metrics
        self.bytes_received = 0  # bytes read from accepted connections, skipped payloads included
        self._sink: Sink | None = None
        self._server: asyncio.Server | None = None
        self._inbound: set[_Inbound] = set()
        self._outbound: set[_Outbound] = set()
        self.scratch = memoryview(bytearray(SCRATCH_BYTES))

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _tune(sock, self.socket_buffer)  # set before listen(): accepted sockets inherit it, window scaling included
        sock.bind((self.host, self.port))
        self._server = await loop.create_server(lambda: _Inbound(self), sock=sock, backlog=128)
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    def attach(self, sink: Sink) -> None:
        if self._sink is not None:
            raise RuntimeError("this transport already delivers to a sink")
        self._sink = sink
        for link in list(self._inbound):
            link.resume()

    async def connect(self, address: str) -> Link:
        host, port = split_address(address)
        loop = asyncio.get_running_loop()
        hello = self.auth.hello(str(port)) if self.auth else b""
        _, link = await loop.create_connection(lambda: _Outbound(self, hello), host, port)
        return link

    async def close(self) -> None:
        for link in [*self._inbound, *self._outbound]:
            link.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class _Outbound(asyncio.Protocol, Link):
    """A connection this member dialed; it only writes. drain() waits for the write buffer to empty."""

    def __init__(self, owner: TcpTransport, hello: bytes):
        self.owner, self.hello = owner, hello
        self.transport: asyncio.Transport | None = None
        self._drained: asyncio.Future | None = None
        self._closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        _tune(transport.get_extra_info("socket"), self.owner.socket_buffer)
        # low = high = 0: pause_writing() fires as soon as anything is queued, resume_writing() when
        # the queue is empty again; that is exactly the "drained" edge drain() waits for.
        transport.set_write_buffer_limits(high=0, low=0)
        self.owner._outbound.add(self)
        if self.hello:
            transport.write(self.hello)

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self._closed:
            return 0
        if payload is None or not header.length:
            self.transport.write(header.pack())
        else:
            self.transport.writelines((header.pack(), payload))
        self.owner.bytes_sent += HEADER_SIZE + header.length
        return HEADER_SIZE + header.length

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        if not self._closed and self._drained is not None and not self._drained.done():
            await asyncio.shield(self._drained)

    def data_received(self, data: bytes) -> None:
        # Nothing is ever sent back on a dialed connection; a peer that does is not speaking our protocol.
        self.owner.events.rejected("wire_unexpected_data")
        self.close()

    def connection_lost(self, exc) -> None:
        self._closed = True
        self.owner._outbound.discard(self)
        self.resume_writing()
        self._notify_closed()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.abort()
            self._notify_closed()


_HEADER, _PAYLOAD, _SKIP, _HELLO = range(4)


class _Inbound(asyncio.BufferedProtocol):
    """A connection another member (or anyone) dialed: a header, then its payload where the sink says."""

    def __init__(self, owner: TcpTransport):
        self.owner = owner
        self.member: int | None = None
        self.transport: asyncio.Transport | None = None
        self._head = memoryview(bytearray(HEADER_SIZE))
        self._header: Header | None = None
        self._dest = self._head  # where the bytes of the current header or payload go (unused when skipping)
        self._state, self._filled, self._want = _HEADER, 0, HEADER_SIZE
        if owner.auth is not None:  # a hello first; the header buffer is large enough for it
            self._state, self._want = _HELLO, HELLO_SIZE
        self._pending: Header | None = None  # a header that arrived before attach(); judged by resume()
        self._closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        _tune(transport.get_extra_info("socket"), self.owner.socket_buffer)
        self.owner._inbound.add(self)
        if self.owner._sink is None:
            transport.pause_reading()  # resumed by attach(): nothing is read before someone can judge it

    def resume(self) -> None:
        if self._pending is not None:
            header, self._pending = self._pending, None
            self._begin(header)
        if not self._closed:
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == _SKIP:
            return self.owner.scratch[: min(len(self.owner.scratch), self._want - self._filled)]
        return self._dest[self._filled : self._want]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self.owner.bytes_received += nbytes
        if self._filled < self._want or self._closed:
            return
        if self._state == _HELLO:
            if not self.owner.auth.check(self._head[:HELLO_SIZE], str(self.transport.get_extra_info("sockname")[1])):
                self.owner.events.rejected("wire_bad_hello")
                logger.debug("dropping connection from %s: bad hello", self._peer())
                self.close()
                return
            self._expect(_HEADER, None, self._head, HEADER_SIZE)
        elif self._state == _HEADER:
            try:
                header = decode(self._head)
            except WireError as e:
                self.owner.events.rejected(e.reason)
                logger.debug("dropping connection from %s: %s", self._peer(), e)
                self.close()
                return
            if self.owner._sink is None:
                # uvloop ignores pause_reading() inside connection_made for a server-side protocol, so
                # bytes can arrive before attach(); inside a read callback pausing does take effect.
                self._pending = header
                self.transport.pause_reading()
                return
            self._begin(header)
        else:
            header, skipped = self._header, self._state == _SKIP
            self._expect(_HEADER, None, self._head, HEADER_SIZE)
            if not skipped:
                self.owner._sink.on_payload(self, header)

    def _begin(self, header: Header) -> None:
        action = self.owner._sink.on_header(self, header)
        if action is Action.DROP:
            self.close()
        elif not header.length:
            self._expect(_HEADER, None, self._head, HEADER_SIZE)
            if action is not Action.SKIP:
                self.owner._sink.on_payload(self, header)
        elif action is Action.SKIP:
            self._expect(_SKIP, header, self._head, header.length)
        elif len(action) != header.length:
            raise ValueError(f"sink gave a {len(action)}-byte buffer for a {header.length}-byte payload")
        else:
            self._expect(_PAYLOAD, header, action, header.length)

    def discard_payload(self) -> None:
        if self._state == _PAYLOAD:
            self._expect(_SKIP, self._header, self._head, self._want - self._filled)

    def _expect(self, state: int, header: Header | None, dest: memoryview, want: int) -> None:
        self._state, self._header, self._dest, self._want, self._filled = state, header, dest, want, 0

    def _peer(self) -> str:
        return str(self.transport.get_extra_info("peername")) if self.transport else "?"

    def connection_lost(self, exc) -> None:
        self._closed = True
        self.owner._inbound.discard(self)
        if self.owner._sink is not None:
            self.owner._sink.on_lost(self)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.abort()
