"""FP8 block-scaled sources (`pipeline.checkpoints.fp8`) and the reader that dequantizes them (`CheckpointReader`).

The spec: a weight is float32(e4m3) times the float32 scale of its 128 x 128 tile, partial tiles at the
edges included; the reader hands weights over in that form, scales unlisted, from any shard.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.checkpoints import fp8
from pipeline.checkpoints.reader import CheckpointReader, ShardReader
from pipeline.errors import BadInputError

CONFIG = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}, "dtype": "bfloat16"}


def test_each_element_is_its_code_times_its_own_tile_scale():
    block = (4, 3)
    codes = (torch.arange(-35, 35, dtype=torch.float32).reshape(7, 10) / 8).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0, 4.0, 8.0], [0.5, 0.25, 16.0, 3.0]])  # 7x10 in 4x3 tiles: partial edges
    got = fp8.dequantize(codes, scales, block)
    assert got.dtype == torch.float32 and got.shape == (7, 10)
    for row in range(7):
        for col in range(10):
            assert got[row, col] == codes[row, col].float() * scales[row // 4, col // 3], (row, col)


def test_a_fused_expert_tensor_has_one_scale_grid_per_expert():
    weight = torch.randn(3, 130, 250) * 0.05
    codes, scales = fp8.quantize(weight, (128, 128))
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (3, 2, 2)
    whole = fp8.dequantize(codes, scales, (128, 128))
    for expert in range(3):
        assert torch.equal(whole[expert], fp8.dequantize(codes[expert], scales[expert], (128, 128)))


def test_quantize_maps_each_tile_maximum_to_448_and_round_trips_within_e4m3_precision():
    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[:128, :128] = 0  # an all-zero tile gets scale 1
    codes, scales = fp8.quantize(weight, (128, 128))
    assert scales[0, 0] == 1 and torch.equal(codes[:128, :128].float(), torch.zeros(128, 128))
    assert codes.float().abs().amax() == fp8.E4M3_MAX
    back = fp8.dequantize(codes, scales, (128, 128))
    tile_max = scales.repeat_interleave(128, 0).repeat_interleave(128, 1) * fp8.E4M3_MAX
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal codes, absolute 2^-10 of the tile max below
    assert ((back - weight).abs() <= torch.maximum(weight.abs() / 16, tile_max * 2**-10)).all()


def test_a_scale_grid_that_does_not_tile_the_weight_is_bad_input():
    with pytest.raises(BadInputError, match="does not tile weight"):
        fp8.dequantize(torch.zeros(256, 256).to(torch.float8_e4m3fn), torch.ones(2, 3), (128, 128))


def test_only_block_scaled_fp8_is_read():
    assert fp8.is_fp8_source(CONFIG) and not fp8.is_fp8_source({"quantization_config": {"quant_method": "quark"}})
    assert fp8.block_size(CONFIG) == (128, 128)
    with pytest.raises(BadInputError, match="per-tensor FP8 is not supported"):
        fp8.block_size({"quantization_config": {"quant_method": "fp8"}})


def test_kept_weights_are_written_in_the_configs_dtype():
    assert fp8.output_dtype(CONFIG) == "BF16"
    assert fp8.output_dtype({"text_config": {"dtype": "float16"}, "dtype": "bfloat16"}) == "F16"
    assert fp8.output_dtype({}) == "BF16"


# --- the reader on the tiny FP8 checkpoint ---------------------------------------------------
def test_the_reader_lists_weights_dequantized_and_hides_their_scales(tiny_fp8):
    config = json.loads((tiny_fp8 / "config.json").read_text())
    with CheckpointReader(tiny_fp8, config) as reader:
        listing = reader.listing()
        assert not any(name.endswith(fp8.SCALE_SUFFIX) for name in listing)
        q_proj = "model.language_model.layers.3.self_attn.q_proj.weight"
        assert reader.is_fp8(q_proj) and listing[q_proj] == ((1024, 256), "BF16")
        raw = reader.shards[reader.where[q_proj]].get(q_proj)
        scale = reader.shards[reader.where[q_proj + "_scale_inv"]].get(q_proj + "_scale_inv")
        assert raw.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert torch.equal(reader.get(q_proj), fp8.dequantize(raw, scale, (128, 128)))
        gate = "model.language_model.layers.0.mlp.gate.weight"  # a router stays bf16, as in Qwen's releases
        assert not reader.is_fp8(gate) and reader.get(gate).dtype == torch.bfloat16


def test_the_reader_finds_a_scale_in_another_shard_and_reads_one_expert_alone(tiny_fp8):
    config = json.loads((tiny_fp8 / "config.json").read_text())
    with CheckpointReader(tiny_fp8, config) as reader:
        split = [n for n in reader.listing() if reader.is_fp8(n)
                 and reader.where[n] != reader.where[fp8.scale_name(n)]]
        assert split, "the tiny FP8 checkpoint is built with a weight and its scale in different shards"
        assert reader.get(split[0]).dtype == torch.float32
        fused = "model.language_model.layers.1.mlp.experts.gate_up_proj"
        whole = reader.get(fused)
        assert whole.shape == (8, 256, 256)
        assert all(torch.equal(reader.get(fused, expert), whole[expert]) for expert in range(8))
        assert reader.written(fused, 2).dtype == torch.bfloat16


def test_a_float8_tensor_without_its_scale_is_bad_input(tmp_path):
    from safetensors.torch import save_file

    save_file({"x.weight": torch.zeros(128, 128).to(torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    assert ShardReader(tmp_path / "model.safetensors").dtype("x.weight") == "F8_E4M3"
    with CheckpointReader(tmp_path, CONFIG) as reader, pytest.raises(BadInputError, match="has no x.weight_scale_inv"):
        reader.listing()


def test_a_scale_without_its_weight_and_an_unknown_dtype_are_bad_input(tmp_path):
    from safetensors.torch import save_file

    save_file({"x.weight_scale_inv": torch.ones(1, 1)}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path, CONFIG) as reader, pytest.raises(BadInputError, match="has no weight x.weight"):
        reader.listing()
    save_file({"y": torch.zeros(4, dtype=torch.int16)}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path, {}) as reader, pytest.raises(BadInputError, match="I16, which mxspec does not read"):
        reader.listing()


def test_reading_one_expert_past_the_last_is_refused(tiny_fp8):
    config = json.loads((tiny_fp8 / "config.json").read_text())
    with CheckpointReader(tiny_fp8, config) as reader, pytest.raises(IndexError, match="has 8 slices"):
        reader.get("model.language_model.layers.1.mlp.experts.gate_up_proj", 8)


@pytest.mark.slow
def test_dequantization_equals_quarks_block_dequantization():
    """Quark's FP8-to-MXFP4 flow dequantizes with a Triton kernel (CUDA only); its torch form for vLLM
    layers (`_dequant_fp8_block`) computes the same float32 product, and so must we, partial tiles included.
    (`torch.ops.quark.dequantize_fp8_per_block` differs on partial tiles: it splits such a dimension into
    equal blocks when it divides evenly, e.g. 200 rows as 2 x 100, not 128 + 72.)"""
    from quark.online_quantization.vllm.dequant import _dequant_fp8_block

    generator = torch.Generator().manual_seed(1)
    for shape in [(256, 384), (200, 300), (130, 1000)]:
        codes, scales = fp8.quantize(torch.randn(*shape, generator=generator) * 0.05, (128, 128))
        assert torch.equal(fp8.dequantize(codes, scales, (128, 128)),
                           _dequant_fp8_block(codes, scales, (128, 128), torch.float32)), shape


@pytest.mark.slow
def test_the_validated_source_of_an_fp8_target_is_its_dequantized_model(tiny, tiny_fp8):
    """validate's unquantized baseline for an FP8 source is the FP8 model dequantized; it computes what the
    bf16 checkpoint it was made from computes, up to e4m3 rounding (which can flip a random router's near-tie
    to other experts for a token: median cosine 0.998, the worst token 0.92)."""
    from pipeline.study.targets import load_target

    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp8_logits = load_target(tiny_fp8, "bf16")(ids).logits[0]
        bf16_logits = load_target(tiny / "qwen3.5-moe-tiny", "bf16")(ids).logits[0]
    assert not torch.equal(fp8_logits, bf16_logits)
    cosine = torch.nn.functional.cosine_similarity(fp8_logits, bf16_logits, dim=-1)
    assert cosine.median() > 0.99 and cosine.min() > 0.8
