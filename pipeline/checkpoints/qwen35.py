"""Every tensor a Qwen3.5 checkpoint carries, with its shape, from config.json alone (no weights, no torch):
the language model, lm_head, the vision tower and the MTP head, dense or MoE; and a DFlash drafter's.

This is the Qwen3.5 layout stated once: memory sizing (`quant.memory`) and recipe checks on targets that
are not here read it. Tests hold it to transformers' own layout on the meta device
(`pipeline.architectures`) name for name and shape for shape, and to the tiny checkpoints' headers."""

from __future__ import annotations

from typing import Any

from pipeline.checkpoints.folder import MTP_PREFIX, mtp_layers, text_config

__all__ = ["mtp_tensor_shapes", "checkpoint_tensors", "drafter_tensors"]


def _full_attention(prefix: str, text: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads, kv, head_dim = (int(text[k]) for k in ("hidden_size", "num_attention_heads",
                                                         "num_key_value_heads", "head_dim"))
    gate = 2 if text.get("attn_output_gate") else 1  # the output gate doubles q_proj's rows
    return {f"{prefix}.self_attn.q_proj.weight": (heads * head_dim * gate, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,)}


def _gated_delta_net(prefix: str, text: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden = int(text["hidden_size"])
    k_heads, v_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    k_dim, v_dim = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    p = f"{prefix}.linear_attn"
    return {f"{p}.dt_bias": (v_heads,), f"{p}.A_log": (v_heads,),
            f"{p}.conv1d.weight": (conv_dim, 1, int(text["linear_conv_kernel_dim"])),
            f"{p}.norm.weight": (v_dim,),
            f"{p}.out_proj.weight": (hidden, v_heads * v_dim),
            f"{p}.in_proj_qkv.weight": (conv_dim, hidden),
            f"{p}.in_proj_z.weight": (v_heads * v_dim, hidden),
            f"{p}.in_proj_b.weight": (v_heads, hidden),
            f"{p}.in_proj_a.weight": (v_heads, hidden)}


def _mlp(prefix: str, text: dict[str, Any], per_expert: bool) -> dict[str, tuple[int, ...]]:
    hidden = int(text["hidden_size"])
    p = f"{prefix}.mlp"
    if "num_experts" not in text:
        inter = int(text["intermediate_size"])
        return {f"{p}.gate_proj.weight": (inter, hidden), f"{p}.up_proj.weight": (inter, hidden),
                f"{p}.down_proj.weight": (hidden, inter)}
    experts, inter, shared = (int(text[k]) for k in ("num_experts", "moe_intermediate_size",
                                                    "shared_expert_intermediate_size"))
    shapes: dict[str, tuple[int, ...]] = {f"{p}.gate.weight": (experts, hidden)}
    if per_expert:  # how MTP layers store them
        for e in range(experts):
            shapes |= {f"{p}.experts.{e}.gate_proj.weight": (inter, hidden),
                       f"{p}.experts.{e}.up_proj.weight": (inter, hidden),
                       f"{p}.experts.{e}.down_proj.weight": (hidden, inter)}
    else:
        shapes |= {f"{p}.experts.gate_up_proj": (experts, 2 * inter, hidden),
                   f"{p}.experts.down_proj": (experts, hidden, inter)}
    return shapes | {f"{p}.shared_expert.gate_proj.weight": (shared, hidden),
                     f"{p}.shared_expert.up_proj.weight": (shared, hidden),
                     f"{p}.shared_expert.down_proj.weight": (hidden, shared),
                     f"{p}.shared_expert_gate.weight": (1, hidden)}


def _decoder_layer(prefix: str, text: dict[str, Any], kind: str, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    hidden = int(text["hidden_size"])
    mixer = _full_attention(prefix, text) if kind == "full_attention" else _gated_delta_net(prefix, text)
    return mixer | _mlp(prefix, text, per_expert) | {f"{prefix}.input_layernorm.weight": (hidden,),
                                                     f"{prefix}.post_attention_layernorm.weight": (hidden,)}


def _vision_tower(vision: dict[str, Any], prefix: str = "model.visual") -> dict[str, tuple[int, ...]]:
    hidden, inter, depth = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["depth"])
    patch, temporal, channels = int(vision["patch_size"]), int(vision["temporal_patch_size"]), int(vision["in_channels"])
    merged = hidden * int(vision["spatial_merge_size"]) ** 2
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}.patch_embed.proj.weight": (hidden, channels, temporal, patch, patch),
        f"{prefix}.patch_embed.proj.bias": (hidden,),
        f"{prefix}.pos_embed.weight": (int(vision["num_position_embeddings"]), hidden)}
    for i in range(depth):
        b = f"{prefix}.blocks.{i}"
        shapes |= {f"{b}.norm1.weight": (hidden,), f"{b}.norm1.bias": (hidden,),
                   f"{b}.norm2.weight": (hidden,), f"{b}.norm2.bias": (hidden,),
                   f"{b}.attn.qkv.weight": (3 * hidden, hidden), f"{b}.attn.qkv.bias": (3 * hidden,),
                   f"{b}.attn.proj.weight": (hidden, hidden), f"{b}.attn.proj.bias": (hidden,),
                   f"{b}.mlp.linear_fc1.weight": (inter, hidden), f"{b}.mlp.linear_fc1.bias": (inter,),
                   f"{b}.mlp.linear_fc2.weight": (hidden, inter), f"{b}.mlp.linear_fc2.bias": (hidden,)}
    out = int(vision["out_hidden_size"])
    return shapes | {f"{prefix}.merger.norm.weight": (hidden,), f"{prefix}.merger.norm.bias": (hidden,),
                     f"{prefix}.merger.linear_fc1.weight": (merged, merged), f"{prefix}.merger.linear_fc1.bias": (merged,),
                     f"{prefix}.merger.linear_fc2.weight": (out, merged), f"{prefix}.merger.linear_fc2.bias": (out,)}


