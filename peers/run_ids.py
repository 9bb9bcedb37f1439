"""Run IDs, run secrets, and the DHT keys derived from them."""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

# Letters, digits, '.', '_' and '-', starting with a letter or digit; short enough for a label value.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MIN_SECRET_BYTES = 16
# No peerd DHT record may ask to live longer: a far-future expiration would let a record outlive
# every later write to the same slot (hivemind keeps the value with the latest expiration).
MAX_RECORD_TTL = 600.0
MAX_SECRET_BYTES = 4096


class InvalidRunId(ValueError):
    pass


class InvalidSecret(ValueError):
    pass


def validate_run_id(run_id: str) -> str:
    """Return run_id unchanged, or raise InvalidRunId saying what is wrong with it."""
    if not run_id:
        raise InvalidRunId("run ID is empty")
    if len(run_id) > 64:
        raise InvalidRunId(f"run ID is {len(run_id)} characters long; at most 64 are allowed")
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise InvalidRunId(
            f"run ID {run_id[:64]!r} has characters other than letters, digits, '.', '_' and '-' "
            "(or does not start with a letter or digit)"
        )
    return run_id


@dataclass(frozen=True, slots=True)
class RunSecret:
    """Key material derived from a run's shared secret; the raw secret is not kept."""

    key_id: bytes  # derives the run's DHT key: without the secret the key cannot be found
    seal_key: bytes  # AES-256-GCM key for the run's DHT records
    engine_key: bytes  # keys the collective engine's link hellos (peers/collective/linkauth.py)

    @classmethod
    def from_bytes(cls, secret: bytes, run_id: str) -> "RunSecret":
        secret = secret.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise InvalidSecret(f"run secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required")
        prk = hmac.new(b"peerd run secret v1", secret, hashlib.sha256).digest()  # HKDF-extract

        def expand(label: str) -> bytes:
            return hmac.new(prk, f"{label}\x00{run_id}".encode(), hashlib.sha256).digest()

        return cls(key_id=expand("dht-key"), seal_key=expand("record-seal"), engine_key=expand("engine-link"))

    @classmethod
    def from_file(cls, path: str | Path, run_id: str) -> "RunSecret":
        path = Path(path)
        try:
            if path.stat().st_size > MAX_SECRET_BYTES:
                raise InvalidSecret(f"run secret file {path} is larger than {MAX_SECRET_BYTES} bytes")
            data = path.read_bytes()
        except OSError as e:
            raise InvalidSecret(f"cannot read run secret file {path}: {e.strerror}") from None
        try:
            return cls.from_bytes(data, run_id)
        except InvalidSecret as e:
            raise InvalidSecret(f"run secret file {path}: {e}") from None


def run_namespace(run_id: str, secret: RunSecret | None) -> str:
    """How the run names itself in DHT keys: its ID, or an opaque ID derived from its secret."""
    return run_id if secret is None else f"sealed-{secret.key_id.hex()}"


def run_dht_key(run_id: str, secret: RunSecret | None, what: str = "members") -> str:
    """A DHT key of the run: "members" (peer ID as subkey) or "manifest" (creator's peer ID as
    subkey). In a secret run the key is derived from the secret, so it reveals nothing of the run
    and cannot be found without the secret."""
    if secret is None:
        return f"peerd/v1/run/{run_id}/{what}"
    return f"peerd/v1/sealed-run/{secret.key_id.hex()}/{what}"
