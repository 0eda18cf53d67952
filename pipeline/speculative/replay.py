"""Greedy DFlash speculation over a HF target: target features, drafting, and acceptance replay.

For greedy decoding the tokens a speculative run commits are exactly the target's own greedy
continuation. So acceptance can be measured without the online loop: run the target once over
prompt + continuation, let the drafter propose a block at every position, then walk the chain of
steps a real run would take (anchor -> accepted prefix + bonus -> next anchor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.speculative.dflash import DFlashDrafter

__all__ = ["TargetHooks", "target_features", "block_attention_mask", "draft_at_anchors", "Replay",
    "replay_acceptance", "accept_along", "same_text_accepted", "replay_sequence", "TargetPass", "replay_pass",
    "extend_greedy", "replay_as_vllm_counts", "OnlineRun", "generate_online"]


@dataclass
class TargetHooks:
    """The parts of the target the drafter borrows: token embedding and lm_head."""

    embed: torch.nn.Module
    lm_head: torch.nn.Module

    @classmethod
    def of(cls, target) -> TargetHooks:
        return cls(target.get_input_embeddings(), target.get_output_embeddings())


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the outputs of target layers `layer_ids` (HF `hidden_states[i + 1]`), on the device of
    the first layer's (a target spread over GPUs leaves its layers' outputs on several)."""
    device = hidden_states[0].device
    return torch.cat([hidden_states[i + 1].to(device) for i in layer_ids], dim=-1)


def block_attention_mask(anchors: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """[1, 1, K*B, C + K*B] bool mask for K blocks packed in one sequence.

    Block j (anchor position a_j) sees context positions < a_j and its own B tokens, nothing else.
    """
    num_blocks = anchors.shape[0]
    queries = num_blocks * block_size
    block_of_query = torch.arange(queries, device=anchors.device) // block_size
    ctx = torch.arange(context_len, device=anchors.device)[None, :] < anchors[block_of_query][:, None]
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
    device = features.device
    anchors = anchors.to(device)
    num_blocks = anchors.shape[0]
    block_tokens = torch.full((num_blocks, block_size), cfg.mask_token_id, dtype=torch.long, device=device)
    block_tokens[:, 0] = tokens.to(device)[anchors]
    dtype = next(drafter.parameters()).dtype
    block_embeds = hooks.embed(block_tokens.view(1, -1).to(hooks.embed.weight.device)).to(device, dtype)
    context = drafter.fuse_context(features[None].to(dtype))
    context_positions = torch.arange(features.shape[0], device=device)[None]
    block_positions = (anchors[:, None] + torch.arange(block_size, device=device)[None]).view(1, -1)
    mask = block_attention_mask(anchors, block_size, features.shape[0])
    hidden = drafter(block_embeds, context, context_positions, block_positions, attn_mask=mask)
    hidden = hidden.view(num_blocks, block_size, -1)[:, 1:]
    head = hooks.lm_head.weight
    return hooks.lm_head(hidden.to(head.device, head.dtype))


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
    end: int | None = None,
    predictions: torch.Tensor | None = None,
) -> Replay:
    """DFlash's acceptance per step of a greedy speculative run whose output is `tokens[prompt_len:end]`
    (`accept_along`): the drafter's block at every anchor the run can visit, drafted in chunks."""
    stop = tokens.shape[0] if end is None else end
    candidates = torch.arange(prompt_len, max(prompt_len, stop - 1))
    drafts = torch.empty(len(candidates), block_size - 1, dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(candidates), chunk):
            part = candidates[start : start + chunk]
            drafts[start : start + len(part)] = draft_at_anchors(
                drafter, hooks, tokens, features, part, block_size
            ).argmax(-1).cpu()
    return accept_along(lambda anchor: drafts[anchor - prompt_len], tokens, prompt_len, block_size, end, predictions)


