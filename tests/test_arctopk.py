"""ARC-Top-K: its pure parts (the shared sketch matrix, the rows every member derives alike, gather and
scatter over a padded last row, error feedback that loses nothing over rounds, the selection check)
and its round among three members over real TCP (the same bytes everywhere, and what it refuses).
How a member keeps what it did not send: tests/test_diloco.py."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import numpy as np
import pytest
import torch

from peerd.peers.collective import AllReduceSettings, Group, Status, TcpTransport, UdpTransport, arctopk
from peerd.peers.collective.arctopk import (
    CHECK,
    agree,
    check_values,
    gather,
    keep,
    scatter,
    select,
    sketch,
    sketch_matrix,
    split,
)
from peerd.peers.collective.arctopk_round import ArcTopKRound
from peerd.peers.collective.codec import Codec
from peerd.peers.collective.transport import Action, Shared
from peerd.peers.collective.wire import Header, Kind
from peerd.peers.events import PeerEvents

ROW = 128  # two codec blocks: small vectors in these tests


def test_the_sketch_matrix_is_the_seeds_and_rows_are_whole_blocks():
    a, b = sketch_matrix(7, ROW, 4), sketch_matrix(7, ROW, 4)
    assert a.shape == (ROW, 4) and a.dtype == np.float32 and np.array_equal(a, b)
    assert not np.array_equal(a, sketch_matrix(8, ROW, 4))
    with pytest.raises(ValueError, match="multiple of the codec's block"):
        sketch_matrix(7, 100, 4)


def test_select_ranks_rows_by_the_squared_norm_and_a_tie_goes_to_the_lower_row():
    s = np.array([[1, 0], [0, 3], [2, 2], [0, -3], [0.5, 0.5]], np.float32)  # norms 1, 9, 8, 9, 0.5
    assert select(s, 1).tolist() == [1]  # 9 at rows 1 and 3: the lower
    assert select(s, 2).tolist() == [1, 3]
    assert select(s, 3).tolist() == [1, 2, 3]
    assert keep(10 * ROW, 0.2, ROW) == 2 and keep(10 * ROW, 0.001, ROW) == 1 and keep(ROW + 1, 1.0, ROW) == 2
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            keep(ROW, bad, ROW)


def test_members_derive_the_rows_that_hold_the_groups_energy():
    """Three members whose vectors are noise plus a shared signal in rows 2 and 5 (of 8, the last
    row padded): the averaged sketch ranks those two first on every member, though no member's own
    vector alone need rank them so."""
    rng = np.random.default_rng(0)
    n = 7 * ROW + 40
    v = sketch_matrix(3, ROW, 4)
    owed = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    for x in owed:
        x[2 * ROW : 3 * ROW] += 2.0
        x[5 * ROW : 6 * ROW] -= 2.0
    sketches = [sketch(x, v) for x in owed]
    assert sketches[0].shape == (8, 4)
    mean = np.mean(sketches, axis=0)
    assert select(mean, 2).tolist() == [2, 5]


def test_gather_and_scatter_keep_the_vectors_layout_over_a_padded_last_row():
    n = 3 * ROW + 5
    x = np.arange(n, dtype=np.float32)
    rows = np.array([0, 3])
    values = gather(x, rows, ROW)
    assert len(values) == 2 * ROW and values[ROW] == 3 * ROW and values[ROW + 4] == n - 1
    assert np.all(values[ROW + 5 :] == 0)  # the padding
    out = np.full(n, 7.0, np.float32)
    scatter(values, rows, out, ROW)
    assert np.array_equal(out[:ROW], x[:ROW]) and np.array_equal(out[3 * ROW :], x[3 * ROW :])
    assert np.all(out[ROW : 3 * ROW] == 0)
    out = np.full(4 * ROW, 7.0, np.float32)  # no padding
    scatter(gather(np.arange(4 * ROW, dtype=np.float32), np.array([1]), ROW), np.array([1]), out, ROW)
    assert out[ROW] == ROW and out.sum() == sum(range(ROW, 2 * ROW))


def test_split_sends_the_rows_as_the_codec_delivers_them_and_keeps_the_rest():
    rng = np.random.default_rng(1)
    owed = rng.standard_normal(4 * ROW).astype(np.float32)
    residual = np.full(4 * ROW, 99.0, np.float32)
    rows = np.array([1, 2])
    values = split(owed, rows, "fp32", residual, ROW)
    assert np.array_equal(values, owed[ROW : 3 * ROW])
    assert np.array_equal(residual[:ROW], owed[:ROW]) and np.all(residual[ROW : 3 * ROW] == 0)
    values = split(owed, rows, "int8", residual, ROW)
    inside = residual[ROW : 3 * ROW]
    assert np.array_equal(values + inside, owed[ROW : 3 * ROW])  # what rounding took stays
    assert 0 < np.abs(inside).max() <= np.abs(owed[ROW : 3 * ROW]).max() / 127  # at most a quantum
    assert np.array_equal(residual[3 * ROW :], owed[3 * ROW :])


def test_error_feedback_over_200_rounds_delivers_what_every_member_owed():
    """Three members, each with a constant vector, at density 1/4: over the rounds every row takes
    its turn, and what was delivered (the rows' means) is the sum of the inputs' mean less what the
    residuals still hold, within float32 rounding; the residuals stay bounded."""
    rng = np.random.default_rng(2)
    n, members, rounds = 4 * ROW, 3, 200
    xs = [(rng.standard_normal(n) * (1 + 3 * (np.arange(n) < ROW))).astype(np.float32) for _ in range(members)]
    residuals = [np.zeros(n, np.float32) for _ in range(members)]
    v = sketch_matrix(5, ROW, arctopk.RANK)
    delivered = np.zeros(n)
    chosen = set()
    for _ in range(rounds):
        owed = [x + r for x, r in zip(xs, residuals, strict=True)]
        rows = select(np.mean([sketch(o, v) for o in owed], axis=0), keep(n, 0.25, ROW))
        chosen.update(rows.tolist())
        sent = [split(o, rows, "int8", r, ROW) for o, r in zip(owed, residuals, strict=True)]
        mean = np.zeros(n, np.float32)
        scatter(np.mean(sent, axis=0), rows, mean, ROW)
        delivered += mean
    total = rounds * np.mean(xs, axis=0) - np.mean(residuals, axis=0)
    assert chosen == {0, 1, 2, 3}  # not only the large row
    assert np.abs(delivered - total).max() < 1e-5 * rounds  # measured: 1.3e-4 (float32 sums)
    assert max(np.abs(r).max() for r in residuals) < 5 * max(np.abs(x).max() for x in xs)  # measured: 1.2


# ---- the round: three members over real TCP on 127.0.0.1 ---------------------------------------------

WIDE = arctopk.ROW  # a run's rows
SETTINGS = AllReduceSettings(
    connect_timeout=5.0, contribute_timeout=10.0, gather_timeout=20.0, verdict_timeout=5.0, drain_timeout=0.5
)
ABORTING = dataclasses.replace(
    SETTINGS, connect_timeout=1.0, contribute_timeout=1.0, gather_timeout=2.0, verdict_timeout=1.0
)


async def rounds(xs, weights, density, settings=SETTINGS, make=ArcTopKRound, events=None, late=0.0):
    """One ArcTopKRound per member on its own TCP transport, run at once: (outcomes, selections).
    `late`: the last member builds its round this many seconds after the others started theirs
    (their links reach its listener first, as in a daemon whose mates matched a moment sooner)."""
    transports = [TcpTransport("127.0.0.1", 0) for _ in xs]
    addresses = [await t.start() for t in transports]
    members = [f"m{i}" for i in range(len(xs))]

    def build(i):
        kind = make if i == len(xs) - 1 else ArcTopKRound
        group = Group("arctopk-test", members, addresses, i)
        return kind("arctopk-test", group, transports[i], len(xs[i]), density, settings, events)

    async def last():
        await asyncio.sleep(late)
        two.append(build(len(xs) - 1))
        return await two[-1].all_reduce(torch.from_numpy(xs[-1]), weights[-1])

    two = [build(i) for i in range(len(xs) - 1)]
    try:
        firsts = [r.all_reduce(torch.from_numpy(x), w) for r, x, w in zip(two, xs, weights)]
        done = await asyncio.gather(*firsts, last())
    finally:
        for r in two:
            await r.close()
        for t in transports:
            await t.close()
    return [o for o, _ in done], [s for _, s in done]


@pytest.mark.parametrize("late", [0.0, 0.5], ids=["together", "one_late"])
def test_three_members_average_the_same_rows_and_hold_the_same_bytes(late):
    """Every member selects the same rows from the averaged sketch and holds their weighted mean
    (of the rows as int8 delivers them, encoded by their owners) and zeros elsewhere; also when one
    member's engines are built after the others' links reached its listener. (A header already read
    when the router attaches reaches it at once, before the engines register: in daemons that made
    every round abort with missing_shard until the router attached only once both had,
    transport.Shared.open; test_diloco_training's arctopk run caught it, this in-process one does
    not reach that state.)"""
    rng = np.random.default_rng(5)
    n = 9 * WIDE + 100
    xs = [rng.standard_normal(n).astype(np.float32) * 0.01 for _ in range(3)]
    for x in xs:
        x[3 * WIDE : 4 * WIDE] += 1.0  # the group's energy: rows 3 and 7
        x[7 * WIDE : 8 * WIDE] -= 2.0
    before = [x.copy() for x in xs]
    outcomes, selected = asyncio.run(rounds(xs, [1.0, 2.0, 1.0], density=0.2, late=late))
    assert all(o.completed for o in outcomes), [o.reason for o in outcomes]
    assert all(np.array_equal(s.rows, [3, 7]) and s.fmt == "int8" for s in selected)
    assert np.array_equal(xs[0], xs[1]) and np.array_equal(xs[0], xs[2])
    sent = [gather(b, np.array([3, 7])) for b in before]
    for s in sent:
        Codec("int8").roundtrip(s)
    mean = (sent[0] + 2 * sent[1] + sent[2]) / 4
    assert np.abs(gather(xs[0], np.array([3, 7])) - mean).max() < 2.5 / 127  # the owner's int8 encoding of it
    assert np.count_nonzero(xs[0]) == 2 * WIDE  # zeros elsewhere
    # The sketch, 2 of 10 rows and the check, headers included: under a third of a dense int8 round
    # (each member sends (g - 1) / g of the payload twice); measured 4,136 bytes.
    int8_round = 2 * 2 / 3 * Codec("int8").size(n)
    assert all(o.bytes_sent < int8_round / 3 for o in outcomes), [o.bytes_sent for o in outcomes]


class OtherRows(ArcTopKRound):
    """A member whose selection differs from the group's (a bug, another version, a forger)."""

    def select(self, mean_sketch):
        return np.sort((super().select(mean_sketch) + 1) % len(mean_sketch))


def test_a_member_that_selects_other_rows_makes_every_member_abort_and_keep_its_vector():
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(6 * WIDE).astype(np.float32) for _ in range(3)]
    before = [x.copy() for x in xs]
    refused = collections.Counter()
    events = PeerEvents(rejected=lambda reason: refused.update([reason]))
    outcomes, selected = asyncio.run(rounds(xs, [1.0, 1.0, 1.0], 0.34, make=OtherRows, events=events))
    assert [o.status for o in outcomes] == [Status.ABORTED] * 3
    assert all("different rows" in o.reason for o in outcomes) and selected == [None] * 3
    assert refused["rows_differ"] == 3
    assert all(np.array_equal(x, b) for x, b in zip(xs, before))


