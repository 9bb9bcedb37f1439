"""The engines' payload codec: float32 vectors as float32, float16 or 8-, 4- or 2-bit blocks, and error feedback.

    codec = Codec(Format.INT8)
    wire = codec.encode(values, out)              # -> memoryview of codec.size(len(values)) bytes of out
    codec.decode(wire, into)                      # checks, then writes float32 values into `into`
    with_feedback(x, residual, Format.INT8)       # the trainer, before a round: see below

Formats (`AllReduceSettings.payload`, one per run; wire.DType names them in every header):
* `fp32` (FLOAT32, 4 bytes per value): the values, as today.
* `fp16` (FLOAT16, 2 bytes): IEEE half, round to nearest. A finite value beyond ±65504 is clamped
  to ±65504 (error feedback carries the rest); NaN and ±Inf stay what they are, and the owner
  leaves them out as it does for fp32 (`contribution_nonfinite`).
* `int8` (INT8_BLOCK, 1 + 4/B bytes): blocks of B = wire.BLOCK (64) values, each a float32
  scale s = max|x| / 127 then q = round(x / s) (ties to even) as int8; a value decodes to q * s.
* `int4` (INT4_BLOCK, 1/2 + 4/B bytes): the same with s = max|x| / 7 and q in [-7, 7], two values
  a byte (the first in the low nibble, two's complement).
* `int2` (INT2_BLOCK, 1/4 + 4/B bytes): four levels, no zero among them: s = max|x| / 1.5 and a
  value decodes to (c - 1.5) * s for its code c in 0..3, the nearest of -1.5 s, -0.5 s, 0.5 s and
  1.5 s (c = floor(x / s) + 2; a tie goes up), four codes a byte (the first in the low bits). A zero
  level would waste one of four codes; with it the error bound would be s / 2 = max|x| / 2 instead
  of max|x| / 3.
Rounding is to the nearest level in every format (stochastic rounding is not offered: error feedback
already carries what rounding loses to the next round).

Blocks sit at absolute positions of the vector an engine averages (block k = elements [kB, (k+1)B),
the last block may be shorter), and the engines cut shards, chunks and packets on block bounds
(`alignment`): a lost datagram spoils only its own blocks, and encoding a vector that is already a
decoded one gives back the same bytes (the scale is max|level * s| / 127, / 7 or / 1.5 again,
exactly: tests/test_codec.py checks every float32 mantissa), so the engine's encoding of a vector
prepared by `with_feedback` loses nothing more. The error of a value is at most s / 2 of its block.

Odd blocks. A block whose largest magnitude is below Q * 2^-126 (Q = 127, 7 or 1.5: float32's
smallest normal, so that scales stay normal numbers) is sent with scale 0: zeros. A block holding
NaN or Inf, or whose scale would exceed `MAX_SCALE`, cannot be encoded: it is sent with a NaN scale
and zero values, and its receiver refuses the message it is in (`codec_bad_scale`): the sender's
chunk (reliable engine) or packet (UDP engine) is left out, as a NaN in a float32 contribution is
(`contribution_nonfinite`); its other chunks or packets, and the other members', are not touched.

Checks on decode (`WireError`, counted by the engines as rejections): a payload whose size is not
`size(count)` (`codec_bad_size`), a scale that is NaN, Inf, negative or above `MAX_SCALE`
(`codec_bad_scale`). An int8 value of -128 and an int4 value of -8 (never written) decode to
-128 s and -8 s.

Arithmetic is numpy's, on one thread (reduction.py says why); `Codec` keeps one float32 scratch
buffer, grown to the largest message it saw, so a round allocates nothing once warm (int4 and int2
unpack each message into arrays of their own).
"""

from __future__ import annotations

import enum

import numpy as np

from peerd.peers.collective.wire import BLOCK, BLOCK_BITS, DType, WireError, payload_fit, payload_size

MAX_SCALE = 2.0**100  # the largest block scale accepted: int8 values up to 127 * 2^100 (1.6e32) encode
FP16_MAX = 65504.0  # float16's largest finite value


