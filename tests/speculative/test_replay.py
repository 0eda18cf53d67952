"""The online DFlash loop and the replay measurement: same tokens as greedy decoding, same acceptance."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.speculative.dflash import DFlashDrafter
from pipeline.speculative.replay import block_attention_mask, generate_online, replay_as_vllm_counts, replay_sequence
from pipeline.study.targets import load_target
from pipeline.study.workloads import load_prompts
from tests.conftest import REFERENCE_DRAFTER


def test_packed_blocks_see_only_their_past_and_themselves():
    mask = block_attention_mask(torch.tensor([2, 4]), block_size=3, context_len=5)[0, 0]
    assert mask.shape == (6, 5 + 6)
    assert mask[0, :5].tolist() == [True, True, False, False, False]  # block 0: context < 2
    assert mask[3, :5].tolist() == [True, True, True, True, False]  # block 1: context < 4
    assert mask[0, 5:].tolist() == [True, True, True, False, False, False]  # own block, no causal mask
    assert mask[4, 5:].tolist() == [False, False, False, True, True, True]


def test_same_text_acceptance_follows_the_verifier_while_the_drafts_stay_on_the_text():
    from pipeline.speculative.replay import same_text_accepted

    text = torch.tensor([5, 6, 7, 8])
    drafts = torch.tensor([5, 6, 9, 8])
    # Verifier that wrote the text: the ordinary rule, the longest prefix equal to the text.
    assert same_text_accepted(drafts, text, text) == 2
    # Verifier that predicts 4 where the text says 6, as the draft does: that draft is accepted, and the
    # step ends after it, because the verifier's prediction after 4 was never computed.
    assert same_text_accepted(torch.tensor([5, 4, 7, 8]), torch.tensor([5, 4, 7, 8]), text) == 2
    # Verifier that rejects the first draft although the text continues with it.
    assert same_text_accepted(drafts, torch.tensor([1, 6, 7, 8]), text) == 0
    assert same_text_accepted(text, text, text) == 4


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


@pytest.mark.slow
def test_same_text_replay_on_the_targets_own_text_is_the_ordinary_replay(reference_target):
    """The same-text rule with the verifier that wrote the text gives exactly the ordinary acceptance."""
    from pipeline.speculative.replay import replay_pass
    from pipeline.study.targets import greedy_continuations

    target = load_target(reference_target, "bf16")
    drafter = DFlashDrafter.from_pretrained(REFERENCE_DRAFTER, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(reference_target)
    accepted = 0
    for tokens, prompt_len in greedy_continuations(target, tokenizer, load_prompts("gsm8k", 2, seed=0), 48):
        ordinary = replay_pass(target, drafter, tokens, prompt_len, [4, 8])
        same_text = replay_pass(target, drafter, tokens, prompt_len, [4, 8], same_text=True)
        for block in (4, 8):
            assert same_text.replays[block].acceptance_lengths == ordinary.replays[block].acceptance_lengths
            accepted += sum(n - 1 for n in ordinary.replays[block].acceptance_lengths)
        assert torch.equal(same_text.logprobs, ordinary.logprobs)
    assert accepted > 0, "with no accepted draft the comparison would be empty"
