"""Loss-tolerant group all-reduce: reduce-scatter and all-gather over datagrams, nothing retransmitted.

    transport = UdpTransport(host, 0, secret=engine_key, session=group_key, rate_bps=...)
    engine = LossyAllReduce(group, transport, numel, settings=..., events=...)
    outcome = await engine.all_reduce(tensor, weight, round_no)   # COMPLETED, PARTIAL or ABORTED

A round, on each member (timeouts from AllReduceSettings, measured from the call):
1. CONTRIBUTE: send chunk c of every other shard to its owner, c = 0, 1, ... interleaved over the
   owners (each owner can start reducing at once), then DONE to each owner. Owners reduce chunk c
   of their shard when it is settled for every sender (packets.py), at `contribute_timeout` with
   whatever arrived: per packet, the weighted mean over the contributions that arrived, its own
   included (lossy.masked_mean), sent at once to every member as RESULT datagrams (runs of packets
   with the same contributors travel as one message), then DONE.
2. GATHER: until every other owner's result is complete or said DONE (or its link closed), at the
   latest `gather_timeout`. Result packets land in the tensor; a packet that did not arrive leaves
   this member's own pre-round value there.
3. No verdict exchange: a member never refuses the packets it got, so there is nothing to agree on.
   Instead the outcome says what this member holds:
   * COMPLETED: every packet of every shard arrived. Every packet is its owner's bytes (the tag
     authenticates it and each owner sends one version), so all COMPLETED members hold the same
     tensor, and the same `digest` (computed locally over the per-packet contributors and weights
     and the values).
   * PARTIAL: some packets are missing; `held[j]` is the share of shard j that is the owner's result
     here (the rest keeps this member's values) and `coverage[j]` the share of members' contributions
     in the packets held. Members drift apart by the missing packets; later rounds pull them back
     together (docs/loss-tolerance.md bounds the drift). The digest is empty: nothing is claimed.
   * ABORTED: nothing arrived from any other member (unreachable, or every datagram lost); the
     tensor is restored, as in the reliable engine.
With a compressed payload (`AllReduceSettings.payload`, codec.py) packets hold whole int8 blocks
(or float16 values) in the bytes of a float32 packet; owners decode into float32, and adopt the
encoding of their result, as in the reliable engine.
A round lasts at most gather_timeout + drain_timeout. Losses are counted (`PeerEvents.packets_lost`,
`shard_coverage`, `packet_rejected`), never retransmitted.
"""

from __future__ import annotations

import functools
import hashlib
import struct

import numpy as np
import torch

from peerd.peers.collective.allreduce import GroupAllReduce
from peerd.peers.collective.decision import Decision, sum64
from peerd.peers.collective.group import AllReduceSettings, Group
from peerd.peers.collective.inbox import Inbox, InboxBuffers, as_bytes
from peerd.peers.collective.codec import Format
from peerd.peers.collective.lossy import keep_missing, masked_mean, packets_finite
from peerd.peers.collective.reduction import all_finite
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.collective.packets import PacketRound, PacketRule
from peerd.peers.collective.rounds import Phase
from peerd.peers.collective.transport import Transport
from peerd.peers.collective.udpsend import packet_stride
from peerd.peers.collective.wire import DIGEST_SIZE, DType, Header, Kind
from peerd.peers.events import PeerEvents