class Format(enum.Enum):
    """How a round's values travel: the manifest's and AllReduceSettings' `payload` setting."""

    FP32 = "fp32"  # 4 bytes per value, exact
    FP16 = "fp16"  # 2 bytes per value: IEEE half
    INT8 = "int8"  # 1 + 4/64 bytes per value: 8-bit values with a float32 scale per block of 64
    INT4 = "int4"  # 1/2 + 4/64 bytes per value: 4-bit values with a float32 scale per block of 64
    INT2 = "int2"  # 1/4 + 4/64 bytes per value: 2-bit codes with a float32 scale per block of 64

    @property
    def dtype(self) -> DType:
        return _DTYPE[self]

    @property
    def alignment(self) -> int:
        """Elements per block: every shard, chunk and packet starts on a multiple of it."""
        return BLOCK if self.dtype in BLOCK_BITS else 1


_DTYPE = {
    Format.FP32: DType.FLOAT32,
    Format.FP16: DType.FLOAT16,
    Format.INT8: DType.INT8_BLOCK,
    Format.INT4: DType.INT4_BLOCK,
    Format.INT2: DType.INT2_BLOCK,
}


class _Levels:
    """A block format's levels: a block's scale is max|x| / top, and a value is level * scale, its
    level the nearest of the format's (whole numbers in [-top, top], or with `midrise`, the half
    numbers -1.5 ... 1.5). Its `bits` per value are wire.BLOCK_BITS', which sizes the payloads."""

    def __init__(self, dtype: DType, top: float, midrise: bool = False):
        self.dtype, self.bits, self.top, self.midrise = dtype, BLOCK_BITS[dtype], np.float32(top), midrise
        self.per_byte = 8 // self.bits
        self.tiny = float(top) * float(np.finfo(np.float32).tiny)  # blocks below this are sent as zeros

    def nearest(self, ratio: np.ndarray) -> None:
        """ratio (x / s, float32) becomes its level, in place."""
        if self.midrise:
            np.floor(ratio, out=ratio)
            ratio += np.float32(0.5)
            np.clip(ratio, -self.top, self.top, out=ratio)
        else:
            np.rint(ratio, out=ratio)

    def pack(self, levels: np.ndarray, out: np.ndarray) -> None:
        """levels: rows of one block each (float32); out: each row's value bytes (uint8)."""
        if self.bits == 8:
            np.copyto(out.view(np.int8), levels, casting="unsafe")
            return
        codes = (levels + self.top).astype(np.uint8) if self.midrise else levels.astype(np.int8).view(np.uint8)
        rows, width = codes.shape
        padded = np.zeros((rows, out.shape[1] * self.per_byte), np.uint8)
        padded[:, :width] = codes & ((1 << self.bits) - 1)
        out[:] = 0
        for i in range(self.per_byte):
            out |= padded[:, i :: self.per_byte] << np.uint8(i * self.bits)

    def unpack(self, data: np.ndarray, width: int) -> np.ndarray:
        """data: rows of value bytes (uint8) -> rows of `width` levels (int8 for 8 bits, else float32)."""
        if self.bits == 8:
            return data.view(np.int8)
        mask = np.uint8((1 << self.bits) - 1)
        codes = np.empty((data.shape[0], data.shape[1] * self.per_byte), np.uint8)
        for i in range(self.per_byte):
            codes[:, i :: self.per_byte] = (data >> np.uint8(i * self.bits)) & mask
        codes = codes[:, :width]
        if self.midrise:
            return codes.astype(np.float32) - self.top
        sign = np.uint8(1 << (self.bits - 1))
        return (codes ^ sign).astype(np.float32) - np.float32(sign)  # two's complement


_LEVELS = {
    levels.dtype: levels
    for levels in (
        _Levels(DType.INT8_BLOCK, 127),
        _Levels(DType.INT4_BLOCK, 7),
        _Levels(DType.INT2_BLOCK, 1.5, midrise=True),
    )
}


