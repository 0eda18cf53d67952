"""The drafter-training objective (pipeline/speculative/training.py): what a block position is scored against."""

from __future__ import annotations

import copy

import torch

from pipeline.speculative import training
from pipeline.speculative.dflash import DFlashConfig, DFlashDrafter, init_weights
from pipeline.speculative.replay import TargetHooks

VOCAB, HIDDEN, PROMPT_LEN = 64, 32, 6


def _drafter_and_hooks() -> tuple[DFlashDrafter, TargetHooks]:
    cfg = DFlashConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, block_size=8, mask_token_id=1,
                       target_layer_ids=(0, 1), num_target_layers=3)
    drafter = DFlashDrafter(cfg)
    init_weights(drafter, std=0.2, seed=0)
    torch.manual_seed(0)
    return drafter, TargetHooks(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False))


def _record(response_token: int, greedy_token: int, runner_up: int) -> dict:
    """A prompt plus a 2-token response: its only anchor is the first response token, whose one label
    is the target's next token after it (`greedy_token`), whatever the response has there."""
    tokens = torch.tensor([3, 31, 32, 33, 7, 8, 9, response_token], dtype=torch.int32)
    top_ids = torch.tensor([[greedy_token, runner_up] + list(range(10, 10 + training.TOP_K - 2))] * (len(tokens) - 1),
                           dtype=torch.int32)
    top_logprobs = torch.log_softmax(torch.linspace(0, -3, training.TOP_K), -1).repeat(len(tokens) - 1, 1)
    features = torch.randn(len(tokens) - 1, 2 * HIDDEN, generator=torch.Generator().manual_seed(1))
    return {"tokens": tokens, "prompt_len": PROMPT_LEN, "features": features.to(torch.bfloat16),
            "target_top_ids": top_ids, "target_top_logprobs": top_logprobs.to(torch.float16)}


def _loss(drafter, vocabulary, record, soft_weight: float) -> float:
    loss, labels = training.training_loss(drafter, vocabulary, record, block_size=8, num_anchors=4,
                                          generator=torch.Generator().manual_seed(0), soft_weight=soft_weight)
    assert labels == 1
    return loss.item()


def test_a_block_position_is_labelled_with_the_targets_greedy_token_not_the_responses_token():
    drafter, hooks = _drafter_and_hooks()
    sampled = _record(response_token=40, greedy_token=30, runner_up=31)
    greedy = _record(response_token=30, greedy_token=30, runner_up=31)
    other_greedy = _record(response_token=30, greedy_token=33, runner_up=31)
    vocabulary = training.TrainingVocabulary([sampled, greedy, other_greedy], hooks)
    for soft_weight in (0.0, 0.5):
        assert _loss(drafter, vocabulary, sampled, soft_weight) == _loss(drafter, vocabulary, greedy, soft_weight)
        assert _loss(drafter, vocabulary, other_greedy, soft_weight) != _loss(drafter, vocabulary, greedy, soft_weight)


def test_the_soft_part_of_the_loss_reads_the_targets_runners_up():
    drafter, hooks = _drafter_and_hooks()
    first, second = _record(30, 30, runner_up=31), _record(30, 30, runner_up=32)
    vocabulary = training.TrainingVocabulary([first, second], hooks)
    assert _loss(drafter, vocabulary, first, 0.0) == _loss(drafter, vocabulary, second, 0.0)
    assert _loss(drafter, vocabulary, first, 0.5) != _loss(drafter, vocabulary, second, 0.5)


def test_runners_up_outside_the_training_vocabulary_are_left_out_of_the_soft_target():
    drafter, hooks = _drafter_and_hooks()
    record = _record(30, 30, runner_up=50)
    vocabulary = training.TrainingVocabulary([record], hooks)  # the record's tokens: 50 and 10.. are not among them
    assert (vocabulary.labels(record["target_top_ids"][0].long())[1:] == -100).all()
    assert torch.isfinite(torch.tensor(_loss(drafter, vocabulary, record, 1.0)))


def _target_config(hidden: int = HIDDEN):
    from types import SimpleNamespace

    return SimpleNamespace(hidden_size=hidden, vocab_size=VOCAB, num_hidden_layers=3)


