"""The payload codec on its own: exact bytes, the error bound, error feedback without bias, garbage refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from peerd.peers.collective.codec import FP16_MAX, MAX_SCALE, Codec, Format, with_feedback
from peerd.peers.collective.wire import BLOCK, WireError

B = BLOCK


def encode(fmt, x) -> bytes:
    codec = Codec(fmt)
    x = np.asarray(x, np.float32)
    return bytes(codec.encode(x, np.empty(codec.size(len(x)), np.uint8)))


def decode(fmt, data, n) -> np.ndarray:
    out = np.full(n, 7.0, np.float32)
    Codec(fmt).decode(data, out)
    return out


TOP = {"int8": 127, "int4": 7, "int2": 1.5}  # a block's scale is its largest magnitude over this


def block_scales(x: np.ndarray, fmt: str = "int8") -> np.ndarray:
    """Per element, its block's scale (blocks at absolute positions)."""
    pad = np.zeros(-(-len(x) // B) * B, np.float32)
    pad[: len(x)] = np.abs(x)
    return np.repeat(pad.reshape(-1, B).max(axis=1) / np.float32(TOP[fmt]), B)[: len(x)]


def test_int8_exact_bytes_of_a_short_block():
    x = [0.0, 1.4, -127.0, 63.5, 62.5, 2.6]  # max |x| = 127: scale 1; ties go to the even integer
    data = encode("int8", x)
    assert data == struct.pack("<f", 1.0) + bytes([0, 1, 256 - 127, 64, 62, 3])
    assert decode("int8", data, 6).tolist() == [0.0, 1.0, -127.0, 64.0, 62.0, 3.0]
    assert Codec("int8").size(6) == 10 and Codec("int8").size(B) == B + 4 and Codec("int8").size(B + 1) == B + 9


def test_int4_and_int2_exact_bytes_of_a_short_block():
    x = [0.0, 1.4, -7.0, 3.5, 2.5, -0.6]  # max |x| = 7: scale 1; ties go to the even integer
    data = encode("int4", x)
    assert data == struct.pack("<f", 1.0) + bytes([0x10, 0x49, 0xF2])  # 0 1 | -7 4 | 2 -1, low nibble first
    assert decode("int4", data, 6).tolist() == [0.0, 1.0, -7.0, 4.0, 2.0, -1.0]
    x = [1.5, -1.5, 0.2, -0.2, 0.0, 1.0, -1.0]  # max |x| = 1.5: scale 1; codes 3 0 2 1 | 2 3 1
    data = encode("int2", x)
    assert data == struct.pack("<f", 1.0) + bytes([3 | 2 << 4 | 1 << 6, 2 | 3 << 2 | 1 << 4])
    assert decode("int2", data, 7).tolist() == [1.5, -1.5, 0.5, -0.5, 0.5, 1.5, -0.5]
    sizes = {fmt: [Codec(fmt).size(n) for n in (1, 5, B, B + 1, 2 * B)] for fmt in ("int4", "int2")}
    assert sizes == {"int4": [5, 7, 36, 41, 72], "int2": [5, 6, 20, 25, 40]}
    assert Codec("int4").fit(72) == 2 * B and Codec("int2").fit(39) == B and Codec("int2").fit(19) == 0


@pytest.mark.parametrize("top", [127, 7, 1.5])
def test_a_scale_survives_its_largest_level_for_every_float32_mantissa(top):
    """Re-encoding a decoded block finds its scale again: with s = a / top for a block's largest
    magnitude a, (top * s) / top == s in float32 for every mantissa of a (at three exponents), so the
    engines' re-encoding of a vector prepared by with_feedback is exact."""
    mantissas = np.arange(2**23, dtype=np.uint32)
    t = np.float32(top)
    for exponent in (100, 127, 150):  # 2^-27, 2^0, 2^23
        s = (mantissas | np.uint32(exponent << 23)).view(np.float32) / t
        assert np.array_equal((s * t) / t, s), (top, exponent)


def test_int8_blocks_sit_at_absolute_positions_and_each_has_its_scale():
    x = np.zeros(B + 3, np.float32)
    x[0], x[1] = 254.0, 1.0  # block 0: scale 2, 1.0 -> q = round(0.5) = 0
    x[B], x[B + 2] = -0.5, 0.25  # block 1 (short): scale 0.5 / 127
    data = encode("int8", x)
    assert len(data) == 4 + B + 4 + 3
    assert struct.unpack_from("<f", data, 0)[0] == 2.0 and data[4:6] == bytes([127, 0])
    s1 = np.float32(0.5) / np.float32(127)
    assert struct.unpack_from("<f", data, 4 + B)[0] == s1
    assert data[8 + B :] == bytes([256 - 127, 0, 64])  # 0.25 / s1 = 63.5 -> 64
    y = decode("int8", data, B + 3)
    assert y[0] == 254.0 and y[1] == 0.0 and y[B] == -127 * s1 and y[B + 2] == 64 * s1


def test_int8_a_block_of_zeros_has_scale_zero_and_odd_blocks_a_nan_scale():
    x = np.zeros(3 * B, np.float32)
    x[B + 5] = np.nan  # block 1 cannot be encoded
    x[2 * B] = 1e-37  # block 2: below 127 * float32's smallest normal, sent as zeros
    data = encode("int8", x)
    scales = [struct.unpack_from("<f", data, k * (B + 4))[0] for k in range(3)]
    assert scales[0] == 0.0 and np.isnan(scales[1]) and scales[2] == 0.0
    assert data[(B + 4) + 4 : 2 * (B + 4)] == bytes(B)  # zero values beside the NaN scale
    big = np.zeros(B, np.float32)
    big[0] = 127 * MAX_SCALE * 2  # finite, but beyond the largest scale
    assert np.isnan(struct.unpack_from("<f", encode("int8", big), 0)[0])


def test_fp16_exact_values_and_clamping():
    x = [1.0, 0.1, -2.5, 65504.0, 1e6, -1e6, np.nan, np.inf]
    data = encode("fp16", x)
    assert len(data) == 16 and data[:2] == b"\x00\x3c"  # 1.0 as IEEE half
    y = decode("fp16", data, 8)
    assert y[:6].tolist() == [1.0, 0.0999755859375, -2.5, FP16_MAX, FP16_MAX, -FP16_MAX]
    assert np.isnan(y[6]) and y[7] == np.inf  # not finite stays not finite: the owner leaves it out


def test_fp32_is_todays_bytes():
    x = np.array([1.5, -2.0, 3e-9], np.float32)
    assert encode("fp32", x) == x.tobytes() and decode("fp32", x.tobytes(), 3).tolist() == x.tolist()


@pytest.mark.parametrize("n", [1, B - 1, B, B + 1, 10 * B + 17])
def test_error_bound_and_re_encoding_is_exact(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
    for fmt in ("int8", "int4", "int2"):
        y = decode(fmt, encode(fmt, x), n)
        scale = block_scales(x, fmt)
        assert np.all(np.abs(x - y) <= scale / 2 * (1 + 1e-6)), fmt  # half a quantum of its block
        assert encode(fmt, y) == encode(fmt, x), fmt  # a decoded vector encodes to the same bytes
    h = decode("fp16", encode("fp16", x), n)
    finite = np.abs(x) <= FP16_MAX
    tiny = np.abs(x) < 2.0**-14  # float16's subnormals: an absolute step of 2^-24
    assert np.all(np.abs(x - h)[finite] <= np.where(tiny, 2.0**-25, np.abs(x) * 2.0**-11)[finite])
    assert encode("fp16", h) == encode("fp16", x)


def test_decode_add_accumulates_scaled_values():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(3 * B + 5).astype(np.float32)
    for fmt in Format:
        data = encode(fmt, x)
        acc = np.ones(len(x), np.float32)
        Codec(fmt).decode_add(data, acc, 0.25)
        np.testing.assert_allclose(acc, 1 + 0.25 * decode(fmt, data, len(x)), rtol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_garbage_is_refused_with_a_reason(fmt):
    x = np.linspace(-1, 1, 2 * B + 3, dtype=np.float32)
    good = bytearray(encode(fmt, x))
    for at in (Codec(fmt).size(B), Codec(fmt).size(2 * B)):  # the second block's scale, the short one's
        for bad_scale in (np.nan, np.inf, -1.0, MAX_SCALE * 4):
            data = bytearray(good)
            struct.pack_into("<f", data, at, bad_scale)
            out = np.full(2 * B + 3, 7.0, np.float32)
            with pytest.raises(WireError) as e:
                Codec(fmt).decode(data, out)
            assert e.value.reason == "codec_bad_scale"
            assert np.all(out == 7.0)  # nothing written
    # (2 B + 4 values take the bytes of 2 B + 3 in int4 and int2: a header's count says which.)
    for data, n in ((good[:-1], 2 * B + 3), (good, 2 * B + 5), (good + b"\0", 2 * B + 3), (good, B)):
        with pytest.raises(WireError) as e:
            Codec(fmt).decode(data, np.empty(n, np.float32))
        assert e.value.reason == "codec_bad_size"
    with pytest.raises(WireError) as e:
        Codec("fp16").decode(b"\0" * 5, np.empty(3, np.float32))
    assert e.value.reason == "codec_bad_size"


def test_error_feedback_exact_values():
    x = np.zeros(B, np.float32)
    x[0], x[1] = 127.0, 0.3  # scale 1: 0.3 alone would be sent as 0 every step
    r = np.zeros(B, np.float32)
    delivered = []
    for _ in range(4):
        v = x.copy()
        with_feedback(v, r, "int8")
        delivered.append(float(v[1]))
        assert v[0] == 127.0
    assert delivered == [0.0, 1.0, 0.0, 0.0] and r[1] == np.float32(np.float32(0.3) * 4 - 1)
    v = np.array([1.0, 2.0], np.float32)
    r = np.array([0.5, -0.25], np.float32)
    with_feedback(v, r, "fp32")
    assert v.tolist() == [1.5, 1.75] and r.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp16"])
def test_error_feedback_leaves_no_bias_over_1000_steps(fmt):
    """Inputs with a small bias below half a quantum (rounded away every step without feedback): the
    running sum of what was delivered stays within one quantum of the running sum of the inputs."""
    rng = np.random.default_rng(7)
    n, steps = 4 * B + 9, 1000
    r = np.zeros(n, np.float32)
    sum_in, sum_out, sum_plain = np.zeros(n), np.zeros(n), np.zeros(n)
    codec = Codec(fmt)
    for _ in range(steps):
        x = (rng.standard_normal(n) * 1e-5 + 2e-4).astype(np.float32)
        x[::B] = 0.1  # one large value per block: the quantum is 0.1 / 127 (int8), / 7, / 1.5
        sum_in += x
        plain = x.copy()
        codec.roundtrip(plain)
        sum_plain += plain
        with_feedback(x, r, fmt, codec)
        assert encode(fmt, x) == encode(fmt, decode(fmt, encode(fmt, x), n))  # the engine loses nothing more
        sum_out += x
    quantum = 0.1 / TOP[fmt] if fmt in TOP else 2.0**-14  # fp16: the step between halves near 0.1
    assert np.all(np.abs(sum_in - sum_out - r) <= 1e-6)  # up to float32 rounding of x + residual
    assert np.abs(r).max() <= quantum
    assert np.abs(sum_in - sum_out).max() <= quantum * 1.01
    if fmt in TOP:
        assert np.abs(sum_in - sum_plain).max() > 10 * quantum  # without feedback the bias accumulates


def test_error_feedback_does_not_carry_a_nan_into_later_steps():
    x = np.ones(2 * B, np.float32)
    x[3] = np.nan
    r = np.full(2 * B, 0.001, np.float32)
    with_feedback(x, r, "int8")
    assert np.isnan(x[3]) and np.all(r[:B] == 0)  # its block is refused by the round; no residual kept
    assert np.all(np.abs(x[B:] - 1.001) < 1e-6) and np.all(np.abs(r[B:]) < 1e-6)  # the other block as usual


def mean_bound(xs, fmt: str) -> np.ndarray:
    """Per element, how far an engine's result may be from the float32 weighted mean of xs (docs/
    algorithms.md): int8, 1.01 A / 127 with A the largest magnitude any member holds in the block
    (half a quantum from the contributions, half from encoding the result), int4 and int2 the same
    with 7 and 1.5 for 127; fp16, 2^-10 of the
    largest magnitude any member holds there (plus float16's subnormal step)."""
    a = np.max([np.abs(np.asarray(x, np.float32)) for x in xs], axis=0)
    if fmt in TOP:
        return block_scales(a, fmt) * 1.01 * 2 + 1e-30
    return a * 2.0**-10 * 1.01 + 2.0**-24
