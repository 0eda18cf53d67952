"""Exclusion rules, checked against the real Qwen3.5-27B and 35B-A3B module names (meta configs)."""

from __future__ import annotations

import pytest

from pipeline.architectures import linear_layers
from pipeline.errors import BadInputError
from pipeline.quant.exclusions import check_exclusions, default_exclusions


@pytest.fixture(scope="module")
def dense() -> list[str]:
    return linear_layers("qwen3.5-27b")


@pytest.fixture(scope="module")
def moe() -> list[str]:
    return linear_layers("qwen3.5-35b-a3b")


def test_dense_defaults_keep_head_vision_and_mtp(dense):
    excluded = check_exclusions(dense, default_exclusions("qwen3_5"))
    assert "lm_head" in excluded
    assert any(n.startswith("model.visual.") for n in excluded)
    assert any(n.startswith("mtp.") for n in excluded)
    quantized = set(dense) - excluded
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv" in quantized
    assert "model.language_model.layers.3.self_attn.q_proj" in quantized
    assert not any(n.startswith(("mtp.", "model.visual.")) for n in quantized)


def test_quantize_mtp_switch_drops_only_the_mtp_exclusion(dense):
    excluded = check_exclusions(dense, default_exclusions("qwen3_5", quantize_mtp=True))
    assert not any(n.startswith("mtp.") for n in excluded) and "lm_head" in excluded


def test_moe_defaults_quantize_only_routed_experts(moe):
    excluded = check_exclusions(moe, default_exclusions("qwen3_5_moe"))
    quantized = set(moe) - excluded
    assert quantized and all(".mlp.experts." in n for n in quantized)
    assert "model.language_model.layers.0.mlp.experts.255.down_proj" in quantized
    assert "model.language_model.layers.0.mlp.gate" in excluded  # the router


def test_a_pattern_matching_nothing_is_an_error(dense):
    with pytest.raises(BadInputError, match=r"pattern '\*mpt\*' matches no layer"):
        check_exclusions(dense, ["lm_head", "*mpt*"])


@pytest.mark.parametrize(
    "pattern, group",
    [
        ("*.linear_attn.in_proj_z", "in_proj_qkvz"),
        ("*.linear_attn.in_proj_b", "in_proj_ba"),
        ("*.self_attn.k_proj", "qkv_proj"),
        ("*.mlp.up_proj", "gate_up_proj"),
    ],
)
def test_a_partial_fused_group_is_an_error_naming_it(dense, pattern, group):
    with pytest.raises(BadInputError, match=f"fused group {group} of model.language_model.layers"):
        check_exclusions(dense, [pattern])


def test_whole_fused_groups_are_fine(dense):
    excluded = check_exclusions(dense, ["*.linear_attn.in_proj_qkv", "*.linear_attn.in_proj_z", "*.self_attn.[qkv]_proj"])
    assert "model.language_model.layers.3.self_attn.v_proj" in excluded


def test_excluding_some_experts_of_a_layer_is_an_error(moe):
    with pytest.raises(BadInputError, match="MoE experts of model.language_model.layers.5.mlp.experts is split"):
        check_exclusions(moe, ["model.language_model.layers.5.mlp.experts.7.*"])
    check_exclusions(moe, ["model.language_model.layers.5.mlp.experts.*"])


def test_unknown_family_needs_explicit_exclusions():
    with pytest.raises(BadInputError, match="list them in \\[quantization\\] exclude"):
        default_exclusions("gpt2")
