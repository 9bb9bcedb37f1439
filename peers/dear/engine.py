"""The Collective of collective.py over peerd's own engine: the reduce-scatter and all-gather
primitives of peers/collective/halves.py, on an event loop in a thread this backend owns.

    collective = EngineCollective(rank=r, world=n, timeout=T)
    address = collective.start()           # listens on 127.0.0.1, a port from the OS: "127.0.0.1:port"
    ...                                    # every member learns every address (a store, the DHT)
    collective.join(addresses)             # addresses[i]: member i's; links open at the first op
    dear = DeAR(model, optimizer, collective, ...)
    ...
    collective.close()                     # queued ops run (or fail) first; the thread is joined

With `loop=` (an event loop running in another thread, such as a daemon's), the engine serves on
that loop instead of a thread of its own; bench/dear_loop.py measures what either costs the loop's
other work (docs/dear.md, "One event loop?").

The training thread calls reduce_scatter / all_gather; each op is handed to the loop with
call_soon_threadsafe and queued there in call order (Halves' FIFO); when it ends, the loop copies
its `started` / `finished` stamps and error into the handle and sets its `done` event. `timeout`
is Halves' op_timeout: what one op may take from its start (the op ahead finished), connecting,
sending, receiving and draining included. `wait` relies on the loop to enforce it, and gives up by
itself only if the loop did nothing for timeout + STALL_GRACE (stuck in a callback, or dead).

A failed op breaks the collective (halves.py): every queued and later op fails with the same
reason, and the other members' ops fail at once as this member closes its connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import uvloop

from peerd.peers.collective.group import Group
from peerd.peers.collective.halves import HalfOp, Halves, HalvesSettings
from peerd.peers.collective.tcp import TcpTransport
from peerd.peers.collective.transport import Transport
from peerd.peers.collective.rounds import Half
from peerd.peers.dear.backend import CollectiveBase, CollectiveError, Handle
from peerd.peers.events import PeerEvents

logger = logging.getLogger(__name__)

START_TIMEOUT = 10.0  # seconds start() and join() wait for the loop thread to listen / attach
STALL_GRACE = 5.0  # seconds beyond `timeout` of no activity on the loop before wait() stops trusting it
JOIN_GRACE = 5.0  # seconds beyond `timeout` close() waits for the thread (the queued op in flight may take `timeout`)


class EngineCollective(CollectiveBase):
    """Collective over Halves. `transport` makes the transport on the backend's loop (default: a
    TcpTransport on `host`, port from the OS); `min_seconds` is the benchmarks' seam for an emulated
    slower link, as in GlooCollective: an op of b bytes lasts at least min_seconds(b)."""

    per_op_timeout = True  # all_gather(handle, timeout=...): Halves' per-op limit

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        timeout: float,
        host: str = "127.0.0.1",
        run_id: str = "dear",
        settings: HalvesSettings | None = None,
        events: PeerEvents | None = None,
        transport: Callable[[], Transport] | None = None,
        min_seconds: Callable[[int], float] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        super().__init__()
        self.rank, self.world, self.timeout, self.run_id = rank, world, timeout, run_id
        self.settings = dataclasses.replace(settings or HalvesSettings(), op_timeout=timeout)
        self.events, self.min_seconds = events or PeerEvents(), min_seconds
        self._make_transport = transport or (lambda: TcpTransport(host, 0, events=self.events))
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host_loop = loop  # a loop running in another thread to serve on, instead of a thread of its own
        self._served: concurrent.futures.Future | None = None  # _serve on the host loop
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Future | None = None  # set by close(): the loop closes the engine and ends
        self._transport: Transport | None = None
        self._halves: Halves | None = None
        self._progress = time.monotonic()  # when the loop last launched or ended an op

    # ---- lifecycle (training thread) ---------------------------------------------------------------

    def start(self) -> str:
        """Start the loop thread and the transport; returns the address the other members dial."""
        ready: concurrent.futures.Future[str] = concurrent.futures.Future()
        if self._host_loop is not None:
            self._served = asyncio.run_coroutine_threadsafe(self._serve(ready), self._host_loop)
        else:
            self._thread = threading.Thread(
                target=uvloop.run, args=(self._serve(ready),), name=f"dear-engine-{self.rank}", daemon=True
            )
            self._thread.start()
        self.address = ready.result(START_TIMEOUT)
        return self.address

    def join(self, addresses: Sequence[str]) -> None:
        """Form the group: addresses[i] is member i's (from start()). Nothing is sent until the first op."""
        group = Group(self.run_id, tuple(f"rank{i}" for i in range(self.world)), tuple(addresses), self.rank)

        async def attach() -> None:
            self._halves = Halves(
                group, self._transport, settings=self.settings, events=self.events, pace=self.min_seconds
            )

        asyncio.run_coroutine_threadsafe(attach(), self._loop).result(START_TIMEOUT)

    def wait(self, handle: Handle) -> None:
        limit = handle.timeout or self.timeout
        while not handle.done.wait(limit):
            if time.monotonic() - self._progress > limit + STALL_GRACE or not self._serving():
                stall = limit + STALL_GRACE
                raise CollectiveError(
                    f"{handle.half.value} #{handle.seq}: the engine's loop did nothing for {stall:.0f} s"
                )
        if handle.error:
            raise CollectiveError(f"{handle.half.value} #{handle.seq} failed: {handle.error}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(lambda: self._stop.done() or self._stop.set_result(None))
        except RuntimeError:  # the loop already ended
            pass
        if self._served is not None:
            try:
                self._served.result(self.timeout + JOIN_GRACE)
            except Exception:
                logger.warning("dear engine %d did not stop cleanly on its host loop", self.rank, exc_info=True)
            return
        self._thread.join(self.timeout + JOIN_GRACE)
        if self._thread.is_alive():  # a daemon thread: the process can still exit
            logger.warning("%s did not stop within %.0f s", self._thread.name, self.timeout + JOIN_GRACE)

    def _serving(self) -> bool:
        """Whether the engine's loop still serves it (its thread alive, or its task on the host loop)."""
        return not self._served.done() if self._served is not None else self._thread.is_alive()

    def _issue(self, handle: Handle) -> None:
        if self._halves is None:
            raise RuntimeError("start() and join() come before the first op")
        self._loop.call_soon_threadsafe(self._launch, handle)

    # ---- on the loop -------------------------------------------------------------------------------

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        try:
            self._transport = self._make_transport()
            ready.set_result(await self._transport.start())
        except Exception as e:  # start() raises it in the training thread
            ready.set_exception(e)
            return
        try:
            await self._stop
        finally:
            if self._halves is not None:
                await self._halves.close()
            await self._transport.close()

    def _launch(self, handle: Handle) -> None:
        self._progress = time.monotonic()
        try:
            if handle.half is Half.REDUCE_SCATTER:
                op = self._halves.reduce_scatter(handle.flat)
            else:
                op = self._halves.all_gather(handle.flat, handle.timeout)
        except (RuntimeError, ValueError) as e:  # closed, or a buffer it refuses: fail the handle, not the loop
            handle.started = handle.finished = time.monotonic()
            handle.error = str(e)
            handle.done.set()
            return
        op.done.add_done_callback(lambda _: self._ended(handle, op))

    def _ended(self, handle: Handle, op: HalfOp) -> None:
        self._progress = time.monotonic()
        handle.started, handle.finished, handle.error = op.started, op.finished, op.error
        handle.done.set()
