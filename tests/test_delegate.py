"""A spanning group's lanes, each averaged by its owner (peers/dear/delegate.py): the wire format's
checks, and how the leader merges what its own rounds and the other daemons' answers give. The two
daemons' side over real stores is in tests/test_group_span.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from peerd.peers.averaging import RoundResult
from peerd.peers.collective import arctopk
from peerd.peers.collective.codec import Codec
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.dear.delegate import (
    Refused,
    decode_answer,
    decode_request,
    encode_answer,
    encode_refusal,
    encode_request,
    spread_round,
)
from peerd.peers.dear.hierarchy import lane_bounds

N, LANES = 10, 3  # lanes [0, 4), [4, 7), [7, 10)


def outcome(round_t: int, status: Status = Status.COMPLETED) -> Outcome:
    return Outcome(status, "ok", round_t, ("a", "c"), (1.0,), 100, 90, 0.25, b"\x01\x02", (1.0,))


def test_a_request_decodes_to_what_was_encoded_and_only_for_lanes_the_daemon_owns():
    values = np.arange(3, dtype=np.float32)  # lane 1: 3 values
    data = encode_request("lead", 7, [1], 12.0, "fp32", [values])
    r = decode_request(data, N, LANES, owned=(1,))
    assert (r.leader, r.round_t, r.lanes, r.weight, r.payload) == ("lead", 7, (1,), 12.0, "fp32")
    assert r.values.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(Refused, match="not among the lanes this daemon owns"):
        decode_request(data, N, LANES, owned=(0, 2))


def body(data: bytes) -> tuple[dict, bytes]:
    header, _, rest = data.partition(b"\n")
    return json.loads(header), rest


@pytest.mark.parametrize("payload", ["fp16", "int8", "int4", "int2"])
def test_lanes_on_the_payloads_grid_travel_in_the_payload_and_arrive_exactly(payload):
    """Each lane encoded on its own (codec blocks start at each lane's start, as DiLoCo's error
    feedback cuts them): int8 takes 1 + 4/64 bytes a value where float32 takes 4. A lane off the
    grid sends the whole message in float32, so nothing is lost either way."""
    n, lanes = 300, 3  # lanes of 100 values: a whole block of 64 and a short one of 36
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal(100).astype(np.float32) for _ in range(2)]
    codec = Codec(payload)
    for p in parts:
        codec.roundtrip(p)
    data = encode_request("lead", 7, [0, 2], 3.0, payload, parts)
    header, values = body(data)
    assert header["values"] == payload and len(values) == 2 * codec.size(100) < 2 * 4 * 100
    r = decode_request(data, n, lanes, owned=(0, 2))
    assert np.array_equal(r.values, np.concatenate(parts))
    vector = torch.zeros(n)
    vector[:100], vector[200:] = torch.from_numpy(parts[0]), torch.from_numpy(parts[1])
    results = [RoundResult(7, 2, outcome(7), "done", lane=0), RoundResult(7, 2, outcome(7), "done", lane=2)]
    answer = encode_answer(results, vector, lanes, payload)
    assert body(answer)[0]["values"] == payload
    (_, v0), (_, v2) = decode_answer(answer, n, lanes, [0, 2], 7, payload)
    assert np.array_equal(v0, parts[0]) and np.array_equal(v2, parts[1])
    off = [parts[0], parts[1] + np.float32(1e-3)]  # lane 2 off the grid
    data = encode_request("lead", 7, [0, 2], 3.0, payload, off)
    assert body(data)[0]["values"] == "fp32" and len(body(data)[1]) == 4 * 200
    assert np.array_equal(decode_request(data, n, lanes, owned=(0, 2)).values, np.concatenate(off))


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda h, b: (dict(h, weight=float("nan")), b), "not a sample count"),
        (lambda h, b: (dict(h, weight=-1), b), "not a sample count"),
        (lambda h, b: (dict(h, payload="int3"), b), "not a format"),
        (lambda h, b: (dict(h, round=-2), b), "not a round number"),
        (lambda h, b: (dict(h, lanes=[1, 1]), b), "not among"),
        (lambda h, b: (dict(h, lanes="1"), b), "not a list"),
        (lambda h, b: (h, b[:-4]), "bytes of values where 3 values in fp32 take 12"),
        (lambda h, b: (h, np.array([0, np.inf, 0], np.float32).tobytes()), "not finite"),
        (lambda h, b: (dict(h, values="int4"), b), "values in 'int4' where fp32 or int8 were expected"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "values"}, b), "values in None where"),
        (lambda h, b: (dict(h, values="int8"), b"\0\0\xc0\x7f" + bytes(3)), "do not decode: .*scale"),
        (lambda h, b: (dict(h, values="int8"), b), "12 bytes of values where 3 values in int8 take 7"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "weight"}, b), "no 'weight'"),
    ],
)
def test_a_request_that_does_not_check_out_is_refused_with_the_reason(change, why):
    header = {"leader": "lead", "round": 7, "lanes": [1], "weight": 12.0, "payload": "int8", "values": "fp32"}
    values = np.zeros(3, np.float32).tobytes()
    header, values = change(header, values)
    with pytest.raises(Refused, match=why):
        decode_request(json.dumps(header).encode() + b"\n" + values, N, LANES, owned=(1,))
    with pytest.raises(Refused, match="no header line"):
        decode_request(b"garbage", N, LANES, owned=(1,))


def test_an_answer_carries_each_lanes_result_and_the_values_of_those_that_applied():
    vector = torch.arange(N, dtype=torch.float32)
    results = [
        RoundResult(7, 2, outcome(7), "done", planned=1, lane=0),
        RoundResult(7, 1, None, "no group: gone", planned=1, lane=2),
    ]
    answered = decode_answer(encode_answer(results, vector, LANES, "int8"), N, LANES, [0, 2], 7, "int8")
    (r0, v0), (r2, v2) = answered
    assert r0.delegated and r0.applied and r0.outcome == outcome(7) and r0.planned == 1 and r0.lane == 0
    assert v0.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert r2.delegated and not r2.applied and v2 is None and r2.reason == "no group: gone"
    with pytest.raises(Refused, match="where lanes \\[0\\] were asked"):
        decode_answer(encode_answer(results, vector, LANES, "int8"), N, LANES, [0], 7, "int8")
    with pytest.raises(Refused, match="refused: lanes"):
        decode_answer(encode_refusal("lanes [1] are not ..."), N, LANES, [1], 7, "int8")


@pytest.mark.parametrize("c_does", ["refuses", "is gone", "answers garbage"])
def test_the_leader_averages_its_lanes_and_takes_each_owners_mean_or_keeps_its_own_values(c_does):
    """Three daemons, three lanes: the leader's own round (lane 0), b's answer (lane 1 applied), and
    c's lane 2: refused (c does not own it in its epoch), the leader averages it; c gone, or its
    answer garbage (counted), the leader's values stay and the result says why."""
    vector = torch.ones(N)
    bounds = lane_bounds(N, LANES)
    asked, own_lanes, rejected = {}, [], []

    async def own(which):
        own_lanes.append(which)
        for lane in which:
            s, e = bounds[lane]
            vector[s:e] = 5.0
        return [RoundResult(3, 2, outcome(3), "done", lane=lane) for lane in which]

    async def ask(peer, request):
        asked[peer] = decode_request(request, N, LANES, owned=(1, 2))
        if peer == "c":
            if c_does == "refuses":
                return encode_refusal("lanes [2] are not among the lanes this daemon owns ([])")
            if c_does == "answers garbage":
                return encode_answer([RoundResult(3, 2, outcome(3), "done", lane=1)], torch.zeros(N), LANES, "int8")
            raise RuntimeError("connection refused")
        mean = torch.zeros(N)
        s, e = bounds[1]
        mean[s:e] = 9.0
        return encode_answer([RoundResult(3, 2, outcome(3), "done", lane=1)], mean, LANES, "int8")

    owners = [("a", (0,)), ("b", (1,)), ("c", (2,))]
    results = asyncio.run(spread_round(vector, 4.0, 3, LANES, "int8", "a", owners, own, ask, rejected.append))
    assert [r.lane for r in results] == [0, 1, 2]
    assert "c" in asked and asked["b"].lanes == (1,) and asked["b"].weight == 4.0 and asked["b"].leader == "a"
    assert asked["b"].values.tolist() == [1.0, 1.0, 1.0]  # the leader's values of lane 1 went out
    if c_does == "refuses":
        assert own_lanes == [[0], [2]] and [r.delegated for r in results] == [False, True, False] and not rejected
        assert [r.applied for r in results] == [True, True, True]
        assert vector.tolist() == [5.0] * 4 + [9.0] * 3 + [5.0] * 3
    else:
        assert own_lanes == [[0]] and [r.delegated for r in results] == [False, True, True]
        assert [r.applied for r in results] == [True, True, False]
        assert vector.tolist() == [5.0] * 4 + [9.0] * 3 + [1.0] * 3
        if c_does == "is gone":
            assert "no answer (RuntimeError: connection refused)" in results[2].reason and not rejected
        else:  # the results of lane 1 where lane 2 was asked
            assert "no answer (Refused: results for lanes [1]" in results[2].reason and len(rejected) == 1


