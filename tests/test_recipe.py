"""Recipes: every shipped recipe validates; every mistake is one line naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import RecipeError
from pipeline.recipe import load_recipe
from pipeline.run.runner import recipe_hash
from tests.conftest import RECIPES

MINIMAL = """
name = "t"
[target]
path = "target"
[drafter]
path = "drafter"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["qwen3.5-27b-mxfp4", "qwen3.5-35b-a3b-mxfp4", "reference-cpu", "qwen3.5-tiny-cpu",
                                  "qwen3.5-4b-mxfp4", "qwen3.5-9b-mxfp4", "qwen3.5-122b-a10b-mxfp4",
                                  "qwen3.5-397b-a17b-mxfp4"])
def test_shipped_recipes_validate(name):
    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert recipe.name == name


def test_study_recipes_encode_the_blog_matrix():
    for name, target, drafter in [
        ("qwen3.5-27b-mxfp4", "Qwen/Qwen3.5-27B", "z-lab/Qwen3.5-27B-DFlash"),
        ("qwen3.5-35b-a3b-mxfp4", "Qwen/Qwen3.5-35B-A3B", "z-lab/Qwen3.5-35B-A3B-DFlash"),
    ]:
        recipe = load_recipe(RECIPES / f"{name}.toml")
        assert (recipe.target.id, recipe.drafter.id) == (target, drafter)
        assert recipe.target.pinned and recipe.drafter.pinned
        v = recipe.validation
        assert v.workloads == ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
        assert (v.budgets, v.concurrency, v.num_prompts, v.max_tokens) == ([4, 8, 16], [1, 32], 128, 4096)
        assert v.methods == ["ar", "mtp", "dflash"] and v.precisions == ["bf16", "mxfp4"]
        assert recipe.serving.max_num_batched_tokens == 32768 and recipe.serving.tensor_parallel_size == 1
    moe = load_recipe(RECIPES / "qwen3.5-35b-a3b-mxfp4.toml")
    assert moe.serving.env == {"VLLM_ROCM_USE_AITER": "1"}


def test_local_paths_resolve_against_the_recipe_folder(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL))
    assert recipe.target.path == (tmp_path / "target").resolve()
    assert recipe.drafter.path == (tmp_path / "drafter").resolve()


def test_a_recipe_hash_changes_only_with_its_sections(tmp_path):
    base = load_recipe(write(tmp_path, MINIMAL))
    changed_gate = load_recipe(write(tmp_path, MINIMAL + "[gate]\nmax_position_gap = 0.2\n"))
    assert recipe_hash(base, "target", "quantization") == recipe_hash(changed_gate, "target", "quantization")
    assert recipe_hash(base, "gate") != recipe_hash(changed_gate, "gate")
    assert recipe_hash(base) != recipe_hash(changed_gate)


def test_the_prompt_source_is_part_of_validates_fingerprint_only(tmp_path):
    from pipeline.stages.quantize import QuantizeStage
    from pipeline.stages.validate import ValidateStage

    base = load_recipe(write(tmp_path, MINIMAL))
    hub = load_recipe(write(tmp_path, MINIMAL + "[validation]\nprompt_source = 'hub'\n"))
    assert base.validation.prompt_source == "packaged"  # the default: the same prompts on every machine, offline
    assert recipe_hash(base, *ValidateStage.sections) != recipe_hash(hub, *ValidateStage.sections)
    assert recipe_hash(base, *QuantizeStage.sections) == recipe_hash(hub, *QuantizeStage.sections)


@pytest.mark.parametrize(
    "extra, key, words",
    [
        ("[quantization]\nschem = 'mxfp4'\n", "quantization.schem", "did you mean 'scheme'"),
        ("[quantization]\nscheme = 'mxfp5'\n", "quantization.scheme", "mxfp4_weight_only"),
        ("[validation]\nnum_prompts = 'many'\n", "validation.num_prompts", "integer"),
        ("[validation]\nbudgets = [1]\n", "validation.budgets", "greater than or equal to 2"),
        ("[validation]\nworkloads = ['gsm9k']\n", "validation.workloads", "gsm8k"),
        ("[serving]\ngpu_memory_utilization = 1.5\n", "serving.gpu_memory_utilization", "less than or equal to 1"),
        ("flavour = 'red'\n", "flavour", "known keys"),
    ],
)
def test_each_mistake_is_one_line_naming_the_key(tmp_path, extra, key, words):
    # Keys appended after a table header belong to that table in TOML; top-level extras go first.
    text = extra + MINIMAL if not extra.startswith("[") else MINIMAL + extra
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    assert f"'{key}'" in message and words in message
    assert message.startswith(str(tmp_path / "recipe.toml") + ":")


