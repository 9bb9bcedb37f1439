"""A local group that spans daemons averages its vector over the WAN as one peer, each daemon a
share of the lanes, over its own link (DESIGN.md: "each member averaging its own lanes").

    results = await spread_round(vector, weight, round_t, lanes, payload, leader, owners, own, ask, rejected)

The group's leading daemon holds the group's vector (DiLoCo's pseudo-gradient, or a state run's
state vector, of its processes: every member holds the same). With `averaging.lanes` L >= 2 and k daemons in the group, daemon j *owns* lanes
j, j + k, ... (`hierarchy.owned_lanes`) and announces the others as delegated, with the group's ID
(`hierarchy.delegated_mask`, `group_id`): peers leave it out of the views of the lanes it does not
average (`hierarchy.lane_view`). At each round the leader

1. starts the rounds of its own lanes (`own`, MoshpitAverager.average on those lanes), and
2. sends each other daemon its lanes' values, the weight (the group's samples), the round and the
   payload's format (`ask`: a request over the group's stores, daemon/groupspan.py); that daemon
   averages them with each lane's Moshpit group and answers each lane's result and, where it
   applied, the lane's mean;
3. writes every applied mean into the vector. A lane whose daemon did not answer (gone, timed out)
   keeps the leader's own values, as a lane that met no mate does: its result says why. A lane
   whose daemon refused it (it does not own it in its epoch: the group changed a beat ago, and it
   does not announce the lane either) the leader averages itself.

Under DiLoCo the outer step, its momentum and the error feedback stay the leader's
(daemon/diloco.py): the values sent are already on the payload's grid (int8 with the residual
kept), so the other daemon's encoding of them loses nothing more. What crosses the WAN: the group's
vector once, spread over min(k, L) links instead of the leader's alone.

The wire format (`encode_request`, `decode_request`, `encode_answer`, `decode_answer`) is a JSON
header, a newline, then the values of the lanes in order, each lane encoded on its own in the
format the header's `values` names: the round's payload (int8: 1 + 4/64 bytes a value, 3.8x fewer
than float32) where every lane's values are on that format's grid already (a codec roundtrip gives
them back exactly, as DiLoCo's error feedback and the engines' outputs leave them), else float32.
So the group's own link carries what the WAN does, and the values arrive exactly as they were.
ARC-Top-K rounds (payload "arctopk"): a request's P + residual goes in float32, an answer's mean in
the rows' format (int8: its rows as delivered, zeros elsewhere), and after the values, for each
lane whose round averaged rows, a bit mask of them (one bit per row of the lane; the result's
`rows` names their format), from which the leader's error feedback takes what it did not send.
Every field is checked before it is used, and what does not check out is refused with a reason
(`Refused`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from peerd.peers.averaging import RoundResult
from peerd.peers.collective import arctopk
from peerd.peers.collective.codec import Codec, Format
from peerd.peers.collective.outcome import Outcome, Status
from peerd.peers.collective.wire import WireError
from peerd.peers.dear.hierarchy import lane_bounds

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # a header lists at most 64 lanes' results


class Refused(ValueError):
    """A request or answer that does not check out; the message says why, in one line."""


class OwnerRefused(Refused):
    """The answer of a daemon that refused the request (it does not own those lanes now)."""


@dataclass(frozen=True, slots=True)
class LaneRequest:
    leader: str  # the peer ID of the group's leading daemon, which asks
    round_t: int
    lanes: tuple[int, ...]  # sorted, distinct
    weight: float  # the group's samples
    payload: str  # the format the lanes travel in (peers/collective/codec.py)
    values: np.ndarray  # float32: the lanes' values, one after the other


def _lane_sizes(n: int, lanes: int, which: Sequence[int]) -> list[int]:
    bounds = lane_bounds(n, lanes)
    return [bounds[lane][1] - bounds[lane][0] for lane in which]


def _split(data: bytes) -> tuple[dict, memoryview]:
    end = data.find(b"\n", 0, MAX_HEADER_BYTES)
    if end < 0:
        raise Refused("no header line")
    try:
        header = json.loads(data[:end])
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise Refused("the header is not an object")
    return header, memoryview(data)[end + 1 :]


def _format_of(payload: str) -> str:
    """The codec format a round's lanes may travel in: the payload's, or for arctopk its rows' (an
    answer's mean, the rows' values as they were delivered and zeros, is exact in it; a request's
    P + residual is not, and goes in float32)."""
    return arctopk.VALUES.value if payload == arctopk.PAYLOAD else payload


def _pack(parts: Sequence[np.ndarray], payload: str) -> tuple[str, bytes]:
    """The lanes' values (one float32 array per lane) as (their format, their bytes): each lane in
    the payload's format where that loses nothing for every lane, else all in float32."""
    codec = Codec(_format_of(payload))
    if codec.format is not Format.FP32:
        encoded, exact = [], True
        for values in parts:
            wire = np.empty(codec.size(len(values)), np.uint8)
            codec.encode(values, wire)
            back = np.empty(len(values), np.float32)
            codec.decode(wire, back, check=False)
            exact = exact and np.array_equal(back, values)
            encoded.append(wire)
        if exact:
            return codec.format.value, b"".join(w.tobytes() for w in encoded)
    body = np.concatenate(parts).astype(np.float32, copy=False).tobytes() if parts else b""
    return Format.FP32.value, body


