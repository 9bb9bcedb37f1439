"""RunMembership's decisions on a made-up clock: a silent peer leaves the table after peer_ttl, is
re-dialed while LOST_MEMORY lasts, then forgotten. A fake DHT node (a dict) stands in for hivemind;
tests/test_membership.py and tests/test_daemon.py run the same code over real DHT nodes."""

from __future__ import annotations

import asyncio

from peerd.peers.identity import Identity
from peerd.peers.membership import LOST_MEMORY, Announcement, DiscoverySettings, Roll, RunMembership


class FakeNode:
    """The part of PeerNode that membership uses, over one shared dict; `answering`: who answers a ping."""

    def __init__(self, identity: Identity, store: dict, answering: set[str]):
        self.identity, self._store, self.answering, self.pinged = identity, store, answering, []
        self.disconnected: list[str] = []

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    async def visible_maddrs(self) -> list[str]:
        return [f"/ip4/127.0.0.1/tcp/1/p2p/{self.peer_id}"]

    async def store(self, key: str, subkey: str, value: bytes, expiration: float) -> bool:
        self._store.setdefault(key, {})[subkey] = (value, expiration)
        return True

    async def get(self, key: str) -> dict:
        return dict(self._store.get(key, {}))

    async def ping(self, peer_id: str) -> bool:
        self.pinged.append(peer_id)
        return peer_id in self.answering

    async def disconnect(self, peer_id: str) -> None:
        self.disconnected.append(peer_id)


def test_a_silent_peer_times_out_on_the_clock_is_redialed_and_then_forgotten(tmp_path):
    t = [1_000_000.0]
    clock = lambda: t[0]  # noqa: E731
    settings = DiscoverySettings(heartbeat_interval=2.0, refresh_interval=1.0, peer_ttl=10.0)
    dht: dict = {}
    a_id, b_id = (Identity.load_or_create(tmp_path / f"{n}.key") for n in "ab")
    a_node, b_node = FakeNode(a_id, dht, set()), FakeNode(b_id, dht, set())
    a = RunMembership(a_node, "clocked", None, settings, version="test", clock=clock)
    b = RunMembership(b_node, "clocked", None, settings, version="test", clock=clock)

    async def main():
        for m in (a, b):
            m._maddrs = tuple(await m.node.visible_maddrs())
            await m.heartbeat()
        await a.refresh()
        assert [e.peer_id for e in a.peers()] == [b_id.peer_id]
        # b stops heartbeating (frozen): still in the table just before peer_ttl, gone just after.
        t[0] += 9.0
        await a.heartbeat()
        await a.refresh()
        assert [e.peer_id for e in a.peers()] == [b_id.peer_id]
        t[0] += 1.5
        await a.heartbeat()
        await a.refresh()
        assert a.peers() == []
        # Re-dialed (it does not answer) while LOST_MEMORY lasts, then forgotten; its connections
        # are closed once, before the first ping (a stale one would hold every ping after a heal).
        await a.rejoin()
        assert a_node.pinged == [b_id.peer_id] and a_node.disconnected == [b_id.peer_id]
        await a.rejoin()
        assert a_node.pinged == [b_id.peer_id] * 2 and a_node.disconnected == [b_id.peer_id]
        t[0] += LOST_MEMORY + 1
        await a.rejoin()
        assert a_node.pinged == [b_id.peer_id] * 2 and a._lost == {}
        # b's heartbeat resumes: it is back at the next refresh.
        await a.heartbeat()
        await b.heartbeat()
        await a.refresh()
        assert [e.peer_id for e in a.peers()] == [b_id.peer_id]
        # Lost again: its connections are closed again.
        t[0] += 11.0
        await a.heartbeat()
        await a.refresh()
        await a.rejoin()
        assert a_node.disconnected == [b_id.peer_id] * 2

    asyncio.run(main())


class SlowNode(FakeNode):
    """A FakeNode whose reads, from the `slow_from`-th on, hang until `released` (a read that waits out the
    DHT's request timeout); entering one moves the clock on by `advance` seconds."""

    def __init__(self, *args, slow_from: int, clock: list[float], advance: float):
        super().__init__(*args)
        self.reads, self.slow_from, self.clock, self.advance = 0, slow_from, clock, advance
        self.released = asyncio.Event()

    async def get(self, key: str) -> dict:
        self.reads += 1
        if self.reads >= self.slow_from:
            self.clock[0] += self.advance
            await self.released.wait()
        return await super().get(key)


def test_the_rendezvous_drops_a_mate_that_timed_out_while_a_read_still_hangs(tmp_path):
    """The peer TTL is applied on the clock at every look, not only when a read returns: a mate that
    went silent behind the boundary is gone within a poll of its timeout, whatever the DHT does."""
    t = [1_000_000.0]
    settings = DiscoverySettings(heartbeat_interval=2.0, refresh_interval=1.0, peer_ttl=4.0)
    dht: dict = {}
    a_id, b_id = (Identity.load_or_create(tmp_path / f"{n}.key") for n in "ab")
    a_node = SlowNode(a_id, dht, set(), slow_from=2, clock=t, advance=settings.peer_ttl + 1)
    a = RunMembership(a_node, "clocked", None, settings, version="test", clock=lambda: t[0])
    b = RunMembership(FakeNode(b_id, dht, set()), "clocked", None, settings, version="test", clock=lambda: t[0])
    a.announcement, b.announcement = (lambda: Announcement(step=30)), (lambda: Announcement(step=25))

    async def main():
        for m in (a, b):
            m._maddrs = tuple(await m.node.visible_maddrs())
        await b.heartbeat()  # b is behind the boundary (25 < 30), and then silent
        loop = asyncio.get_running_loop()
        started = loop.time()
        roll = await a.rendezvous([b_id.peer_id], 30, 20, timeout=5.0)
        assert roll == Roll(gone=(b_id.peer_id,))
        assert loop.time() - started < 2.0  # a poll or two after the first read; not the 5 s patience
        assert a_node.reads == 2 and not a_node.released.is_set()  # the second read still hangs
        a_node.released.set()
        await asyncio.sleep(0)

    asyncio.run(main())
