"""Membership records: what a daemon publishes about itself, signed, and sealed for secret runs.

Every record read from the DHT or received from a peer goes through `open_envelope`, which either
returns a checked `MemberRecord` or raises `RecordRejected` with a reason for peerd_rejected_total.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError

from peers.identity import Identity, peer_id_from_public_key, verify
from peers.runs import RUN_ID_PATTERN, RunSecret
from protos import records_pb2

RECORD_FORMAT_VERSION = 1
MAX_ENVELOPE_BYTES = 16 * 1024  # a record is about 1 KiB; anything far larger is hostile
MAX_MADDRS = 32
MAX_CLOCK_SKEW_SECONDS = 300.0  # records timestamped further in the future are refused


class MemberState(Enum):
    ACTIVE = records_pb2.MEMBER_STATE_ACTIVE  # heartbeating
    LEFT = records_pb2.MEMBER_STATE_LEFT  # left on purpose


class RecordRejected(ValueError):
    """A record failed a check; .reason is the label used in peerd_rejected_total."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MemberRecord:
    run_id: str
    peer_id: str
    maddrs: tuple[str, ...]
    version: str
    role: str
    state: MemberState
    timestamp: float


def seal_record(record: MemberRecord, identity: Identity, secret: RunSecret | None) -> bytes:
    """Sign `record` with this daemon's identity; encrypt it with the run secret if there is one."""
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
    ).SerializeToString()
    signed = records_pb2.SignedRecord(
        record=body, public_key=identity.public_key_der, signature=identity.sign(body)
    ).SerializeToString()
    envelope = records_pb2.Envelope(format_version=RECORD_FORMAT_VERSION, sealed=secret is not None)
    if secret is None:
        envelope.payload = signed
    else:
        envelope.nonce = os.urandom(12)
        envelope.payload = AESGCM(secret.seal_key).encrypt(envelope.nonce, signed, _aad(record.run_id))
    return envelope.SerializeToString()


def open_envelope(
    data: object, *, run_id: str, secret: RunSecret | None, subkey: str | None, now: float
) -> MemberRecord:
    """Check and decode a record of run `run_id` published under `subkey` (None: not from the DHT)."""
    envelope = _parse_envelope(data)
    if secret is None:
        if envelope.sealed:
            raise RecordRejected("record_auth", "sealed record in an open run")
        signed_bytes = envelope.payload
    else:
        if not envelope.sealed or len(envelope.nonce) != 12:
            raise RecordRejected("record_auth", "unsealed record in a secret run")
        try:
            signed_bytes = AESGCM(secret.seal_key).decrypt(envelope.nonce, envelope.payload, _aad(run_id))
        except InvalidTag:
            raise RecordRejected("record_auth", "seal does not verify with the run secret") from None
    body = _verify_signed(signed_bytes, subkey)
    if body.run_id != run_id:
        raise RecordRejected("record_wrong_run", "record belongs to another run")
    try:
        state = MemberState(body.state)
    except ValueError:
        raise RecordRejected("record_malformed", f"unknown member state {body.state}") from None
    if len(body.maddrs) > MAX_MADDRS or not RUN_ID_PATTERN.fullmatch(body.run_id):
        raise RecordRejected("record_malformed", "too many addresses or a bad run ID")
    if body.timestamp > now + MAX_CLOCK_SKEW_SECONDS:
        raise RecordRejected("record_future", f"timestamp {body.timestamp - now:.0f} s ahead")
    return MemberRecord(
        run_id=body.run_id,
        peer_id=body.peer_id,
        maddrs=tuple(body.maddrs),
        version=body.version[:64],
        role=body.role[:32],
        state=state,
        timestamp=body.timestamp,
    )


def check_storable(data: object, subkey: str) -> None:
    """What a DHT node can check before storing a record of any run, without its secret.

    The envelope must parse; an open-run record must be signed by the peer named in the subkey
    (so nobody can overwrite another peer's record). A sealed one is checked by its readers.
    """
    envelope = _parse_envelope(data)
    if not envelope.sealed:
        _verify_signed(envelope.payload, subkey)


def _parse_envelope(data: object) -> records_pb2.Envelope:
    if not isinstance(data, bytes):
        raise RecordRejected("record_malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise RecordRejected("record_oversized", f"{len(data)} bytes")
    envelope = _parse(records_pb2.Envelope, data)
    if envelope.format_version != RECORD_FORMAT_VERSION:
        raise RecordRejected("record_version", f"format version {envelope.format_version}")
    return envelope


def _verify_signed(signed_bytes: bytes, subkey: str | None) -> records_pb2.PeerRecord:
    signed = _parse(records_pb2.SignedRecord, signed_bytes)
    if not verify(signed.public_key, signed.record, signed.signature):
        raise RecordRejected("record_signature", "signature does not verify")
    body = _parse(records_pb2.PeerRecord, signed.record)
    signer = peer_id_from_public_key(signed.public_key)
    if body.peer_id != signer or (subkey is not None and subkey != signer):
        raise RecordRejected("record_forged", "record names a peer other than its signer")
    return body


def _aad(run_id: str) -> bytes:
    return f"peerd-record-v{RECORD_FORMAT_VERSION}\x00{run_id}".encode()


def _parse(message_type, data: bytes):
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise RecordRejected("record_malformed", f"not a {message_type.__name__}") from None
    return message
