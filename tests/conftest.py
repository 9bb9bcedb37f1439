"""Fixtures that start real daemons as subprocesses on loopback, and reap them whatever happens."""

from __future__ import annotations

import os
import secrets

import pytest

from peerd.daemon.procs import LocalDaemon
from tests.helpers import peer_ids, wait_for

_started: list[LocalDaemon] = []  # every daemon of the session, reaped at its end
_this_test: list[LocalDaemon] = []  # started by the running test itself, reaped when it ends


@pytest.fixture(scope="session", autouse=True)
def _reap_daemons():
    """Kill every daemon a test started, with its p2pd, even when the test failed half-way."""
    yield
    for d in _started:
        d.kill_group()


@pytest.fixture(autouse=True)
def _reap_the_tests_daemons():
    """Kill the daemons a test started once it ends, passed or failed: a failed test's daemons would
    otherwise train on until the session ends and slow every test after it. Daemons of session and
    module fixtures (the cluster) are set up before this fixture and are not the test's."""
    _this_test.clear()
    yield
    for d in _this_test:
        d.kill_group()
    _this_test.clear()


@pytest.fixture(scope="session")
def spawn(tmp_path_factory):
    """spawn(name, args, wait=True) -> LocalDaemon: a real `peerd start` in a fresh data dir."""

    def _spawn(name: str, args=(), *, wait: bool = True, data_dir=None) -> LocalDaemon:
        d = LocalDaemon(data_dir or tmp_path_factory.mktemp("d") / name, list(args))
        _started.append(d)
        _this_test.append(d)
        return d.start(wait=wait)

    return _spawn


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "run.secret"
    path.write_text(secrets.token_hex(32))
    os.chmod(path, 0o600)
    return path


CLUSTER_RUN = "alpha"


@pytest.fixture(scope="session")
def cluster(spawn, secret_file):
    """Three daemons in the secret run `alpha`, each seeing the other two. Tests must leave it so."""
    args = ["--run", CLUSTER_RUN, "--run-secret-file", str(secret_file)]
    a = spawn("a", args)
    b = spawn("b", [*args, "--initial-peers", a.maddrs[0]], wait=False)
    c = spawn("c", [*args, "--initial-peers", a.maddrs[0]], wait=False)
    b.wait_ready()
    c.wait_ready()
    daemons = [a, b, c]
    for d in daemons:
        others = sorted(x.peer_id for x in daemons if x is not d)
        wait_for(lambda: peer_ids(d, CLUSTER_RUN) == others, timeout=20, what=f"{d.data_dir.name} sees the other two")
    return daemons


@pytest.fixture
def loop_thread():
    """An event loop in a thread (tests/helpers.LoopThread), closed after the test."""
    from tests import helpers

    running = helpers._LOOP = helpers.LoopThread()
    yield running
    helpers._LOOP = None
    running.close()