def test_training_continues_from_a_saved_drafter_and_records_its_digest_and_card(tmp_path):
    from pipeline.run.hashing import digest_of, list_files, sha256_file

    drafter, _ = _drafter_and_hooks()
    drafter.save_pretrained(tmp_path, dtype=torch.float32)
    (tmp_path / "README.md").write_text("# Stage-1 drafter\n\nmade somehow\n")
    loaded, parent = training.continue_from(tmp_path, _target_config(), (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values()))
    assert parent["sha256"] == digest_of({n: sha256_file(tmp_path / n) for n in list_files(tmp_path)})
    section = training.parent_section(parent)
    assert parent["sha256"] in section and "\n### Stage-1 drafter\n" in section  # its heading two levels down


def test_a_deep_lineage_keeps_its_headings_within_markdowns_six_levels():
    card = "# Stage 3\n\n#5 is a number\n\n## Continues\n\n### Stage 2\n\n##### Deep\n\n###### Deepest\n"
    section = training.parent_section({"sha256": "ab" * 32, "card": card})
    headings = [line for line in section.splitlines() if line.startswith("#")]
    assert headings == ["## The drafter this one continues (digest " + "ab" * 32 + ")", "### Stage 3", "#5 is a number",
                        "#### Continues", "##### Stage 2", "###### Deep", "###### Deepest"]


def test_continuing_from_a_drafter_of_another_target_is_refused_in_one_line(tmp_path):
    import pytest

    drafter, _ = _drafter_and_hooks()
    drafter.save_pretrained(tmp_path)
    for config, layer_ids in ((_target_config(hidden=2 * HIDDEN), (0, 1)), (_target_config(), (0, 2))):
        with pytest.raises(SystemExit, match="this target needs") as refused:
            training.continue_from(tmp_path, config, layer_ids)
        assert "\n" not in str(refused.value)
    with pytest.raises(SystemExit, match="no config.json"):
        training.continue_from(tmp_path / "missing", _target_config(), (0, 1))


def test_a_grown_drafter_drafts_exactly_as_before_and_its_new_layers_learn():
    drafter, hooks = _drafter_and_hooks()
    grown = training.grow(drafter, extra_layers=2)
    assert grown.cfg.num_hidden_layers == 3 and len(grown.layers) == 3
    record = _record(30, 30, runner_up=31)
    vocabulary = training.TrainingVocabulary([record], hooks)
    assert _loss(grown, vocabulary, record, 0.5) == _loss(drafter, vocabulary, record, 0.5)
    loss, _ = training.training_loss(grown, vocabulary, record, block_size=8, num_anchors=4,
                                     generator=torch.Generator().manual_seed(0), soft_weight=0.5)
    loss.backward()
    for layer in grown.layers[1:]:
        assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0
        assert layer.mlp.down_proj.weight.grad.abs().sum() > 0


def test_the_training_command_line_refuses_add_layers_without_a_drafter_to_grow():
    import subprocess
    import sys

    from tests.conftest import ROOT

    command = [sys.executable, str(ROOT / "scripts" / "train_dflash_drafter.py"), "--target", "t", "--out", "o",
               "--add-layers", "1"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "pass --init-from-drafter DIR too" in refused.stderr


def test_float32_matmuls_give_the_loss_of_the_exact_arithmetic_and_bf16_autocast_rounds_it():
    """`matmul_dtype=float32` (the tiny drafters' setting) computes the loss as float64 does to float32
    precision; the default bf16 autocast rounds every matmul, which moves the loss far more."""
    drafter, hooks = _drafter_and_hooks()
    record = _record(30, 30, runner_up=31)
    vocabulary = training.TrainingVocabulary([record], hooks)

    def loss(model, words, dtype) -> float:
        value, _ = training.training_loss(model, words, record, block_size=8, num_anchors=4,
                                          generator=torch.Generator().manual_seed(0), soft_weight=0.5,
                                          matmul_dtype=dtype)
        return value.item()

    in_float64 = training.TrainingVocabulary([record], TargetHooks(copy.deepcopy(hooks.embed).double(),
                                                                   copy.deepcopy(hooks.lm_head).double()))
    exact = loss(drafter.double(), in_float64, torch.float32)
    drafter.float()
    assert abs(loss(drafter, vocabulary, torch.float32) - exact) < 1e-5
    assert abs(loss(drafter, vocabulary, torch.bfloat16) - exact) > 1e-4
