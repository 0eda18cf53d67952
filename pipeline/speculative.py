"""Greedy DFlash speculation over a HF target: target features, drafting, and acceptance replay.

For greedy decoding the tokens a speculative run commits are exactly the target's own greedy
continuation. So acceptance can be measured without the online loop: run the target once over
prompt + continuation, let the drafter propose a block at every position, then walk the chain of
steps a real run would take (anchor -> accepted prefix + bonus -> next anchor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.dflash import DFlashDrafter


@dataclass
class TargetHooks:
    """The parts of the target the drafter borrows: token embedding and lm_head."""

    embed: torch.nn.Module
    lm_head: torch.nn.Module

    @classmethod
    def of(cls, target) -> TargetHooks:
        return cls(target.get_input_embeddings(), target.get_output_embeddings())


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the outputs of target layers `layer_ids` (HF `hidden_states[i + 1]`)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[1, 1, K*B, C + K*B] bool mask for K blocks packed in one sequence.

    Block j (anchor position a_j) sees context positions < a_j and its own B tokens, nothing else.
    """
    num_blocks = anchors.shape[0]
    queries = num_blocks * block_size
    block_of_query = torch.arange(queries) // block_size
    ctx = torch.arange(context_len)[None, :] < anchors[block_of_query][:, None]
    own = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([ctx, own], dim=1)[None, None]


def draft_at_anchors(
    drafter: DFlashDrafter,
    hooks: TargetHooks,
    tokens: torch.Tensor,  # [T] the sequence (prompt + continuation)
    features: torch.Tensor,  # [T, n*H] target features of the same sequence
    anchors: torch.Tensor,  # [K] anchor positions
    block_size: int,
) -> torch.Tensor:
    """Draft logits [K, B-1, vocab] for a block anchored at each position, all in one pass."""
    cfg = drafter.cfg
    num_blocks = anchors.shape[0]
    block_tokens = torch.full((num_blocks, block_size), cfg.mask_token_id, dtype=torch.long)
    block_tokens[:, 0] = tokens[anchors]
    dtype = next(drafter.parameters()).dtype
    block_embeds = hooks.embed(block_tokens.view(1, -1)).to(dtype)
    context = drafter.fuse_context(features[None].to(dtype))
    context_positions = torch.arange(features.shape[0])[None]
    block_positions = (anchors[:, None] + torch.arange(block_size)[None]).view(1, -1)
    mask = block_attention_mask(anchors, block_size, features.shape[0])
    hidden = drafter(block_embeds, context, context_positions, block_positions, attn_mask=mask)
    hidden = hidden.view(num_blocks, block_size, -1)[:, 1:]
    return hooks.lm_head(hidden.to(hooks.lm_head.weight.dtype))


@dataclass(frozen=True)
class Replay:
    acceptance_lengths: list[int]  # per speculative step, bonus token counted: each in [1, B]
    block_size: int


def replay_acceptance(
    drafter: DFlashDrafter,
    hooks: TargetHooks,
    tokens: torch.Tensor,
    features: torch.Tensor,
    prompt_len: int,
    block_size: int,
    chunk: int = 64,
) -> Replay:
    """Acceptance per step of a greedy speculative run whose output is `tokens[prompt_len:]`.

    The first continuation token comes from the prefill; every later step anchors a block at the
    last committed token, accepts the longest prefix of drafts that match the continuation, and
    commits one bonus token from the target.
    """
    end = tokens.shape[0]
    # Anchors a run can visit: the first generated token onwards, up to the second-to-last token.
    candidates = torch.arange(prompt_len, end - 1)
    drafts = torch.empty(len(candidates), block_size - 1, dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(candidates), chunk):
            part = candidates[start : start + chunk]
            drafts[start : start + len(part)] = draft_at_anchors(
                drafter, hooks, tokens, features, part, block_size
            ).argmax(-1)
    lengths = []
    anchor = prompt_len
    while anchor < end - 1:
        proposed = drafts[anchor - prompt_len]
        truth = tokens[anchor + 1 : anchor + block_size]
        matches = (proposed[: len(truth)] == truth).int().cumprod(0)
        accepted = int(matches.sum())
        lengths.append(accepted + 1)
        anchor += accepted + 1
    return Replay(lengths, block_size)
