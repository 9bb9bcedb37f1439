"""An answer to a call its caller gave up on is dropped (a fix of hivemind 1.1.12's p2p client).

hivemind's ControlClient sends every unary call (and adds or removes every unary handler) over one
persistent connection to p2pd, parks a future per call in `_pending_calls`, and a single reader task
resolves them as answers come in. A caller that is cancelled while it waits (PeerNode.call's
timeout, a state download cancelling its workers once every holder dropped out) has its future
cancelled at once but only removes it from `_pending_calls` when it next runs. If the answer is read
in between, which a busy CPU makes likely (answers queue up, and the reader takes all that are
buffered in one go), the reader calls set_result on a cancelled future, dies of InvalidStateError,
and from then on no call of that node is ever answered: every request waits out its timeout, and
removing a handler (DHTNode.shutdown) waits forever while p2pd lives.

install() gives hivemind's control module an asyncio whose Future ignores a result or an exception
that arrives after it is done, so the reader drops a late answer and reads on. Nothing else
changes. tests/test_late_answers.py fails if an upgrade of hivemind changes what this relies on.
"""

from __future__ import annotations

import asyncio
import types


class _CallFuture(asyncio.Future):
    """A call's future whose caller may be gone: an answer that finds it done is dropped."""

    def set_result(self, result) -> None:
        if not self.done():
            super().set_result(result)

    def set_exception(self, exception) -> None:
        if not self.done():
            super().set_exception(exception)


class _Asyncio(types.ModuleType):
    """asyncio as hivemind's control module sees it: the same, except for Future."""

    Future = _CallFuture

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


def install() -> None:
    """Have hivemind's p2p client drop late answers. Idempotent."""
    from hivemind.p2p.p2p_daemon_bindings import control

    if not isinstance(control.asyncio, _Asyncio):
        control.asyncio = _Asyncio("asyncio")