def _values(body: memoryview, fmt: object, sizes: Sequence[int], allowed: Sequence[str]) -> np.ndarray:
    """The lanes' values (float32, one after the other) from a body of lanes of `sizes` values in
    format `fmt`, which must be one of `allowed`."""
    if fmt not in allowed:
        raise Refused(f"values in {fmt!r} where {' or '.join(allowed)} were expected")
    codec = Codec(str(fmt))
    expected = sum(codec.size(k) for k in sizes)
    if len(body) != expected:
        raise Refused(f"{len(body)} bytes of values where {sum(sizes)} values in {fmt} take {expected}")
    values, offset, at = np.empty(sum(sizes), np.float32), 0, 0
    for k in sizes:
        size = codec.size(k)
        try:
            codec.decode(body[offset : offset + size], values[at : at + k])
        except WireError as e:
            raise Refused(f"values that do not decode: {e}") from None
        offset, at = offset + size, at + k
    if not np.isfinite(values).all():
        raise Refused("values that are not finite")
    return values


def encode_request(
    leader: str, round_t: int, lanes: Sequence[int], weight: float, payload: str, parts: Sequence[np.ndarray]
) -> bytes:
    """The request to average `lanes` (`parts`: each lane's values, float32) in `payload`'s format."""
    fmt, body = _pack(parts, payload)
    header = {"leader": leader, "round": round_t, "lanes": list(lanes), "weight": weight, "payload": payload}
    return json.dumps({**header, "values": fmt}).encode() + b"\n" + body


def decode_request(data: bytes, n: int, lanes: int, owned: Sequence[int]) -> LaneRequest:
    """The request in `data` for a vector of n values in `lanes` lanes, of which this daemon owns
    `owned`. Raises Refused: a lane it does not own, a size, weight, round or format that is wrong."""
    header, body = _split(data)
    try:
        leader, round_t, which = str(header["leader"]), header["round"], header["lanes"]
        weight, payload = header["weight"], str(header["payload"])
    except KeyError as e:
        raise Refused(f"the header has no {e}") from None
    if not isinstance(round_t, int) or round_t < 0:
        raise Refused(f"round {round_t!r} is not a round number")
    if not isinstance(which, list) or not which or any(not isinstance(x, int) for x in which):
        raise Refused(f"lanes {which!r} are not a list of lane numbers")
    if sorted(set(which)) != which or not set(which) <= set(owned):
        raise Refused(f"lanes {which} are not among the lanes this daemon owns ({list(owned)})")
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise Refused(f"weight {weight!r} is not a sample count")
    try:
        fmt = _format_of(payload)
        Format(fmt)
    except ValueError:
        raise Refused(f"payload {payload!r} is not a format") from None
    values = _values(body, header.get("values"), _lane_sizes(n, lanes, which), ("fp32", fmt))
    return LaneRequest(leader, round_t, tuple(which), float(weight), payload, values)


