"""State sync: a daemon that joins late, restarts or fell behind downloads the run's state from peers.

A snapshot is one flat float32 vector (parameters and optimizer state, laid out identically on every
peer of the run) and the global step it belongs to. It is content-addressed: its bytes are cut into
chunks of `chunk_bytes` (the last one shorter), each hashed with blake2b-128, and snapshot_id =
blake2b-128(step, 8 bytes LE || numel, 8 bytes LE || chunk hashes). Donors holding the same bytes at
the same step (with the same chunk size) advertise the same id.

Protocol (protos/state.proto; one handler name per RPC serves every run, picked by run_key):
* info: the id, step, numel, chunk size and chunk hashes of the newest snapshot the donor's trainer
  published (StateServer.serve's provider), or NO_SNAPSHOT. Hashed once per snapshot (in a thread
  when large). A donor holds the `keep` snapshots it advertised last (default 3: the newest and the
  two before), so a download in progress survives the next rounds' publications, and lets go of
  one that no request touched for HOLD_IDLE s unless the trainer still publishes it: each is a copy
  of the whole state (8 bytes a parameter for DiLoCo's [θ; m]) that only downloads need.
* chunk (snapshot_id, index): that chunk's bytes while the donor holds the snapshot, else GONE.
  Through p2pd, or over direct TCP where the donor listens (StateServer(tcp_host=...); its info
  answer gives the address): the fast path, with the same checks (peers/state_tcp.py). A fetcher
  whose connection to a donor fails or breaks asks that donor through p2pd from then on.
* Secret runs: every request carries tag = HMAC-SHA256(state key; caller, donor, kind, snapshot_id,
  index). The donor recomputes it with the caller's peer ID (p2pd's authenticated one; over direct
  TCP the one the request names), so a peer without the secret gets nothing and a captured request
  is worthless to any other peer (over TCP, but for the chunk it names). The state key derives
  from the secret's seal_key, not key_id: key_id is public (it names the run's DHT keys).

fetch_state, the downloader, returns a FetchResult (never raises for network trouble):
1. asks every donor for info at once, checks each answer (sizes, hash count, the id recomputed from
   the hashes) and picks with choose_snapshot: the highest step >= min_step, then the id most donors
   at that step advertise;
2. keeps `parallel` chunk requests in flight, each to the live holder with the fewest in flight, and
   checks every chunk against its hash before writing it;
3. drops a donor that errors, times out, answers anything but OK or sends a chunk that fails its
   hash, and requeues the chunk for the others. Every request verifies a chunk or meets a dropped
   donor, so there are at most chunks + donors * parallel requests; `timeout` bounds the whole call.
When every holder is dropped (or time is up) the result says why, and `partial` holds what was
verified: pass it as `resume` to a later call (new donors, fresh info) and each verified chunk whose
hash is unchanged at its index is kept. Do not modify partial.tensor in between.

Rejections, counted through PeerEvents.rejected (the request is answered REFUSED or GONE; nothing changes):
  state_malformed         a request field of the wrong size (run key, tag, snapshot id)
  state_unknown_run       a run_key this daemon does not serve (another run, or a run under another secret)
  state_bad_tag           a missing or wrong tag in a secret run (wrong secret, or replayed by another peer)
  state_unknown_snapshot  a chunk of a snapshot this donor does not hold (never did, or not any more)
  state_bad_index         a chunk index past the snapshot's last chunk
  state_bad_info          (fetcher side) an info answer that is inconsistent: sizes, hash count, id
  state_bad_chunk         (fetcher side) a chunk whose length or hash differs from the advertised one
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from peerd.peers.events import PeerEvents
from peerd.peers.node import P2PContext, PeerNode
from peerd.peers.run_ids import RunSecret, run_dht_key
from peerd.peers.state_tcp import TcpLink, parse_address, serve_connection
from peerd.protos import state_pb2 as pb

if TYPE_CHECKING:  # torch is imported where a tensor is touched: a daemon that trains nothing never loads it
    import torch

__all__ = [
    "FetchResult",
    "Partial",
    "Snapshot",
    "SnapshotInfo",
    "StateServer",
    "choose_snapshot",
    "fetch_state",
    "snapshot_id",
    "state_tag",
]

INFO_HANDLER = "peerd.state.v1.info"
CHUNK_HANDLER = "peerd.state.v1.chunk"
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 4 << 10, 2 << 20  # p2pd refuses unary messages over 4 MiB
MAX_CHUNKS = 1 << 16  # keeps an info answer near 1 MiB at most
DIGEST_BYTES, TAG_BYTES, MAX_RUN_KEY_CHARS, MAX_CALLER_CHARS = 16, 32, 256, 128
HASH_IN_THREAD_BYTES = 4 << 20  # hashing more on the event loop would stall it for milliseconds
HOLD_IDLE = 30.0  # seconds a held snapshot outlives its last request: 3 request timeouts of a fetcher


def _digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def snapshot_id(step: int, numel: int, chunk_hashes) -> bytes:
    return _digest(step.to_bytes(8, "little") + numel.to_bytes(8, "little") + b"".join(chunk_hashes))


def state_tag(secret: RunSecret, caller: str, donor: str, kind: bytes, snapshot: bytes = b"", index: int = 0) -> bytes:
    """The tag of a request of `kind` (b"info" or b"chunk") from `caller` to `donor` in a secret run."""
    key = hmac.new(secret.seal_key, b"peerd state-sync v1", hashlib.sha256).digest()
    msg = b"\0".join((caller.encode(), donor.encode(), kind, snapshot)) + index.to_bytes(4, "little")
    return hmac.new(key, msg, hashlib.sha256).digest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().numpy()).cast("B")


def _fits(t: torch.Tensor | None, numel: int) -> bool:
    """Whether t can hold a snapshot of `numel` elements in place."""
    import torch

    return (
        t is not None
        and t.numel() == numel
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.is_contiguous()
    )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a trainer publishes. The server keeps a reference: never modify the tensor afterwards."""

    step: int  # the run's global step this state belongs to
    tensor: torch.Tensor  # flat, contiguous, float32, on the CPU, not empty

    def __post_init__(self) -> None:
        t = self.tensor
        if not 0 <= self.step < 2**63 or t.dim() != 1 or t.numel() == 0 or not _fits(t, t.numel()):
            raise ValueError("a snapshot is a step in [0, 2**63) and a non-empty flat contiguous float32 CPU tensor")


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """A snapshot's description: what an info answer carries, checked by consistent()."""

    id: bytes
    step: int
    numel: int
    chunk_bytes: int
    hashes: tuple[bytes, ...]

    @classmethod
    def of(cls, snapshot: Snapshot, chunk_bytes: int) -> "SnapshotInfo":
        data, numel = _bytes_of(snapshot.tensor), snapshot.tensor.numel()
        hashes = tuple(_digest(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes))
        return cls(snapshot_id(snapshot.step, numel, hashes), snapshot.step, numel, chunk_bytes, hashes)

    def consistent(self) -> bool:
        cb = self.chunk_bytes
        return (
            len(self.id) == DIGEST_BYTES
            and MIN_CHUNK_BYTES <= cb <= MAX_CHUNK_BYTES
            and cb % 4 == 0
            and 0 < self.numel
            and self.step < 2**63
            and len(self.hashes) == -(-self.numel * 4 // cb) <= MAX_CHUNKS
            and all(len(h) == DIGEST_BYTES for h in self.hashes)
            and snapshot_id(self.step, self.numel, self.hashes) == self.id
        )

    def span(self, index: int) -> slice:
        return slice(index * self.chunk_bytes, min((index + 1) * self.chunk_bytes, self.numel * 4))


def choose_snapshot(infos: dict[str, SnapshotInfo], min_step: int) -> tuple[SnapshotInfo | None, list[str], str]:
    """What to download: the highest step >= min_step, then the id most donors hold, then the smallest
    id. Returns (its description or None, the donors holding it, a human-readable reason)."""
    eligible = [i for i in infos.values() if i.step >= min_step]
    if not eligible:
        steps = sorted({i.step for i in infos.values()})
        return None, [], f"no snapshot at step >= {min_step} among {len(infos)} answer(s) (steps {steps})"
    top = max(i.step for i in eligible)
    votes = Counter(i.id for i in eligible if i.step == top)
    best = min(votes, key=lambda sid: (-votes[sid], sid))
    holders = sorted(d for d, i in infos.items() if i.id == best)
    return infos[holders[0]], holders, f"step {top}: {len(holders)} donor(s), {len(votes) - 1} other id(s) at it"


@dataclass(slots=True)
class _Served:
    run_id: str
    secret: RunSecret | None
    provider: Callable[[], Snapshot | None]
    held: deque[tuple[Snapshot, SnapshotInfo]]  # the snapshots advertised last, newest at the right
    lock: asyncio.Lock  # one hashing per new snapshot, however many info requests arrive at once
    used: dict[bytes, float] = field(default_factory=dict)  # snapshot id -> time of its last request


class StateServer:
    """Serves the snapshots of every run this daemon serves; start() registers the two handlers."""

    def __init__(
        self,
        node: PeerNode,
        events: PeerEvents | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep: int = 3,
        tcp_host: str | None = None,
        advertise_host: str | None = None,
    ):
        """tcp_host: also serve chunks over direct TCP on that host (an OS-chosen port), advertised in
        info answers as advertise_host (default tcp_host):port; None: through p2pd only."""
        if not (MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES and chunk_bytes % 4 == 0) or keep < 2:
            raise ValueError(f"need chunk_bytes a multiple of 4 in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], keep >= 2")
        self.node, self.events, self.chunk_bytes, self.keep = node, events or node.events, chunk_bytes, keep
        self.tcp_host, self.advertise_host = tcp_host, advertise_host or tcp_host
        self.tcp_address = ""  # "host:port" once start() listens on TCP
        self._tcp: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._releaser: asyncio.Task | None = None
        self._runs: dict[str, _Served] = {}  # by run_key

    async def start(self) -> None:
        await self.node.add_handler(INFO_HANDLER, self._on_info, pb.StateInfoRequest)
        await self.node.add_handler(CHUNK_HANDLER, self._on_chunk, pb.StateChunkRequest)
        if self.tcp_host is not None:
            self._tcp = await asyncio.start_server(self._on_tcp, self.tcp_host, 0)
            port = self._tcp.sockets[0].getsockname()[1]
            host = self.advertise_host
            self.tcp_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._releaser = asyncio.create_task(self._release_idle_forever(), name="state-release")

    async def _release_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(HOLD_IDLE / 2)
            self.release_idle(time.monotonic())

    def release_idle(self, now: float) -> int:
        """Let go of the held snapshots no request touched for HOLD_IDLE s by `now`, except each
        run's current one (its trainer holds it anyway); returns how many were let go."""
        released = 0
        for served in self._runs.values():
            current = served.provider()
            keep = [(s, i) for s, i in served.held if s is current or now - served.used.get(i.id, now) < HOLD_IDLE]
            released += len(served.held) - len(keep)
            served.held = deque(keep, maxlen=self.keep)
            served.used = {i.id: served.used[i.id] for _, i in keep if i.id in served.used}
        return released

    async def stop(self) -> None:
        """Close the TCP listener and its connections (the p2pd handlers go with the node)."""
        if self._releaser is not None:
            self._releaser.cancel()
            await asyncio.gather(self._releaser, return_exceptions=True)
            self._releaser = None
        if self._tcp is not None:
            self._tcp.close()
            for writer in self._connections:
                writer.close()
            await self._tcp.wait_closed()
            self._tcp = None

    def serve(self, run_id: str, secret: RunSecret | None, provider: Callable[[], Snapshot | None]) -> None:
        """Answer for run_id from now on. provider() is called on every info request: it must return
        the same Snapshot object until the trainer publishes the next one (a new object is hashed)."""
        self._runs[run_dht_key(run_id, secret)] = _Served(
            run_id, secret, provider, deque(maxlen=self.keep), asyncio.Lock()
        )

    def stop_serving(self, run_id: str) -> None:
        """Stop answering for run_id and release its snapshots; downloads in progress are refused."""
        self._runs = {k: s for k, s in self._runs.items() if s.run_id != run_id}

    async def _newest(self, served: _Served) -> SnapshotInfo | None:
        snapshot = served.provider()
        if snapshot is None:
            return None
        async with served.lock:
            info = next((i for s, i in served.held if s is snapshot), None)
            if info is None:
                describe = functools.partial(SnapshotInfo.of, snapshot, self.chunk_bytes)
                large = snapshot.tensor.numel() * 4 > HASH_IN_THREAD_BYTES
                info = await asyncio.to_thread(describe) if large else describe()
                # The same bytes republished count once; the deque forgets the oldest beyond `keep`.
                served.held = deque(((s, i) for s, i in served.held if i.id != info.id), maxlen=self.keep)
                served.held.append((snapshot, info))
            served.used[info.id] = time.monotonic()
            return info

    def _admit(self, run_key: str, tag: bytes, caller: str, kind: bytes, snapshot: bytes = b"", index: int = 0):
        """The served run a request is for, or None after counting why it is refused."""
        served = self._runs.get(run_key)
        if (
            len(run_key) > MAX_RUN_KEY_CHARS
            or len(tag) not in (0, TAG_BYTES)
            or len(snapshot) != (DIGEST_BYTES if kind == b"chunk" else 0)
            or len(caller) > MAX_CALLER_CHARS
        ):
            reason = "state_malformed"
        elif served is None:
            reason = "state_unknown_run"
        elif served.secret is not None and not hmac.compare_digest(
            tag, state_tag(served.secret, caller, self.node.peer_id, kind, snapshot, index)
        ):
            reason = "state_bad_tag"
        else:
            return served
        self.events.rejected(reason)
        return None

    async def _on_info(self, request: pb.StateInfoRequest, context: P2PContext) -> pb.StateInfoResponse:
        served = self._admit(request.run_key, request.tag, context.remote_id.to_base58(), b"info")
        if served is None:
            return pb.StateInfoResponse(status=pb.STATE_STATUS_REFUSED)
        info = await self._newest(served)
        if info is None:
            return pb.StateInfoResponse(status=pb.STATE_STATUS_NO_SNAPSHOT)
        return pb.StateInfoResponse(
            status=pb.STATE_STATUS_OK,
            snapshot_id=info.id,
            step=info.step,
            numel=info.numel,
            chunk_bytes=info.chunk_bytes,
            chunk_hashes=info.hashes,
            tcp_address=self.tcp_address,
        )

    def _answer(self, request: pb.StateChunkRequest, caller: str) -> tuple[int, memoryview | None]:
        """A chunk request's status and, when OK, the chunk's bytes (a view of the snapshot)."""
        sid, index = request.snapshot_id, request.index
        served = self._admit(request.run_key, request.tag, caller, b"chunk", sid, index)
        if served is None:
            return pb.STATE_STATUS_REFUSED, None
        held = next(((s, i) for s, i in served.held if i.id == sid), None)
        if held is None:
            self.events.rejected("state_unknown_snapshot")
            return pb.STATE_STATUS_GONE, None
        snapshot, info = held
        served.used[sid] = time.monotonic()
        if index >= len(info.hashes):
            self.events.rejected("state_bad_index")
            return pb.STATE_STATUS_REFUSED, None
        return pb.STATE_STATUS_OK, _bytes_of(snapshot.tensor)[info.span(index)]

    async def _on_chunk(self, request: pb.StateChunkRequest, context: P2PContext) -> pb.StateChunkResponse:
        status, data = self._answer(request, context.remote_id.to_base58())
        return pb.StateChunkResponse(status=status, data=data.tobytes() if data is not None else b"")

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Over TCP the caller names itself: the tag of a secret run binds that name (peers/state_tcp.py).
        self._connections.add(writer)
        try:
            await serve_connection(reader, writer, lambda r: self._answer(r, r.caller), self.events.rejected)
        finally:
            self._connections.discard(writer)


@dataclass(frozen=True, slots=True)
class Partial:
    """What a failed fetch verified; pass it as fetch_state(resume=...) to keep those chunks."""

    info: SnapshotInfo  # the snapshot it was downloading
    tensor: torch.Tensor  # holds the verified chunks
    verified: frozenset[int]  # indices of the chunks of `tensor` that match their hash


@dataclass(kw_only=True, slots=True)
class FetchResult:
    ok: bool  # tensor holds the whole snapshot, every chunk verified
    reason: str  # one human-readable line: what was fetched, or why not, and which donors were dropped why
    step: int | None = None  # of the chosen snapshot; None if none was chosen
    snapshot_id: bytes | None = None
    tensor: torch.Tensor | None = None  # when ok: `out` if it fit, else resume's tensor if it fit, else a new one
    donors_used: tuple[str, ...] = ()  # donors that sent at least one verified chunk, most chunks first
    bytes: int = 0  # verified chunk bytes downloaded by this call (chunks kept from `resume` excluded)
    direct_bytes: int = 0  # of `bytes`, those that came over direct TCP (the rest through p2pd)
    duration: float = 0.0  # seconds from the call to the return
    partial: Partial | None = None  # when not ok after a snapshot was chosen: the progress to resume from


class _Fetch:
    """The state of one fetch_state call, readable whenever the overall timeout strikes."""

    def __init__(self, node: PeerNode, run_id: str, secret: RunSecret | None, request_timeout: float, events):
        self.node, self.secret, self.request_timeout, self.events = node, secret, request_timeout, events
        self.run_key = run_dht_key(run_id, secret)
        self.info: SnapshotInfo | None = None
        self.buffer: torch.Tensor | None = None
        self.verified: set[int] = set()
        self.served: Counter[str] = Counter()  # verified chunks by donor
        self.dropped: dict[str, str] = {}  # donor -> why (its first failure)
        self.bytes = self.direct_bytes = 0
        self.addresses: dict[str, tuple[str, int]] = {}  # donor -> its direct TCP listener, while it works
        self.links: dict[str, list[TcpLink]] = {}  # donor -> idle connections to it

    async def _call(self, donor: str, handler: str, request, response_type, kind: bytes, index: int = 0):
        """One RPC to `donor`; its OK answer, or None with the donor's failure recorded."""
        if self.secret is not None:
            snapshot = self.info.id if kind == b"chunk" else b""
            request.tag = state_tag(self.secret, self.node.peer_id, donor, kind, snapshot, index)
        try:
            answer = await self.node.call(donor, handler, request, response_type, self.request_timeout)
        except Exception as e:  # a timeout, a dead donor, a handler error: p2pd raises several types
            self.dropped.setdefault(donor, f"{kind.decode()}: {type(e).__name__}")
            return None
        if answer.status != pb.STATE_STATUS_OK:
            self.dropped.setdefault(donor, f"{kind.decode()}: {pb.StateStatus.Name(answer.status)}")
            return None
        return answer

    async def ask_info(self, donor: str) -> SnapshotInfo | None:
        request = pb.StateInfoRequest(run_key=self.run_key)
        r = await self._call(donor, INFO_HANDLER, request, pb.StateInfoResponse, b"info")
        if r is None:
            return None
        info = SnapshotInfo(r.snapshot_id, r.step, r.numel, r.chunk_bytes, tuple(r.chunk_hashes))
        if not info.consistent():
            self.events.rejected("state_bad_info")
            self.dropped[donor] = "info: inconsistent"
            return None
        address = parse_address(r.tcp_address)
        if address is not None:
            self.addresses[donor] = address
        return info

    def prepare(self, info: SnapshotInfo, out: torch.Tensor | None, resume: Partial | None) -> None:
        """Pick the buffer (out, else resume's, else new) and keep resumed chunks whose hash is unchanged."""
        import torch

        self.info = info
        old = resume.tensor if resume is not None and _fits(resume.tensor, info.numel) else None
        fresh = old if old is not None else torch.empty(info.numel, dtype=torch.float32)
        self.buffer = out if _fits(out, info.numel) else fresh
        if old is None or resume.info.chunk_bytes != info.chunk_bytes:
            return
        self.verified = {i for i in resume.verified if resume.info.hashes[i] == info.hashes[i]}
        if old is not self.buffer:
            dst, src = _bytes_of(self.buffer), _bytes_of(old)
            for i in self.verified:
                dst[info.span(i)] = src[info.span(i)]

    async def download(self, holders: list[str], parallel: int) -> None:
        """Returns when every chunk is verified or every holder is dropped."""
        live, inflight, finished = set(holders), Counter(), asyncio.Event()
        queue = asyncio.Queue()
        for i in sorted(set(range(len(self.info.hashes))) - self.verified):
            queue.put_nowait(i)

        async def worker() -> None:
            while live:
                index = await queue.get()
                donor = min(live, key=lambda d: (inflight[d], self.served[d], d))
                inflight[donor] += 1
                try:
                    ok = await self._chunk(donor, index)
                finally:
                    inflight[donor] -= 1
                if not ok:
                    live.discard(donor)
                    queue.put_nowait(index)
                if not live or len(self.verified) == len(self.info.hashes):
                    finished.set()

        workers = [asyncio.create_task(worker()) for _ in range(min(parallel, queue.qsize()))]
        for w in workers:
            w.add_done_callback(lambda _: finished.set())  # a worker that crashed must not leave us waiting
        try:
            if workers:
                await finished.wait()
        finally:
            for w in workers:
                w.cancel()
            crashes = [e for e in await asyncio.gather(*workers, return_exceptions=True) if isinstance(e, Exception)]
        if crashes:
            raise crashes[0]

    async def _chunk(self, donor: str, index: int) -> bool:
        """Fetch, check and write one chunk; False (the donor's failure recorded) if that failed.
        Over direct TCP where the donor offers it; through p2pd once that fails to connect or breaks."""
        if donor in self.addresses:
            direct = await self._chunk_tcp(donor, index)
            if direct is not None:
                return direct
            self.addresses.pop(donor, None)
        request = pb.StateChunkRequest(run_key=self.run_key, snapshot_id=self.info.id, index=index)
        r = await self._call(donor, CHUNK_HANDLER, request, pb.StateChunkResponse, b"chunk", index)
        if r is None:
            return False
        span = self.info.span(index)
        if len(r.data) != span.stop - span.start or _digest(r.data) != self.info.hashes[index]:
            return self._bad_chunk(donor, index)
        _bytes_of(self.buffer)[span] = r.data
        return self._verified(donor, index, len(r.data))

    async def _chunk_tcp(self, donor: str, index: int) -> bool | None:
        """One chunk over a connection to the donor's listener, received straight into the buffer
        (its span is not verified, so nothing verified is overwritten); None if the connection
        failed (the caller falls back to p2pd)."""
        request = pb.StateChunkRequest(
            run_key=self.run_key, snapshot_id=self.info.id, index=index, caller=self.node.peer_id
        )
        if self.secret is not None:
            request.tag = state_tag(self.secret, self.node.peer_id, donor, b"chunk", self.info.id, index)
        into = _bytes_of(self.buffer)[self.info.span(index)]
        idle, link = self.links.setdefault(donor, []), None
        try:
            async with asyncio.timeout(self.request_timeout):
                link = idle.pop() if idle else await TcpLink.open(*self.addresses[donor])
                status, size = await link.ask(request.SerializeToString(), into)
        except BaseException as e:  # failed or cancelled mid-answer: the stream's position is unknown
            if link is not None:
                link.close()
            if isinstance(e, (OSError, EOFError, TimeoutError)):
                return None
            raise
        if status != pb.STATE_STATUS_OK or size != len(into):
            if size:  # bytes left unread on the stream
                link.close()
            else:
                idle.append(link)
            if status != pb.STATE_STATUS_OK:
                self.dropped.setdefault(donor, f"chunk: {pb.StateStatus.Name(status)}")
                return False
            return self._bad_chunk(donor, index)
        idle.append(link)
        if _digest(into) != self.info.hashes[index]:
            return self._bad_chunk(donor, index)
        self.direct_bytes += size
        return self._verified(donor, index, size)

    def _bad_chunk(self, donor: str, index: int) -> bool:
        self.events.rejected("state_bad_chunk")
        self.dropped.setdefault(donor, f"chunk {index}: bad hash")
        return False

    def _verified(self, donor: str, index: int, size: int) -> bool:
        self.verified.add(index)
        self.served[donor] += 1
        self.bytes += size
        return True

    def close(self) -> None:
        """Close every connection to a donor's listener."""
        for links in self.links.values():
            for link in links:
                link.close()
        self.links.clear()

    def result(self, ok: bool, reason: str, started: float) -> FetchResult:
        info = self.info
        if self.dropped:
            reason += "; dropped " + ", ".join(f"{d} ({why})" for d, why in sorted(self.dropped.items()))
        return FetchResult(
            ok=ok,
            reason=reason,
            step=info.step if info else None,
            snapshot_id=info.id if info else None,
            tensor=self.buffer if ok else None,
            donors_used=tuple(d for d, _ in self.served.most_common()),
            bytes=self.bytes,
            direct_bytes=self.direct_bytes,
            duration=time.monotonic() - started,
            partial=Partial(info, self.buffer, frozenset(self.verified)) if info and not ok else None,
        )


async def fetch_state(
    node: PeerNode,
    run_id: str,
    secret: RunSecret | None,
    donors: list[str],
    *,
    min_step: int = 0,
    out: torch.Tensor | None = None,
    resume: Partial | None = None,
    parallel: int = 8,
    request_timeout: float = 10.0,
    timeout: float = 300.0,
    events: PeerEvents | None = None,
) -> FetchResult:
    """Download the best snapshot `donors` hold (see the module docstring). `request_timeout` covers one
    info or chunk RPC; `timeout` covers the whole call. Writes into `out` when it is a contiguous
    float32 CPU tensor of the snapshot's numel, else into resume's tensor if that fits, else a new one."""
    started = time.monotonic()
    fetch = _Fetch(node, run_id, secret, request_timeout, events or node.events)
    donors = list(dict.fromkeys(d for d in donors if d != node.peer_id))
    try:
        async with asyncio.timeout(timeout):
            answers = await asyncio.gather(*(fetch.ask_info(d) for d in donors))
            info, holders, why = choose_snapshot({d: i for d, i in zip(donors, answers) if i}, min_step)
            if info is None:
                return fetch.result(False, f"{why} from {len(donors)} donor(s)", started)
            fetch.prepare(info, out, resume)
            kept = len(fetch.verified)
            await fetch.download(holders, max(1, parallel))
    except TimeoutError:
        done = f"{len(fetch.verified)}/{len(fetch.info.hashes)} chunks" if fetch.info else "no snapshot chosen"
        return fetch.result(False, f"timed out after {timeout} s with {done}", started)
    finally:
        fetch.close()
    n, got = len(info.hashes), len(fetch.verified)
    if got < n:
        return fetch.result(False, f"{why}; every holder dropped with {got}/{n} chunks verified", started)
    direct = f"{fetch.direct_bytes >> 20} of {fetch.bytes >> 20} MiB over direct TCP"
    return fetch.result(
        True, f"{why}; {n} chunks, {kept} kept from resume, from {len(fetch.served)} donor(s), {direct}", started
    )