class LossyAllReduce(GroupAllReduce):
    """GroupAllReduce's API and lifecycle, with the loss-tolerant round. `transport` must cut
    messages into packets of `packet_elements` elements (UdpTransport does, and says how many)."""

    def __init__(
        self,
        group: Group,
        transport: Transport,
        numel: int,
        *,
        settings: AllReduceSettings | None = None,
        events: PeerEvents | None = None,
        packet_elements: int | None = None,
        buffers: InboxBuffers | None = None,
    ):
        self.packet_elements = packet_elements or transport.packet_elements
        payload = (settings or AllReduceSettings()).payload
        self.stride = packet_stride(self.packet_elements, Format(payload).dtype)  # the packet grid's
        if self.stride < 1:
            raise ValueError(f"datagrams of {self.packet_elements * 4} payload bytes hold no {payload} block")
        super().__init__(group, transport, numel, settings=settings, events=events, buffers=buffers)

    def _make_inbox(self, buffers: InboxBuffers | None) -> Inbox:
        s, rule = self.settings, functools.partial(PacketRule, stride=self.stride)
        inbox = Inbox(self.group, self.numel, s.chunk_elements, self.events, rule, buffers, s.payload)
        self.reducer = PacketReducer(inbox, self.group.me, self.events)
        return inbox

    async def _run(self, st: PacketRound, x: torch.Tensor, weight: float, t0: float) -> tuple[Decision, str, bytes]:
        s, me, inbox, rule = self.settings, self.group.me, self.inbox, self.inbox.rule
        grid = rule.grid
        await self._connect(st)
        live = self._live_links()
        for c in range(max(inbox.nchunks)):
            for j, link in live:
                if c < inbox.nchunks[j]:
                    start, end = inbox.chunks[j][c]
                    h = self._header(
                        Kind.CONTRIBUTION,
                        st,
                        shard=j,
                        offset=start - inbox.bounds[j][0],
                        count=end - start,
                        weight=weight,
                    )
                    st.bytes_sent += link.send(h, inbox.payload(start, end))
        for j, link in live:
            st.bytes_sent += link.send(self._done(st, Kind.CONTRIBUTION, j, grid.packets(j)))

        deadline, mine = t0 + s.contribute_timeout, inbox.nchunks[me]
        while st.reduced < mine and await inbox.until(lambda: rule.ready(st, st.reduced), deadline):
            self._reduce_chunk(st, x)
        inbox.phase = Phase.GATHER  # from here on, contributions of this round are late
        while st.reduced < mine:
            self._reduce_chunk(st, x)
        sent = int(np.count_nonzero(st.held[me]))
        for _, link in self._live_links():
            st.bytes_sent += link.send(self._done(st, Kind.RESULT, me, sent))
        self._report_coverage(st)

        await inbox.until(lambda: rule.gathered(st).over, t0 + s.gather_timeout)
        inbox.phase = Phase.DECIDE
        self.events.packets_lost(rule.missing(st))
        if self.group.size > 1 and not st.heard:
            return Decision.ABORT, "nothing arrived from any other member", b""
        if rule.gathered(st).complete:
            return Decision.COMPLETE, "every packet of the result arrived", self._digest(st, x.numpy())
        return Decision.COMPLETE, "some packets of the result are missing: own values kept there", b""

    def _reduce_chunk(self, st: PacketRound, x: torch.Tensor) -> None:
        """Reduce chunk st.reduced of my shard and send its usable packets to every member."""
        me, grid = self.group.me, self.inbox.rule.grid
        p0, p1 = self.reducer.finish(st)
        mask, total = st.rmask[me][p0:p1], st.rweight[me][p0:p1]
        cuts = np.flatnonzero((mask[1:] != mask[:-1]) | (total[1:] != total[:-1])) + 1
        edges, xb, base = [0, *cuts.tolist(), p1 - p0], as_bytes(x), self.inbox.bounds[me][0]
        starts, counts, live = grid.starts[me], grid.counts[me], self._live_links()
        for a, b in zip(edges, edges[1:]):  # runs of packets with the same contributors: one message each
            if not mask[a]:
                continue  # no usable contribution: not sent, members keep their own values
            first, last = p0 + a, p0 + b - 1
            offset, count = int(starts[first]), int(starts[last] + counts[last] - starts[first])
            h = self._header(
                Kind.RESULT, st, shard=me, offset=offset, count=count, weight=float(total[a]), mask=int(mask[a])
            )
            if self.inbox.coded:
                payload = self.inbox.wire_view(base + offset, base + offset + count)
            else:
                payload = xb[(base + offset) * 4 : (base + offset + count) * 4]
            for _, link in live:
                st.bytes_sent += link.send(h, payload)

    def _done(self, st: PacketRound, phase: Kind, shard: int, packets: int) -> Header:
        return Header(
            kind=Kind.DONE,
            run_tag=self.group.tag,
            round=st.number,
            sender=self.group.me,
            shard=shard,
            dtype=DType.BYTES,
            code=phase,
            offset=packets,
        )

    def _report_coverage(self, st: PacketRound) -> None:
        counts = np.bincount(np.bitwise_count(st.rmask[self.group.me]), minlength=self.group.size + 1)
        for k, packets in enumerate(counts.tolist()):
            if packets and k:
                self.events.shard_coverage(k / self.group.size, packets)

    def _digest(self, st: PacketRound, x: np.ndarray) -> bytes:
        """Fingerprint of a complete result: per packet its contributors and weight, per chunk sum64."""
        h = hashlib.blake2b(digest_size=DIGEST_SIZE)
        h.update(self.group.tag + struct.pack("<QQ", st.number, self.group.size))
        for j, bounds in enumerate(self.inbox.chunks):
            h.update(st.rmask[j].tobytes())
            h.update(st.rweight[j].tobytes())
            h.update(b"".join(struct.pack("<Q", sum64(x[a:b])) for a, b in bounds))
        return h.digest()

    def _outcome(self, st: PacketRound, decision: Decision, reason: str, digest: bytes, duration: float) -> Outcome:
        grid, size, applied = self.inbox.rule.grid, self.group.size, decision is Decision.COMPLETE
        held, coverage, everywhere = [], [], (1 << size) - 1
        for j in range(size):
            have = st.held[j] if applied else np.zeros(grid.packets(j), bool)
            elements = int(grid.counts[j][have].sum())
            length = grid.bounds[j][1] - grid.bounds[j][0]
            members = np.bitwise_count(st.rmask[j][have]).astype(np.int64)
            held.append(elements / length)
            coverage.append(float((members * grid.counts[j][have]).sum()) / (size * elements) if elements else 0.0)
            if elements:
                everywhere &= int(np.bitwise_and.reduce(st.rmask[j][have]))
        status = Status.ABORTED if not applied else Status.COMPLETED if digest else Status.PARTIAL
        return Outcome(
            status=status,
            reason=reason,
            round=st.number,
            members=tuple(m for k, m in enumerate(self.group.members) if applied and everywhere >> k & 1),
            coverage=tuple(coverage),
            bytes_sent=st.bytes_sent,
            bytes_received=st.bytes_received,
            duration=duration,
            digest=digest,
            held=tuple(held),
        )