def _result_json(r: RoundResult) -> dict:
    o = r.outcome
    return {
        "lane": r.lane,
        "group_size": r.group_size,
        "reason": r.reason,
        "planned": r.planned,
        "skipped": r.skipped,
        "interrupted": r.interrupted,
        "cancelled": r.cancelled,
        "outcome": None if o is None else {**o.as_dict(), "duration": o.duration, "digest": o.digest.hex()},
        **({} if r.selected is None else {"rows": r.selected.fmt}),  # the rows' format; their mask ends the body
    }


def encode_answer(results: Sequence[RoundResult], vector: torch.Tensor, lanes: int, payload: str) -> bytes:
    """The results of the lanes averaged here and, for each lane that applied, its values (in lane
    order; `vector` is the whole vector those lanes were averaged in, in `payload`'s rounds); after
    them, for each ARC-Top-K lane that averaged rows, its rows as a bit mask (read by `_rows`)."""
    bounds = lane_bounds(vector.numel(), lanes)
    parts = [vector[bounds[r.lane][0] : bounds[r.lane][1]].numpy() for r in results if r.applied]
    fmt, body = _pack(parts, payload)
    masks = b""
    for r in results:
        if r.selected is not None:
            rows = np.zeros(arctopk.rows_of(bounds[r.lane][1] - bounds[r.lane][0]), bool)
            rows[r.selected.rows] = True
            masks += np.packbits(rows).tobytes()
    header = {"results": [_result_json(r) for r in results], "values": fmt}
    return json.dumps(header).encode() + b"\n" + body + masks


def encode_refusal(why: str) -> bytes:
    """The answer to a request that did not check out: its asker stops waiting, and says why."""
    return json.dumps({"refused": why}).encode() + b"\n"


def _outcome(o: dict) -> Outcome:
    return Outcome(
        status=Status(o["status"]),
        reason=str(o["reason"]),
        round=int(o["round"]),
        members=tuple(str(m) for m in o["members"]),
        coverage=tuple(float(c) for c in o["coverage"]),
        bytes_sent=int(o["bytes_sent"]),
        bytes_received=int(o["bytes_received"]),
        duration=float(o["duration"]),
        digest=bytes.fromhex(o["digest"]),
        held=tuple(float(h) for h in o["held"]),
    )


def decode_answer(
    data: bytes, n: int, lanes: int, asked: Sequence[int], round_t: int, payload: str
) -> list[tuple[RoundResult, np.ndarray | None]]:
    """Each asked lane's result (marked `delegated`: the other daemon counted it as its round) and,
    where it applied, its values; an ARC-Top-K lane's result says which rows it averaged (`selected`).
    Raises Refused: a lane not asked or missing, sizes that differ, rows of a lane that did not apply."""
    header, body = _split(data)
    if "refused" in header:
        raise OwnerRefused(f"refused: {header['refused']}")
    try:
        results, formats = [], []
        for r in header["results"]:
            formats.append(r.get("rows"))
            outcome = None if r["outcome"] is None else _outcome(r["outcome"])
            results.append(
                RoundResult(
                    round_t,
                    int(r["group_size"]),
                    outcome,
                    str(r["reason"]),
                    planned=int(r["planned"]),
                    skipped=bool(r["skipped"]),
                    lane=int(r["lane"]),
                    delegated=True,
                    interrupted=bool(r["interrupted"]),
                    cancelled=bool(r["cancelled"]),
                )
            )
    except (KeyError, TypeError, ValueError) as e:
        raise Refused(f"a result that does not parse: {type(e).__name__}: {e}") from None
    if [r.lane for r in results] != list(asked):
        raise Refused(f"results for lanes {[r.lane for r in results]} where lanes {list(asked)} were asked")
    body, results = _rows(body, results, formats, n, lanes, payload)
    applied = [r.lane for r in results if r.applied]
    values = _values(body, header.get("values"), _lane_sizes(n, lanes, applied), ("fp32", _format_of(payload)))
    out, offset = [], 0
    sizes = dict(zip(applied, _lane_sizes(n, lanes, applied)))
    for r in results:
        if r.applied:
            out.append((r, values[offset : offset + sizes[r.lane]]))
            offset += sizes[r.lane]
        else:
            out.append((r, None))
    return out


