"""A node's start when its initial peer does not answer at first (peers/node.py, _bootstrap): real
p2pd and DHT nodes on loopback. hivemind pings each initial peer once; over the lab's 5 % loss one
lost ping failed a daemon's whole start."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID

from peerd.peers.events import PeerEvents
from peerd.peers.identity import Identity
from peerd.peers.node import NodeSettings, PeerNode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_start_pings_its_initial_peer_again_until_it_answers_and_fails_clearly_if_it_never_does(tmp_path):
    port = free_port()
    later = Identity.load_or_create(tmp_path / "later.key")
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{later.peer_id}"

    def settings(name: str, startup_timeout: float = 30) -> NodeSettings:
        return NodeSettings(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=tmp_path / f"{name}.key",
            initial_peers=[address],
            request_timeout=1.0,
            startup_timeout=startup_timeout,
        )

    async def main() -> None:
        events = PeerEvents()
        # The initial peer's p2pd is up (a start's p2pd needs to reach one), its DHT node not yet:
        # as over a lossy link, the first pings go unanswered.
        p2p = await P2P.create(
            host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"],
            identity_path=str(tmp_path / "later.key"),
            nat_port_map=False,
            auto_nat=False,
        )
        dht = None
        try:
            early = asyncio.create_task(PeerNode.start(settings("early"), events))
            await asyncio.sleep(2.5)  # its first pings (1 s each) went unanswered
            assert not early.done()
            dht = await DHTNode.create(p2p=p2p, wait_timeout=1.0)
            node = await asyncio.wait_for(early, 30)
            try:
                known = {str(p) for p in node.dht.protocol.routing_table.uid_to_peer_id.values()}
                assert later.peer_id in known, known
                assert await dht.protocol.call_ping(PeerID.from_base58(node.peer_id)) is not None
            finally:
                await node.shutdown()
            await dht.shutdown()
            dht = None

            # A peer whose DHT never answers: a clear error at startup_timeout, nothing left running.
            t0 = time.monotonic()
            with pytest.raises(RuntimeError, match="within 4 s .*no initial peer answered a DHT ping") as e:
                await PeerNode.start(settings("lone", startup_timeout=4), events)
            assert address in str(e.value) and time.monotonic() - t0 < 10
        finally:
            if dht is not None:
                await dht.shutdown()
            await p2p.shutdown()

    asyncio.run(main())
