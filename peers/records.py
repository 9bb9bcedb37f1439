"""Membership records: what a daemon publishes about itself in a run (see peers/envelope.py).

Every record read from the DHT or received from a peer goes through `open_envelope`, which either
returns a checked `MemberRecord` or raises `RecordRejected` with a reason for peerd_rejected_total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from peerd.peers.envelope import RecordKind, RecordRejected, open_payload, parse, seal, verified
from peerd.peers.identity import Identity
from peerd.peers.linkprobe import LinkReport
from peerd.peers.run_ids import RunSecret
from peerd.peers.sketch import MAX_SKETCH_VALUES, ParamSketch
from peerd.protos import records_pb2

RECORD_FORMAT_VERSION = 1
MAX_MADDRS = 32
MAX_LABEL = 256  # characters of local_group and dear_address
MAX_CLOCK_SKEW_SECONDS = 300.0  # records timestamped further in the future are refused
MAX_LINKS = 64  # link reports per record (peers/linkprobe.py MAX_REPORTS)
MAX_LINK_AGE = 3600.0  # seconds: a report claiming an older measurement is malformed (fresh ones are < 60 s)
MAX_LINK_RTT = 60.0  # seconds

__all__ = [
    "LinkReport",
    "MemberRecord",
    "MemberState",
    "ParamSketch",
    "RecordRejected",
    "seal_record",
    "open_envelope",
    "check_storable",
]


class MemberState(Enum):
    ACTIVE = records_pb2.MEMBER_STATE_ACTIVE  # heartbeating
    LEFT = records_pb2.MEMBER_STATE_LEFT  # left on purpose


@dataclass(frozen=True, slots=True)
class MemberRecord:
    run_id: str
    peer_id: str
    maddrs: tuple[str, ...]
    version: str
    role: str
    state: MemberState
    timestamp: float
    step: int = 0  # the peer's global step in the run; 0 when it does not train
    local_group: str = ""  # the operator's --local-group label; "" when unset
    dear_address: str = (
        ""  # "host:port" of its DeAR engine (docs/dear.md) or its local group's store (daemon/groupspan.py)
    )
    probe_address: str = ""  # "host:port" where it answers link probes (peers/linkprobe.py); "" when none
    delegated_lanes: int = 0  # bit l: another member of its local group averages lane l (peers/dear/hierarchy.py)
    dear_group: str = ""  # ID of its active DeAR group (hierarchy.group_id); "" when none
    links: tuple[LinkReport, ...] = ()  # its fresh link measurements (--local-group auto); at most MAX_LINKS
    sketch: ParamSketch | None = None  # its latest parameter sketch (peers/sketch.py); None before its first round


def seal_record(record: MemberRecord, identity: Identity, secret: RunSecret | None) -> bytes:
    """Encrypt `record` with the run secret if there is one, then sign it with this daemon's identity."""
    if record.peer_id != identity.peer_id:
        raise ValueError("a daemon only signs records about itself")
    body = records_pb2.PeerRecord(
        format_version=RECORD_FORMAT_VERSION,
        run_id=record.run_id,
        peer_id=record.peer_id,
        maddrs=list(record.maddrs),
        version=record.version,
        role=record.role,
        state=record.state.value,
        timestamp=record.timestamp,
        step=record.step,
        local_group=record.local_group,
        dear_address=record.dear_address,
        probe_address=record.probe_address,
        delegated_lanes=record.delegated_lanes,
        dear_group=record.dear_group,
        links=[
            records_pb2.LinkReport(peer_id=r.peer_id, rtt=r.rtt, bandwidth=r.bandwidth, loss=r.loss, age=r.age)
            for r in record.links
        ],
    )
    if record.sketch is not None:
        s = record.sketch
        body.sketch.step, body.sketch.size, body.sketch.values = s.step, s.size, np.asarray(s.values, "<f4").tobytes()
    return seal(RecordKind.MEMBER, body.SerializeToString(), identity, secret, record.run_id)


