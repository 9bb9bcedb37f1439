"""This daemon's libp2p identity: the RSA key p2pd uses, loaded to sign what we publish."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import P2P
from hivemind.proto import crypto_pb2

_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


def peer_id_from_public_key(public_key_der: bytes) -> str:
    """The base58 libp2p peer ID of an RSA key (sha2-256 multihash of the protobuf public key)."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def verify(public_key_der: bytes, data: bytes, signature: bytes) -> bool:
    try:
        key = serialization.load_der_public_key(public_key_der)
    except (ValueError, TypeError):
        return False
    if not isinstance(key, rsa.RSAPublicKey):
        return False
    try:
        key.verify(signature, data, _PADDING, hashes.SHA256())
    except InvalidSignature:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Identity:
    private_key: rsa.RSAPrivateKey
    public_key_der: bytes
    peer_id: str

    @classmethod
    def load_or_create(cls, path: Path) -> "Identity":
        """Load the identity file p2pd will use, creating it (mode 0400) if missing."""
        if not path.exists():
            P2P.generate_identity(str(path))
        key_data = crypto_pb2.PrivateKey.FromString(path.read_bytes()).data
        private_key = serialization.load_der_private_key(key_data, password=None)
        if not isinstance(private_key, rsa.RSAPrivateKey):
            raise ValueError(f"identity file {path} does not hold an RSA key")
        public_der = private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        return cls(private_key=private_key, public_key_der=public_der, peer_id=peer_id_from_public_key(public_der))

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data, _PADDING, hashes.SHA256())