def test_a_member_whose_vector_has_another_size_is_refused_and_the_round_aborts_unchanged():
    """Its sketch has more rows than the group's: its messages are refused (counted), and no member
    applies anything."""
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (6 * WIDE, 6 * WIDE, 8 * WIDE)]
    before = [x.copy() for x in xs]
    refused = collections.Counter()
    events = PeerEvents(rejected=lambda reason: refused.update([reason]))
    outcomes, selected = asyncio.run(rounds(xs, [1.0, 1.0, 1.0], 0.34, settings=ABORTING, events=events))
    assert all(not o.completed for o in outcomes) and selected == [None] * 3
    assert all(o.reason.startswith("sketch: ") for o in outcomes)
    assert sum(refused.values()) > 0, refused
    assert all(np.array_equal(x, b) for x, b in zip(xs, before))


def test_the_check_values_are_the_rows_digest_and_agree_only_with_the_same_selection():
    a, b = check_values(np.array([1, 5])), check_values(np.array([1, 6]))
    assert (
        a.shape == (CHECK,) and set(np.unique(a)) == {-1.0, 1.0} and np.array_equal(a, check_values(np.array([1, 5])))
    )
    assert not np.array_equal(a, b)
    assert agree(a.copy(), a)
    mixed = (2 * a + b) / 3  # one member of three selected other rows
    Codec("int8").roundtrip(mixed)
    assert not agree(mixed, a) and not agree(mixed, b)


