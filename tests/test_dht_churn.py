"""DHT requests while peers freeze (real p2pd daemons, some stopped with SIGSTOP): a store cut off
by its timeout is counted, and leaves no task pending behind it (issue 14: survivors of a churn test
logged "Task was destroyed but it is pending! ... coro=<Event.wait()>", one per interrupted store)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time

from peerd.peers.events import PeerEvents
from tests.helpers import peer_nodes


def test_stores_cut_off_by_frozen_peers_leave_no_pending_task(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")  # where asyncio reports a pending task it destroys
    results: list[tuple[str, str]] = []

    async def scenario():
        events = PeerEvents(dht_request=lambda op, result: results.append((op, result)))
        async with peer_nodes(4, tmp_path, events) as nodes:
            frozen = [n.p2p._child.pid for n in nodes[2:]]
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)  # their RPCs hang: the stores' searches outlast the timeout
            try:
                nodes[0].settings.request_timeout = 0.5
                for i in range(3):
                    await nodes[0].store(f"key-{i}", "sub", b"value", time.time() + 30)
            finally:
                for pid in frozen:
                    os.kill(pid, signal.SIGCONT)
            gc.collect()  # what nothing references any more goes now, pending or not
            await asyncio.sleep(0)
        gc.collect()  # and what shutdown() ended

    asyncio.run(scenario())
    # A store may finish in time when the frozen peers are not yet in node 0's routing table (a slow
    # bootstrap on a busy machine); one cut off by its timeout is what this test is about.
    assert ("store", "timeout") in results, results
    destroyed = [r.getMessage() for r in caplog.records if "Task was destroyed" in r.getMessage()]
    assert destroyed == [], destroyed
