"""Dialed TCP links (peers/collective/tcp.py `_Outbound`): close notification (Link.on_close, which
the DeAR engine relies on to fail an op at once when a member it waits for goes), and order."""

from __future__ import annotations

import asyncio

import uvloop

from peerd.peers.collective import TcpTransport
from peerd.peers.collective.transport import FilteredTransport
from peerd.peers.collective.wire import Header, Kind, run_tag

TAG = run_tag("tcp-links-test")


class Collect:
    """A sink that keeps every payload, in arrival order, and notes lost links."""

    def __init__(self):
        self.got: list[tuple[Header, bytes]] = []
        self.lost = 0
        self._buf: memoryview | None = None

    def on_header(self, link, header):
        self._buf = memoryview(bytearray(header.length))
        return self._buf

    def on_payload(self, link, header):
        self.got.append((header, bytes(self._buf)))

    def on_lost(self, link):
        self.lost += 1


def _header(i: int, count: int) -> Header:
    return Header(kind=Kind.CONTRIBUTION, run_tag=TAG, round=i, sender=0, shard=0, count=count)


async def _until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def test_on_close_fires_once_on_peer_close_and_on_local_close():
    async def main():
        receiver, sender = TcpTransport(), TcpTransport()
        address = await receiver.start()
        await sender.start()
        receiver.attach(Collect())
        fired: list[str] = []
        a = await sender.connect(address)
        a.on_close(lambda: fired.append("a"))
        b = await FilteredTransport(sender, lambda addr, h: False).connect(address)  # a wrapped link
        b.on_close(lambda: fired.append("b"))
        a.send(_header(0, 4), memoryview(bytes(16)))
        await a.drain()
        await _until(lambda: len(receiver._inbound) == 2)
        for inbound in list(receiver._inbound):  # the peer closes: a and b learn it without sending
            inbound.close()
        await _until(lambda: len(fired) == 2)
        assert sorted(fired) == ["a", "b"] and a.closed and b.closed
        c = await sender.connect(address)
        c.on_close(lambda: fired.append("c"))
        c.close()
        c.close()
        assert fired.count("c") == 1  # at once, and once
        c.on_close(lambda: fired.append("late"))  # registered on a closed link: called at once
        assert fired[-1] == "late"
        await sender.close()
        await receiver.close()
        await asyncio.sleep(0.05)
        assert sorted(fired) == ["a", "b", "c", "late"]

    uvloop.run(main())


def test_many_messages_of_many_sizes_arrive_in_order():
    async def main():
        receiver, sender = TcpTransport(), TcpTransport()
        address = await receiver.start()
        await sender.start()
        sink = Collect()
        receiver.attach(sink)
        link = await sender.connect(address)
        sizes = [0, 1, 7, 1 << 16, 3, (1 << 20) + 5, 2] * 30
        payloads = [
            bytes((i + j) % 251 for j in range(min(n * 4, 64))) * (n * 4 // 64 + 1) for i, n in enumerate(sizes)
        ]
        payloads = [p[: n * 4] for p, n in zip(payloads, sizes)]
        sent = sum(
            link.send(_header(i, n), memoryview(p) if n else None) for i, (n, p) in enumerate(zip(sizes, payloads))
        )
        assert sent == sender.bytes_sent
        await link.drain()
        await _until(lambda: len(sink.got) == len(sizes), timeout=20)
        assert [h.round for h, _ in sink.got] == list(range(len(sizes)))
        assert [d for _, d in sink.got] == payloads
        await sender.close()
        await receiver.close()

    uvloop.run(main())
