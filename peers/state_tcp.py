"""State chunks over direct TCP: the fast path of state sync (peers/statesync.py), p2pd the fallback.

Through p2pd a chunk crosses two unix sockets, p2pd twice and protobuf four times, and is copied
about eight times in Python: 60-90 MB/s between two daemons on loopback, CPU-bound (docs/benchmarks.md,
"A model of real size"). Here the donor writes the snapshot's bytes from the tensor itself and the
fetcher receives them straight into its buffer (sock_recv_into), then hashes them in place.

Frames (protos/state.proto): the fetcher sends a 4-byte little-endian length and a StateChunkRequest
(at most MAX_REQUEST_BYTES); the donor answers a 1-byte StateStatus, a 4-byte little-endian length
and that many bytes of the chunk (0 unless OK). One request at a time per connection; the fetcher
opens one connection per request in flight and reuses it.

The caller's peer ID travels in the request (p2pd is not there to authenticate it): in a secret run
the tag binds it, so a peer without the secret gets nothing. Unlike p2pd, TCP does not encrypt: an
on-path party can read the chunks (and replay a request it saw for the same chunk), as it can read
the engine's rounds over TCP (docs/security.md).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Callable

from google.protobuf.message import DecodeError

from peerd.protos import state_pb2 as pb

MAX_REQUEST_BYTES = 1024  # a chunk request is about 350 bytes with a tag and a caller ID
IDLE_TIMEOUT = 60.0  # seconds a donor keeps a connection that sends no request
WRITE_TIMEOUT = 30.0  # seconds a donor waits for a fetcher to take one chunk's bytes
HEAD_BYTES = 5  # status (1) + length (4)


def parse_address(address: str) -> tuple[str, int] | None:
    """('host', port) of a 'host:port' (IPv6 in brackets), or None if it is not one."""
    host, _, port = address.rpartition(":")
    if not host or len(address) > 300 or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


Answer = Callable[[pb.StateChunkRequest], tuple[int, memoryview | None]]


async def serve_connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answer: Answer, rejected
) -> None:
    """Answer one fetcher's chunk requests until it closes, idles IDLE_TIMEOUT s or sends garbage
    (counted as state_malformed; a stream that does not parse cannot find its next frame)."""
    try:
        while True:
            async with asyncio.timeout(IDLE_TIMEOUT):
                size = int.from_bytes(await reader.readexactly(4), "little")
                if size > MAX_REQUEST_BYTES:
                    rejected("state_malformed")
                    return
                body = await reader.readexactly(size)
            try:
                request = pb.StateChunkRequest.FromString(body)
            except DecodeError:
                rejected("state_malformed")
                return
            status, data = answer(request)
            writer.write(bytes([status]) + (len(data) if data is not None else 0).to_bytes(4, "little"))
            if data is not None:
                writer.write(data)  # the snapshot's own bytes: no copy unless the socket is full
            async with asyncio.timeout(WRITE_TIMEOUT):
                await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


class TcpLink:
    """One connection to a donor's chunk listener; ask() one request at a time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    @classmethod
    async def open(cls, host: str, port: int) -> TcpLink:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def ask(self, request: bytes, into: memoryview) -> tuple[int, int]:
        """Send `request`; returns (status, length). The chunk's bytes land in `into` when the status
        is OK and the length is len(into); otherwise they are left unread (close the link then).
        Raises OSError or EOFError when the connection fails (close it then too)."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, len(request).to_bytes(4, "little") + request)
        head = memoryview(bytearray(HEAD_BYTES))
        await self._fill(head)
        status, size = head[0], int.from_bytes(head[1:], "little")
        if status == pb.STATE_STATUS_OK and size == len(into):
            await self._fill(into)
        return status, size

    async def _fill(self, view: memoryview) -> None:
        loop, got = asyncio.get_running_loop(), 0
        while got < len(view):
            n = await loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise EOFError("the donor closed the connection")
            got += n

    def close(self) -> None:
        self.sock.close()
