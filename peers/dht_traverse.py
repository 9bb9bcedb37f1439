"""A DHT search cut short ends every task it started (a fix of hivemind 1.1.12's traverse_dht).

Each worker of hivemind's traverse_dht starts a task that waits for the search's end
(`asyncio.create_task(search_finished_event.wait())`) and drops it. A search that ends leaves the task
nothing to wait for; a search that is cancelled (a DHT store cut off by --dht-timeout because a peer is
frozen or gone, a run left during a heartbeat) cancels its workers but not that task, which stays pending
until the garbage collector destroys it and asyncio logs "Task was destroyed but it is pending! ...
coro=<Event.wait()>": 166 such lines in a 10-minute churn test (issue 14).

install() wraps traverse_dht where DHTNode calls it. The tasks a search creates are recorded (the module's
`asyncio.create_task`, seen through a context variable that its workers inherit); when the search raises or
is cancelled, those still pending are cancelled and awaited. A search that returns is left as hivemind
wrote it: its unfinished requests (await_all_tasks=False) still feed the results they were started for.
tests/test_dht_churn.py fails if an upgrade of hivemind changes what this relies on.
"""

from __future__ import annotations

import asyncio
import contextvars
import types

# The tasks of the search running in this context; its workers and their requests inherit it.
_created: contextvars.ContextVar[list[asyncio.Task] | None] = contextvars.ContextVar("dht_search_tasks", default=None)


class _RecordingAsyncio(types.ModuleType):
    """asyncio as hivemind.dht.traverse sees it: the same, except that create_task records the task
    in the search it belongs to."""

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    @staticmethod
    def create_task(coro, **kwargs) -> asyncio.Task:
        task = asyncio.create_task(coro, **kwargs)
        created = _created.get()
        if created is not None:
            created.append(task)
        return task


def install() -> None:
    """Wrap hivemind's traverse_dht for DHTNode. Idempotent."""
    from hivemind.dht import node, traverse

    if getattr(node.traverse_dht, "_peerd_wrapped", False):
        return
    original = node.traverse_dht
    traverse.asyncio = _RecordingAsyncio("asyncio")

    async def traverse_dht(*args, **kwargs):
        created: list[asyncio.Task] = []
        token = _created.set(created)
        try:
            return await original(*args, **kwargs)
        except BaseException:
            left = [t for t in created if not t.done()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            raise
        finally:
            _created.reset(token)

    traverse_dht._peerd_wrapped = True
    node.traverse_dht = traverse_dht