def open_envelope(
    data: object, *, run_id: str, secret: RunSecret | None, subkey: str | None, now: float
) -> MemberRecord:
    """Check and decode a record of run `run_id` published under `subkey` (None: not from the DHT)."""
    body_bytes, signer = open_payload(data, RecordKind.MEMBER, run_id=run_id, secret=secret, subkey=subkey)
    body = parse(records_pb2.PeerRecord, body_bytes)
    if body.peer_id != signer:
        raise RecordRejected("record_forged", "record names a peer other than its signer")
    if body.run_id != run_id:
        raise RecordRejected("record_wrong_run", "record belongs to another run")
    try:
        state = MemberState(body.state)
    except ValueError:
        raise RecordRejected("record_malformed", f"unknown member state {body.state}") from None
    if len(body.maddrs) > MAX_MADDRS:
        raise RecordRejected("record_malformed", f"{len(body.maddrs)} addresses")
    if body.timestamp > now + MAX_CLOCK_SKEW_SECONDS:
        raise RecordRejected("record_future", f"timestamp {body.timestamp - now:.0f} s ahead")
    if max(len(body.local_group), len(body.dear_address), len(body.probe_address), len(body.dear_group)) > MAX_LABEL:
        raise RecordRejected("record_malformed", "local group label, DeAR group, DeAR or probe address too long")
    links = _links(body)
    sketch = _sketch(body)
    return MemberRecord(
        run_id=body.run_id,
        peer_id=body.peer_id,
        maddrs=tuple(body.maddrs),
        version=body.version[:64],
        role=body.role[:32],
        state=state,
        timestamp=body.timestamp,
        step=body.step,
        local_group=body.local_group,
        dear_address=body.dear_address,
        probe_address=body.probe_address,
        delegated_lanes=body.delegated_lanes,
        dear_group=body.dear_group,
        links=links,
        sketch=sketch,
    )


def _links(body: records_pb2.PeerRecord) -> tuple[LinkReport, ...]:
    """The record's link reports, checked: bounded in number, one per peer (not the signer), every
    figure finite and in range. One bad report refuses the whole record, like any malformed field."""
    if len(body.links) > MAX_LINKS:
        raise RecordRejected("record_malformed", f"{len(body.links)} link reports (at most {MAX_LINKS})")
    seen: set[str] = set()
    out = []
    for r in body.links:
        figures = (r.rtt, r.bandwidth, r.loss, r.age)
        if not r.peer_id or len(r.peer_id) > MAX_LABEL or r.peer_id == body.peer_id or r.peer_id in seen:
            raise RecordRejected("record_malformed", "link report with an empty, overlong, own or repeated peer ID")
        if not all(math.isfinite(f) for f in figures) or not (
            0 <= r.rtt <= MAX_LINK_RTT and r.bandwidth >= 0 and 0 <= r.loss <= 1 and 0 <= r.age <= MAX_LINK_AGE
        ):
            raise RecordRejected("record_malformed", f"link report with figures out of range: {figures}")
        seen.add(r.peer_id)
        out.append(LinkReport(r.peer_id, r.rtt, r.bandwidth, r.loss, r.age))
    return tuple(out)


def _sketch(body: records_pb2.PeerRecord) -> ParamSketch | None:
    """The record's parameter sketch, checked: bounded in size, no more values than the vector has
    entries, every value finite, taken at a step the sender has reached. A bad one refuses the record."""
    if not body.HasField("sketch"):
        return None
    s = body.sketch
    count, odd = divmod(len(s.values), 4)
    if odd or not 0 < count <= MAX_SKETCH_VALUES or count > s.size:
        raise RecordRejected("record_malformed", f"parameter sketch of {len(s.values)} bytes for {s.size} parameters")
    if not 0 < s.step <= body.step:
        raise RecordRejected("record_malformed", f"parameter sketch of step {s.step} in a record of step {body.step}")
    values = np.frombuffer(s.values, dtype="<f4")
    if not np.isfinite(values).all():
        raise RecordRejected("record_malformed", "parameter sketch with a NaN or infinite value")
    return ParamSketch(s.step, s.size, tuple(values.tolist()))


def check_storable(data: object, subkey: str) -> None:
    """What any DHT node checks before storing a record, without the run's secret: the envelope
    parses and is signed by the peer named in the subkey, so nobody can overwrite another's slot."""
    verified(data, subkey)
