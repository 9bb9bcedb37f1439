"""Reducing this member's own shard, chunk by chunk, in place in the caller's tensor.

Chunk c ends as sum_k(w_k v_k) / sum_k(w_k) over the contributions v_k that reached it in time,
this member's own included. The chunk of x is the accumulator, and it starts as this member's own
values unscaled: it holds own + sum_k (w_k / s) v_k with s = this member's weight (1 if that is 0,
and then the chunk starts at zero), so the own part costs no pass of its own (its old value is
copied to the backup first). Each contribution is folded in (`fold`) as soon as it has arrived,
while the kernel's copy of it is still in cache; `finish` divides the chunk by sum_k(w_k) / s once
all are in or the contribute deadline passed, and checks it once. Only if that check fails (rare)
is every part checked on its own: those with NaN or Inf are refused ("contribution_nonfinite"),
left out of that chunk only, and the chunk is summed again from the parts, which are all still in
their buffers.

With a compressed payload (codec.py) contributions are decoded into their buffers as they arrive
(inbox.py) and folded as above; the finished chunk is encoded once, into the inbox's `wire`, and
this owner adopts the decoded values, so that it holds the very bytes every member receives (and
the digest agrees). A chunk whose mean cannot be encoded (beyond codec.MAX_SCALE) is gone, as one
with no usable contribution is.

The arithmetic is this module's kernel, the one every engine reduces with (GroupAllReduce here,
LossyAllReduce through lossy.masked_mean, Halves for DeAR): `fold` adds a weighted contribution
into an accumulator (out += alpha * v), `divide` turns the sum into the mean, `all_finite` checks
it. They run on one thread, on purpose: torch would spread each chunk over its intra-op threads,
and with several processes (or a trainer) on few cores those threads spin and multiply the CPU a
round costs (5x in bench.engine_allreduce with torch's default thread count). `fold` is torch's
`add(alpha=)`, one fused pass where numpy needs two and a temporary (0.8 against 1.3 ms of CPU per
16 MiB here), fed blocks of `TORCH_GRAIN` elements when torch has more than one thread: below that
size torch runs an op on the caller's thread. `divide` divides (rather than multiplying by a
reciprocal) so that a mean of values whose weighted sum is exact is the correctly rounded one.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from peerd.peers.collective.decision import sum64
from peerd.peers.collective.inbox import Inbox
from peerd.peers.collective.rounds import RoundState, bits
from peerd.peers.collective.wire import WireError
from peerd.peers.events import PeerEvents

TORCH_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch runs smaller element-wise ops on one thread


def fold(out: np.ndarray, v: np.ndarray, alpha: float) -> None:
    """out += alpha * v, in place, in one fused pass on this thread (float32 arrays of one length,
    possibly empty: Halves folds what each sender has sent so far, which may be nothing yet)."""
    acc, part = torch.from_numpy(out), torch.from_numpy(v)
    n = len(out)
    step = max(n, 1) if torch.get_num_threads() == 1 else TORCH_GRAIN  # range() refuses a step of 0
    for a in range(0, n, step):
        block = acc[a : a + step]
        torch.add(block, part[a : a + step], alpha=alpha, out=block)


def divide(out: np.ndarray, by: float | np.ndarray) -> None:
    """out /= by, in place, in float32: a scalar, or one divisor per row of a 2-D `out` (shape (rows, 1))."""
    np.divide(out, np.float32(by) if np.isscalar(by) else by.astype(np.float32), out=out)


def all_finite(a: np.ndarray) -> bool:
    """No NaN and no Inf in a (max and min propagate NaN and meet +Inf and -Inf: two passes on one thread)."""
    return bool(a.size == 0 or (math.isfinite(a.max()) and math.isfinite(a.min())))


class ShardReducer:
    """GroupAllReduce's owner side: this member's shard, chunk by chunk, as the module docstring says."""

    def __init__(self, inbox: Inbox, me: int, events: PeerEvents):
        self.inbox, self.me, self.events = inbox, me, events
        self.base = inbox.bounds[me][0]
        self.x: np.ndarray | None = None
        self.weight = 0.0
        self.scale = 1.0  # the accumulator's unit (see the module docstring)

    def begin(self, st: RoundState, x: torch.Tensor, weight: float) -> None:
        """Start a round on the flat tensor x: fold in what arrived before it opened."""
        self.x, self.weight = x.numpy(), weight
        self.scale = weight if weight > 0 else 1.0
        for k in self.inbox.inbox:
            for c in bits(st.contrib_have[k]):
                self.fold(st, k, c)

    def end(self) -> None:
        self.x = None

    def fold(self, st: RoundState, k: int, c: int) -> None:
        """Add member k's chunk c to the accumulator (checked later, in finish)."""
        out = self._started(st, c)
        fold(out, self._part(k, c), st.weights[k] / self.scale)
        st.acc_mask[c] |= 1 << k
        st.acc_weight[c] += st.weights[k]

    def finish(self, st: RoundState) -> bool:
        """Scale chunk st.reduced into the weighted mean and record it as this owner's result.
        False if nothing usable reached it (the chunk is then gone: the round cannot complete)."""
        c = st.reduced
        out = self._started(st, c)
        st.reduced += 1
        if st.acc_weight[c] > 0:
            divide(out, st.acc_weight[c] / self.scale)
        if not (st.acc_weight[c] > 0 and all_finite(out)):
            self._recompute(st, c, out)
        mask, total = st.acc_mask[c], st.acc_weight[c]
        if mask and total > 0 and not self._adopt(c, out):
            mask = st.acc_mask[c] = 0
        if not mask or not total > 0:
            st.result_gone[self.me] |= 1 << c
            return False
        st.result_have[self.me] |= 1 << c
        st.result_mask[self.me][c], st.result_weight[self.me][c] = mask, total
        st.result_sum[self.me][c] = sum64(out)
        return True

    def _adopt(self, c: int, out: np.ndarray) -> bool:
        """Encode chunk c for the all-gather and replace it by its decoded values; False if it cannot be."""
        inbox = self.inbox
        if not inbox.coded:
            return True
        start, end = inbox.chunks[self.me][c]
        try:
            inbox.codec.decode(inbox.encode(start, end), out)
        except WireError:
            return False
        return True

    def _recompute(self, st: RoundState, c: int, out: np.ndarray) -> None:
        """Sum chunk c again from the parts that are finite; refuse the others."""
        weights = {k: (self.weight if k == self.me else st.weights[k]) for k in bits(st.acc_mask[c])}
        good = {k: w for k, w in weights.items() if all_finite(self._part(k, c))}
        for _ in weights.keys() - good.keys():
            self.events.rejected("contribution_nonfinite")
        total = sum(good.values())
        st.acc_mask[c], st.acc_weight[c] = sum(1 << k for k in good), total
        if total > 0:
            out.fill(0.0)
            for k, w in good.items():
                fold(
                    out, self._part(k, c), w / total
                )  # scaled part by part: no sum can overflow that the mean would not
            if not all_finite(out):  # finite parts whose mean overflows float32
                st.acc_mask[c] = 0

    def _part(self, k: int, c: int) -> np.ndarray:
        """Member k's contribution to chunk c of my shard (my own is in the backup)."""
        start, end = self.inbox.chunks[self.me][c]
        if k == self.me:
            return self.inbox.backup_np[start:end]
        return self.inbox.inbox_np[k][start - self.base : end - self.base]

    def _started(self, st: RoundState, c: int) -> np.ndarray:
        """Chunk c of x as an accumulator, holding this member's own contribution (in units of
        self.scale: as it is, or zero if its weight is 0)."""
        start, end = self.inbox.chunks[self.me][c]
        out = self.x[start:end]
        if not st.acc_started >> c & 1:
            st.acc_started |= 1 << c
            self.inbox.back_up(st, self.me, c)
            if self.weight == 0:
                out.fill(0.0)
            st.acc_mask[c], st.acc_weight[c] = 1 << self.me, self.weight
        return out
