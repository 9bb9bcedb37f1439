"""The reliable path's links: the libp2p fallback for members that cannot be dialed directly, and the
hello that keeps parties without the run's secret off a secret run's links.

Real p2pd nodes and TCP on loopback. A member that is "behind a firewall" advertises a TCP address
nobody listens on (connection refused, the seam), so the others reach it through its libp2p handler.
"""

from __future__ import annotations

import asyncio
import socket

import torch

from peerd.peers.collective import AllReduceSettings, Group, GroupAllReduce, TcpTransport
from peerd.peers.collective.fallback import FallbackTransport, member_address
from peerd.peers.collective.linkauth import HELLO_SIZE, LinkAuth
from peerd.peers.collective.p2p import P2PTransport
from peerd.peers.collective.wire import HEADER_SIZE, Header, Kind, run_tag
from peerd.peers.events import PeerEvents
from tests.helpers import peer_nodes

RUN = "fallback-test"
SETTINGS = AllReduceSettings(
    connect_timeout=3.0, contribute_timeout=4.0, gather_timeout=8.0, verdict_timeout=1.0, drain_timeout=1.0
)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def reduce_over(
    nodes,
    *,
    unreachable: set[int],
    mode: str = "auto",
    numel: int = 300_000,
    rejected=None,
    auth: LinkAuth | None = None,
):
    """One all-reduce among the nodes' members; members in `unreachable` advertise a dead TCP port."""
    events = PeerEvents(rejected=(rejected.append if rejected is not None else lambda r: None))
    transports, addresses = [], []
    for i, node in enumerate(nodes):
        transport = FallbackTransport("127.0.0.1", 0, p2p=node.p2p, mode=mode, auth=auth, events=events)
        port = (await transport.start()).rsplit(":", 1)[1]
        transports.append(transport)
        advertised = f"127.0.0.1:{closed_port()}" if i in unreachable else f"127.0.0.1:{port}"
        # The libp2p handler keeps the real port's tag, whatever TCP address is advertised.
        addresses.append(f"{advertised}|{transport.relay.address}")
        assert i in unreachable or addresses[-1] == member_address(advertised, node.peer_id)
    members = [n.peer_id for n in nodes]
    engines = [
        GroupAllReduce(Group(RUN, members, addresses, i), t, numel, settings=SETTINGS, events=events)
        for i, t in enumerate(transports)
    ]
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(len(nodes))]
    weights = [1.0 + i for i in range(len(nodes))]
    expected = sum(w * x for w, x in zip(weights, xs)) / sum(weights)
    tensors = [x.clone() for x in xs]
    try:
        outcomes = await asyncio.gather(*(e.all_reduce(t, w, 1) for e, t, w in zip(engines, tensors, weights)))
    finally:
        for e in engines:
            await e.close()
        for t in transports:
            await t.close()
    return outcomes, tensors, expected, transports, addresses


def test_an_undialable_member_is_reached_over_libp2p_and_the_round_is_exact(tmp_path):
    async def scenario():
        async with peer_nodes(3, tmp_path) as nodes:
            rejected: list[str] = []
            auth = LinkAuth(b"k" * 32, "group-key")  # as in a secret run: every link opens with a hello
            outcomes, tensors, expected, transports, addresses = await reduce_over(
                nodes, unreachable={2}, rejected=rejected, auth=auth
            )
            assert rejected == []
            assert all(o.completed for o in outcomes), [o.reason for o in outcomes]
            assert len({o.digest for o in outcomes}) == 1
            for t in tensors:
                assert torch.allclose(t, expected, rtol=1e-5, atol=1e-6)
            # Members 0 and 1 reach each other directly and member 2 through libp2p; member 2 dials out directly.
            for i in (0, 1):
                assert transports[i].choices[addresses[1 - i]] == "tcp"
                assert transports[i].choices[addresses[2]] == "libp2p"
            assert set(transports[2].choices.values()) == {"tcp"}
            sent = {k: v[0] for k, v in transports[0].bytes_by_transport().items()}
            assert sent["libp2p"] > 4 * 100_000 // 3 and sent["tcp"] > 0, sent
            received_by_2 = transports[2].bytes_by_transport()["libp2p"][1]
            assert received_by_2 > 0

    asyncio.run(scenario())