def _rows(
    body: memoryview, results: list[RoundResult], formats: list, n: int, lanes: int, payload: str
) -> tuple[memoryview, list[RoundResult]]:
    """The body's values, and the results with the rows each ARC-Top-K lane averaged: a bit mask per
    such lane (in result order) ends the body, one bit per row of the lane."""
    which = [r.lane for r in results]
    sizes = dict(zip(which, _lane_sizes(n, lanes, which)))
    spans, end = [], len(body)
    for r, fmt in reversed(list(zip(results, formats))):
        if fmt is None:
            continue
        if payload != arctopk.PAYLOAD or fmt not in ("fp32", _format_of(payload)) or not r.applied:
            raise Refused(f"rows in {fmt!r} for lane {r.lane} of a {payload} round that applied={r.applied}")
        rows = arctopk.rows_of(sizes[r.lane])
        start = end - -(-rows // 8)
        if start < 0:
            raise Refused(f"no room for lane {r.lane}'s rows in {len(body)} bytes")
        spans.append((r, fmt, rows, body[start:end]))
        end = start
    chosen = {}
    for r, fmt, rows, mask in spans:
        bits = np.unpackbits(np.frombuffer(mask, np.uint8))
        if bits[rows:].any() or not bits[:rows].any():
            raise Refused(f"lane {r.lane}'s rows: a mask with no row, or bits past its {rows} rows")
        chosen[r.lane] = arctopk.Selected(np.flatnonzero(bits[:rows]), fmt)
    out = [r if r.lane not in chosen else dataclasses.replace(r, selected=chosen[r.lane]) for r in results]
    return body[:end], out


Own = Callable[[list[int]], Awaitable[list[RoundResult]]]  # this daemon's rounds of these lanes
Ask = Callable[[str, bytes], Awaitable[bytes]]  # (the owner's peer ID, the request) -> its answer


async def spread_round(
    vector: torch.Tensor,
    weight: float,
    round_t: int,
    lanes: int,
    payload: str,
    leader: str,
    owners: Sequence[tuple[str, Sequence[int]]],
    own: Own,
    ask: Ask,
    rejected: Callable[[str], None] = lambda why: None,
) -> list[RoundResult]:
    """One round of the group's vector (in place), each lane averaged by its owner: `owners` lists
    (peer ID, its lanes) of the group's daemons, this one (`leader`) first; `own(lanes)` runs this
    daemon's rounds, `ask(peer, request)` another's. Returns one RoundResult per lane, in lane order.
    A lane whose owner fails is left as it was, its result saying why (`delegated`, no outcome); one
    its owner refuses is averaged here. An answer that does not check out is counted (`rejected`)."""
    n = vector.numel()
    bounds = lane_bounds(n, lanes)

    async def delegate(peer: str, which: list[int]) -> list[RoundResult]:
        parts = [vector[bounds[lane][0] : bounds[lane][1]].numpy() for lane in which]
        request = encode_request(leader, round_t, which, weight, payload, parts)
        try:
            answered = decode_answer(await ask(peer, request), n, lanes, which, round_t, payload)
        except OwnerRefused as e:
            # That daemon does not own these lanes now (its epoch is not the leader's yet, for a
            # beat): it does not announce them either, so the peers expect the leader in their views.
            logger.info("run round %d: lanes %s back from %s (%s): averaged here", round_t, which, peer[-8:], e)
            return await own(which)
        except (Refused, OSError, RuntimeError, TimeoutError) as e:  # DistError is a RuntimeError
            if isinstance(e, Refused):
                rejected(str(e))
            why = f"lane averaged by {peer[-8:]}: no answer ({type(e).__name__}: {e})"
            return [RoundResult(round_t, 1, None, why, lane=lane, delegated=True) for lane in which]
        for result, mean in answered:
            if mean is not None:
                s, e = bounds[result.lane]
                vector[s:e].numpy()[:] = mean  # numpy: the answer's bytes are read-only
        return [result for result, _ in answered]

    mine = list(owners[0][1])
    jobs = [own(mine)] if mine else []
    jobs += [delegate(peer, list(which)) for peer, which in owners[1:] if which]
    done = [r for results in await asyncio.gather(*jobs) for r in results]
    return sorted(done, key=lambda r: r.lane)
