"""libp2p streams between group members, through hivemind's p2pd: the path when direct TCP cannot connect.

A member behind NAT or a firewall cannot be dialed on its engine port, but p2pd can usually reach it
(hole punching, relays, or a connection it already holds for the DHT). Each round's transport
registers a binary stream handler named `peerd/engine/<id>` on the daemon's p2pd; its address is
`<peer ID>/<handler name>`. Messages are framed as on TCP (wire.Header, then the payload), one stream
per ordered pair, written only by the member that opened it.

Costs against direct TCP: every byte crosses two extra unix sockets and p2pd, and payloads are read
into a temporary buffer and copied into the tensor (StreamReader has no readinto). It is the
fallback, not the fast path. Inbound streams come with the sender's libp2p peer ID, authenticated by
libp2p's handshake; the engine still judges every header by itself (the sink).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from hivemind.p2p import P2P, PeerID

from peerd.peers.collective.linkauth import HELLO_SIZE, LinkAuth
from peerd.peers.collective.transport import Action, Link, Sink, Transport
from peerd.peers.collective.wire import HEADER_SIZE, Header, WireError, decode
from peerd.peers.events import PeerEvents

logger = logging.getLogger(__name__)

HANDLER_PREFIX = "peerd/engine/"
READ_BYTES = 1 << 20  # skipped payloads are read and dropped in pieces of at most this size


def split_p2p_address(address: str) -> tuple[str, str]:
    """'<peer ID>/<handler>' -> (peer ID, handler); ValueError if it is not one."""
    peer_id, _, name = address.partition("/")
    if not peer_id or not name.startswith(HANDLER_PREFIX):
        raise ValueError(f"not a libp2p engine address: {address!r}")
    return peer_id, name


class P2PTransport(Transport):
    """Receives on a stream handler of `p2p` named HANDLER_PREFIX + tag; dials others' handlers.

    `tag` must be unique among this daemon's transports that are open at the same time (the
    averager uses its TCP transport's port). Streams that arrive before attach() wait for it."""

    def __init__(self, p2p: P2P, tag: str, *, events: PeerEvents | None = None, auth: LinkAuth | None = None):
        self.p2p, self.name, self.auth = p2p, HANDLER_PREFIX + tag, auth
        self.events = events or PeerEvents()
        self.address = ""
        self.bytes_sent = 0  # headers and payloads handed to p2pd, for per-transport metrics
        self.bytes_received = 0  # headers and payloads read from p2pd
        self._sink: Sink | None = None
        self._attached = asyncio.Event()
        self._links: set[_StreamLink] = set()
        self._inbound: set[_InboundStream] = set()
        self._registered = False
        self._closing = False

    async def start(self) -> str:
        await self.p2p.add_binary_stream_handler(self.name, self._on_stream)
        self._registered = True
        self.address = f"{self.p2p.peer_id.to_base58()}/{self.name}"
        return self.address

    def attach(self, sink: Sink) -> None:
        if self._sink is not None:
            raise RuntimeError("this transport already delivers to a sink")
        self._sink = sink
        self._attached.set()

    async def connect(self, address: str) -> Link:
        peer_id, name = split_p2p_address(address)
        try:
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # p2pd reports an unreachable peer or a missing handler with its own types
            raise OSError(f"libp2p stream to {peer_id[:12]}... failed: {e}") from e
        link = _StreamLink(self, reader, writer)
        self._links.add(link)
        if self.auth is not None:
            writer.write(self.auth.hello(name))
        return link

    async def close(self) -> None:
        self._closing = True
        self._attached.set()  # streams still waiting for a sink give up
        for link in list(self._links):
            link.close()
        for inbound in list(self._inbound):
            inbound.close()
        if self._registered:
            self._registered = False
            with contextlib.suppress(Exception):  # p2pd may already be gone at shutdown
                await self.p2p.remove_binary_stream_handler(self.name)

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        inbound = _InboundStream(self, str(info.peer_id), writer)
        self._inbound.add(inbound)
        try:
            await self._attached.wait()  # bounded by the round: close() sets it
            if not self._closing:
                await inbound.pump(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sender closed or died: on_lost below says so to the sink
        finally:
            self._inbound.discard(inbound)
            inbound.close()
            if self._sink is not None:
                self._sink.on_lost(inbound)


class _StreamLink(Link):
    """A stream this member opened; it only writes."""

    def __init__(self, owner: P2PTransport, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.owner, self.reader, self.writer = owner, reader, writer
        self._closed = False
        # Nothing comes back on a stream we opened: reading it only finds out when the peer (or
        # p2pd) closes it, so that on_close fires then, as it does on TCP.
        self._watch = asyncio.get_running_loop().create_task(self._watch_peer())

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        if self._closed or self.writer.is_closing():
            return 0
        self.writer.write(header.pack())
        if payload is not None and header.length:
            self.writer.write(payload)
        self.owner.bytes_sent += HEADER_SIZE + header.length
        return HEADER_SIZE + header.length

    async def drain(self) -> None:
        if self._closed:
            return
        try:
            await self.writer.drain()
        except ConnectionError:
            self.close()

    async def _watch_peer(self) -> None:
        try:
            if await self.reader.read(1):
                self.owner.events.rejected("wire_unexpected_data")  # a peer that talks back is not one of ours
        except (ConnectionError, OSError):
            pass
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed or self.writer.is_closing()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.owner._links.discard(self)
            self.writer.transport.abort()
            if self._watch is not asyncio.current_task():
                self._watch.cancel()
            self._notify_closed()


class _InboundStream:
    """A stream another member opened: headers and payloads, delivered to the sink as on TCP."""

    def __init__(self, owner: P2PTransport, peer_id: str, writer: asyncio.StreamWriter):
        self.owner, self.peer_id, self.writer = owner, peer_id, writer
        self.member: int | None = None
        self._discard = False
        self._closed = False

    def discard_payload(self) -> None:
        self._discard = True

    async def pump(self, reader: asyncio.StreamReader) -> None:
        sink, auth = self.owner._sink, self.owner.auth
        if auth is not None and not auth.check(await reader.readexactly(HELLO_SIZE), self.owner.name):
            self.owner.events.rejected("wire_bad_hello")
            logger.debug("dropping libp2p stream from %s: bad hello", self.peer_id)
            return
        while not self._closed:
            raw = await reader.readexactly(HEADER_SIZE)
            try:
                header = decode(raw)
            except WireError as e:
                self.owner.events.rejected(e.reason)
                logger.debug("dropping libp2p stream from %s: %s", self.peer_id, e)
                return
            self.owner.bytes_received += HEADER_SIZE
            action = sink.on_header(self, header)
            if action is Action.DROP:
                return
            self._discard = action is Action.SKIP
            remaining = header.length
            if self._discard:
                while remaining:
                    remaining -= len(await reader.readexactly(min(remaining, READ_BYTES)))
            elif remaining:
                if len(action) != header.length:
                    raise ValueError(f"sink gave a {len(action)}-byte buffer for a {header.length}-byte payload")
                data = await reader.readexactly(remaining)
                if self._closed:
                    return  # closed while we waited: the buffer may already serve another engine
                if not self._discard:  # the sink may have taken the buffer back while we waited
                    action[:] = data
            self.owner.bytes_received += header.length
            if not self._discard:
                sink.on_payload(self, header)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.transport.abort()