def mtp_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The `mtp.*` tensors: `fc` [H, 2H], three norms and full-attention decoder layers whose routed
    experts are stored per expert (as Qwen3.5-35B-A3B's checkpoint has them)."""
    text = text_config(config)
    hidden = int(text["hidden_size"])
    layers = mtp_layers(config)
    if layers == 0:
        return {}
    shapes: dict[str, tuple[int, ...]] = {f"{MTP_PREFIX}fc.weight": (hidden, 2 * hidden),
                                          f"{MTP_PREFIX}norm.weight": (hidden,),
                                          f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (hidden,),
                                          f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (hidden,)}
    for i in range(layers):
        shapes |= _decoder_layer(f"{MTP_PREFIX}layers.{i}", text, "full_attention", per_expert=True)
    return shapes


def checkpoint_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3.5 checkpoint (dense or MoE, with or without a vision tower): name -> shape."""
    text = text_config(config)
    multimodal = "vision_config" in config
    # as Qwen3.5 checkpoints name it (the tiny text-only MoE too); transformers' text-only classes map it to `model.`
    lm = "model.language_model"
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {f"{lm}.embed_tokens.weight": (vocab, hidden)}
    for i, kind in enumerate(text["layer_types"]):
        shapes |= _decoder_layer(f"{lm}.layers.{i}", text, kind)
    shapes[f"{lm}.norm.weight"] = (hidden,)
    if not (text.get("tie_word_embeddings") or config.get("tie_word_embeddings")):
        shapes["lm_head.weight"] = (vocab, hidden)
    if multimodal:
        shapes |= _vision_tower(config["vision_config"])
    return shapes | mtp_tensor_shapes(config)


def drafter_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """A DFlash drafter's own tensors (z-lab's DFlashDraftModel): it borrows the target's embedding and
    lm_head. `fc` maps the concatenated target layers' hidden states to the drafter's width."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    taps = len(config["dflash_config"]["target_layer_ids"])
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (hidden, taps * hidden), "hidden_norm.weight": (hidden,),
                                          "norm.weight": (hidden,)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"layers.{i}"
        shapes |= {f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                   f"{p}.self_attn.k_proj.weight": (kv * head_dim, hidden),
                   f"{p}.self_attn.v_proj.weight": (kv * head_dim, hidden),
                   f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                   f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,),
                   f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
                   f"{p}.mlp.down_proj.weight": (hidden, inter),
                   f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)}
    return shapes
