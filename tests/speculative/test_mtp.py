"""pipeline/speculative/mtp.py: Qwen3.5's MTP head in PyTorch, with the checkpoint's names, drafting as vLLM runs it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.checkpoints.qwen35 import mtp_tensor_shapes
from pipeline.speculative.mtp import MtpHead, load_mtp_head


def _text_config(path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).get_text_config()


def test_the_head_has_the_checkpoints_mtp_tensors_and_loads_them_back(tiny):
    path = tiny / "qwen3.5-tiny"
    head = MtpHead(_text_config(path))
    shapes = {name: tuple(t.shape) for name, t in head.checkpoint_tensors().items()}
    assert shapes == mtp_tensor_shapes(json.loads((path / "config.json").read_text()))
    stored = {k: v for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.")}
    head.load_checkpoint_tensors(stored)
    assert all(torch.equal(head.checkpoint_tensors()[k], v) for k, v in stored.items())


def test_an_moe_targets_head_is_refused(tiny):
    with pytest.raises(ValueError, match="routed experts"):
        MtpHead(_text_config(tiny / "qwen3.5-moe-tiny"))


def test_a_draft_depends_on_no_later_position(tiny):
    head = MtpHead(_text_config(tiny / "qwen3.5-tiny")).eval()
    embeds, hidden = torch.randn(1, 6, 256), torch.randn(1, 6, 256)
    changed = hidden.clone()
    changed[0, 4:] += 1.0
    with torch.no_grad():
        before, after = head(embeds, hidden, torch.arange(6)[None]), head(embeds, changed, torch.arange(6)[None])
    assert torch.equal(before[0, :4], after[0, :4]) and not torch.equal(before[0, 4:], after[0, 4:])


@torch.no_grad()
def test_the_built_head_drafts_the_targets_token_after_next_on_a_prompt_it_never_saw(tiny):
    """`make` trains the tiny dense target's head (scripts/train_tiny_qwen35.py) on tail prompts; on the
    first GSM8K prompt (validation's head) its first draft at row i, from the target's normed final hidden
    state at i and the token at i+1, is the target's greedy token after i+1 nearly everywhere; fed the
    token at i instead, it is not."""
    from transformers import AutoTokenizer

    from pipeline.checkpoints.tokenizer import chat_ids
    from pipeline.study.targets import greedy_continuations, load_target
    from pipeline.study.workloads import load_prompts

    path = tiny / "qwen3.5-tiny"
    target, tokenizer = load_target(path, "bf16"), AutoTokenizer.from_pretrained(path)
    head = load_mtp_head(path)
    prompt = load_prompts("gsm8k", 1, 0)[0]
    [(tokens, prompt_len)] = greedy_continuations(target, tokenizer, [prompt], 32)
    assert prompt_len == len(chat_ids(tokenizer, prompt.text))
    ids = torch.tensor([tokens])
    out = target(ids, output_hidden_states=True)
    greedy = out.logits[0].argmax(-1)  # [i] = the target's token after position i
    embeds = target.get_input_embeddings()(ids)

    def first_draft_accuracy(hidden, next_embeds):
        rows = ids.shape[1] - 2
        drafts = target.lm_head(head(next_embeds[:, 1 : rows + 1], hidden[:, :rows], torch.arange(rows)[None]))[0].argmax(-1)
        response = slice(prompt_len - 1, rows)
        return (drafts[response] == greedy[1 : rows + 1][response]).float().mean().item()

    assert first_draft_accuracy(out.hidden_states[-1], embeds) > 0.9
    assert first_draft_accuracy(out.hidden_states[-1], embeds.roll(1, dims=1)) < 0.5


def test_a_checkpoints_head_loads_where_this_module_can_run_it(tiny, tmp_path):
    import shutil

    from safetensors.torch import save_file

    assert isinstance(load_mtp_head(tiny / "qwen3.5-tiny"), MtpHead)
    assert load_mtp_head(tiny / "qwen3.5-moe-tiny") is None  # routed experts
    # a head stored quantized (packed uint8 weights beside scales) is not run
    shutil.copy(tiny / "qwen3.5-tiny" / "config.json", tmp_path / "config.json")
    tensors = {k: v for k, v in load_file(tiny / "qwen3.5-tiny" / "model.safetensors").items() if k.startswith("mtp.")}
    tensors["mtp.fc.weight"] = torch.zeros(256, 256, dtype=torch.uint8)
    tensors["mtp.fc.weight_scale"] = torch.zeros(256, 16, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors")
    assert load_mtp_head(tmp_path) is None


@torch.no_grad()
def test_a_same_text_replay_verified_by_the_target_that_wrote_the_text_is_the_own_text_replay(tiny):
    """`replay_mtp(..., predictions=)`: when the verifier's greedy predictions are the text itself, the
    same-text rule is the ordinary one; predictions that disagree everywhere accept nothing."""
    from transformers import AutoTokenizer

    from pipeline.speculative.mtp import replay_mtp
    from pipeline.speculative.replay import TargetHooks
    from pipeline.study.targets import greedy_continuations, load_target
    from pipeline.study.workloads import load_prompts

    path = tiny / "qwen3.5-tiny"
    target, tokenizer = load_target(path, "bf16"), AutoTokenizer.from_pretrained(path)
    head, hooks = load_mtp_head(path), TargetHooks.of(target)
    [(tokens, prompt_len)] = greedy_continuations(target, tokenizer, load_prompts("gsm8k", 1, 0), 24)
    out = target(torch.tensor([tokens]), output_hidden_states=True)
    final_hidden, predictions = out.hidden_states[-1][0].float(), out.logits[0].argmax(-1)
    own = replay_mtp(head, hooks, tokens, final_hidden, prompt_len, 4)
    verified = replay_mtp(head, hooks, tokens, final_hidden, prompt_len, 4, predictions=predictions)
    assert verified.acceptance_lengths == own.acceptance_lengths and max(own.acceptance_lengths) > 1
    wrong = replay_mtp(head, hooks, tokens, final_hidden, prompt_len, 4, predictions=(predictions + 1) % 256)
    assert set(wrong.acceptance_lengths) == {1}
