"""The serving matrix as the MI355X recipes define it: which servers start, with which flags (fast: no
server starts; the vLLM tier in test_vllm_validate.py starts real ones). One slow test serves the
reference pair's DFlash cell and checks vLLM drafts exactly as the reference drafter does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.recipe import Recipe, load_recipe
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.speculative.dflash import DFlashDrafter
from pipeline.speculative.replay import replay_as_vllm_counts
from pipeline.study.cells import CellStore
from pipeline.study.served import MatrixServer, serve_matrix, server_matrix, server_spec, serving_cells
from pipeline.study.targets import load_target
from pipeline.study.workloads import load_prompts
from tests.conftest import RECIPES, REFERENCE_DRAFTER, reference_recipe_with


def test_qwen35_matrix_has_ar_mtp_and_dflash_per_budget_at_both_precisions():
    recipe = load_recipe(RECIPES / "qwen3.5-27b-mxfp4.toml")
    cells = server_matrix(recipe)
    for precision in ("bf16", "mxfp4"):
        assert MatrixServer(precision, "ar", None) in cells
        for budget in (4, 8, 16):
            assert MatrixServer(precision, "mtp", budget) in cells
            assert MatrixServer(precision, "dflash", budget) in cells
    assert len(cells) == 2 * (1 + 2 * 3)


def test_mtp_cell_speculates_budget_minus_one_tokens_without_prefix_caching_in_the_recipe_env():
    recipe = load_recipe(RECIPES / "qwen3.5-35b-a3b-mxfp4.toml")
    spec = server_spec(recipe, MatrixServer("mxfp4", "mtp", 8), Path("/ckpt"), Path("/drafter"))
    args = spec.args()
    assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 7}
    assert "--no-enable-prefix-caching" in args
    assert spec.env["VLLM_ROCM_USE_AITER"] == "1"
    assert args[args.index("--max-num-batched-tokens") + 1] == str(recipe.serving.max_num_batched_tokens)


def test_dflash_cell_names_the_unchanged_drafter_and_ar_has_no_speculation():
    recipe = load_recipe(RECIPES / "qwen3.5-27b-mxfp4.toml")
    dflash = server_spec(recipe, MatrixServer("bf16", "dflash", 16), Path("/target"), Path("/drafter")).args()
    assert json.loads(dflash[dflash.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": "/drafter", "num_speculative_tokens": 15}
    assert "--no-enable-prefix-caching" not in dflash
    ar = server_spec(recipe, MatrixServer("bf16", "ar", None), Path("/target"), Path("/drafter")).args()
    assert "--speculative-config" not in ar



def test_the_reference_recipe_serves_ar_and_dflash_at_one_budget_eager():
    recipe = load_recipe(RECIPES / "reference-cpu.toml")
    assert server_matrix(recipe) == [MatrixServer(p, m, b) for p in ("bf16", "mxfp4") for m, b in (("ar", None), ("dflash", 8))]
    assert "--enforce-eager" in server_spec(recipe, MatrixServer("bf16", "ar", None), Path("/t"), Path("/d")).args()
    study = load_recipe(RECIPES / "qwen3.5-27b-mxfp4.toml")
    assert "--enforce-eager" not in server_spec(study, MatrixServer("bf16", "ar", None), Path("/t"), Path("/d")).args()


def test_a_serving_cells_fingerprint_depends_on_what_it_serves_not_on_how_the_subset_is_spelled():
    def fingerprints(validation: dict, serving: dict) -> dict[str, str]:
        data = load_recipe(RECIPES / "reference-cpu.toml").model_dump()
        data["validation"] |= validation
        data["serving"] |= {"workloads": None, "budgets": None, "num_prompts": None, **serving}
        cells = serving_cells(Recipe.model_validate(data), {}, Path("/d"), {}, dict.fromkeys(("bf16", "mxfp4", "drafter"), "x"))
        return {c.name: c.fingerprint for c in cells}

    whole = fingerprints({"workloads": ["gsm8k"], "budgets": [8], "num_prompts": 3}, {})
    subset = fingerprints({"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8], "num_prompts": 6},
                          {"workloads": ["gsm8k"], "budgets": [8], "num_prompts": 3})
    assert subset == whole  # the same servers on the same prompts: kept, not served again
    more = fingerprints({"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8], "num_prompts": 6},
                        {"workloads": ["gsm8k"], "budgets": [8], "num_prompts": 4})
    assert more.keys() == whole.keys() and all(more[name] != whole[name] for name in whole)


@pytest.mark.slow
def test_served_dflash_accepts_exactly_what_the_reference_drafter_accepts_on_the_served_text(tmp_path, reference_target):
    """The committed drafter runs in vLLM's `dflash` method and drafts as `pipeline.speculative.dflash` does: per
    prompt, the served acceptance counts (per position, from /metrics) equal the reference replay's on
    the text the server produced. Replayed untrimmed, because vLLM counts the final step's accepted
    drafts before trimming them at max_tokens or the stop token (README, vLLM backend)."""
    block_size = 8
    recipe = reference_recipe_with(workloads=["gsm8k"], budgets=[block_size], precisions=["bf16"], methods=["dflash"],
                                   backends=["vllm"], concurrency=[1], num_prompts=4, max_tokens=64, warmup_requests=1)
    validation = recipe.validation
    prompts = load_prompts("gsm8k", validation.num_prompts, validation.seed)

    served = serve_matrix(recipe, {"bf16": reference_target}, REFERENCE_DRAFTER, {"gsm8k": prompts},
                          CellStore(tmp_path / "cells", tmp_path / "logs"))

    target = load_target(reference_target, "bf16")
    drafter = DFlashDrafter.from_pretrained(REFERENCE_DRAFTER, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(reference_target)
    served_tokens = served.tokens[(MatrixServer("bf16", "dflash", block_size).label, "gsm8k")]
    for prompt, tokens, served_stats in zip(prompts, served_tokens, served.per_prompt[("gsm8k", "bf16", block_size)],
                                            strict=True):
        sequence = chat_ids(tokenizer, prompt.text) + list(tokens)
        prompt_len = len(sequence) - len(tokens)
        replay = replay_as_vllm_counts(target, drafter, sequence, prompt_len, block_size)
        assert served_stats == AcceptanceStats.from_lengths(replay.acceptance_lengths, block_size), prompt.id
        assert served_stats.num_drafts > 0


def test_a_served_text_without_its_prompt_ids_is_refused_in_one_line():
    """Served fidelity and the replay read the prompt as the server tokenized it; a vLLM that does not
    return it must not be scored along the continuation alone."""
    from pipeline.errors import ServerError
    from pipeline.study.served import ServedText, ServingCellResult, served_texts

    cell = ServingCellResult(label="bf16-ar", rows=[], tokens={"gsm8k": [[5, 6]]}, prompt_tokens={"gsm8k": [[1, 2, 3]]})
    assert served_texts(cell, "gsm8k") == [ServedText([1, 2, 3], [5, 6])] and served_texts(cell, "gsm8k")[0].tokens == [1, 2, 3, 5, 6]
    with pytest.raises(ServerError, match="returned no prompt token ids for gsm8k"):
        served_texts(cell.model_copy(update={"prompt_tokens": {"gsm8k": [[]]}}), "gsm8k")
