"""The two retries (tenacity): attaching to a daemon that is away, a round's listener on a taken port.
Fakes stand in for the daemon and the transports; a real restart is tests/test_your_loop.py's."""

import asyncio
import errno

import grpc
import pytest

import peerd.attachment
from peerd import PeerdError
from peerd.attachment import Attachment
from peerd.peers.averaging import START_ATTEMPTS, MoshpitAverager


class _Rpc(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return f"{self._code.name} details"


def _attachment(reconnect_timeout: float, answers: list) -> Attachment:
    a = Attachment(
        run="r",
        daemon="/nowhere",
        control=None,
        layout=[],
        settings={},
        device="cpu",
        attach_timeout=1.0,
        reconnect_timeout=reconnect_timeout,
    )

    def once(step):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    a._attach_once = once
    return a


def test_attach_retries_only_an_absent_daemon_until_its_deadline(monkeypatch):
    monkeypatch.setattr(peerd.attachment, "RETRY_EVERY", 0.01)
    away = _Rpc(grpc.StatusCode.UNAVAILABLE)
    assert _attachment(5.0, [away, away, "attached"]).attach(0) == "attached"
    with pytest.raises(PeerdError, match="NOT_FOUND details"):  # an answer, not an absence: raised at once
        _attachment(5.0, [_Rpc(grpc.StatusCode.NOT_FOUND), "attached"]).attach(0)
    with pytest.raises(PeerdError, match="did not answer within 0 s"):
        _attachment(0.0, [away, "attached"]).attach(0)


class _Transport:
    def __init__(self, error):
        self.error, self.closed = error, False

    async def start(self):
        if self.error:
            raise self.error
        return "127.0.0.1:1"

    async def close(self):
        self.closed = True


@pytest.mark.parametrize("taken", [0, START_ATTEMPTS - 1, START_ATTEMPTS])
def test_a_listener_on_a_taken_port_is_tried_again_on_a_fresh_one(taken):
    made = []

    class Fake:
        def _transport(self, key):
            made.append(_Transport(OSError(errno.EADDRINUSE, "in use") if len(made) < taken else None))
            return made[-1]

    if taken < START_ATTEMPTS:
        transport, address = asyncio.run(MoshpitAverager._listen(Fake(), "k"))
        assert address == "127.0.0.1:1" and transport is made[-1] and len(made) == taken + 1
    else:
        with pytest.raises(OSError):
            asyncio.run(MoshpitAverager._listen(Fake(), "k"))
        assert len(made) == START_ATTEMPTS
    assert all(t.closed for t in made[:taken])


def test_another_listener_error_is_not_retried():
    made = []

    class Fake:
        def _transport(self, key):
            made.append(_Transport(OSError(errno.EACCES, "denied")))
            return made[-1]

    with pytest.raises(OSError, match="denied"):
        asyncio.run(MoshpitAverager._listen(Fake(), "k"))
    assert len(made) == 1 and made[0].closed