def accept_along(
    drafts_at: Callable[[int], torch.Tensor],
    tokens: torch.Tensor,
    prompt_len: int,
    block_size: int,
    end: int | None = None,
    predictions: torch.Tensor | None = None,
) -> Replay:
    """Acceptance per step of a greedy speculative run whose output is `tokens[prompt_len:end]`, for any
    drafter: `drafts_at(anchor)` are its B-1 drafts after the committed token at `anchor`.

    The first continuation token comes from the prefill; every later step anchors at the last committed
    token, accepts the longest prefix of drafts that match the continuation, and commits one bonus token
    from the target.

    The final step counts only the tokens the run kept (it ends at a stop token or the budget), the
    rule `generate_online` applies. vLLM's counters do not trim: its scheduler counts a step's
    accepted drafts before cutting them at the stop token or `max_tokens`. Passing `end` < len(tokens),
    with the target's greedy tokens past the stop (at least B-1 of them), replays that count instead.

    `predictions` (same-text replay): the verifying target's greedy next token at every position of
    `tokens`, when `tokens` is another target's text (see `same_text_accepted`). Without it the
    verifier is the target that wrote `tokens`, whose prediction at position i is tokens[i + 1].
    """
    trimmed = end is None
    end = tokens.shape[0] if end is None else end
    assert trimmed or tokens.shape[0] - end >= block_size - 1, "untrimmed count needs B-1 tokens past `end`"
    lengths = []
    anchor = prompt_len
    while anchor < end - 1:  # anchors: the first generated token onwards, up to the second-to-last token
        proposed = drafts_at(anchor)
        truth = tokens[anchor + 1 : anchor + block_size]
        if predictions is None:
            accepted = int((proposed[: len(truth)] == truth).int().cumprod(0).sum())
        else:
            verified = predictions[anchor : anchor + len(truth)]
            accepted = same_text_accepted(proposed[: len(truth)], verified, truth)
        lengths.append(min(accepted + 1, end - 1 - anchor) if trimmed else accepted + 1)
        anchor += accepted + 1
    return Replay(lengths, block_size)


def same_text_accepted(drafts: torch.Tensor, verified: torch.Tensor, text: torch.Tensor) -> int:
    """Drafts a target accepts when it verifies them along a text it did not write (teacher forced).

    Draft j is checked against the verifier's greedy token after the text's first j tokens past the
    anchor, `verified[j]`. That prediction is only known while the drafts so far equal the text: a
    draft the verifier accepts but the text does not continue with ends the step, since the
    verifier's next prediction on that other path was never computed. When the verifier wrote the
    text (verified[j] == text[j]) this is the ordinary rule: the longest prefix equal to the text.
    """
    accepts = (drafts == verified).int()
    on_text = torch.cat([torch.ones(1, dtype=torch.int), (drafts[:-1] == text[:-1]).int()])
    return int((accepts * on_text.cumprod(0)).cumprod(0).sum())


@torch.no_grad()
def replay_sequence(target, drafter: DFlashDrafter, tokens, prompt_len: int, block_sizes,
                    end: int | None = None) -> dict[int, Replay]:
    """One target pass over `tokens` (prompt + greedy continuation) for its features, then the
    drafter's acceptance along the continuation replayed at each block size (`end`: see
    `replay_acceptance`)."""
    return replay_pass(target, drafter, tokens, prompt_len, block_sizes, end=end).replays


@dataclass(frozen=True)
class TargetPass:
    """What one target pass over a text gives: the drafter's acceptance at each block size, the target's
    next-token log-probabilities at the continuation's positions (prompt_len - 1 .. end - 2), and its final
    hidden states (what an MTP head drafts from)."""

    replays: dict[int, Replay]
    logprobs: torch.Tensor  # [positions, vocab], float32
    final_hidden: torch.Tensor  # [T, H] float32: the target's last hidden states (after its final norm)
    predictions: torch.Tensor | None = None  # [T] its greedy next token at every position (same-text passes)


@torch.no_grad()
def replay_pass(target, drafter: DFlashDrafter, tokens, prompt_len: int, block_sizes, end: int | None = None,
                same_text: bool = False) -> TargetPass:
    """`replay_sequence` that also returns the target's log-probabilities along the continuation.

    `same_text`: `tokens` were written by another target (the bf16 one); the drafter is replayed with
    this target's features, and its drafts are verified by this target's own greedy predictions
    (`same_text_accepted`)."""
    sequence = torch.as_tensor(tokens)
    out = target(sequence[None].to(target.get_input_embeddings().weight.device), output_hidden_states=True)
    features = target_features(out.hidden_states, drafter.cfg.target_layer_ids)[0].float()
    logits = out.logits[0].float().cpu()
    predictions = logits.argmax(-1) if same_text else None
    hooks = TargetHooks.of(target)
    replays = {b: replay_acceptance(drafter, hooks, sequence, features, prompt_len, b, end=end, predictions=predictions)
               for b in block_sizes}
    stop = sequence.shape[0] if end is None else end
    return TargetPass(replays, torch.log_softmax(logits[prompt_len - 1 : stop - 1], dim=-1),
                      out.hidden_states[-1][0].float().cpu(), predictions)


