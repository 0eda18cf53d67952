"""The serving matrix as the MI355X recipes define it: which servers start, with which flags. Fast: no
server starts (the vLLM tier in test_vllm_validate.py starts real ones)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.recipe import load_recipe
from pipeline.serving.benchmark import ServerCell, server_matrix, server_spec
from tests.conftest import RECIPES


def test_qwen35_matrix_has_ar_mtp_and_dflash_per_budget_at_both_precisions():
    recipe = load_recipe(RECIPES / "qwen3.5-27b-mxfp4.toml")
    cells = server_matrix(recipe)
    for precision in ("bf16", "mxfp4"):
        assert ServerCell(precision, "ar", None) in cells
        for budget in (4, 8, 16):
            assert ServerCell(precision, "mtp", budget) in cells
            assert ServerCell(precision, "dflash", budget) in cells
    assert len(cells) == 2 * (1 + 2 * 3)


def test_mtp_cell_speculates_budget_minus_one_tokens_without_prefix_caching_in_the_recipe_env():
    recipe = load_recipe(RECIPES / "qwen3.5-35b-a3b-mxfp4.toml")
    spec = server_spec(recipe, ServerCell("mxfp4", "mtp", 8), Path("/ckpt"), Path("/drafter"))
    args = spec.args()
    assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 7}
    assert "--no-enable-prefix-caching" in args
    assert spec.env["VLLM_ROCM_USE_AITER"] == "1"
    assert args[args.index("--max-num-batched-tokens") + 1] == str(recipe.serving.max_num_batched_tokens)


def test_dflash_cell_names_the_unchanged_drafter_and_ar_has_no_speculation():
    recipe = load_recipe(RECIPES / "qwen3.5-27b-mxfp4.toml")
    dflash = server_spec(recipe, ServerCell("bf16", "dflash", 16), Path("/target"), Path("/drafter")).args()
    assert json.loads(dflash[dflash.index("--speculative-config") + 1]) == {
        "method": "dflash", "model": "/drafter", "num_speculative_tokens": 15}
    assert "--no-enable-prefix-caching" not in dflash
    ar = server_spec(recipe, ServerCell("bf16", "ar", None), Path("/target"), Path("/drafter")).args()
    assert "--speculative-config" not in ar
