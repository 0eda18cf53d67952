"""MXFP4 (OCP Microscaling Formats v1.0) exactly as AMD Quark 0.13 writes it into checkpoints.

This module is the project's one home for the MXFP4 layout facts. It is plain numpy on purpose: an
encoder that shares no code with Quark is what lets the tests prove Quark's output right, bit for bit.

Layout of a quantized Linear weight ``W [out, in]`` (``in`` divisible by 32):

* ``X.weight`` uint8 ``[out, in/2]``: two 4-bit elements a byte, element ``2i`` in the LOW nibble and
  ``2i+1`` in the HIGH nibble. A nibble is ``sign << 3 | code``, ``code`` indexing ``E2M1_VALUES``.
* ``X.weight_scale`` uint8 ``[out, in/32]``: one e8m0 scale per 32 consecutive inputs, worth
  ``2 ** (byte - 127)``.

Element rounding: each element is divided by its block's scale (a true division, as Quark does;
with power-of-two scales this equals multiplying by the reciprocal except in subnormal corners that
round to zero anyway), rounded to the nearest e2m1 value with ties to the even code, saturated at
6, and written as +0 when it rounds to zero (never ``0b1000``).

Shared scale, per block of 32 with ``amax`` = largest magnitude (Quark ``get_scale``/``even_round``
in ``quark/torch/quantization/observer/observer.py`` and ``quark/torch/quantization/utils.py``):

* ``"even"`` (Quark's default): round ``amax`` to one mantissa bit (add half an ulp at mantissa bit 22
  of its float32 pattern and truncate: ``[1, 1.75) * 2^E -> 2^E``, ``[1.75, 2) * 2^E -> 2^(E+1)``),
  then ``floor(log2) - 2``. Because ``amax / scale < 7`` the saturation never costs more than rounding.
* ``"floor"``: the spec's ``floor(log2(amax)) - 2``; ``amax / scale`` can reach 8 and saturates.

Degenerate blocks (all-zero, or ``amax`` below ~2^-124), reproduced as Quark does them:

* ``"even"`` clamps the exponent to [-127, 127] (zero and float32-subnormal amax give -127) and
  quantizes with ``2^-127``, but Quark's e8m0 writer (``to_e8m0_uint8``) clamps the stored scale to
  at least ``2^-126``: byte 1. All-zero block: byte 1.
* ``"floor"`` leaves the exponent unclamped; a zero (or underflowed) scale is replaced by float32
  eps ``2^-23``: an all-zero block is written as byte 104. Stored bytes are again clamped to >= 1.

The stored byte differs from the scale actually used only when ``amax < 2^-124``, values no real
weight has. Likewise at the top of the range: Quark packs the weight it fake-quantized at freeze time,
so an element that rounds to >= 2^128 (|w| >= 1.75 * 2^127) has become inf and is packed as code 6.
Non-finite weights are refused: by its source, Quark writes garbage for them (an inf becomes code 6
beside a 2^127 scale, a NaN block gets the byte of an undefined float-to-int cast).

Quark's own "floor" mode is NOT reproduced for bfloat16 weights: it takes ``torch.log2`` of the
bfloat16 amax in bfloat16, which rounds values just below a power of two up to it, so about 1% of
blocks get an exponent one higher than the spec's. ``"floor"`` here is the spec's exact rule.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GROUP_SIZE", "E2M1_VALUES", "E2M1_MAX", "E2M1_EMAX", "SIGN_BIT", "SCALE_BIAS", "SCALE_NAN",
    "SCALE_MODES", "encode", "decode", "fake_quantize", "shared_exponent", "pack_nibbles", "unpack_nibbles"]

GROUP_SIZE = 32
"""Elements sharing one e8m0 scale (OCP MX block size k)."""

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
"""Magnitude of each 3-bit e2m1 code: 1 sign, 2 exponent (bias 1), 1 mantissa bit; code 1 is subnormal."""

E2M1_MAX = 6.0
E2M1_EMAX = 2
"""Exponent of the largest e2m1 value (6 = 1.5 * 2^2): the scale is 2^(shared exponent - 2)."""

SIGN_BIT = 0b1000
SCALE_BIAS = 127
"""e8m0 byte b means 2^(b - 127); byte 255 is NaN."""

SCALE_NAN = 0xFF
SCALE_MODES = ("even", "floor")

# Rounding boundaries between consecutive codes i and i+1. A value exactly on a boundary goes to the
# even code: it stays at i when i is even, and moves up when i is odd.
_BOUNDARIES = (E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
_FLOAT32_EPS_EXPONENT = -23  # Quark replaces a zero scale by torch.finfo(float32).eps
_MIN_STORED_EXPONENT = -126  # Quark's to_e8m0_uint8 clamps the scale to >= 2^-126 before log2
_MIN_FLOAT32_EXPONENT = -149  # 2.0 ** e underflows to 0 in float32 below this


def encode(weight: np.ndarray, scale_mode: str = "even") -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``weight [..., in]`` to MXFP4: ``(packed uint8 [..., in/2], scales uint8 [..., in/32])``.

    Takes any real floating array (float32, float16, bfloat16 via ml_dtypes, float64); values are
    handled as float32, as Quark does. Leading dimensions (e.g. MoE experts) are kept.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    w = np.asarray(weight)
    if w.ndim == 0 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs a last dimension divisible by {GROUP_SIZE}, got shape {w.shape}")
    w = w.astype(np.float32)
    if not np.isfinite(w).all():
        raise ValueError("cannot encode NaN or infinite weights to MXFP4")

    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(blocks).max(axis=-1)
    quant_exp = shared_exponent(amax, scale_mode)

    scale = np.ldexp(np.float32(1.0), quant_exp).astype(np.float32)  # exact powers of two
    codes = _round_to_e2m1(blocks / scale[..., None])
    codes = _as_quark_overflows(codes, quant_exp)
    packed = pack_nibbles(codes.reshape(w.shape))
    scales = (np.maximum(quant_exp, _MIN_STORED_EXPONENT) + SCALE_BIAS).astype(np.uint8)
    return packed, scales


def decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantize to float32 ``[..., in]``: e2m1 value times ``2^(byte - 127)``; byte 255 gives NaN."""
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.uint8)
    n = packed.shape[-1] * 2
    if scales.shape != (*packed.shape[:-1], n // GROUP_SIZE) or n % GROUP_SIZE:
        raise ValueError(f"scales {scales.shape} do not match packed {packed.shape} (one per {GROUP_SIZE})")
    nibbles = unpack_nibbles(packed)
    values = E2M1_VALUES[nibbles & 0b111]
    values = np.where(nibbles & SIGN_BIT, -values, values)
    blocks = values.reshape(*scales.shape, GROUP_SIZE)
    out = np.ldexp(blocks, scales.astype(np.int32)[..., None] - SCALE_BIAS).astype(np.float32)
    out[scales == SCALE_NAN] = np.nan
    return out.reshape(*packed.shape[:-1], n)


def fake_quantize(weight: np.ndarray, scale_mode: str = "even") -> np.ndarray:
    """``decode(encode(weight))``: the float32 values a loader of the checkpoint will compute with."""
    return decode(*encode(weight, scale_mode))


def shared_exponent(amax: np.ndarray, scale_mode: str = "even") -> np.ndarray:
    """Exponent ``e`` of the scale ``2^e`` Quark divides a block by, from the block's float32 ``amax``.

    The byte Quark stores is ``max(e, -126) + 127``; the two differ only for ``amax < 2^-124``.
    """
    amax = np.asarray(amax, dtype=np.float32)
    bits = amax.view(np.uint32).astype(np.int64)
    if scale_mode == "even":
        # Add half an ulp of a 1-bit mantissa and keep sign+exponent: round-half-up of the mantissa
        # to one bit, carrying into the exponent (Quark's even_round). Exponent field 0 means a zero or
        # subnormal amax (log2 -> -inf), 255 means amax rounded past the float32 range (log2 -> inf).
        field = ((bits + (1 << 21)) >> 23) & 0xFF
        exp = np.where(field == 0, -(1 << 20), field - SCALE_BIAS - E2M1_EMAX)
        exp = np.where(field == 0xFF, 1 << 20, exp)
        return np.clip(exp, -SCALE_BIAS, SCALE_BIAS).astype(np.int32)
    if scale_mode == "floor":
        # frexp gives amax = m * 2^k with m in [0.5, 1), so floor(log2(amax)) = k - 1, exactly, also for
        # subnormals. (Quark takes a float32 log2, which can round up for float32 amax within ~2^-24
        # of a power of two; no bfloat16 value comes that close.)
        _, k = np.frexp(amax)
        exp = (k - 1 - E2M1_EMAX).astype(np.int32)
        underflow = (amax == 0) | (exp < _MIN_FLOAT32_EXPONENT)
        return np.where(underflow, _FLOAT32_EPS_EXPONENT, exp).astype(np.int32)
    raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


def pack_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """Pack 4-bit values along the last axis: element 2i -> low nibble, 2i+1 -> high nibble."""
    nibbles = np.asarray(nibbles, dtype=np.uint8)
    if nibbles.shape[-1] % 2:
        raise ValueError(f"need an even number of nibbles, got shape {nibbles.shape}")
    return (nibbles[..., 0::2] & 0xF) | ((nibbles[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_nibbles``: ``[..., n]`` bytes to ``[..., 2n]`` nibbles."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


def _as_quark_overflows(codes: np.ndarray, quant_exp: np.ndarray) -> np.ndarray:
    """Quark packs the weight it fake-quantized at freeze time. A value that rounded to >= 2^128
    (only in "even" blocks with amax >= 1.75 * 2^127) is float32 inf by then, and inf packs as code 6.
    Such a value decodes to inf whichever code is written; this keeps the bytes identical to Quark's."""
    with np.errstate(over="ignore"):
        magnitude = np.ldexp(E2M1_VALUES[codes & 0b111], quant_exp[..., None])
    return np.where(np.isinf(magnitude), (codes & SIGN_BIT) | 6, codes).astype(np.uint8)


def _round_to_e2m1(scaled: np.ndarray) -> np.ndarray:
    """Nibbles of float32 values already divided by their scale: nearest e2m1, ties to even, saturate."""
    magnitude = np.abs(scaled)
    code = np.zeros(scaled.shape, dtype=np.uint8)
    for i, boundary in enumerate(_BOUNDARIES):
        above = magnitude >= boundary if i % 2 else magnitude > boundary
        code += above.astype(np.uint8)  # past the last boundary (5) everything is 6: saturation
    negative = np.signbit(scaled) & (code != 0)  # whatever rounds to zero is written +0
    return code | (negative.astype(np.uint8) << 3)
