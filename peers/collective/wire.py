"""The collective engine's wire format: one fixed binary header in front of every message.

Layout (little-endian, 72 bytes, struct format `HEADER_FORMAT`):

| offset | size | field    | type | meaning                                                          |
|-------:|-----:|----------|------|------------------------------------------------------------------|
|      0 |    4 | magic    | 4s   | b"PDCL": anything else is not ours; the stream is dropped        |
|      4 |    1 | version  | B    | WIRE_VERSION; another version is refused                         |
|      5 |    1 | kind     | B    | Kind: CONTRIBUTION, RESULT or VERDICT                            |
|      6 |    1 | dtype    | B    | DType of the payload's elements                                  |
|      7 |    1 | flags    | B    | VERDICT: 1 = ok, 0 = abort; otherwise 0                          |
|      8 |    8 | run_tag  | 8s   | blake2b-64 of the run ID: messages of another run are refused    |
|     16 |    8 | round    | Q    | round number (consecutive per group, chosen by the caller)       |
|     24 |    2 | sender   | H    | sender's index in the group                                      |
|     26 |    2 | shard    | H    | shard the payload belongs to (its owner's index)                 |
|     28 |    4 | code     | I    | VERDICT: AbortCode when flags = 0; DONE: the Kind it ends        |
|     32 |    8 | length   | Q    | payload bytes that follow the header (`payload_size(dtype, count)`) |
|     40 |    8 | count    | Q    | payload elements                                                 |
|     48 |    8 | offset   | Q    | element offset of the payload in its shard; DONE: packets sent   |
|     56 |    8 | weight   | d    | CONTRIBUTION: the sender's weight; RESULT: total weight included |
|     64 |    8 | mask     | Q    | RESULT: bit i set = member i's contribution is included          |

Payload formats (DType): FLOAT32 (count * 4 bytes), FLOAT16 (count * 2), the block formats (the
vector in blocks of `BLOCK` values at absolute positions, each a float32 scale then its values:
INT8_BLOCK one byte per value, INT4_BLOCK two values per byte, INT2_BLOCK four; a block's bytes are
4 + ceil(values * bits / 8); codec.py), BYTES (verdicts).

`decode` checks only what needs no context (magic, version, kind, dtype, length = payload_size);
whether a header fits the group and the round is decided where it is received (inbox.py and its
admission rules, chunks.py and packets.py; halves.py for DeAR's ops).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import NamedTuple

MAGIC = b"PDCL"
WIRE_VERSION = 1
HEADER_FORMAT = "<4sBBBB8sQHHIQQQdQ"
HEADER = struct.Struct(HEADER_FORMAT)
HEADER_SIZE = HEADER.size  # 72
MAX_PAYLOAD = 1 << 34  # 16 GiB: far above any shard, far below what would overflow arithmetic
DIGEST_SIZE = 16  # bytes of a VERDICT payload


class Kind(enum.IntEnum):
    CONTRIBUTION = 1  # a member's slice of shard j, sent to owner j (reduce-scatter)
    RESULT = 2  # owner j's reduced shard j, sent to every member (all-gather)
    VERDICT = 3  # a member's digest of the whole result, or its decision to abort
    DONE = 4  # loss-tolerant rounds: the sender sent all it will of one phase to you (see lossy_allreduce.py)


class DType(enum.IntEnum):
    BYTES = 0  # opaque bytes (VERDICT payloads)
    FLOAT32 = 1  # IEEE 754 binary32, little-endian
    FLOAT16 = 2  # IEEE 754 binary16, little-endian (codec.py)
    INT8_BLOCK = 3  # blocks of BLOCK values: a float32 scale, then int8 values (codec.py)
    INT4_BLOCK = 4  # blocks of BLOCK values: a float32 scale, then 4-bit values, two per byte (codec.py)
    INT2_BLOCK = 5  # blocks of BLOCK values: a float32 scale, then 2-bit codes, four per byte (codec.py)


BLOCK = 64  # values per block of the block formats: shard, chunk and packet bounds are multiples of it
DTYPE_SIZE = {DType.BYTES: 1, DType.FLOAT32: 4, DType.FLOAT16: 2}  # bytes per element, block formats aside
BLOCK_BITS = {DType.INT8_BLOCK: 8, DType.INT4_BLOCK: 4, DType.INT2_BLOCK: 2}  # bits per value of a block format


def payload_size(dtype: DType, count: int) -> int:
    """Bytes of a payload of `count` elements; a block format's payload starts on a block boundary
    (only its last block may be shorter than BLOCK)."""
    if (bits := BLOCK_BITS.get(dtype)) is not None:
        full, tail = divmod(count, BLOCK)
        return full * (4 + BLOCK * bits // 8) + (4 + -(-tail * bits // 8) if tail else 0)
    return count * DTYPE_SIZE[dtype]


def payload_fit(dtype: DType, nbytes: int) -> int:
    """The most elements, whole blocks for a block format, whose payload fits in nbytes."""
    if (bits := BLOCK_BITS.get(dtype)) is not None:
        return nbytes // (4 + BLOCK * bits // 8) * BLOCK
    return nbytes // DTYPE_SIZE[dtype]


_KINDS = {k.value: k for k in Kind}
_DTYPES = {d.value: d for d in DType}


class AbortCode(enum.IntEnum):
    NONE = 0  # not an abort
    MISSING_SHARD = 1  # the sender lacks a reduced shard (owner dead, slow or unreachable)
    MISMATCH = 2  # the sender saw a digest that differs from its own
    ECHO = 3  # the sender relays another member's abort
    EMPTY_SHARD = 4  # an owner had no finite contribution at all for its shard


class WireError(ValueError):
    """A header that is not a valid message of this format; `reason` is the rejection counter's label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def run_tag(run_id: str) -> bytes:
    return hashlib.blake2b(run_id.encode(), digest_size=8).digest()


class Header(NamedTuple):  # a tuple: built for every message, so it must be cheap
    kind: Kind
    run_tag: bytes
    round: int
    sender: int
    shard: int
    count: int = 0
    dtype: DType = DType.FLOAT32
    flags: int = 0
    code: int = 0
    offset: int = 0
    weight: float = 0.0
    mask: int = 0

    @property
    def length(self) -> int:
        return payload_size(self.dtype, self.count)

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            WIRE_VERSION,
            self.kind,
            self.dtype,
            self.flags,
            self.run_tag,
            self.round,
            self.sender,
            self.shard,
            self.code,
            self.length,
            self.count,
            self.offset,
            self.weight,
            self.mask,
        )


def decode(data: bytes | bytearray | memoryview) -> Header:
    """Parse one header; raises WireError with the rejection reason if it is not a valid one."""
    if len(data) != HEADER_SIZE:
        raise WireError("wire_truncated", f"{len(data)} bytes")
    magic, version, kind, dtype, flags, tag, rnd, sender, shard, code, length, count, offset, weight, mask = (
        HEADER.unpack(data)
    )
    if magic != MAGIC:
        raise WireError("wire_bad_magic", repr(magic))
    if version != WIRE_VERSION:
        raise WireError("wire_bad_version", str(version))
    if kind not in _KINDS:
        raise WireError("wire_bad_kind", str(kind))
    if dtype not in _DTYPES:
        raise WireError("wire_bad_dtype", str(dtype))
    if length > MAX_PAYLOAD or length != payload_size(_DTYPES[dtype], count):
        raise WireError("wire_bad_size", f"length {length}, count {count}")
    return Header(_KINDS[kind], tag, rnd, sender, shard, count, _DTYPES[dtype], flags, code, offset, weight, mask)