def test_a_shared_transport_hands_each_message_to_the_sink_of_its_run_tag():
    """transport.Shared, the router of ARC-Top-K's two engines: by the header's run tag (a tag of
    neither: the first sink, whose rule refuses it), a lost connection to the sinks that had its
    messages, and nothing attached to the transport until `open`."""

    class Sink:
        def __init__(self):
            self.seen = []

        def on_header(self, link, header):
            self.seen.append(("header", link, header.run_tag))
            return Action.SKIP

        def on_payload(self, link, header):
            self.seen.append(("payload", link, header.run_tag))

        def on_lost(self, link):
            self.seen.append(("lost", link))

    class Inner:
        sink = None

        def attach(self, sink):
            self.sink = sink

    inner, sketches, rows = Inner(), Sink(), Sink()
    shared = Shared(inner)
    with pytest.raises(RuntimeError, match="no engine"):
        shared.open()
    shared.view(b"sketch..").attach(sketches)
    shared.view(b"rows....").attach(rows)
    with pytest.raises(RuntimeError, match="already has a sink"):
        shared.view(b"rows....").attach(Sink())
    assert inner.sink is None  # not before both engines are there
    shared.open()
    assert inner.sink is shared
    one, two, three = object(), object(), object()
    for link, tag in ((one, b"sketch.."), (two, b"rows...."), (three, b"other..."), (one, b"rows....")):
        h = Header(Kind.CONTRIBUTION, tag, 1, 0, 0)
        assert shared.on_header(link, h) is Action.SKIP
        shared.on_payload(link, h)
    shared.on_lost(one)
    shared.on_lost(two)
    assert sketches.seen == [
        ("header", one, b"sketch.."),
        ("payload", one, b"sketch.."),
        ("header", three, b"other..."),
        ("payload", three, b"other..."),
        ("lost", one),
    ]
    assert rows.seen == [
        ("header", two, b"rows...."),
        ("payload", two, b"rows...."),
        ("header", one, b"rows...."),
        ("payload", one, b"rows...."),
        ("lost", one),
        ("lost", two),
    ]


