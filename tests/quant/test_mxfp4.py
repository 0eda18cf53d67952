"""MXFP4 as a specification: hand-computed vectors, the layout rules, and bit-exactness against Quark.

Values below are written in e2m1 units unless said otherwise: with a scale byte of 127 (2^0) an
element's value is its own e2m1 value. Codes: 0, .5, 1, 1.5, 2, 3, 4, 6 -> 0..7; sign is bit 3.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.quant import mxfp4
from pipeline.quant.mxfp4 import GROUP_SIZE, decode, encode, fake_quantize, pack_nibbles, unpack_nibbles

# One block with amax 6 (both scale modes give 2^0, byte 127): every tie, both signs, and the
# values that round to zero. (value, expected nibble), worked out by hand.
SPEC_BLOCK = [
    (0.5, 0x1), (1.0, 0x2), (1.5, 0x3), (6.0, 0x7),
    (-6.0, 0xF),
    (0.25, 0x0),   # tie 0 / 0.5 -> 0 (even code 0)
    (0.75, 0x2),   # tie 0.5 / 1 -> 1 (even code 2)
    (1.25, 0x2),   # tie 1 / 1.5 -> 1
    (1.75, 0x4),   # tie 1.5 / 2 -> 2
    (2.5, 0x4),    # tie 2 / 3 -> 2
    (3.5, 0x6),    # tie 3 / 4 -> 4
    (5.0, 0x6),    # tie 4 / 6 -> 4
    (-0.1, 0x0),   # rounds to zero: written +0, not 0b1000
    (-0.25, 0x0),  # negative tie to zero: +0 too
    (-0.0, 0x0),
    (0.3, 0x1),    # just past the first tie
    (2.0, 0x4), (3.0, 0x5), (4.0, 0x6),
    (-0.5, 0x9), (-1.75, 0xC), (-5.0, 0xE),
    (5.5, 0x7), (4.9, 0x6),
] + [(0.0, 0x0)] * 8
# The same block packed: element 2i in the low nibble, 2i+1 in the high nibble.
SPEC_BLOCK_PACKED = [0x21, 0x73, 0x0F, 0x22, 0x44, 0x66, 0x00, 0x10,
                     0x54, 0x96, 0xEC, 0x67, 0x00, 0x00, 0x00, 0x00]


def block(*values: float) -> np.ndarray:
    """A [1, 32] row: the given values, then zeros."""
    row = np.zeros((1, GROUP_SIZE), dtype=np.float32)
    row[0, : len(values)] = values
    return row


def nibbles(packed: np.ndarray) -> list[int]:
    return unpack_nibbles(packed).ravel().tolist()


# ---------------------------------------------------------------- layout constants


def test_constants_are_the_ocp_mx_v1_facts():
    assert GROUP_SIZE == 32 and mxfp4.SCALE_BIAS == 127 and mxfp4.E2M1_MAX == 6.0
    assert mxfp4.E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert mxfp4.E2M1_EMAX == 2 and mxfp4.SIGN_BIT == 0b1000


# ---------------------------------------------------------------- hand-computed vectors


@pytest.mark.parametrize("scale_mode", ["even", "floor"])
def test_spec_block_rounds_half_to_even_and_writes_plus_zero(scale_mode):
    values, expected = zip(*SPEC_BLOCK, strict=True)
    packed, scales = encode(block(*values), scale_mode)
    assert scales.tolist() == [[127]]
    assert nibbles(packed) == list(expected)
    assert packed.ravel().tolist() == SPEC_BLOCK_PACKED


@pytest.mark.parametrize("power", [-20, -6, 0, 9])
def test_a_power_of_two_moves_only_the_scale_byte(power):
    values, expected = zip(*SPEC_BLOCK, strict=True)
    packed, scales = encode(block(*values) * np.float32(2.0**power))
    assert scales.tolist() == [[127 + power]]
    assert nibbles(packed) == list(expected)


def test_nibble_order_is_low_nibble_first():
    packed, scales = encode(block(0.5, 6.0))  # 0.5 -> code 1, 6 -> code 7
    assert packed[0, 0] == 0x71 and scales[0, 0] == 127
    codes = np.arange(64, dtype=np.uint8).reshape(2, 32) % 16
    assert np.array_equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert pack_nibbles(np.array([[0x1, 0x2]])).tolist() == [[0x21]]


def test_floor_saturates_where_even_moves_to_the_next_scale():
    # amax 7 = 1.75 * 2^2. floor: 2^(2-2) = 1, and 7 saturates to 6.
    # even: 1.75 rounds up to 2, so amax counts as 2^3 and the scale is 2^1: 7/2 = 3.5 ties to 4.
    row = block(7.0, 0.5, -7.0, 3.5, 1.0)
    packed, scales = encode(row, "floor")
    assert scales.tolist() == [[127]] and nibbles(packed)[:5] == [0x7, 0x1, 0xF, 0x6, 0x2]
    assert decode(packed, scales)[0, :5].tolist() == [6.0, 0.5, -6.0, 4.0, 1.0]
    packed, scales = encode(row, "even")
    assert scales.tolist() == [[128]] and nibbles(packed)[:5] == [0x6, 0x0, 0xE, 0x4, 0x1]
    assert decode(packed, scales)[0, :5].tolist() == [8.0, 0.0, -8.0, 4.0, 1.0]


@pytest.mark.parametrize(
    ("amax", "even_byte", "floor_byte"),
    [
        (1.0, 125, 125),      # 2^0: both 2^-2
        (1.74, 125, 125),     # mantissa below 1.75 rounds down
        (1.75, 126, 125),     # the tie rounds up (to an even, zero mantissa)
        (1.9, 126, 125),
        (6.0, 127, 127),      # 1.5 * 2^2
        (7.0, 128, 127),
        (3e38, 254, 252),     # 1.76 * 2^127: even's exponent is clamped to 127
        (2.0**-125, 1, 1),    # even gives 2^-127; Quark stores at least 2^-126 (byte 1)
    ],
)
def test_scale_byte_per_mode(amax, even_byte, floor_byte):
    row = block(amax, -amax / 3)
    assert encode(row, "even")[1][0, 0] == even_byte
    assert encode(row, "floor")[1][0, 0] == floor_byte


def test_all_zero_block_is_all_plus_zero_with_quarks_scale_bytes():
    zeros = np.zeros((2, 64), dtype=np.float32)
    zeros[1] = -0.0
    for mode, byte in [("even", 1), ("floor", 104)]:  # even: 2^-127 stored as 2^-126; floor: eps 2^-23
        packed, scales = encode(zeros, mode)
        assert not packed.any() and (scales == byte).all()
        assert np.array_equal(decode(packed, scales), np.zeros((2, 64), dtype=np.float32))


def test_a_value_rounding_past_float32_is_packed_as_quark_packs_inf():
    # Quark packs its fake-quantized weight: 3e38 -> 2 * 2^127 = inf, and inf packs as code 6.
    packed, scales = encode(block(3e38, -1e38, -3e38))
    assert scales[0, 0] == 254 and nibbles(packed)[:3] == [0x6, 0x9, 0xE]


# ---------------------------------------------------------------- properties


def reference_codes(scaled: np.ndarray) -> np.ndarray:
    """Brute force: nearest signed e2m1 value, ties to the even code, +0 for zero."""
    mags = mxfp4.E2M1_VALUES.astype(np.float64)
    dist = np.abs(np.abs(scaled.astype(np.float64))[..., None] - mags)
    best = dist.min(axis=-1, keepdims=True)
    candidates = np.where(dist == best, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(axis=-1)
    code = np.where(even < 99, even, candidates.min(axis=-1))
    return np.where((code > 0) & np.signbit(scaled), code | 8, code)


def test_rounding_matches_brute_force_on_ties_and_their_neighbours():
    rng = np.random.default_rng(0)
    points = np.concatenate([mxfp4.E2M1_VALUES, (mxfp4.E2M1_VALUES[:-1] + mxfp4.E2M1_VALUES[1:]) / 2])
    points = np.concatenate([points, np.nextafter(points, 0), np.nextafter(points, 7), [6.5, 6.9]])
    pool = np.concatenate([points, -points, rng.uniform(-7, 7, 4000)]).astype(np.float32)
    values = rng.permutation(np.resize(pool, 31 * 256)).reshape(256, 31)
    # column 0 pins every block's amax to 6.5 (< 7 keeps "even" at 2^0), then a random power of two
    rows = np.concatenate([np.full((256, 1), 6.5, np.float32), values], axis=1)
    rows *= np.exp2(rng.integers(-30, 30, (256, 1))).astype(np.float32)
    packed, scales = encode(rows.reshape(32, 256))
    scale = np.exp2(scales.astype(np.float64) - 127).repeat(GROUP_SIZE, axis=1)
    assert np.array_equal(unpack_nibbles(packed), reference_codes(rows.reshape(32, 256) / scale))


@pytest.mark.parametrize("scale_mode", ["even", "floor"])
def test_dequantization_error_is_bounded_by_the_scale(scale_mode):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 512)) * np.exp(rng.normal(0, 3, (64, 1)))).astype(np.float32)
    packed, scales = encode(w, scale_mode)
    q = decode(packed, scales)
    scale = np.exp2(scales.astype(np.float64) - 127).repeat(GROUP_SIZE, axis=1)
    err = np.abs(q.astype(np.float64) - w)
    # even: |w|/scale < 7, so only rounding: at most half the widest gap (4..6) = 1 scale.
    # floor: |w|/scale < 8 may saturate at 6: up to 2 scales.
    assert (err <= (1.0 if scale_mode == "even" else 2.0) * scale).all()
    assert ((np.sign(q) == np.sign(w)) | (q == 0)).all()
    # and relative to the block: even keeps every element within amax / 3.5 (scale <= amax / 3.5)
    if scale_mode == "even":
        amax = np.abs(w).reshape(64, -1, GROUP_SIZE).max(-1).repeat(GROUP_SIZE, axis=1)
        assert (err <= amax / 3.5).all()


@pytest.mark.parametrize("scale_mode", ["even", "floor"])
def test_quantizing_twice_changes_nothing(scale_mode):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    once = fake_quantize(w, scale_mode)
    assert np.array_equal(fake_quantize(once, scale_mode), once)
    assert [a.tolist() for a in encode(once, scale_mode)] == [a.tolist() for a in encode(w, scale_mode)]


def test_even_and_floor_differ_in_a_sizeable_share_of_gaussian_blocks():
    w = np.random.default_rng(3).standard_normal((256, 1024)).astype(np.float32)
    share = (encode(w, "even")[1] != encode(w, "floor")[1]).mean()
    assert 0.08 < share < 0.3  # the amaxes whose mantissa is >= 1.75


def test_shapes_and_leading_dimensions():
    w = np.random.default_rng(4).standard_normal((3, 8, 96)).astype(np.float32)  # e.g. 3 experts
    packed, scales = encode(w)
    assert packed.shape == (3, 8, 48) and packed.dtype == np.uint8
    assert scales.shape == (3, 8, 3) and scales.dtype == np.uint8
    assert decode(packed, scales).shape == (3, 8, 96) and decode(packed, scales).dtype == np.float32
    flat = encode(w.reshape(24, 96))
    assert np.array_equal(flat[0], packed.reshape(24, 48)) and np.array_equal(flat[1], scales.reshape(24, 3))


def test_bfloat16_input_is_taken_as_its_float32_value():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = np.random.default_rng(5).standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    assert all(np.array_equal(a, b) for a, b in zip(encode(w), encode(w.astype(np.float32)), strict=True))


def test_e8m0_byte_255_decodes_to_nan():
    out = decode(np.zeros((1, 16), np.uint8), np.array([[255]], np.uint8))
    assert np.isnan(out).all()


@pytest.mark.parametrize(
    ("weight", "scale_mode", "message"),
    [
        (np.zeros((2, 48), np.float32), "even", "divisible by 32"),
        (block(np.nan), "even", "NaN or infinite"),
        (block(-np.inf), "even", "NaN or infinite"),
        (block(1.0), "ceil", "scale_mode"),
    ],
)
def test_refuses_what_it_cannot_encode(weight, scale_mode, message):
    with pytest.raises(ValueError, match=message):
        encode(weight, scale_mode)


def test_decode_refuses_mismatched_scales():
    with pytest.raises(ValueError, match="do not match"):
        decode(np.zeros((2, 32), np.uint8), np.zeros((2, 1), np.uint8))


# ---------------------------------------------------------------- against real AMD Quark

# Blocks planted in q_proj (bf16-representable): zero, -0, subnormal, tiny, huge, ties, the 1.75 edge.
PLANTED = [
    [0.0] * 32,
    [-0.0] * 32,
    [1e-39 * (i % 5) * (-1) ** i for i in range(32)],
    [2.0**-125] + [2.0**-127] * 31,
    [1.75 * 2.0**-126] + [-(2.0**-128)] * 31,
    [2.0**-126] * 32,
    [3e38, -1e38] + [1e30] * 30,
    [v * 2.0**-4 for v, _ in SPEC_BLOCK[:24]] + [7 * 2.0**-4, -7 * 2.0**-4, 6.5 * 2.0**-4] + [0.0] * 5,
    [1.75 * 2**3] + [0.1 * i for i in range(31)],
    [1.7421875 * 2**3] + [-0.1 * i for i in range(31)],
    [-1e-3, 1.0] + [-1e-4] * 30,
]


def _tiny_llama(torch, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    planted = torch.tensor(PLANTED, dtype=torch.float32).to(dtype)
    with torch.no_grad():
        weight = model.model.layers[0].self_attn.q_proj.weight
        weight[: len(PLANTED), 32:64] = planted
        weight[20 : 20 + len(PLANTED), 0:32] = planted.flip(0)
    return model


@pytest.fixture(scope="module")
def quark_exports(tmp_path_factory):
    """Quantize the same tiny Llama with Quark three ways; keep each export's tensors and config."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    saved = os.environ.get("QUARK_DISABLE_COMPILE")
    os.environ["QUARK_DISABLE_COMPILE"] = "1"  # read by quark at import and at freeze
    try:
        from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors

        exports = {}
        for name, dtype, mode in [("bf16-even", torch.bfloat16, None), ("bf16-floor", torch.bfloat16, "floor"),
                                  ("fp32-even", torch.float32, None)]:
            model = _tiny_llama(torch, dtype)
            original = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
            cfg = LLMTemplate.get("llama").get_config(scheme="mxfp4_weight_only", exclude_layers=["lm_head"])
            if mode:
                cfg.global_quant_config.weight.scale_calculation_mode = mode
            quantizer = ModelQuantizer(cfg)
            model = quantizer.quantize_model(model, None)
            model = quantizer.freeze(model)
            out = tmp_path_factory.mktemp(name)
            export_safetensors(model, str(out), custom_mode="quark", weight_format="real_quantized",
                               pack_method="reorder")
            tensors = {}
            for file in sorted(out.glob("*.safetensors")):
                tensors.update(load_file(str(file)))
            exports[name] = (original, tensors, json.loads((out / "config.json").read_text()))
        return exports
    finally:
        if saved is None:
            os.environ.pop("QUARK_DISABLE_COMPILE", None)
        else:
            os.environ["QUARK_DISABLE_COMPILE"] = saved


