"""The DFlash checkpoint format, on the committed reference drafter (which must also be trained only on
prompts validation never uses)."""

from __future__ import annotations

import json

from pipeline.recipe import load_recipe
from pipeline.speculative.dflash import DFlashConfig, DFlashDrafter
from pipeline.study.workloads import all_prompts
from tests.conftest import RECIPES, REFERENCE_DRAFTER


def test_no_prompt_the_recipes_can_evaluate_was_trained_on():
    training = json.loads((REFERENCE_DRAFTER / "training.json").read_text())
    num_prompts = load_recipe(RECIPES / "reference-cpu.toml").validation.num_prompts
    stages = 0
    while training:  # this drafter's training, then that of each drafter it was continued from
        heldout = training["heldout_from"]
        for workload, trained_ids in training["train_prompts"].items():
            evaluated = {p.id for p in all_prompts(workload, seed=0)[:heldout]}
            assert trained_ids and not evaluated & set(trained_ids), workload
        eval_ids = set(training["eval_prompts"])
        assert eval_ids <= {p.id for p in all_prompts("gsm8k", seed=0)[:heldout]}
        assert num_prompts <= heldout
        parent, stages = training.get("init_from_drafter"), stages + 1
        assert parent is None or parent["report"], "a drafter it continues has no training report to check"
        training = parent and parent["report"]
    # five stages (the drafter's card): each continued the previous one and brings its own report
    assert stages == 5


def test_checkpoint_is_in_the_z_lab_layout_and_loads_strictly():
    config = json.loads((REFERENCE_DRAFTER / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    drafter = DFlashDrafter.from_pretrained(REFERENCE_DRAFTER)  # strict: no missing or extra tensor
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert drafter.cfg == DFlashConfig.from_dict(config)
