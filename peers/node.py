"""One libp2p host and one DHT node, started with safe defaults, with every request timed and counted.

hivemind's P2P turns on UPnP port mapping (which multicasts on the local network) and AutoNAT by
default. Here both are off unless the caller opts in, so a daemon probes no network unasked.
The DHT node runs on the caller's event loop (no extra process), and p2pd is our only child.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from peerd.peers import dht_traverse, late_answers
from peerd.peers.events import PeerEvents
from peerd.peers.identity import Identity
from peerd.peers.validator import PeerdRecordValidator

logger = logging.getLogger(__name__)

BOOTSTRAP_RETRY = 0.5  # seconds between two rounds of pings to the initial peers while none answered
# hivemind's DHT caching is for keys read rarely: after a read it stores what it found on the nearest
# node that lacked it (cache_nearest) and re-reads a used value shortly before it expires
# (cache_refresh_before_expiry). peerd reads its keys itself, every refresh_interval, and every
# member stores its own record every heartbeat: both were extra requests to every node for nothing.
# Together with reads and stores that search for the num_replicas nodes a value is stored on
# (PeerNode.get, PeerNode.store) instead of bucket_size (20: every node of a swarm under 20), they cut
# an idle daemon tree's CPU by more than half at 16 daemons on one machine (docs/benchmarks.md, "Scale").
DHT_CACHING = {"cache_nearest": 0, "cache_refresh_before_expiry": 0}


@dataclass(kw_only=True, slots=True)
class NodeSettings:
    host_maddrs: list[str]
    identity_path: Path
    initial_peers: list[str] = field(default_factory=list)
    announce_maddrs: list[str] = field(default_factory=list)
    nat_port_map: bool = False  # UPnP/NAT-PMP port mapping: multicasts on the LAN, so opt-in
    auto_nat: bool = False  # AutoNAT service: asks peers to dial us back, so opt-in
    startup_timeout: float = 15.0  # covers starting p2pd and bootstrapping to initial_peers
    request_timeout: float = 5.0  # covers one DHT get or store, all hops included


class PeerNode:
    """The daemon's presence on the network: p2pd, the DHT node and the signing identity."""

    def __init__(self, p2p: P2P, dht: DHTNode, identity: Identity, settings: NodeSettings, events: PeerEvents):
        self.p2p, self.dht, self.identity = p2p, dht, identity
        self.settings, self.events = settings, events

    @classmethod
    async def start(cls, settings: NodeSettings, events: PeerEvents) -> "PeerNode":
        """Start p2pd and join the DHT; raises on failure, leaving no child process behind."""
        # hivemind checks that a key file it finds is not in use by another peer: it starts a second
        # p2pd and asks the swarm for that peer ID, which costs a second and, over a slow or busy
        # swarm, stalled a start for 30 s. A key made here a moment ago cannot be in use; one that
        # was there before (a restart, or a data dir copied to another host) is checked.
        fresh = not settings.identity_path.exists()
        identity = Identity.load_or_create(settings.identity_path)
        dht_traverse.install()  # a store cut off by request_timeout ends every task of its search
        late_answers.install()  # a call cut off by its timeout leaves the other calls answered
        stage = "p2pd did not start"
        try:
            async with asyncio.timeout(settings.startup_timeout):
                p2p = await P2P.create(
                    initial_peers=settings.initial_peers or None,
                    host_maddrs=settings.host_maddrs,
                    announce_maddrs=settings.announce_maddrs or None,
                    identity_path=str(settings.identity_path),
                    check_if_identity_free=not fresh,
                    nat_port_map=settings.nat_port_map,
                    auto_nat=settings.auto_nat,
                    startup_timeout=settings.startup_timeout,
                )
                dht = None
                try:
                    stage = (
                        "no initial peer answered a DHT ping"
                        if settings.initial_peers
                        else "the DHT node did not start"
                    )
                    dht = await DHTNode.create(
                        p2p=p2p,
                        record_validator=PeerdRecordValidator(events),
                        initial_peers=settings.initial_peers or None,
                        wait_timeout=settings.request_timeout,
                        bootstrap_timeout=settings.startup_timeout,
                        ensure_bootstrap_success=False,  # one ping each; _bootstrap pings again
                        **DHT_CACHING,
                    )
                    if settings.initial_peers:
                        await cls._bootstrap(dht, settings.initial_peers)
                except BaseException:
                    if dht is not None:
                        await dht.shutdown()
                    await p2p.shutdown()
                    raise
        except TimeoutError:
            raise RuntimeError(
                f"the node did not start within {settings.startup_timeout:g} s (startup_timeout): {stage}"
                + (f" (initial peers: {', '.join(settings.initial_peers)})" if "ping" in stage else "")
            ) from None
        return cls(p2p, dht, identity, settings, events)

    @staticmethod
    async def _bootstrap(dht: DHTNode, initial_peers: list[str]) -> None:
        """hivemind pings each initial peer once and gives up: over a lossy link, a SYN lost twice
        outlasts request_timeout, and one lost ping failed the whole start. Ping them until one
        answers, validated as hivemind's bootstrap does (it raises when the peer cannot reach this
        node back, or their clocks differ too much); each answer puts the two in each other's
        routing table, and the caller's startup_timeout bounds the wait. Then, if hivemind's own
        pings all went unanswered, look up this node's neighbours, as its bootstrap does."""
        lookup = not dht.protocol.routing_table.uid_to_peer_id
        peers = {PeerID.from_base58(Multiaddr(a)["p2p"]) for a in initial_peers}
        while True:
            answers = await asyncio.gather(*(dht.protocol.call_ping(p, validate=True, strict=True) for p in peers))
            if any(a is not None for a in answers):
                break
            logger.info("none of the %d initial peer(s) answered a DHT ping yet; pinging again", len(peers))
            await asyncio.sleep(BOOTSTRAP_RETRY)
        if lookup:
            await dht.find_nearest_nodes([dht.node_id])

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def visible_maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def get(self, key: str) -> dict[str, tuple[Any, float]]:
        """Latest subkey -> (value, expiration) of a dictionary key; {} if absent or on failure. The
        search keeps the num_replicas nodes nearest the key, the nodes every store writes to, and
        merges their subkeys (hivemind's default keeps bucket_size, 20)."""
        found = await self._request("get", self.dht.get(key, latest=True, beam_size=self.dht.num_replicas))
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): (v.value, v.expiration_time) for sub, v in found.value.items()}

    async def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        """Store one subkey on the num_replicas nodes nearest the key, found by a search that keeps
        that many (hivemind's default keeps bucket_size, 20: every node of a swarm under 20)."""
        stored = self.dht.store(key, value, expiration, subkey=subkey, beam_size=self.dht.num_replicas)
        return bool(await self._request("store", stored))

    async def ping(self, peer_id: str) -> bool:
        """Ping a peer's DHT node; on an answer each side adds the other to its routing table. This is
        how the two sides of a healed partition find each other again: while cut off, their routing
        tables dropped each other, and nothing else would ever dial across. An answer also lifts
        this node's DHT ban on the peer: hivemind's DHTNode skips a peer that failed requests for
        5 s, doubled at each failure in a row (its `blacklist`), so a peer cut off or frozen for
        15-20 s stayed skipped, its records unread, for up to 20 s more after it was back."""
        peer = PeerID.from_base58(peer_id)
        answered = await self._request("ping", self.dht.protocol.call_ping(peer)) is not None
        if answered:
            self.dht.blacklist.register_success(peer)
        return answered

    async def disconnect(self, peer_id: str) -> None:
        """Close p2pd's connections to a peer, so that the next request dials it afresh.

        A peer cut off (a partition, a freeze) keeps its connection open on both sides: nothing
        closes it while no write fails, and every request to the peer, the rejoin ping included,
        goes over it. After the link is back such requests went unanswered for seconds more (the
        likely cause: TCP resends what is queued at doubling intervals, so after a 15 s cut the
        next resend can come 10 s after the heal); a fresh dial is answered at the link's RTT."""
        try:
            async with asyncio.timeout(self.settings.request_timeout):
                await self.p2p._client.disconnect(PeerID.from_base58(peer_id))  # hivemind's P2P has no public call
        except Exception as e:  # a peer with no connection, or p2pd busy: the next ping dials as before
            logger.debug("disconnect from %s failed: %r", peer_id, e)

    async def _request(self, op: str, coro) -> Any:
        try:
            async with asyncio.timeout(self.settings.request_timeout):
                result = await coro
        except TimeoutError:
            self.events.dht_request(op, "timeout")
            return None
        except Exception as e:  # hivemind raises many types on network errors; all mean "no answer"
            logger.debug("DHT %s failed: %r", op, e)
            self.events.dht_request(op, "error")
            return None
        # A get that finds nothing is a successful answer; a store that no node accepted, or a ping
        # nobody answered, is not.
        self.events.dht_request(op, "error" if op in ("store", "ping") and not result else "ok")
        return result

    async def add_handler(self, name: str, handler, request_type) -> None:
        await self.p2p.add_protobuf_handler(name, handler, request_type)

    async def call(self, peer_id: str, name: str, request, response_type, timeout: float):
        async with asyncio.timeout(timeout):
            return await self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), name, request, response_type)

    async def unless_p2pd_exits(self, coro) -> bool:
        """Run coro to its end, or cancel it as soon as p2pd exits (a terminal's Ctrl-C or hang-up
        signals p2pd too): a request to a p2pd that is gone can wait forever, as p2pclient never
        fails the futures of a closed connection. Returns whether coro ran to its end."""
        task = asyncio.ensure_future(coro)
        child = self.p2p._child  # hivemind keeps no public handle on its p2pd process
        if child is None:
            await task
            return True
        exited = asyncio.ensure_future(child.wait())
        try:
            await asyncio.wait({task, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, exited):
                t.cancel()
            await asyncio.gather(task, exited, return_exceptions=True)
        if task.cancelled():
            logger.info("p2pd exited; not waiting for it to answer")
            return False
        task.result()  # its exception, if any
        return True

    async def shutdown(self) -> None:
        """Leave the DHT and stop p2pd (our only child process), without waiting on a p2pd that is gone."""
        try:
            await self.unless_p2pd_exits(self.dht.shutdown())
        finally:
            await self.p2p.shutdown()


__all__ = ["NodeSettings", "PeerNode", "P2PContext"]
