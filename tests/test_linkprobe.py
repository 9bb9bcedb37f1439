"""Link probes over real UDP sockets on loopback: what passes, what fails, what is refused."""

from __future__ import annotations

import asyncio
import collections
import socket

import pytest

from peers.events import PeerEvents
from peers.linkprobe import FORMAT, MAGIC, PROBE_COUNT, SIZE, VERSION, ECHO, LinkProber


def _counting():
    rejected: collections.Counter[str] = collections.Counter()
    probes = collections.Counter()
    events = PeerEvents(
        packet_rejected=lambda r: rejected.update([r]),
        link_probes=lambda answered, lost: probes.update(answered=answered, lost=lost),
    )
    return events, rejected, probes


def test_a_clean_link_passes_with_no_loss_and_a_closed_port_fails():
    async def main():
        events, rejected, probes = _counting()
        a, b = LinkProber(events=events), LinkProber(events=events)
        await a.start(), await b.start()
        try:
            stats = await a.measure("b", b.address)
            assert stats.passes and stats.last_loss == 0 and 0 < stats.rtt < 0.1, stats
            assert a.passes("b") and not a.passes("nobody")
            # A port where nothing answers (UDP blocked, or no prober): every probe is lost.
            closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
            closed.close()
            stats = await a.measure("c", f"127.0.0.1:{port}", wait=0.2)
            assert not stats.passes and stats.last_loss == 1 and not a.passes("c")
            assert probes == {"answered": PROBE_COUNT, "lost": PROBE_COUNT}
            assert not rejected
            with pytest.raises(ValueError, match="not host:port"):
                await a.measure("d", "no-port-here")
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_a_lossy_link_still_passes_and_its_loss_is_measured():
    """The answering side drops every second probe (as a path losing half of them would): the link
    passes (the loss-tolerant engine is made for it) and the loss reads 50 %."""

    async def main():
        a, b = LinkProber(), LinkProber()
        await a.start(), await b.start()
        seen = 0
        original = b._received

        def lossy(data, addr, at):
            nonlocal seen
            seen += 1
            if seen % 2:
                original(data, addr, at)

        b._received = lossy
        try:
            stats = await a.measure("b", b.address, wait=0.2)
            assert stats.passes and stats.last_loss == pytest.approx(0.5), stats
        finally:
            a.close(), b.close()

    asyncio.run(main())


def test_garbage_forged_echoes_and_floods_are_refused_and_counted():
    async def main():
        events, rejected, _ = _counting()
        a = LinkProber(events=events, echo_rate=100.0)
        await a.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.sendto(b"x" * 10, ("127.0.0.1", a.port))  # wrong size
            sock.sendto(b"NOPE".ljust(SIZE, b"\0"), ("127.0.0.1", a.port))  # not a probe
            forged = FORMAT.pack(MAGIC, VERSION, ECHO, b"12345678", 0, 0.0).ljust(SIZE, b"\0")
            sock.sendto(forged, ("127.0.0.1", a.port))  # an echo of nothing a sent
            await asyncio.sleep(0.2)
            assert rejected == {"probe_bad_size": 1, "probe_bad_header": 1, "probe_unexpected_echo": 1}
            # A flood of valid probes is answered up to the echo rate, the rest counted, not answered.
            probe = FORMAT.pack(MAGIC, VERSION, 1, b"abcdefgh", 0, 0.0).ljust(SIZE, b"\0")
            for _ in range(400):
                try:
                    sock.sendto(probe, ("127.0.0.1", a.port))
                except BlockingIOError:
                    await asyncio.sleep(0.001)
            await asyncio.sleep(0.2)
            echoes = 0
            while True:
                try:
                    sock.recv(100)
                    echoes += 1
                except BlockingIOError:
                    break
            # A burst of 100 and 100 a second: at most about 150 echoes in this half second.
            assert rejected["probe_rate_limited"] > 0 and echoes <= 150, (echoes, rejected)
            assert echoes + rejected["probe_rate_limited"] <= 400
        finally:
            sock.close()
            a.close()

    asyncio.run(main())
