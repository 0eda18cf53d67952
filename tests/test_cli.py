"""The `mxspec` command line as a user meets it: exit codes and one-line errors, no tracebacks."""

from __future__ import annotations

import pytest

from tests.conftest import RECIPES


def test_help_lists_every_command(mxspec):
    result = mxspec("--help")
    assert result.returncode == 0
    for command in ("recipe", "plan", "quantize", "pair", "validate", "gate", "publish", "run"):
        assert command in result.stdout


def test_recipe_check_accepts_the_27b_recipe(mxspec):
    result = mxspec("recipe", "check", RECIPES / "qwen3.5-27b-mxfp4.toml")
    assert result.returncode == 0, result.stderr
    assert "Qwen/Qwen3.5-27B@fc05daec18b0a78c049392ed2e771dde82bdf654" in result.stdout
    # the memory plan, from the config stored for the Hub repo (pipeline.quant.memory; its figures: test_memory)
    assert "target bf16 55.6 GB -> MXFP4 19.8 GB; drafter 3.5 GB" in result.stdout
    assert "fits: 48.5 GB of 259.2 GB per GPU" in result.stdout



@pytest.mark.parametrize("name, sizes", [
    ("qwen3.5-4b-mxfp4", None),  # the 4B target's config was not found: no sizes
    ("qwen3.5-9b-mxfp4", "target bf16 19.3 GB -> MXFP4 9.1 GB"),
    ("qwen3.5-122b-a10b-mxfp4", "target bf16 250.2 GB -> MXFP4 79.9 GB; drafter 1.5 GB"),
    ("qwen3.5-397b-a17b-mxfp4", "target fp8 406.2 GB -> MXFP4 237.9 GB"),
])
def test_recipe_check_passes_on_the_family_and_warns_what_is_not_pinned(mxspec, name, sizes):
    result = mxspec("recipe", "check", RECIPES / f"{name}.toml")
    assert result.returncode == 0, result.stderr
    assert "drafter" in result.stderr and "is not pinned" in result.stderr
    if sizes is None:
        assert "config is not known here" in result.stdout
    else:
        assert sizes in result.stdout and "fits: " in result.stdout


def test_a_config_the_memory_plan_cannot_read_is_a_row_not_an_error(mxspec, tmp_path, tiny):
    """The plan is information: a Qwen3.5 config without `layer_types` still passes recipe check."""
    import json

    from tests.conftest import tiny_reference_recipe
    from tests.test_bad_input import model_copy

    config = json.loads((tiny / "qwen3.5-tiny" / "config.json").read_text())
    del config["text_config"]["layer_types"]
    target = model_copy(tmp_path, tiny / "qwen3.5-tiny", "T", config)
    recipe = tiny_reference_recipe(tmp_path, tiny)
    recipe.write_text(recipe.read_text().replace(str(tiny / "qwen3.5-tiny") + '"', f'{target}"'))
    result = mxspec("recipe", "check", recipe)
    assert result.returncode == 0, result.stderr
    assert "a config lacks 'layer_types'" in result.stdout


def test_recipe_check_says_what_vllm_serves_of_the_reference_recipe(mxspec):
    result = mxspec("recipe", "check", RECIPES / "reference-cpu.toml")
    assert result.returncode == 0, result.stderr
    assert "gsm8k; budgets [8]; 3 prompts per workload; eager (no torch.compile)" in result.stdout


@pytest.mark.parametrize(
    "edit, key",
    [
        (("revision = ", "revison = "), "target.revison"),  # typo'd key
        (("num_prompts = 128", "num_prompts = 12.5"), "validation.num_prompts"),  # wrong type
        (('scheme = "mxfp4"', 'scheme = "nvfp4"'), "quantization.scheme"),  # unknown scheme
    ],
)
def test_bad_recipe_exits_2_with_one_line(mxspec, tmp_path, edit, key):
    text = (RECIPES / "qwen3.5-27b-mxfp4.toml").read_text().replace(*edit, 1)
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    result = mxspec("recipe", "check", bad)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"'{key}'" in lines[0] and "Traceback" not in result.stderr + result.stdout


def test_missing_recipe_exits_2(mxspec, tmp_path):
    result = mxspec("run", tmp_path / "missing.toml", "--out", tmp_path / "out")
    assert result.returncode == 2 and "recipe not found" in result.stderr
    assert not (tmp_path / "out").exists()


def test_traceback_switch_shows_the_cause_of_an_mxspec_error(mxspec, tmp_path):
    """One line by default; MXSPEC_TRACEBACK=1 shows the chain down to the error that caused it."""
    report = tmp_path / "report.json"
    report.write_text("{not json")
    quiet = mxspec("gate", report, "--out", tmp_path / "gate")
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    loud = mxspec("gate", report, "--out", tmp_path / "gate", env={"MXSPEC_TRACEBACK": "1"})
    assert loud.returncode == 2
    assert "JSONDecodeError" in loud.stderr and "direct cause of the following exception" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1] == quiet.stderr.strip().splitlines()[-1]


def test_the_ray_executor_without_ray_installed_is_one_line_naming_the_install(tmp_path):
    """Ray is an optional extra: choosing it without Ray fails before any stage, exit 2, no traceback."""
    import subprocess
    import sys

    hide_ray = "import sys; sys.modules['ray'] = None; from pipeline.cli import main; main()"
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", hide_ray, "run", str(RECIPES / "reference-cpu.toml"), "--executor", "ray",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: the ray executor needs Ray, which is not installed; pip install 'ray==2.60.0' (or `pip install -e "
        "'.[ray]'` in a checkout), or use the local executor (--executor local)"]
    assert not out.exists()


def test_an_executor_that_does_not_exist_is_bad_input(mxspec, tmp_path):
    result = mxspec("run", RECIPES / "reference-cpu.toml", "--executor", "slurm", "--out", tmp_path / "out")
    assert result.returncode == 2 and "--executor slurm: choose 'local' or 'ray'" in result.stderr