@torch.no_grad()
def extend_greedy(target, tokens: list[int], num_tokens: int) -> list[int]:
    """`tokens` followed by the target's next `num_tokens` greedy tokens, ignoring stop tokens."""
    tokens = list(tokens)
    for _ in range(num_tokens):
        tokens.append(int(target(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens


def replay_as_vllm_counts(target, drafter: DFlashDrafter, tokens: list[int], prompt_len: int, block_size: int) -> Replay:
    """The drafter's acceptance along `tokens[prompt_len:]` counted as vLLM's counters count it: the
    final step untrimmed, so `tokens` is extended with the target's next greedy tokens to replay it."""
    extended = extend_greedy(target, tokens, block_size - 1)
    return replay_sequence(target, drafter, extended, prompt_len, [block_size], end=len(tokens))[block_size]


@dataclass(frozen=True)
class OnlineRun:
    tokens: list[int]  # prompt + committed continuation (stops at EOS or max_new_tokens)
    prompt_len: int
    acceptance_lengths: list[int]
    sampled_lengths: list[int]  # the same before the final step is trimmed at the stop: what vLLM counts


def _has_recurrent_state(target) -> bool:
    """True for hybrid targets (e.g. Qwen3.5's `linear_attention` layers) whose state can't be cropped."""
    layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
    return any(kind not in {"full_attention", "sliding_attention"} for kind in layer_types)


@torch.no_grad()
def generate_online(
    target,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    block_size: int,
    max_new_tokens: int,
    stop_ids: set[int],
) -> OnlineRun:
    """The real greedy DFlash loop: draft a block, verify it in one target pass, commit, repeat.

    After a partial acceptance the target's cache must forget the rejected positions. Attention
    caches are cropped; recurrent states (Qwen3.5's gated-delta-net layers) cannot be cropped, so
    for them the cache is snapshotted before verifying and, on rejection, restored and advanced over
    the accepted tokens only. The final step's acceptance counts only the tokens kept (up to the
    stop token or the token budget), the same rule `replay_acceptance` applies.
    """
    import copy

    hooks = TargetHooks.of(target)
    cfg = drafter.cfg
    dtype = next(drafter.parameters()).dtype
    recurrent = _has_recurrent_state(target)
    ids = torch.tensor([prompt_ids])
    out = target(ids, use_cache=True, output_hidden_states=True)
    cache = out.past_key_values
    context = drafter.fuse_context(target_features(out.hidden_states, cfg.target_layer_ids).to(dtype))
    tokens = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    lengths: list[int] = []
    sampled: list[int] = []
    budget_end = len(prompt_ids) + max_new_tokens
    while tokens[-1] not in stop_ids and len(tokens) < budget_end:
        anchor = len(tokens) - 1
        block = torch.full((1, block_size), cfg.mask_token_id, dtype=torch.long)
        block[0, 0] = tokens[-1]
        hidden = drafter(
            hooks.embed(block).to(dtype), context, torch.arange(anchor)[None], torch.arange(anchor, anchor + block_size)[None]
        )
        drafts = hooks.lm_head(hidden[:, 1:].to(hooks.lm_head.weight.dtype)).argmax(-1)[0]
        snapshot = copy.deepcopy(cache) if recurrent else None
        verify_ids = torch.cat([block[:, :1], drafts[None]], dim=1)
        verify = target(verify_ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        posterior = verify.logits[0].argmax(-1)
        accepted = int((drafts == posterior[:-1]).int().cumprod(0).sum())
        new = drafts[:accepted].tolist() + [int(posterior[accepted])]
        kept = next((i + 1 for i, t in enumerate(new) if t in stop_ids), len(new))
        kept = min(kept, budget_end - len(tokens))
        lengths.append(kept)
        sampled.append(len(new))
        tokens += new[:kept]
        if kept < len(new) or tokens[-1] in stop_ids:
            break
        features = target_features(verify.hidden_states, cfg.target_layer_ids)[:, : accepted + 1]
        context = torch.cat([context, drafter.fuse_context(features.to(dtype))], dim=1)
        if accepted < block_size - 1:
            if recurrent:
                cache = snapshot
                target(verify_ids[:, : accepted + 1], past_key_values=cache, use_cache=True)
            else:
                cache.crop(-(block_size - 1 - accepted))  # negative: drop the rejected drafts' positions
    return OnlineRun(tokens, len(prompt_ids), lengths, sampled)
