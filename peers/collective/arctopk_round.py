"""ARC-Top-K's round among one group's members, on the transport the group was formed with
(peers/averaging.py): the sketch's all-reduce, then the rows'. The pure parts: arctopk.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from peerd.peers.collective.allreduce import GroupAllReduce
from peerd.peers.collective.lossy_allreduce import LossyAllReduce
from peerd.peers.collective.arctopk import (
    CHECK,
    RANK,
    ROW,
    VALUES,
    Selected,
    agree,
    check_values,
    gather,
    keep,
    rows_of,
    scatter,
    select,
    sketch,
    sketch_matrix,
)
from peerd.peers.collective.codec import Codec, Format
from peerd.peers.collective.group import AllReduceSettings, Group
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.collective.transport import Shared, Transport
from peerd.peers.collective.wire import BLOCK, run_tag
from peerd.peers.events import PeerEvents


class ArcTopKRound:
    """One group's ARC-Top-K round, on the transport the group was formed with (shared by two
    engines under run tags of their own): (1) the members' sketches averaged in float32 (the
    engine's verdict makes every completer's mean the same bytes); (2) each member selects the same
    k rows from it, and the group averages their values, as `VALUES` (float32 where a group has
    more members than the vector has blocks), followed by the selection check. The vector takes the
    rows' mean and zeros elsewhere only if the sketch's round completed, the rows' applied (in a
    loss-tolerant round, PARTIAL: the mean where its packets arrived, this member's own values
    elsewhere) and the check holds; otherwise it is left as it was. Members whose selections differ
    all abort the round ("rows_differ", counted)."""

    def __init__(
        self,
        run_id: str,
        group: Group,
        transport: Transport,
        n: int,
        density: float,
        settings: AllReduceSettings,
        events: PeerEvents | None = None,
        lossy: bool = False,
    ):
        """`lossy`: `transport` is a loss-tolerant round's UdpTransport: the sketch goes over its
        reliable control links (every member must hold the same mean), the rows as datagrams
        (LossyAllReduce: a lost packet is a lost block, the member's own values there)."""
        self.n, self.k = n, keep(n, density)
        self.v = sketch_matrix(int.from_bytes(run_tag(run_id), "little"))  # the run's: the same everywhere
        self.events = events or PeerEvents()
        shared = Shared(transport)
        sizes = {"sketch": rows_of(n) * RANK, "rows": self.k * ROW + CHECK}
        self.fmt = VALUES.value if -(-sizes["rows"] // BLOCK) >= group.size else Format.FP32.value
        self.engines = {}
        for stage, fmt in (("sketch", Format.FP32.value), ("rows", self.fmt)):
            g = Group(f"{run_id}/{stage}", group.members, group.addresses, group.me)
            stage_settings = dataclasses.replace(settings, payload=fmt)
            if lossy and stage == "rows":
                engine, view = LossyAllReduce, shared.view(g.tag)
            else:
                engine, view = GroupAllReduce, shared.view(g.tag, transport.control if lossy else None)
            self.engines[stage] = engine(g, view, sizes[stage], settings=stage_settings, events=self.events)
        shared.open()

    async def all_reduce(self, vector: torch.Tensor, weight: float) -> tuple[Outcome, Selected | None]:
        """The round on `vector` (n float32 values: this member's pseudo-gradient plus what it owes):
        the outcome (bytes and duration of both stages) and, where it applied, the rows."""
        x = vector.numpy()
        mean_sketch = torch.from_numpy(sketch(x, self.v).reshape(-1))
        first = await self.engines["sketch"].all_reduce(mean_sketch, weight, 1)
        if not first.completed:
            return dataclasses.replace(first, reason=f"sketch: {first.reason}"), None
        rows = self.select(mean_sketch.numpy().reshape(-1, RANK))
        values = np.empty(self.k * ROW + CHECK, np.float32)
        values[: self.k * ROW] = gather(x, rows)
        Codec(self.fmt).roundtrip(values[: self.k * ROW])  # as sent: the engine's encoding is then exact
        values[self.k * ROW :] = mine = check_values(rows)
        second = await self.engines["rows"].all_reduce(torch.from_numpy(values), weight, 1)
        outcome = dataclasses.replace(
            second,
            reason=f"{second.reason} ({self.k} of {rows_of(self.n)} rows)",
            bytes_sent=first.bytes_sent + second.bytes_sent,
            bytes_received=first.bytes_received + second.bytes_received,
            duration=first.duration + second.duration,
        )
        if not second.applied:  # COMPLETED, or PARTIAL (loss-tolerant: the mean where it arrived)
            return dataclasses.replace(outcome, reason=f"rows: {outcome.reason}"), None
        if not agree(values[self.k * ROW :], mine):
            self.events.rejected("rows_differ")
            why = "the group's members selected different rows"
            return dataclasses.replace(outcome, status=Status.ABORTED, reason=why, digest=b""), None
        scatter(values[: self.k * ROW], rows, x)
        return outcome, Selected(rows, self.fmt)

    def select(self, mean_sketch: np.ndarray) -> np.ndarray:
        """The k rows of the group's mean sketch (`select`): the same on every member."""
        return select(mean_sketch, self.k)

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.close()
