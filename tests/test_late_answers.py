"""hivemind's p2p client and late answers (peers/late_answers.py): the reader of a node's persistent
connection to p2pd gets the answer to a call whose caller was cancelled (a timeout) before the call
left `_pending_calls`, then the answer to the next call. Unpatched, the reader dies on the first and
the next call is never answered (a state download that cancelled its workers, then waited forever)."""

from __future__ import annotations

import asyncio
import uuid

from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.proto import p2pd_pb2 as p2pd_pb

from peerd.peers import late_answers


def framed(call_id: uuid.UUID) -> bytes:
    """An answer to a unary call as p2pd writes it: a varint length, then the message."""
    answer = p2pd_pb.CallUnaryResponse(response=b"ok")
    body = p2pd_pb.PersistentConnectionResponse(callId=call_id.bytes, callUnaryResponse=answer).SerializeToString()
    size, n = bytearray(), len(body)
    while True:
        size.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(size) + body


def test_a_late_answer_to_a_cancelled_call_leaves_the_reader_reading():
    late_answers.install()
    late_answers.install()  # idempotent

    async def scenario():
        client = control.ControlClient.__new__(control.ControlClient)  # only what the reader touches
        client._pending_calls, client._handler_tasks, client._read_task, client._write_task = {}, {}, None, None
        given_up, next_call = uuid.uuid4(), uuid.uuid4()
        for call_id in (given_up, next_call):  # as call_unary_handler parks them, through the module's asyncio
            client._pending_calls[call_id] = control.asyncio.Future()
        client._pending_calls[given_up].cancel()  # its caller's timeout: still in _pending_calls until it runs
        reader = asyncio.StreamReader()
        reader.feed_data(framed(given_up) + framed(next_call))
        reader.feed_eof()
        await client._read_from_persistent_conn(reader)  # returns at the end of the stream, or raises
        assert client._pending_calls[next_call].result() == b"ok"

    asyncio.run(scenario())
