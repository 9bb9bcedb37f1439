"""bench.overhead's byte counter, loaded into the lab's daemons through PYTHONPATH (never by peerd).

Where PEERD_OVERHEAD_DIR is set, it wraps hivemind's p2pd client once that module is imported: each
unary call this process makes (request and answer bytes, per protocol and per what asked for it:
heartbeat, refresh, rendezvous, ...), each unary request it answers, and each stream it opens or
accepts. Every second it writes the counts to PEERD_OVERHEAD_DIR/<pid>.json. It changes nothing else.
"""

import os

if os.environ.get("PEERD_OVERHEAD_DIR"):
    import contextvars
    import importlib.abc
    import importlib.util
    import json
    import sys
    import threading
    import time

    _DIR = os.environ["PEERD_OVERHEAD_DIR"]
    _CAUSE = contextvars.ContextVar("peerd_overhead_cause", default="")
    _COUNTS: dict[str, list[int]] = {}  # "kind|cause|proto": [calls, bytes out, bytes in]
    _LOCK = threading.Lock()
    _STARTED = []

    def _count(kind: str, cause: str, proto: str, out: int, inn: int) -> None:
        key = f"{kind}|{cause}|{proto}"
        with _LOCK:
            c = _COUNTS.setdefault(key, [0, 0, 0])
            c[0] += 1
            c[1] += out
            c[2] += inn
        if not _STARTED:
            _STARTED.append(threading.Thread(target=_dump_forever, daemon=True, name="overhead-dump"))
            _STARTED[0].start()

    def _dump_forever() -> None:
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        while True:
            with _LOCK:
                snap = {k: list(v) for k, v in _COUNTS.items()}
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), "argv": sys.argv, "t": time.time(), "counts": snap}, f)
            os.replace(tmp, path)
            time.sleep(1.0)

    def _patch_control(mod) -> None:
        cls = mod.ControlClient
        call, add, sopen, shandler = (
            cls.call_unary_handler,
            cls.add_unary_handler,
            cls.stream_open,
            cls.stream_handler,
        )

        async def call_unary_handler(self, peer_id, proto, data):
            answer = await call(self, peer_id, proto, data)
            _count("call", _CAUSE.get(), proto, len(data), len(answer))
            return answer

        async def add_unary_handler(self, proto, handler, balanced=False):
            async def counted(data, remote):
                answer = await handler(data, remote)
                _count("serve", "", proto, len(answer), len(data))
                return answer

            return await add(self, proto, counted, balanced)

        async def stream_open(self, peer_id, protocols):
            _count("stream_open", _CAUSE.get(), ",".join(protocols), 0, 0)
            return await sopen(self, peer_id, protocols)

        async def stream_handler(self, proto, handler_cb, balanced=False):
            async def counted(*a, **k):
                _count("stream_serve", "", proto, 0, 0)
                return await handler_cb(*a, **k)

            return await shandler(self, proto, counted, balanced)

        cls.call_unary_handler = call_unary_handler
        cls.add_unary_handler = add_unary_handler
        cls.stream_open = stream_open
        cls.stream_handler = stream_handler

    def _caused(fn, name):
        async def wrapped(*a, **k):
            outer = _CAUSE.get()
            token = _CAUSE.set(f"{outer}/{name}" if outer else name)
            try:
                return await fn(*a, **k)
            finally:
                _CAUSE.reset(token)

        return wrapped

    def _patch_membership(mod) -> None:
        cls = mod.RunMembership
        for name in ("heartbeat", "refresh", "rendezvous", "rejoin", "leave"):
            setattr(cls, name, _caused(getattr(cls, name), name))

    def _patch_node(mod) -> None:
        cls = mod.PeerNode
        for name in ("store", "get", "ping", "call"):
            setattr(cls, name, _caused(getattr(cls, name), name))

    def _patch_matchmaking(mod) -> None:
        cls = mod.Matchmaker
        for name in ("_store", "_read"):
            setattr(cls, name, _caused(getattr(cls, name), "matchmaking" + name))

    def _patch_manifest(mod) -> None:
        for name in ("fetch", "publish"):
            setattr(mod, name, _caused(getattr(mod, name), "manifest_" + name))

    _PATCHES = {
        "hivemind.p2p.p2p_daemon_bindings.control": _patch_control,
        "peerd.peers.membership": _patch_membership,
        "peerd.peers.node": _patch_node,
        "peerd.peers.matchmaking": _patch_matchmaking,
        "peerd.peers.manifest": _patch_manifest,
    }

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in _PATCHES:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def patched(module):
                exec_module(module)
                _PATCHES[fullname](module)

            spec.loader.exec_module = patched
            return spec

    sys.meta_path.insert(0, _Finder())
