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
from peers.runs import RunSecret
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
    ).SerializeToString()
    envelope = records_pb2.Envelope(format_version=RECORD_FORMAT_VERSION, sealed=secret is not None)
    if secret is None:
        envelope.payload = body
    else:
        envelope.nonce = os.urandom(12)
        envelope.payload = AESGCM(secret.seal_key).encrypt(envelope.nonce, body, _aad(record.run_id))
    envelope.public_key = identity.public_key_der
    envelope.signature = identity.sign(_signed_bytes(envelope))
    return envelope.SerializeToString()


def open_envelope(
    data: object, *, run_id: str, secret: RunSecret | None, subkey: str | None, now: float
) -> MemberRecord:
    """Check and decode a record of run `run_id` published under `subkey` (None: not from the DHT)."""
    envelope, signer = _verified_envelope(data, subkey)
    if secret is None:
        if envelope.sealed:
            raise RecordRejected("record_auth", "sealed record in an open run")
        body_bytes = envelope.payload
    else:
        if not envelope.sealed or len(envelope.nonce) != 12:
            raise RecordRejected("record_auth", "unsealed record in a secret run")
        try:
            body_bytes = AESGCM(secret.seal_key).decrypt(envelope.nonce, envelope.payload, _aad(run_id))
        except InvalidTag:
            raise RecordRejected("record_auth", "seal does not verify with the run secret") from None
    body = _parse(records_pb2.PeerRecord, body_bytes)
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
    """What any DHT node checks before storing a record, without the run's secret: the envelope
    parses and is signed by the peer named in the subkey, so nobody can overwrite another's slot."""
    _verified_envelope(data, subkey)


def _verified_envelope(data: object, subkey: str | None) -> tuple[records_pb2.Envelope, str]:
    """Parse an envelope and check its signature; returns it with the signer's peer ID."""
    if not isinstance(data, bytes):
        raise RecordRejected("record_malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise RecordRejected("record_oversized", f"{len(data)} bytes")
    envelope = _parse(records_pb2.Envelope, data)
    if envelope.format_version != RECORD_FORMAT_VERSION:
        raise RecordRejected("record_version", f"format version {envelope.format_version}")
    if not verify(envelope.public_key, _signed_bytes(envelope), envelope.signature):
        raise RecordRejected("record_signature", "signature does not verify")
    signer = peer_id_from_public_key(envelope.public_key)
    if subkey is not None and subkey != signer:
        raise RecordRejected("record_forged", "stored under another peer's slot")
    return envelope, signer


def _signed_bytes(envelope: records_pb2.Envelope) -> bytes:
    return b"peerd-envelope-v1" + envelope.nonce + envelope.payload


def _aad(run_id: str) -> bytes:
    return f"peerd-record-v{RECORD_FORMAT_VERSION}\x00{run_id}".encode()


def _parse(message_type, data: bytes):
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise RecordRejected("record_malformed", f"not a {message_type.__name__}") from None
    return message