def test_an_arctopk_answer_carries_each_lanes_rows_and_their_mean_in_int8():
    """The owner's ARC-Top-K round of lane 0 averaged rows 0 and 2 of its 3 (their mean in int8
    blocks, zeros elsewhere: exact in int8); lane 1 met no group. The answer carries lane 0's rows
    as a bit mask after the values, and the asker gets them back as the result's `selected`."""
    n, lanes, row = 6144, 2, arctopk.ROW  # lanes of 3,072 values: 3 rows each
    vector = torch.zeros(n)
    mean = np.random.default_rng(1).standard_normal(2 * row).astype(np.float32)
    Codec("int8").roundtrip(mean)
    arctopk.scatter(mean, np.array([0, 2]), vector[: 3 * row].numpy())
    results = [
        RoundResult(7, 2, outcome(7), "done", lane=0, selected=arctopk.Selected(np.array([0, 2]), "int8")),
        RoundResult(7, 1, None, "no group: gone", planned=1, lane=1),
    ]
    data = encode_answer(results, vector, lanes, "arctopk")
    header, rest = body(data)
    assert header["values"] == "int8" and header["results"][0]["rows"] == "int8" and "rows" not in header["results"][1]
    assert len(rest) == Codec("int8").size(3 * row) + 1  # the values, then one byte of mask for 3 rows
    (r0, v0), (r1, v1) = decode_answer(data, n, lanes, [0, 1], 7, "arctopk")
    assert r0.selected.rows.tolist() == [0, 2] and r0.selected.fmt == "int8" and r1.selected is None and v1 is None
    assert np.array_equal(v0, vector[: 3 * row].numpy())
    # A request's P + residual is off the int8 grid: it goes in float32, and decodes for an arctopk round.
    p = np.random.default_rng(2).standard_normal(3 * row).astype(np.float32)
    request = encode_request("lead", 7, [1], 3.0, "arctopk", [p])
    assert body(request)[0]["values"] == "fp32"
    assert np.array_equal(decode_request(request, n, lanes, owned=(1,)).values, p)
    for bad, why in (
        (data[:-1] + bytes([0b11110000]), "bits past its 3 rows"),
        (data[:-1] + bytes([0]), "a mask with no row"),
        (data[:-2] + data[-1:], "bytes of values where"),  # a value byte short
    ):
        with pytest.raises(Refused, match=why):
            decode_answer(bad, n, lanes, [0, 1], 7, "arctopk")
    with pytest.raises(Refused, match="rows in 'int8' for lane 0 of a int8 round"):
        decode_answer(data, n, lanes, [0, 1], 7, "int8")