class Codec:
    """Encodes and decodes float32 values in one format. Not thread-safe (one scratch buffer)."""

    def __init__(self, fmt: Format | str = Format.FP32):
        self.format = Format(fmt)
        self.dtype, self.block = self.format.dtype, self.format.alignment
        self.levels = _LEVELS.get(self.dtype)  # None for fp32 and fp16
        self._scratch = np.empty(0, np.float32)

    def size(self, count: int) -> int:
        """Bytes of `count` values starting on a block boundary."""
        return payload_size(self.dtype, count)

    def fit(self, nbytes: int) -> int:
        """The most values, a whole number of blocks, whose encoding fits in `nbytes` (0 if none)."""
        return payload_fit(self.dtype, nbytes)

    def encode(self, values: np.ndarray, out: np.ndarray | memoryview) -> memoryview:
        """Write `values` (float32, starting on a block boundary) into the front of `out` (bytes);
        returns the bytes written, a view of `out`. Never fails: see the module docstring for odd values."""
        n = len(values)
        buf = _u8(out)[: self.size(n)]
        if self.format is Format.FP32:
            buf.view(np.float32)[:] = values
        elif self.format is Format.FP16:
            half = buf.view(np.float16)
            with np.errstate(over="ignore"):
                np.copyto(half, values, casting="same_kind")
            if not _finite(half):  # rare: clamp what overflowed; NaN and Inf stay
                wide = np.isinf(half) & np.isfinite(values)
                half[wide] = np.copysign(FP16_MAX, values[wide])
        else:
            full = n // BLOCK * BLOCK
            if full:
                self._encode_blocks(values[:full], buf[: self.size(full)])
            if full < n:
                self._encode_blocks(values[full:], buf[self.size(full) :])
        return memoryview(buf)

    def decode(self, data: np.ndarray | memoryview | bytes, out: np.ndarray, check: bool = True) -> None:
        """Check `data` as the encoding of len(out) values, then write them into `out` (float32).
        Raises WireError (`codec_bad_size`, `codec_bad_scale`) before writing anything. check=False
        is for bytes this process just encoded: a block that could not be encoded then decodes to NaN."""
        buf = self._check(data, len(out)) if check else _u8(data)
        if self.levels is not None:
            for scales, q, dest in self._blocks(buf, out):
                np.multiply(q, scales[:, None], out=dest)
        else:
            out[:] = buf.view(np.float32 if self.format is Format.FP32 else np.float16)

    def decode_add(self, data: np.ndarray | memoryview | bytes, acc: np.ndarray, weight: float) -> None:
        """acc += weight * decode(data), checked as `decode` does; acc is float32 and is the only
        full-size array written (the scratch holds the levels of one message for a block format)."""
        buf = self._check(data, len(acc))
        w = np.float32(weight)
        if self.levels is not None:
            for scales, q, dest in self._blocks(buf, acc):
                tmp = self._rows(q.shape)
                np.multiply(q, (scales * w)[:, None], out=tmp)
                dest += tmp
        else:
            tmp = self._rows((len(acc),))
            np.multiply(buf.view(np.float32 if self.format is Format.FP32 else np.float16), w, out=tmp)
            acc += tmp

    def roundtrip(self, x: np.ndarray) -> np.ndarray:
        """Per element: whether it is encodable; x is replaced in place by decode(encode(x)) where it is
        (elsewhere left as it is). What a receiver gets, without the bytes."""
        ok = np.isfinite(x)
        if self.format is Format.FP16:
            with np.errstate(over="ignore"):
                np.copyto(x, np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16), where=ok)
        elif self.levels is not None:
            full = len(x) // BLOCK * BLOCK
            whole = (x[:full].reshape(-1, BLOCK), ok[:full].reshape(-1, BLOCK))
            for part, good in (whole, (x[full:].reshape(1, -1), ok[full:].reshape(1, -1))):
                if part.size:
                    scales, q = _quantize(part, self._rows(part.shape), self.levels)
                    usable = scales == scales  # not NaN
                    good &= usable[:, None]
                    np.multiply(q, scales[:, None], out=q)
                    np.copyto(part, q, where=good)
        return ok

    # ---- blocks ---------------------------------------------------------------------------------

    def _encode_blocks(self, values: np.ndarray, buf: np.ndarray) -> None:
        """values: whole blocks, or one short last block; buf: their encoding."""
        rows = -(-len(values) // BLOCK)
        width = len(values) // rows
        grid = buf.reshape(rows, -1)
        scales, q = _quantize(values.reshape(rows, width), self._rows((rows, width)), self.levels)
        grid[:, :4].view(np.float32)[:, 0] = scales
        self.levels.pack(q, grid[:, 4:])

    def _blocks(self, buf: np.ndarray, out: np.ndarray):
        """(scales, levels, destination) for the whole blocks of buf, then its short last one."""
        n = len(out)
        full = n // BLOCK * BLOCK
        split = self.size(full)
        for data, dest in ((buf[:split], out[:full]), (buf[split:], out[full:])):
            if len(dest):
                rows = -(-len(dest) // BLOCK)
                grid = data.reshape(rows, -1)
                levels = self.levels.unpack(grid[:, 4:], len(dest) // rows)
                yield grid[:, :4].view(np.float32)[:, 0], levels, dest.reshape(rows, -1)

    def _scales(self, buf: np.ndarray, count: int):
        """The scales of the whole blocks of buf (a payload of `count` values), then its short last one's."""
        full = count // BLOCK * BLOCK
        split = self.size(full)
        if full:
            yield buf[:split].reshape(full // BLOCK, -1)[:, :4].copy().view(np.float32)[:, 0]
        if full < count:
            yield buf[split : split + 4].copy().view(np.float32)

    def _check(self, data, count: int) -> np.ndarray:
        buf = _u8(data)
        if len(buf) != self.size(count):
            raise WireError("codec_bad_size", f"{len(buf)} bytes for {count} values as {self.format.value}")
        if self.levels is not None:
            for scales in self._scales(buf, count):
                low, high = scales.min(), scales.max()  # NaN propagates through both
                if not (low >= 0 and high <= MAX_SCALE):
                    raise WireError("codec_bad_scale", f"scales from {low} to {high}")
        return buf

    def _rows(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        if len(self._scratch) < n:
            self._scratch = np.empty(n, np.float32)
        return self._scratch[:n].reshape(shape)


def _quantize(blocks: np.ndarray, scratch: np.ndarray, levels: _Levels) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `blocks`: its scale (NaN where the row cannot be encoded) and its values' levels
    in `scratch` (float32)."""
    np.abs(blocks, out=scratch)
    with np.errstate(invalid="ignore", over="ignore"):
        amax = scratch.max(axis=1)
        scales = amax / levels.top
        bad = ~(scales <= MAX_SCALE)  # NaN, Inf, too large
        tiny = amax < levels.tiny
        scales[tiny] = 0
        divisor = np.where(bad | tiny, np.float32(np.inf), scales)  # those rows quantize to zeros
        np.divide(blocks, divisor[:, None], out=scratch)
    if bad.any():
        scratch[bad] = 0
        scales[bad] = np.nan
    levels.nearest(scratch)
    return scales, scratch


def with_feedback(x: np.ndarray, residual: np.ndarray, fmt: Format | str, codec: Codec | None = None) -> None:
    """Error feedback, in place: x becomes what the codec delivers for x + residual, and residual
    becomes (x + residual) - delivered, so what one step loses is sent with the next.

    Run it on the vector an engine averages (int8 blocks sit at its absolute positions) just before
    the round: the engine's own encoding of x then loses nothing more. Elements that cannot be
    encoded (NaN, Inf, a block beyond MAX_SCALE) keep x + residual, which the round refuses, and
    their residual restarts at zero, so one bad step does not poison the later ones. fp32: x +=
    residual, residual = 0. Both are float32 arrays of one length."""
    if x.dtype != np.float32 or residual.dtype != np.float32 or x.shape != residual.shape:
        raise ValueError("x and residual must be float32 arrays of one shape")
    x += residual
    codec = codec or Codec(fmt)
    if codec.format is Format.FP32:
        residual.fill(0)
        return
    np.copyto(residual, x)
    ok = codec.roundtrip(x)
    residual -= x
    residual[~ok] = 0


def _u8(data) -> np.ndarray:
    a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def _finite(a: np.ndarray) -> bool:
    return bool(a.size == 0 or (np.isfinite(a.max()) and np.isfinite(a.min())))