def _quantized_names(tensors) -> list[str]:
    return sorted(k[: -len("_scale")] for k in tensors if k.endswith(".weight_scale"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16-even", "fp32-even"])
def test_encode_matches_quark_byte_for_byte(quark_exports, name):
    import torch

    original, tensors, _ = quark_exports[name]
    names = _quantized_names(tensors)
    assert len(names) == 14  # 7 Linear layers x 2 layers; lm_head excluded
    assert tensors["lm_head.weight"].dtype != torch.uint8
    for weight_name in names:
        packed, scales = encode(original[weight_name])  # the default mode is Quark's default
        assert tensors[weight_name].dtype == torch.uint8 and tensors[weight_name + "_scale"].dtype == torch.uint8
        assert np.array_equal(tensors[weight_name].numpy(), packed), weight_name
        assert np.array_equal(tensors[weight_name + "_scale"].numpy(), scales), weight_name


@pytest.mark.slow
def test_quarks_floor_mode_is_the_spec_rule_except_where_bf16_log2_rounds_up(quark_exports):
    """Quark takes log2 of the bf16 amax in bf16 (8 significant bits): an amax just below 2^k reads as
    2^k and its block gets the next exponent. Every other block is the spec's floor rule, bit for bit."""
    import torch

    original, tensors, _ = quark_exports["bf16-floor"]
    lifted_total = blocks_total = 0
    for weight_name in _quantized_names(tensors):
        w = original[weight_name]
        packed, scales = encode(w, "floor")
        amax = np.abs(w).reshape(w.shape[0], -1, GROUP_SIZE).max(-1)
        bf16_log2 = torch.log2(torch.from_numpy(amax).to(torch.bfloat16)).float().numpy()
        lifted = (amax > 0) & (np.floor(bf16_log2) - 2 > mxfp4.shared_exponent(amax, "floor"))
        quark_scales = tensors[weight_name + "_scale"].numpy()
        quark_blocks = tensors[weight_name].numpy().reshape(w.shape[0], -1, GROUP_SIZE // 2)
        ours_blocks = packed.reshape(quark_blocks.shape)
        assert np.array_equal(quark_scales[~lifted], scales[~lifted]), weight_name
        assert np.array_equal(quark_blocks[~lifted], ours_blocks[~lifted]), weight_name
        spec_plus_one = np.maximum(mxfp4.shared_exponent(amax, "floor") + 1, -126) + 127
        assert np.array_equal(quark_scales[lifted], spec_plus_one[lifted]), weight_name
        lifted_total += lifted.sum()
        blocks_total += lifted.size
    assert 0 < lifted_total < 0.05 * blocks_total


@pytest.mark.slow
def test_quark_config_json_describes_mxfp4_weight_only(quark_exports):
    for name, mode in [("bf16-even", "even"), ("bf16-floor", "floor")]:
        qc = quark_exports[name][2]["quantization_config"]
        assert qc["quant_method"] == "quark"
        assert qc["export"]["pack_method"] == "reorder" and qc["export"]["weight_format"] == "real_quantized"
        assert qc["export"]["kv_cache_group"] == []
        weight = qc["global_quant_config"]["weight"]
        assert {k: weight[k] for k in ("dtype", "qscheme", "group_size", "scale_format", "is_dynamic")} == {
            "dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": False,
        }
        assert weight["scale_calculation_mode"] == mode
        assert qc["global_quant_config"]["input_tensors"] is None  # weight-only
        assert qc["exclude"] == ["lm_head"]
