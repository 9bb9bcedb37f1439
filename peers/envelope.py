"""Signed (and, for secret runs, sealed) envelopes: the one format of everything peerd puts in the DHT.

seal() signs with this daemon's identity after encrypting with the run secret, so any DHT node can
check who wrote an envelope (verified()) while only the run's members can read it (open_payload()).
Every check that fails raises RecordRejected with the reason counted in peerd_rejected_total.
"""

from __future__ import annotations

import collections
import os
import threading
from enum import Enum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError

from peerd.peers.identity import Identity, peer_id_from_public_key, verify
from peerd.peers.run_ids import RunSecret
from peerd.protos import records_pb2

FORMAT_VERSION = 1
MAX_ENVELOPE_BYTES = 16 * 1024  # a record is about 1 KiB; anything far larger is hostile
# Envelopes whose signature verified, by their exact bytes -> signer, the most recent last. The same
# record arrives many times: from each DHT node a read asks, at every refresh (every second), until
# its writer's next heartbeat; an RSA check and a peer ID cost about 0.1 ms (py-spy: about 30 % of an
# idle daemon's Python samples at 8 daemons, about 10 % of its CPU). Bytes that verified once verify
# again: the cache changes no answer. Bounded: 4,096 records of at most 16 KiB (about 4 MiB at 1 KiB a record).
_VERIFIED: collections.OrderedDict[bytes, str] = collections.OrderedDict()
_VERIFIED_LOCK = threading.Lock()  # the DHT's loop and the control handlers' threads both check records
VERIFIED_CACHE = 4096


class RecordKind(Enum):
    MEMBER = records_pb2.RECORD_KIND_MEMBER  # a PeerRecord: one daemon's membership in one run
    MANIFEST = records_pb2.RECORD_KIND_MANIFEST  # a RunManifest: what the run trains and how
    GROUP_ENTRY = records_pb2.RECORD_KIND_GROUP_ENTRY  # a GroupEntry: one peer's bid for one round's group


class RecordRejected(ValueError):
    """A record failed a check; .reason is the label used in peerd_rejected_total."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def seal(kind: RecordKind, body: bytes, identity: Identity, secret: RunSecret | None, run_id: str) -> bytes:
    envelope = records_pb2.Envelope(format_version=FORMAT_VERSION, sealed=secret is not None, kind=kind.value)
    if secret is None:
        envelope.payload = body
    else:
        envelope.nonce = os.urandom(12)
        envelope.payload = AESGCM(secret.seal_key).encrypt(envelope.nonce, body, _aad(kind, run_id))
    envelope.public_key = identity.public_key_der
    envelope.signature = identity.sign(_signed_bytes(envelope))
    return envelope.SerializeToString()


def verified(data: object, subkey: str | None) -> tuple[records_pb2.Envelope, str]:
    """Parse an envelope and check its signature (and, given a subkey, that the signer owns it).
    Needs no run secret: this is what every DHT node checks before storing. Returns the signer."""
    if not isinstance(data, bytes):
        raise RecordRejected("record_malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise RecordRejected("record_oversized", f"{len(data)} bytes")
    envelope = parse(records_pb2.Envelope, data)
    if envelope.format_version != FORMAT_VERSION:
        raise RecordRejected("record_version", f"format version {envelope.format_version}")
    if envelope.kind not in {k.value for k in RecordKind}:
        raise RecordRejected("record_malformed", f"unknown record kind {envelope.kind}")
    with _VERIFIED_LOCK:
        signer = _VERIFIED.get(data)
        if signer is not None:
            _VERIFIED.move_to_end(data)
    if signer is None:
        if not verify(envelope.public_key, _signed_bytes(envelope), envelope.signature):
            raise RecordRejected("record_signature", "signature does not verify")
        signer = peer_id_from_public_key(envelope.public_key)
        with _VERIFIED_LOCK:
            _VERIFIED[data] = signer
            while len(_VERIFIED) > VERIFIED_CACHE:
                _VERIFIED.popitem(last=False)
    if subkey is not None and subkey != signer:
        raise RecordRejected("record_forged", "stored under another peer's slot")
    return envelope, signer


def open_payload(
    data: object, kind: RecordKind, *, run_id: str, secret: RunSecret | None, subkey: str | None
) -> tuple[bytes, str]:
    """Verify an envelope of `kind` and return (its plaintext body, the signer's peer ID)."""
    envelope, signer = verified(data, subkey)
    if envelope.kind != kind.value:
        raise RecordRejected("record_malformed", f"expected a {kind.name} record")
    if secret is None:
        if envelope.sealed:
            raise RecordRejected("record_auth", "sealed record in an open run")
        return envelope.payload, signer
    if not envelope.sealed or len(envelope.nonce) != 12:
        raise RecordRejected("record_auth", "unsealed record in a secret run")
    try:
        return AESGCM(secret.seal_key).decrypt(envelope.nonce, envelope.payload, _aad(kind, run_id)), signer
    except InvalidTag:
        raise RecordRejected("record_auth", "seal does not verify with the run secret") from None


def parse(message_type, data: bytes):
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise RecordRejected("record_malformed", f"not a {message_type.__name__}") from None
    return message


def _aad(kind: RecordKind, run_id: str) -> bytes:
    # Binds the ciphertext to its kind and run: a sealed record cannot be replayed as another.
    return f"peerd-{kind.name.lower()}-v{FORMAT_VERSION}\x00{run_id}".encode()


def _signed_bytes(envelope: records_pb2.Envelope) -> bytes:
    return b"peerd-envelope-v1" + bytes([envelope.kind & 0xFF]) + envelope.nonce + envelope.payload
