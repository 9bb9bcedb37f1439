"""The reliable path between members: direct TCP where it connects, libp2p streams where it does not.

A member address here is `host:port|<peer ID>/<handler>` (`member_address`): the member's direct
TCP listener and its libp2p stream handler. `connect` tries TCP for at most `direct_timeout`
seconds, then opens a libp2p stream, and records which one each link uses (`choices`), so that a
round can say how it reached each member and metrics can count bytes by transport.

Modes (the daemon's `--reliable-links`; its `auto` is `reliable` here): `reliable` (TCP, else libp2p), `tcp` (direct only: a member it
cannot dial is unreachable) and `libp2p` (streams only, e.g. to test the fallback or when direct
connections are known to be blocked).
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from peerd.peers.collective.linkauth import LinkAuth
from peerd.peers.collective.p2p import HANDLER_PREFIX, P2PTransport
from peerd.peers.collective.tcp import TcpTransport, split_address
from peerd.peers.collective.transport import Link, Sink, Transport
from peerd.peers.events import PeerEvents

MODES = ("auto", "tcp", "libp2p")  # as network.reliable_links: auto = direct TCP, else libp2p streams
# A direct connection to a reachable member opens in about one RTT; a firewall that drops SYNs makes
# connect() hang, so the wait is short and the engine's connect_timeout (2 s) covers both attempts.
DIRECT_TIMEOUT = 0.75


def member_address(engine_addr: str, peer_id: str) -> str:
    """The address of a member whose TCP listener is engine_addr ('host:port'). Its libp2p handler is
    tagged with the same port: one handler per open transport, unique on that daemon."""
    port = engine_addr.rpartition(":")[2]
    return f"{engine_addr}|{peer_id}/{HANDLER_PREFIX}{port}"


class FallbackTransport(Transport):
    """Listens on a TcpTransport at host:port and, given p2pd, on the libp2p handler tagged with the
    same port; dials by `mode`. Both deliver to the same sink. `auth` (secret runs) applies to both."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        p2p: P2P | None,
        mode: str = "auto",
        auth: LinkAuth | None = None,
        events: PeerEvents | None = None,
        direct_timeout: float = DIRECT_TIMEOUT,
    ):
        if mode not in MODES:
            raise ValueError(f"transport mode must be one of {', '.join(MODES)}, not {mode!r}")
        if p2p is None and mode != "tcp":
            raise ValueError(f"mode {mode!r} needs p2pd")
        self.direct = TcpTransport(host, port, events=events, auth=auth)
        self.relay: P2PTransport | None = None  # made by start(): its tag is the port the OS gives TCP
        self.p2p, self.mode, self.auth, self.events, self.direct_timeout = p2p, mode, auth, events, direct_timeout
        self.choices: dict[str, str] = {}  # address -> "tcp" or "libp2p", for every link opened

    async def start(self) -> str:
        address = await self.direct.start()
        if self.p2p is not None:
            self.relay = P2PTransport(self.p2p, str(split_address(address)[1]), events=self.events, auth=self.auth)
            await self.relay.start()
        return address

    def attach(self, sink: Sink) -> None:
        self.direct.attach(sink)
        if self.relay is not None:
            self.relay.attach(sink)

    async def connect(self, address: str) -> Link:
        direct_addr, _, relay_addr = address.partition("|")
        failure: Exception | None = None
        if self.mode != "libp2p":
            try:
                async with asyncio.timeout(self.direct_timeout):
                    link = await self.direct.connect(direct_addr)
                self.choices[address] = "tcp"
                return link
            except (OSError, TimeoutError, ValueError) as e:
                failure = e
        if self.mode == "tcp" or not relay_addr:
            raise OSError(f"direct connection to {direct_addr} failed ({failure!r}) and no fallback is allowed")
        link = await self.relay.connect(relay_addr)
        self.choices[address] = "libp2p"
        return link

    def bytes_by_transport(self) -> dict[str, tuple[int, int]]:
        """{transport: (bytes sent, bytes received)} since start."""
        out = {"tcp": (self.direct.bytes_sent, self.direct.bytes_received)}
        if self.relay is not None:
            out["libp2p"] = (self.relay.bytes_sent, self.relay.bytes_received)
        return out

    async def close(self) -> None:
        await self.direct.close()
        if self.relay is not None:
            await self.relay.close()