def test_mode_libp2p_uses_only_streams_and_mode_tcp_refuses_to_fall_back(tmp_path):
    async def scenario():
        async with peer_nodes(2, tmp_path) as nodes:
            outcomes, tensors, expected, transports, _ = await reduce_over(nodes, unreachable=set(), mode="libp2p")
            assert all(o.completed for o in outcomes), [o.reason for o in outcomes]
            assert all(set(t.choices.values()) == {"libp2p"} for t in transports)
            assert all(t.bytes_by_transport()["tcp"] == (0, 0) for t in transports)
            outcomes, tensors, _, transports, _ = await reduce_over(nodes, unreachable={1}, mode="tcp")
            assert not any(o.completed for o in outcomes)  # member 1 cannot be reached: nobody completes
            assert torch.equal(tensors[0], torch.randn(300_000, generator=torch.Generator().manual_seed(0)))

    asyncio.run(scenario())


class RecordingSink:
    """A sink that records headers (payloads must be empty) and sets `lost` when a link ends."""

    def __init__(self):
        self.headers: list[Header] = []
        self.lost = asyncio.Event()

    def on_header(self, link, header):
        self.headers.append(header)
        return memoryview(b"")

    def on_payload(self, link, header) -> None: ...

    def on_lost(self, link) -> None:
        self.lost.set()


def test_garbage_on_a_libp2p_stream_is_refused_and_counted(tmp_path):
    async def scenario():
        rejected: list[str] = []
        async with peer_nodes(2, tmp_path) as (a, b):
            relay = P2PTransport(a.p2p, "9", events=PeerEvents(rejected=rejected.append))
            await relay.start()
            sink = RecordingSink()
            relay.attach(sink)
            _, _, writer = await b.p2p.call_binary_stream_handler(a.p2p.peer_id, relay.name)
            writer.write(b"\x00" * HEADER_SIZE)
            await writer.drain()
            async with asyncio.timeout(10):
                await sink.lost.wait()
            assert rejected == ["wire_bad_magic"] and sink.headers == []
            writer.close()
            await relay.close()

    asyncio.run(scenario())


def test_hellos_hold_only_for_their_key_round_and_listener():
    auth = LinkAuth(b"k" * 32, "peerd/v1/run/x/moshpit/3/0/*")
    hello = auth.hello("4000")
    assert len(hello) == HELLO_SIZE and auth.check(hello, "4000")
    assert auth.hello("4000") != hello  # a fresh nonce every time
    assert not auth.check(hello, "4001")  # another listener
    assert not LinkAuth(b"k" * 32, "peerd/v1/run/x/moshpit/3/1/*").check(hello, "4000")  # another round
    assert not LinkAuth(b"j" * 32, "peerd/v1/run/x/moshpit/3/0/*").check(hello, "4000")  # another secret
    assert not auth.check(hello[:-1], "4000") and not auth.check(b"\x00" * HELLO_SIZE, "4000")


def test_a_dialer_without_the_secret_is_cut_off_before_its_header_is_read():
    """A real TCP listener with auth: a valid hello gets through, a forged or missing one is counted
    and the connection closed before the sink sees a single header."""

    async def scenario():
        rejected: list[str] = []
        auth = LinkAuth(b"k" * 32, "group")
        listener = TcpTransport("127.0.0.1", 0, events=PeerEvents(rejected=rejected.append), auth=auth)
        port = (await listener.start()).rsplit(":", 1)[1]
        sink = RecordingSink()
        headers, lost = sink.headers, sink.lost
        listener.attach(sink)
        header = Header(kind=Kind.VERDICT, run_tag=run_tag(RUN), round=1, sender=0, shard=0, count=0)
        forged, good = LinkAuth(b"x" * 32, "group").hello(port), auth.hello(port)
        for first_bytes, accepted in ((forged, False), (b"", False), (good, True)):
            lost.clear()
            _, writer = await asyncio.open_connection("127.0.0.1", int(port))
            writer.write(first_bytes + header.pack() + header.pack())
            await writer.drain()
            async with asyncio.timeout(5):
                if accepted:
                    while len(headers) < 2:
                        await asyncio.sleep(0.01)
                else:
                    await lost.wait()
                    assert headers == []
            writer.close()
        assert len(headers) == 2 and rejected == ["wire_bad_hello", "wire_bad_hello"]
        await listener.close()

    asyncio.run(scenario())
