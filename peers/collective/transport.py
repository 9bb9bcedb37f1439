"""What the collective engine needs from a transport, and nothing about how one works.

A transport moves framed messages (a `wire.Header` plus its payload) between group members. The
engine never touches sockets: it sends through `Link`s it asked for by address, and receives by
being the transport's `Sink`. For each incoming header the sink says where its payload goes: a
writable buffer of exactly `header.length` bytes (so a transport can receive straight into the
tensor it belongs to), SKIP (read and discard it) or DROP (close that connection). A stream
transport (tcp.py direct TCP, p2p.py libp2p streams, fallback.py one of the two per link) delivers whole
messages in order per connection; a datagram transport (udp.py) delivers packets, with
`header.offset` saying where each one goes.

`FilteredTransport` is the seam through which tests and emulations lose messages by rule.
"""

from __future__ import annotations

import abc
import enum
from typing import Callable, Protocol

from peerd.peers.collective.wire import Header


class Action(enum.Enum):
    SKIP = "skip"  # read the payload and throw it away; the connection stays up
    DROP = "drop"  # close the connection: its sender is broken or not one of ours


class Inbound(Protocol):
    """One incoming connection, as the sink sees it."""

    member: int | None  # the group member this connection speaks for; set by the sink

    def discard_payload(self) -> None:
        """Throw away the rest of the payload being received (its buffer is no longer the sink's to fill)."""

    def close(self) -> None: ...


class Sink(Protocol):
    """Where a transport delivers what it receives (the engine). Called on the event loop."""

    def on_header(self, link: Inbound, header: Header) -> memoryview | Action: ...

    def on_payload(self, link: Inbound, header: Header) -> None: ...

    def on_lost(self, link: Inbound) -> None: ...


class Link(abc.ABC):
    """An outgoing connection to one member. Sends never block: they queue; drain() waits.

    A dialed link only writes, so its owner would learn that it closed only by asking (`closed`);
    `on_close` tells it instead. Implementations call `_notify_closed()` once they are closed, for
    any reason: the peer closed or reset it, a send failed, or `close()` was called."""

    _close_callbacks: list[Callable[[], None]] | None = None
    _close_notified = False

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call callback() (on the event loop) once, when this link closes; at once if it already is."""
        if self._close_notified or self.closed:
            callback()
            return
        if self._close_callbacks is None:
            self._close_callbacks = []
        self._close_callbacks.append(callback)

    def _notify_closed(self) -> None:
        """Run the on_close callbacks, once. Implementations call it on the event loop when they close."""
        if self._close_notified:
            return
        self._close_notified = True
        callbacks, self._close_callbacks = self._close_callbacks or [], None
        for callback in callbacks:
            callback()

    @abc.abstractmethod
    def send(self, header: Header, payload: memoryview | None = None) -> int:
        """Queue one message; returns the bytes queued (0 if the link is closed or the message dropped).

        The payload buffer is sent from where it lies, without a copy: it must not change until
        drain() returns or the link is closed."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Return once everything queued has been handed to the network (or the link closed)."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Close at once, discarding whatever is still queued."""


class Transport(abc.ABC):
    @abc.abstractmethod
    async def start(self) -> str:
        """Start listening; returns the address other members connect to."""

    @abc.abstractmethod
    def attach(self, sink: Sink) -> None:
        """Deliver incoming messages to sink. Connections that arrive before this wait for it."""

    @abc.abstractmethod
    async def connect(self, address: str) -> Link:
        """Open a link to a member's address; raises OSError if it cannot. The caller bounds the time."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class FilteredTransport(Transport):
    """Wraps a transport; messages for which drop(address, header) is true are silently not sent."""

    def __init__(self, inner: Transport, drop: Callable[[str, Header], bool]):
        self.inner, self.drop = inner, drop

    async def start(self) -> str:
        return await self.inner.start()

    def attach(self, sink: Sink) -> None:
        self.inner.attach(sink)

    async def connect(self, address: str) -> Link:
        return _FilteredLink(await self.inner.connect(address), lambda header: self.drop(address, header))

    async def close(self) -> None:
        await self.inner.close()


class WrappedLink(Link):
    """A link that changes what `send` does and hands everything else to the link it wraps."""

    def __init__(self, inner: Link):
        self.inner = inner

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        return self.inner.send(header, payload)

    async def drain(self) -> None:
        await self.inner.drain()

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def close(self) -> None:
        self.inner.close()

    def on_close(self, callback: Callable[[], None]) -> None:
        self.inner.on_close(callback)  # the wrapped link is the one that closes


class _FilteredLink(WrappedLink):
    def __init__(self, inner: Link, drop: Callable[[Header], bool]):
        super().__init__(inner)
        self.drop = drop

    def send(self, header: Header, payload: memoryview | None = None) -> int:
        return 0 if self.drop(header) else self.inner.send(header, payload)


class Shared:
    """One started transport for several engines of one group at once, each under a run tag of its
    own (its Group's run_id): ARC-Top-K's round runs the sketch's engine and the rows' engine on the
    one listener the group was formed with (arctopk_round.py). `view(tag)` is the transport an engine
    is given: its `attach` registers the engine's sink for that tag; once every engine is built,
    `open()` attaches this router to the transport (connections that arrived before wait for it, and
    a faster member's may already have), and every message goes to the sink of its header's run tag
    (a tag of none: the first sink's, whose rule refuses and counts it), and a connection that is
    lost, to every sink that had a message of it. The owner closes the transport."""

    def __init__(self, inner: Transport):
        self.inner = inner
        self.sinks: dict[bytes, Sink] = {}
        self._seen: dict[Inbound, list[Sink]] = {}

    def open(self) -> None:
        """Deliver to the sinks registered by now (every engine's: call it once they are built)."""
        if not self.sinks:
            raise RuntimeError("no engine is attached to this shared transport")
        self.inner.attach(self)

    def view(self, tag: bytes, dial: Transport | None = None) -> Transport:
        """The transport of the engine whose Group has run tag `tag`; it dials through `dial` (a
        loss-tolerant round's reliable control transport, for an engine whose messages must all
        arrive), else through the shared transport. Its other attributes are the shared one's."""
        return _View(self, tag, dial or self.inner)

    def _sink(self, link: Inbound, header: Header) -> Sink:
        sink = self.sinks.get(header.run_tag) or next(iter(self.sinks.values()))
        seen = self._seen.setdefault(link, [])
        if sink not in seen:
            seen.append(sink)
        return sink

    def on_header(self, link: Inbound, header: Header) -> memoryview | Action:
        return self._sink(link, header).on_header(link, header)

    def on_payload(self, link: Inbound, header: Header) -> None:
        self._sink(link, header).on_payload(link, header)

    def on_lost(self, link: Inbound) -> None:
        for sink in self._seen.pop(link, None) or list(self.sinks.values())[:1]:
            sink.on_lost(link)


class _View(Transport):
    def __init__(self, shared: Shared, tag: bytes, dial: Transport):
        self.shared, self.tag, self.dial = shared, tag, dial

    def __getattr__(self, name: str):  # packet_elements, datagrams, ...: the shared transport's
        return getattr(self.shared.inner, name)

    async def start(self) -> str:
        raise RuntimeError("a shared transport is started by its owner")

    def attach(self, sink: Sink) -> None:
        if self.tag in self.shared.sinks:
            raise RuntimeError("this run tag already has a sink")
        self.shared.sinks[self.tag] = sink

    async def connect(self, address: str) -> Link:
        return await self.dial.connect(address)

    async def close(self) -> None:
        """Nothing: the transport is its owner's to close."""
