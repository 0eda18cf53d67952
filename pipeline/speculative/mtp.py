"""Qwen3.5's multi-token-prediction (MTP) head, as vLLM runs it, in PyTorch.

The checkpoint's `mtp.*` tensors hold one extra decoder layer that drafts the token after next. To draft
at position i, vLLM (`Qwen3_5MultiTokenPredictor`) takes the target's final hidden state h_i (after the
model's last norm) and the embedding of the token at i+1 (the target's own embed_tokens), norms each,
concatenates [embedding, hidden], projects 2H -> H with `fc`, runs one full-attention decoder layer
(causal, over the head's own earlier positions, at the same positions as the target), applies `norm`
and reads logits with the target's lm_head. Further drafts chain: the head's normed output stands in
for h and the drafted token for the next input. transformers builds no MTP head, so this module
builds one from transformers' own Qwen3.5 decoder layer and norm, with the checkpoint's names
(`mtp.` + this module's state-dict names).

Dense heads only: an MoE target's MTP layer has routed experts (stored per expert in the checkpoint),
which this module does not build.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from pipeline.checkpoints.folder import MTP_PREFIX, has_mtp_head, mtp_layers, text_config
from pipeline.speculative.replay import Replay, TargetHooks, accept_along, extend_greedy

__all__ = ["MtpHead", "mtp_drafts", "replay_mtp", "replay_mtp_as_vllm_counts", "load_mtp_head"]


class MtpHead(nn.Module):
    def __init__(self, text_config):
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
            Qwen3_5TextRotaryEmbedding,
        )

        super().__init__()
        if getattr(text_config, "num_experts", None):
            raise ValueError("MtpHead builds dense MTP layers; this target's MTP layer has routed experts")
        config = copy.deepcopy(text_config)
        config._attn_implementation = "sdpa"
        full = config.layer_types.index("full_attention")  # the decoder layer is built as a full-attention one
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            [Qwen3_5DecoderLayer(config, full) for _ in range(mtp_layers(config.to_dict()))]
        )
        self.norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(config)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """[batch, T, H] embeddings of the tokens at i+1 and the hidden states at i -> the head's normed
        output at i (its logits are the target's lm_head of it). Attention is causal over the T positions.
        `step` picks the layer as vLLM does (`spec_step_idx % num_layers`)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()[None, None]
        x = self.layers[step % len(self.layers)](
            x, position_embeddings=self.rotary(x, positions), attention_mask=causal, position_ids=positions
        )
        x = x[0] if isinstance(x, tuple) else x
        return self.norm(x)

    def checkpoint_tensors(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The head's weights under the checkpoint's `mtp.*` names."""
        return {MTP_PREFIX + k: v.detach().to(dtype).contiguous().clone() for k, v in self.state_dict().items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the `mtp.*` tensors of a checkpoint (strict: every tensor of the head, nothing else)."""
        own = {k.removeprefix(MTP_PREFIX): v for k, v in tensors.items() if k.startswith(MTP_PREFIX)}
        self.load_state_dict(own, strict=True)


@torch.no_grad()
def mtp_drafts(head: MtpHead, hooks: TargetHooks, tokens: torch.Tensor, final_hidden: torch.Tensor, anchor: int,
               num_drafts: int) -> torch.Tensor:
    """The head's `num_drafts` chained drafts after the committed token at `anchor`, as vLLM drafts them.

    Row i of the head reads (token i+1, the target's final hidden state at i). vLLM's head keeps a KV
    cache: rows before `anchor` were written by earlier steps from verified tokens and the target's
    hidden states, so they are exactly a teacher-forced pass. Draft 1 is row anchor-1's output (the
    token at `anchor` is the last bonus); draft k reads draft k-1 and the head's own output that made
    it, at the next position, attending to those rows and to the chain before it."""
    weight = next(head.parameters())  # the head may sit elsewhere than the target's embedding and lm_head

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return hooks.embed(ids.long().to(hooks.embed.weight.device)).to(weight.device, weight.dtype)

    embeds, hidden = embed(tokens[1 : anchor + 1])[None], final_hidden[:anchor][None].to(weight.device, weight.dtype)
    drafts = []
    for _ in range(num_drafts):
        out = head(embeds, hidden, torch.arange(embeds.shape[1], device=weight.device)[None])[:, -1:]
        draft = hooks.lm_head(out.to(hooks.lm_head.weight.device, hooks.lm_head.weight.dtype))[0, -1].argmax()
        drafts.append(draft.cpu())
        embeds = torch.cat([embeds, embed(draft[None])[None]], dim=1)
        hidden = torch.cat([hidden, out], dim=1)
    return torch.stack(drafts)


def replay_mtp(head: MtpHead, hooks: TargetHooks, tokens: torch.Tensor, final_hidden: torch.Tensor, prompt_len: int,
               block_size: int, end: int | None = None, predictions: torch.Tensor | None = None) -> Replay:
    """The MTP head's acceptance along `tokens[prompt_len:end]` (`speculative.accept_along`), B-1 chained
    drafts per step, from the target's final hidden states over `tokens` (`speculative.TargetPass`);
    `predictions`: another target wrote `tokens` (same-text replay, as `accept_along` says)."""
    tokens = torch.as_tensor(tokens)
    return accept_along(lambda anchor: mtp_drafts(head, hooks, tokens, final_hidden, anchor, block_size - 1),
                        tokens, prompt_len, block_size, end, predictions)


@torch.no_grad()
def replay_mtp_as_vllm_counts(target, head: MtpHead, tokens: list[int], prompt_len: int, block_size: int) -> Replay:
    """`replay_mtp` counted as vLLM's counters count: the final step untrimmed (see
    `speculative.replay_as_vllm_counts`)."""
    extended = torch.tensor(extend_greedy(target, tokens, block_size - 1))
    final_hidden = target(extended[None], output_hidden_states=True).hidden_states[-1][0].float()
    return replay_mtp(head, TargetHooks.of(target), extended, final_hidden, prompt_len, block_size, end=len(tokens))


def load_mtp_head(folder: Path) -> MtpHead | None:
    """The MTP head of a checkpoint in float32, or None where it has none this module runs: no `mtp.*`
    tensors, a head with routed experts, or one stored quantized (MXFP4 or FP8 weights and their scales)."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig

    config = json.loads((folder / "config.json").read_text())
    if not has_mtp_head(config) or text_config(config).get("num_experts"):
        return None
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys() if name.startswith(MTP_PREFIX)}
    head = MtpHead(AutoConfig.from_pretrained(folder).get_text_config())
    if set(tensors) != {MTP_PREFIX + name for name in head.state_dict()} or \
            any(not t.is_floating_point() or t.element_size() < 2 for t in tensors.values()):
        return None
    head.load_checkpoint_tensors({name: t.float() for name, t in tensors.items()})
    return head.eval()