def test_at_10_percent_loss_the_sketch_arrives_whole_and_the_rows_where_their_packets_do():
    """A loss-tolerant round (UdpTransport, LossyAllReduce for the rows): one datagram in ten that
    carries the rows' values is dropped, none of the sketch's (it goes over the reliable control
    links). Every member selects the same rows; each holds the group's mean of them where its
    packets arrived and its own values elsewhere (PARTIAL), zeros outside them."""
    rng = np.random.default_rng(8)
    n, rows = 12 * WIDE, np.array([2, 5, 9])
    xs = [rng.standard_normal(n).astype(np.float32) * 0.01 for _ in range(3)]
    for x in xs:
        x[rows[0] * WIDE : (rows[0] + 1) * WIDE] += 1.0
        x[rows[1] * WIDE : (rows[1] + 1) * WIDE] -= 2.0
        x[rows[2] * WIDE : (rows[2] + 1) * WIDE] += 3.0
    sent = [gather(x, rows) for x in xs]
    for s in sent:
        Codec("int8").roundtrip(s)
    losses = [lambda address, header, r=np.random.default_rng(i): r.random() < 0.1 for i in range(3)]

    async def run():
        transports = [
            UdpTransport("127.0.0.1", 0, secret=b"s" * 32, session=b"arctopk", drop=losses[i]) for i in range(3)
        ]
        addresses = [await t.start() for t in transports]
        members = [f"m{i}" for i in range(3)]
        two = [
            ArcTopKRound("lossy", Group("lossy", members, addresses, i), t, n, 0.25, SETTINGS, lossy=True)
            for i, t in enumerate(transports)
        ]
        try:
            return await asyncio.gather(*(r.all_reduce(torch.from_numpy(x), 1.0) for r, x in zip(two, xs)))
        finally:
            for r in two:
                await r.close()
            for t in transports:
                await t.close()

    done = asyncio.run(run())
    assert all(o.applied for o, _ in done), [o.reason for o, _ in done]
    assert all(s is not None and np.array_equal(s.rows, rows) for _, s in done)
    mean = np.mean(sent, axis=0)
    for (o, _), x, own in zip(done, xs, sent):
        mine = gather(x, rows)
        near_mean = np.abs(mine - mean) < 2.5 * 3 / 127  # the owner's int8 encoding of the mean
        assert np.all(near_mean | (mine == own)), o.reason  # the mean, or its own values where lost
        assert np.count_nonzero(x) <= 3 * WIDE
    assert any(o.status is Status.PARTIAL for o, _ in done), [o.reason for o, _ in done]  # 10 %: some lost