def test_vllm_serves_the_subset_serving_names_and_the_reference_backend_measures_all(tmp_path):
    recipe = load_recipe(write(tmp_path, MINIMAL + "[validation]\nworkloads = ['gsm8k', 'mbpp']\nbudgets = [4, 8]\n"
                               "backends = ['reference', 'vllm']\nnum_prompts = 6\n"
                               "[serving]\nworkloads = ['gsm8k']\nbudgets = [8]\nnum_prompts = 3\n"))
    assert (recipe.served.workloads, recipe.served.budgets, recipe.served.num_prompts) == (["gsm8k"], [8], 3)
    assert (recipe.validation.workloads, recipe.validation.budgets) == (["gsm8k", "mbpp"], [4, 8])
    assert recipe.served.max_tokens == recipe.validation.max_tokens  # the rest of [validation] is shared
    unnarrowed = load_recipe(write(tmp_path, MINIMAL))
    assert unnarrowed.served == unnarrowed.validation


@pytest.mark.parametrize(
    "validation, serving, words",
    [
        ("workloads = ['gsm8k']", "workloads = ['mbpp']", "serving.workloads lists mbpp, which validation.workloads"),
        ("budgets = [4, 8]", "budgets = [16]", "serving.budgets lists 16, which validation.budgets"),
        ("num_prompts = 4", "num_prompts = 5", "serving.num_prompts = 5 is more than validation.num_prompts = 4"),
        ("", "budgets = [8, 8]", "serving.budgets lists 8 more than once"),
    ],
)
def test_a_served_subset_outside_the_study_is_one_line_at_its_key(tmp_path, validation, serving, words):
    text = (MINIMAL + f"[validation]\nbackends = ['reference', 'vllm']\n{validation}\n"
            f"[serving]\ndtype = 'float32'\n{serving}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message and words in message
    assert message.startswith(f"{tmp_path / 'recipe.toml'}:{text.splitlines().index(serving) + 1}: ")


def test_a_served_subset_needs_the_reference_backend_and_is_unused_without_vllm(tmp_path):
    subset = "[serving]\nworkloads = ['gsm8k']\n"
    with pytest.raises(RecipeError, match="add 'reference' to validation.backends"):
        load_recipe(write(tmp_path, MINIMAL + "[validation]\nbackends = ['vllm']\n" + subset))
    reference_only = load_recipe(write(tmp_path, MINIMAL + "[validation]\nbackends = ['reference']\n" + subset))
    assert reference_only.validation.backends == ["reference"]  # like the rest of [serving]: unused


def test_error_points_at_the_line(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, MINIMAL + "[quantization]\nscheme = 'int8'\n"))
    assert f"recipe.toml:{MINIMAL.count(chr(10)) + 2}:" in str(info.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ('name = "t"\n[drafter]\npath = "d"\n', "missing required key 'target'"),
        (MINIMAL.replace('path = "target"', 'path = "target"\nid = "a/b"\nrevision = "x"'), "exactly one of"),
        (MINIMAL.replace('path = "target"', 'id = "Qwen/Qwen3.5-27B"'), "pinned 'revision'"),
        (MINIMAL.replace('path = "target"', 'id = "noslash"\nrevision = "x"'), "owner/name"),
        ("name = [unclosed\n", "not valid TOML"),
    ],
)
def test_structural_mistakes(tmp_path, text, words):
    with pytest.raises(RecipeError, match=None) as info:
        load_recipe(write(tmp_path, text))
    assert words in str(info.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "nope.toml")


def test_the_gpu_check_recipes_are_the_cpu_ones_made_for_a_gpu(tmp_path):
    """scripts/gpu_check.sh derives its recipes from the CPU ones; --dry-run writes and checks them here."""
    import subprocess

    done = subprocess.run(["bash", str(RECIPES.parent / "scripts" / "gpu_check.sh"), "--dry-run", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name, cpu in (("qwen3.5-tiny-gpu", "qwen3.5-tiny-cpu"), ("qwen3.5-moe-tiny-gpu", "qwen3.5-tiny-cpu"),
                      ("reference-gpu", "reference-cpu")):
        recipe, original = load_recipe(tmp_path / f"{name}.toml"), load_recipe(RECIPES / f"{cpu}.toml")
        assert recipe.serving.env == {} and recipe.serving.dtype == "bfloat16"
        assert recipe.serving.gpu_memory_utilization == 0.3
        assert recipe.validation.workloads == ["gsm8k"] and recipe.validation.num_prompts == 3
        moe = name.startswith("qwen3.5-moe")
        assert recipe.target.path.name == original.target.path.name.replace("qwen3.5-", "qwen3.5-moe-" if moe else "qwen3.5-")
        assert recipe.drafter.path.parent == original.drafter.path.parent
        assert recipe.quantization.mode == ("file_to_file" if moe else original.quantization.mode)
        assert recipe.validation.methods == original.validation.methods
    alone = load_recipe(tmp_path / "qwen3.5-tiny-vllm-only-gpu.toml")
    assert alone.validation.backends == ["vllm"] and alone.validation.replays_served_text
    assert alone.validation.methods == ["ar", "mtp", "dflash"] and alone.serving.dtype == "bfloat16"


def test_a_quantized_mtp_head_cannot_be_asked_of_in_memory_mode(tmp_path):
    text = MINIMAL + "[quantization]\nquantize_mtp = true\nmode = \"in_memory\"\n"
    with pytest.raises(RecipeError, match="quantize_mtp = true needs mode = 'file_to_file'"):
        load_recipe(write(tmp_path, text))

