"""The online DFlash loop and the replay measurement: same tokens as greedy decoding, same acceptance."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.dflash import DFlashDrafter
from pipeline.speculative import block_attention_mask, generate_online, replay_as_vllm_counts, replay_sequence
from pipeline.validate import chat_ids, load_target
from pipeline.workloads import load_prompts
from tests.conftest import REFERENCE_DRAFTER


def test_packed_blocks_see_only_their_past_and_themselves():
    mask = block_attention_mask(torch.tensor([2, 4]), block_size=3, context_len=5)[0, 0]
    assert mask.shape == (6, 5 + 6)
    assert mask[0, :5].tolist() == [True, True, False, False, False]  # block 0: context < 2
    assert mask[3, :5].tolist() == [True, True, True, True, False]  # block 1: context < 4
    assert mask[0, 5:].tolist() == [True, True, True, False, False, False]  # own block, no causal mask
    assert mask[4, 5:].tolist() == [False, False, False, True, True, True]


def _online_and_replay(target, drafter, tokenizer, text, block_size, max_new_tokens):
    prompt = chat_ids(tokenizer, text)
    run = generate_online(target, drafter, prompt, block_size, max_new_tokens, {tokenizer.eos_token_id})
    with torch.no_grad():
        greedy = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)[0].tolist()
    replay = replay_sequence(target, drafter, run.tokens, run.prompt_len, [block_size])[block_size]
    return run, greedy, replay


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 8])
def test_online_loop_on_a_hybrid_target_matches_greedy_decoding(tiny, block_size):
    # Gated-delta-net layers cannot crop their state: every rejection restores a snapshot.
    target = load_target(tiny / "qwen3.5-tiny", "bf16")
    drafter = DFlashDrafter.from_pretrained(tiny / "qwen3.5-tiny-dflash")
    tokenizer = AutoTokenizer.from_pretrained(tiny / "qwen3.5-tiny")
    run, greedy, replay = _online_and_replay(target, drafter, tokenizer, "Count: 1 2 3", block_size, 24)
    assert run.tokens == greedy[: len(run.tokens)] and len(run.tokens) == len(greedy)
    assert run.acceptance_lengths == replay.acceptance_lengths


@pytest.mark.slow
def test_replay_equals_the_online_loop_on_the_reference_pair(reference_target):
    target = AutoModelForCausalLM.from_pretrained(reference_target, dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(REFERENCE_DRAFTER)
    tokenizer = AutoTokenizer.from_pretrained(reference_target)
    total_steps, accepted, overshoot = 0, 0, 0
    for prompt in load_prompts("gsm8k", 3, seed=0):
        run, greedy, replay = _online_and_replay(target, drafter, tokenizer, prompt.text, 8, 64)
        assert run.tokens == greedy[: len(run.tokens)]
        assert run.acceptance_lengths == replay.acceptance_lengths
        assert sum(run.acceptance_lengths) == len(run.tokens) - run.prompt_len - 1  # the first token is the prefill's
        # vLLM's counters keep the final step's drafts past the stop: replayed with the target's tokens
        # beyond it, the count is the online loop's before trimming.
        untrimmed = replay_as_vllm_counts(target, drafter, run.tokens, run.prompt_len, 8)
        assert untrimmed.acceptance_lengths == run.sampled_lengths
        overshoot += sum(run.sampled_lengths) - sum(run.acceptance_lengths)
        total_steps += len(run.acceptance_lengths)
        accepted += sum(n - 1 for n in run.acceptance_lengths)
    assert accepted > 0, "a trained drafter accepts some drafts"
    assert overshoot > 0, "no final step accepted a draft past the budget, so the untrimmed count went untested"