class PacketReducer:
    """This member's shard, chunk by chunk, in place in x: lossy.masked_mean over what arrived."""

    def __init__(self, inbox: Inbox, me: int, events: PeerEvents):
        self.inbox, self.me, self.events = inbox, me, events
        self.x: np.ndarray | None = None
        self.weight = 0.0

    def begin(self, st: PacketRound, x: torch.Tensor, weight: float) -> None:
        """Start a round on the flat tensor x."""
        self.x, self.weight = x.numpy(), weight

    def end(self) -> None:
        self.x = None

    def finish(self, st: PacketRound) -> tuple[int, int]:
        """Reduce chunk st.reduced; returns its packet range. Packets without a usable contribution
        keep this member's own values and are not marked held."""
        inbox, me, grid = self.inbox, self.me, self.inbox.rule.grid
        c = st.reduced
        st.reduced += 1
        start, end = inbox.chunks[me][c]
        base, (p0, p1) = inbox.bounds[me][0], grid.chunk_packets(me, c)
        inbox.back_up(st, me, c)  # my own contribution is read from the backup: x is the output
        own = inbox.backup_np[start:end]
        parts = [  # in member order, as lossy.simulate_round adds them: the same sums, bit for bit
            (me, own, self.weight, np.ones(p1 - p0, bool))
            if k == me
            else (k, inbox.inbox_np[k][start - base : end - base], st.weights[k], st.have[k][p0:p1])
            for k in range(self.inbox.group.size)
            if k == me or k in st.weights
        ]
        out = self.x[start:end]
        mask, total, refused = masked_mean(out, parts, grid.stride)
        for _ in range(refused):
            self.events.packet_rejected("contribution_nonfinite")
        if inbox.coded:  # encoded once for the all-gather; this owner holds what members receive
            inbox.codec.decode(inbox.encode(start, end), out, check=False)
            if not all_finite(out):  # blocks that could not be encoded (beyond codec.MAX_SCALE): not sent
                mask[~packets_finite(out, grid.stride)] = 0
        usable = mask != 0
        if not usable.all():
            keep_missing(out, own, ~usable, grid.stride)
        st.rmask[me][p0:p1], st.rweight[me][p0:p1], st.held[me][p0:p1] = mask, total, usable
        st.held_count[me] += int(np.count_nonzero(usable))
        return p0, p1
