"""Group all-reduce (reduce-scatter + all-gather) with an explicit, agreed outcome per round.

    engine = GroupAllReduce(group, transport, numel, settings=..., events=...)
    outcome = await engine.all_reduce(tensor, weight, round_no)

Result: every member that completes holds, chunk by chunk, sum_i(w_i x_i) / sum_i(w_i) over the
contributions that reached the chunk's owner in time. Member i owns the contiguous shard i (sizes
differ by at most one); shards travel in chunks of `chunk_elements`.

A round, on each member, timed from the call (settings in group.py):
1. CONTRIBUTE: open the links not open yet (`connect_timeout`); send slice j of the tensor to owner
   j, chunk by chunk. Each contribution to my shard is folded into my chunk as it arrives; once
   every other member's chunk c is in (or its connection closed), chunk c is finished and sent to
   every member, so the all-gather overlaps the reduce-scatter. At `contribute_timeout` the
   remaining chunks are finished with what arrived (each says whose contributions it holds).
   Contributions with NaN/Inf are left out of their chunk, refused and counted.
2. GATHER: wait until every chunk of every shard arrived, or one no longer can (its owner's
   connection closed, or it was refused), or `gather_timeout` passed. Chunks land straight in the
   tensor; each chunk's old value is saved first (inbox.py), so nothing is copied on COMPLETE
   (with `restore=False`, only this member's own shard is saved: the caller restores the rest).
3. DECIDE: broadcast my verdict (OK with a digest of the whole result, or ABORT), then apply the
   pure rule of decision.py until it says COMPLETE or ABORT, at the latest at `gather_timeout +
   verdict_timeout`. Wait up to `drain_timeout` for queued sends (links still full are closed);
   on ABORT put back every chunk the round overwrote: the tensor is exactly as before the call
   (with `restore=False`, only this member's own shard; see all_reduce).

Contract. A member SIGKILLed or SIGSTOPped at any point holds the others up for at most
`longest_round` (gather + verdict + drain timeouts), and the survivors all decide the same:
* an owner that fails before every member holds its shard makes each member that lacks it abort
  and say so. Those ABORTs leave before their senders' gather deadlines, hence inside every other
  member's verdict window; a member that hears one echoes it. Everyone aborts.
* an owner that fails after every member holds its shard changes nothing: silence in the verdict
  exchange is not a reason to abort, so every member completes with the same digest.
Assumption: members call all_reduce for a round within `verdict_timeout` (minus a message delay)
of each other. What is left open: two failures in one round (a member X whose ABORT reached only
some members, all of which fail before echoing it), or X itself frozen and resumed so that its
late ABORT lands between two other members' verdict deadlines (a gap no wider than their start
skew). A member that was frozen through a round reports ABORTED (its tensor restored) while the
others may have completed: the Outcome says so, and the caller must resynchronise that member
(state sync) before it contributes again.

Not covered here: authentication (in secret runs, linkauth.py makes every link open with a hello
keyed by the secret; in open runs anyone who knows the run ID and a member index can speak as that
member), retransmission (a contribution that misses
its owner's deadline is left out, not resent), and re-owning a dead owner's shard (the round aborts).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

import torch

from peerd.peers.collective.codec import Format
from peerd.peers.collective.decision import Decision, Verdict, decide, result_digest
from peerd.peers.collective.group import AllReduceSettings, Group
from peerd.peers.collective.chunks import ChunkRule
from peerd.peers.collective.inbox import Inbox, InboxBuffers
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.collective.reduction import ShardReducer
from peerd.peers.collective.rounds import Phase, RoundState
from peerd.peers.collective.transport import Link, Transport
from peerd.peers.collective.wire import DIGEST_SIZE, AbortCode, DType, Header, Kind
from peerd.peers.events import PeerEvents


class GroupAllReduce:
    """All-reduces float32 vectors of `numel` elements within one group, over one transport.

    Buffers and connections are allocated once and reused by every round; `buffers` lends the
    engine receive buffers kept from an earlier engine (a caller that builds one engine per round).
    Rounds must be called one at a time, with increasing numbers (consecutive numbers let early
    messages be buffered)."""

    def __init__(
        self,
        group: Group,
        transport: Transport,
        numel: int,
        *,
        settings: AllReduceSettings | None = None,
        events: PeerEvents | None = None,
        buffers: InboxBuffers | None = None,
    ):
        self.settings = settings or AllReduceSettings()
        block = Format(self.settings.payload).alignment
        if -(-numel // block) < group.size:
            raise ValueError(f"cannot shard {numel} elements ({self.settings.payload}) among {group.size} members")
        self.group, self.transport, self.numel = group, transport, numel
        self.events = events or PeerEvents()
        self.inbox = self._make_inbox(buffers)
        self.links: dict[int, Link | None] = {k: None for k in range(group.size) if k != group.me}
        self._busy = False
        transport.attach(self.inbox)

    async def all_reduce(self, tensor: torch.Tensor, weight: float, round_no: int, *, restore: bool = True) -> Outcome:
        """Average `tensor` (in place) with the group's; see the module docstring for the contract.

        Nothing else may read or write the tensor until this returns: result chunks land in it while
        the round runs. Raises ValueError for a tensor, weight or round number this engine cannot
        take; network trouble never raises: it shows in the Outcome.

        restore=False is for a caller that holds the tensor's old value elsewhere (the trainer: the
        model it gathered the vector from): the engine then keeps no copy of the other members'
        shards, and after an ABORT their chunks may hold results of this round (this member's own
        shard is still put back). The caller must restore the tensor itself after anything but
        COMPLETED. The loss-tolerant engine ignores it: a PARTIAL round needs every old value."""
        self._check_call(tensor, weight, round_no)
        began, loop = time.perf_counter(), asyncio.get_running_loop()
        st = self.inbox.open(round_no, tensor.view(-1), restore)
        self._busy, decision = True, Decision.ABORT
        self.reducer.begin(st, tensor.view(-1), float(weight))
        try:
            decision, reason, digest = await self._run(st, tensor.view(-1), float(weight), loop.time())
        finally:
            await self._drain()  # before a restore: queued sends point into the tensor
            if decision is not Decision.COMPLETE:
                self.inbox.restore(st)
            self.inbox.close()
            self.reducer.end()
            self._busy = False
        return self._outcome(st, decision, reason, digest, time.perf_counter() - began)

    def _make_inbox(self, buffers: InboxBuffers | None) -> Inbox:
        """The sink, and `self.reducer` for this member's shard (loss-tolerant rounds use others);
        `buffers` (see inbox.BufferPool) or fresh ones."""
        s = self.settings
        inbox = Inbox(self.group, self.numel, s.chunk_elements, self.events, ChunkRule, buffers, s.payload)
        self.reducer = ShardReducer(inbox, self.group.me, self.events)
        inbox.fold = self.reducer.fold
        return inbox

    async def close(self) -> None:
        """Close this engine's links; the transport stays open (its owner closes it)."""
        for link in self.links.values():
            if link is not None:
                link.close()

    # ---- one round -----------------------------------------------------------------------------

    async def _run(self, st: RoundState, x: torch.Tensor, weight: float, t0: float) -> tuple[Decision, str, bytes]:
        s, me, inbox, rule = self.settings, self.group.me, self.inbox, self.inbox.rule
        await self._connect(st)
        for j, link in self._live_links():
            base = inbox.bounds[j][0]
            for start, end in inbox.chunks[j][st.result_next[j] :]:  # owner j already reduced the others
                h = self._header(Kind.CONTRIBUTION, st, shard=j, offset=start - base, count=end - start, weight=weight)
                st.bytes_sent += link.send(h, inbox.payload(start, end))

        deadline, mine = t0 + s.contribute_timeout, inbox.nchunks[me]
        while st.reduced < mine and await inbox.until(lambda: rule.ready(st, st.reduced), deadline):
            self._reduce_chunk(st, x)
        inbox.phase = Phase.GATHER  # from here on, contributions of this round are late
        while st.reduced < mine:
            self._reduce_chunk(st, x)

        await inbox.until(lambda: rule.gathered(st).over, t0 + s.gather_timeout)
        inbox.phase = Phase.DECIDE
        if rule.gathered(st).complete:
            digest = result_digest(
                self.group.tag, st.number, inbox.chunks, st.result_mask, st.result_weight, st.result_sum
            )
            mine_v = Verdict(ok=True, digest=digest)
        else:
            empty = st.result_gone[me] != 0  # an own chunk with no usable contribution at all
            mine_v = Verdict.abort(AbortCode.EMPTY_SHARD if empty else AbortCode.MISSING_SHARD)
        self._broadcast(st, mine_v)

        deadline = t0 + s.gather_timeout + s.verdict_timeout
        loop = asyncio.get_running_loop()

        def verdict(now: float) -> tuple[Decision, str]:
            return decide(me, self.group.size, mine_v, st.verdicts, now, deadline)

        settled = await inbox.until(lambda: verdict(loop.time())[0] is not Decision.WAIT, deadline)
        decision, reason = verdict(loop.time() if settled else deadline)
        if decision is Decision.ABORT and mine_v.ok:
            self._broadcast(st, Verdict.abort(AbortCode.ECHO))  # others may not have heard the reason
        return decision, reason, mine_v.digest

    def _reduce_chunk(self, st: RoundState, x: torch.Tensor) -> None:
        """Finish chunk st.reduced of my shard (see reduction.py) and send it to every member."""
        c, me = st.reduced, self.group.me
        if not self.reducer.finish(st):
            return
        start, end = self.inbox.chunks[me][c]
        h = self._header(
            Kind.RESULT,
            st,
            shard=me,
            offset=start - self.inbox.bounds[me][0],
            count=end - start,
            weight=st.result_weight[me][c],
            mask=st.result_mask[me][c],
        )
        payload = self.inbox.wire_view(start, end) if self.inbox.coded else self.inbox.x_bytes[start * 4 : end * 4]
        for _, link in self._live_links():
            st.bytes_sent += link.send(h, payload)

    # ---- helpers -------------------------------------------------------------------------------

    def _header(
        self, kind: Kind, st: RoundState, *, shard: int, offset: int, count: int, weight: float, mask: int = 0
    ) -> Header:
        return Header(
            kind=kind,
            run_tag=self.group.tag,
            round=st.number,
            sender=self.group.me,
            shard=shard,
            count=count,
            dtype=self.inbox.codec.dtype,
            offset=offset,
            weight=weight,
            mask=mask,
        )

    def _live_links(self) -> list[tuple[int, Link]]:
        return [(k, link) for k, link in self.links.items() if link is not None and not link.closed]

    def _broadcast(self, st: RoundState, v: Verdict) -> None:
        h = Header(
            kind=Kind.VERDICT,
            run_tag=self.group.tag,
            round=st.number,
            sender=self.group.me,
            shard=self.group.me,
            count=DIGEST_SIZE,
            dtype=DType.BYTES,
            flags=int(v.ok),
            code=v.code,
        )
        for _, link in self._live_links():
            st.bytes_sent += link.send(h, memoryview(v.digest))

    async def _connect(self, st: RoundState) -> None:
        """Open links that are not open; a member that cannot be reached is lost for this round."""
        for k in await open_links(self.transport, self.group.addresses, self.links, self.settings.connect_timeout):
            st.lost |= 1 << k

    async def _drain(self) -> None:
        await drain_links([link for _, link in self._live_links()], self.settings.drain_timeout)

    def _check_call(self, tensor: torch.Tensor, weight: float, round_no: int) -> None:
        if self._busy:
            raise RuntimeError("a round is already in progress on this engine")
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("the tensor must be a contiguous float32 CPU tensor")
        if tensor.numel() != self.numel:
            raise ValueError(f"this engine reduces {self.numel} elements, not {tensor.numel()}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, not {weight!r}")
        if round_no <= self.inbox.round:
            raise ValueError(f"round {round_no} is not after round {self.inbox.round}")

    def _outcome(self, st: RoundState, decision: Decision, reason: str, digest: bytes, duration: float) -> Outcome:
        size, inbox = self.group.size, self.inbox
        coverage, everywhere = [], (1 << size) - 1
        for j, bounds in enumerate(inbox.chunks):
            covered = 0
            for c, (start, end) in enumerate(bounds):
                mask = st.result_mask[j][c] if st.result_have[j] >> c & 1 else 0
                covered += (end - start) * bin(mask).count("1")
                everywhere &= mask
            coverage.append(covered / (size * (inbox.bounds[j][1] - inbox.bounds[j][0])))
        done = decision is Decision.COMPLETE
        return Outcome(
            status=Status.COMPLETED if done else Status.ABORTED,
            reason=reason,
            round=st.number,
            members=tuple(m for k, m in enumerate(self.group.members) if done and everywhere >> k & 1),
            coverage=tuple(coverage),
            bytes_sent=st.bytes_sent,
            bytes_received=st.bytes_received,
            duration=duration,
            digest=digest if done else b"",
            held=(float(done),) * size,
        )


async def open_links(
    transport: Transport, addresses: Sequence[str], links: dict[int, Link | None], timeout: float
) -> list[int]:
    """Dial, at once, every member k of `links` whose link is missing or closed (`timeout` for all);
    stores the new links and returns the members that could not be reached (their entry is None)."""

    async def one(k: int) -> int | None:
        try:
            async with asyncio.timeout(timeout):
                links[k] = await transport.connect(addresses[k])
            return None
        except (OSError, TimeoutError):
            links[k] = None
            return k

    missing = await asyncio.gather(*(one(k) for k, link in links.items() if link is None or link.closed))
    return [k for k in missing if k is not None]


async def drain_links(links: Sequence[Link], timeout: float) -> None:
    """Let queued sends go out (`timeout`); close links that cannot take them: their payloads point
    into buffers the caller will overwrite."""
    if not links:
        return
    tasks = {asyncio.ensure_future(link.drain()): link for link in links}
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
        tasks[task].close()
