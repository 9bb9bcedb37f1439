"""What one DHT read and one DHT write cost, on real p2pd and DHT nodes on loopback (peers/node.py).

A run's records live on the num_replicas (5) nodes nearest its key. hivemind's default search keeps
bucket_size (20) nodes, every node of a swarm under 20: each read and each heartbeat asked every
daemon, and an idle daemon's CPU grew with the swarm (docs/benchmarks.md, "Scale"). Here eight nodes
each write their own subkey, and a read must still return all eight while asking at most the five.
"""

from __future__ import annotations

import asyncio

from peerd.peers.clock import now
from peerd.peers.records import MemberRecord, MemberState, seal_record
from tests.helpers import peer_nodes as started

N = 8
KEY = "a-run-key"


def count_finds(node) -> list[int]:
    """Count the DHT find requests `node` sends from now on (its searches' only request)."""
    calls = [0]
    protocol = node.dht.protocol
    real = protocol.call_find

    async def counted(*args, **kwargs):
        calls[0] += 1
        return await real(*args, **kwargs)

    protocol.call_find = counted
    return calls


def test_a_read_asks_only_the_nodes_that_hold_the_key_and_merges_every_subkey(tmp_path):
    async def scenario():
        async with started(N, tmp_path) as nodes:
            replicas = nodes[0].dht.num_replicas
            assert replicas < N - 1  # else a read asks every other node anyway
            expiration = now() + 60

            def sealed(node) -> bytes:
                record = MemberRecord(
                    run_id="r",
                    peer_id=node.peer_id,
                    maddrs=("/ip4/127.0.0.1/tcp/5",),
                    version="0",
                    role="trainer",
                    state=MemberState.ACTIVE,
                    timestamp=now(),
                )
                return seal_record(record, node.identity, None)

            writer_finds = count_finds(nodes[1])
            assert await nodes[1].store(KEY, nodes[1].peer_id, sealed(nodes[1]), expiration)
            assert writer_finds[0] <= replicas, writer_finds
            # A later expiration: a node keeps a subkey's value only for a newer one (nodes[1] stores again).
            stored = await asyncio.gather(*(n.store(KEY, n.peer_id, sealed(n), expiration + 1) for n in nodes))
            assert all(stored)
            for reader in (nodes[0], nodes[-1]):
                finds = count_finds(reader)
                got = await reader.get(KEY)
                assert set(got) == {n.peer_id for n in nodes}, f"{len(got)} of {N} subkeys"
                assert finds[0] <= replicas, f"{finds[0]} find requests for one read"

    asyncio.run(scenario())


def test_a_ping_answered_lifts_the_dht_ban_on_that_peer(tmp_path):
    """hivemind's DHTNode skips a peer that failed requests (5 s, doubled at each failure in a row);
    a peer back from a freeze or a cut answers the membership's rejoin ping, which must end the ban,
    else its records stay unread for up to 20 s more (docs/benchmarks.md, "Goodput under churn")."""

    async def scenario():
        async with started(2, tmp_path) as (a, b):
            peer = b.dht.peer_id
            for _ in range(3):  # a frozen peer's failures in a row: banned 5, then 10, then 20 s
                a.dht.blacklist.register_failure(peer)
                del a.dht.blacklist.banned_peers[peer]
            a.dht.blacklist.register_failure(peer)
            assert peer in a.dht.blacklist
            assert await a.ping(b.peer_id)
            assert peer not in a.dht.blacklist
            assert a.dht.blacklist.ban_counter[peer] == 0  # the next failure bans for 5 s again

    asyncio.run(scenario())


def test_a_disconnected_peer_is_dialed_afresh_by_the_next_request(tmp_path):
    """The membership closes its connections to a peer that timed out (PeerNode.disconnect): a
    connection that outlived a cut waits for TCP's next resend, up to seconds after the link is back.
    The connection is gone from p2pd afterwards, and the next ping dials the peer again and is answered;
    a peer with no connection is no error."""

    async def scenario():
        async with started(2, tmp_path) as (a, b):
            assert await a.ping(b.peer_id)
            connected = lambda peers: b.peer_id in {str(p.peer_id) for p in peers}  # noqa: E731
            assert connected(await a.p2p.list_peers())
            await a.disconnect(b.peer_id)
            assert not connected(await a.p2p.list_peers())
            await a.disconnect(b.peer_id)  # nothing left to close
            assert await a.ping(b.peer_id)
            assert connected(await a.p2p.list_peers())

    asyncio.run(scenario())
