"""The serving matrix as the MI355X recipes define it: which servers start, with which flags (no server starts
here: tests/serving/test_vllm_validate.py starts real ones, and checks there that vLLM drafts exactly as
the reference drafter does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.recipe import Recipe, load_recipe
from pipeline.study.served import MatrixServer, server_matrix, server_spec, serving_cells
from tests.conftest import RECIPES


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


def test_a_served_text_without_its_prompt_ids_is_refused_in_one_line():
    """Served fidelity and the replay read the prompt as the server tokenized it; a vLLM that does not
    return it must not be scored along the continuation alone."""
    from pipeline.errors import ServerError
    from pipeline.study.served import ServedText, ServingCellResult, served_texts

    cell = ServingCellResult(label="bf16-ar", rows=[], tokens={"gsm8k": [[5, 6]]}, prompt_tokens={"gsm8k": [[1, 2, 3]]})
    assert served_texts(cell, "gsm8k") == [ServedText([1, 2, 3], [5, 6])] and served_texts(cell, "gsm8k")[0].tokens == [1, 2, 3, 5, 6]
    with pytest.raises(ServerError, match="returned no prompt token ids for gsm8k"):
        served_texts(cell.model_copy(update={"prompt_tokens": {"gsm8k": [[]]}}), "gsm8k")
