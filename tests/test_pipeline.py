"""`mxspec run` end to end on the reference pair (a smaller matrix than the demo), then resumed."""

from __future__ import annotations

import json

import pytest

from tests.conftest import RECIPES

pytestmark = pytest.mark.slow


def test_run_end_to_end_then_resume(mxspec, tmp_path, reference_target):
    text = (RECIPES / "reference-cpu.toml").read_text()
    text = text.replace('workloads = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]', 'workloads = ["gsm8k", "mbpp"]')
    text = text.replace("budgets = [4, 8, 16]", "budgets = [4, 8]").replace("num_prompts = 6", "num_prompts = 2")
    text = text.replace("max_tokens = 96", "max_tokens = 24")
    text = text.replace('path = "../models/', f'path = "{RECIPES.parent}/models/')
    recipe = tmp_path / "small.toml"
    recipe.write_text(text)
    first = mxspec("run", recipe, "--out", tmp_path / "out", timeout=1800)
    assert first.returncode == 0, first.stderr[-3000:]
    for stage in ("resolve", "quantize", "pair", "validate"):
        manifest = json.loads((tmp_path / "out" / stage / "manifest.json").read_text())
        assert manifest["stage"] == stage and manifest["outputs"]
    report = json.loads((tmp_path / "out" / "validate" / "report.json").read_text())
    assert len(report["cells"]) == 2 * 2 * 2 and report["verdict"] in {"pass", "fail", "inconclusive"}
    quantize = json.loads((tmp_path / "out" / "quantize" / "mxspec-quantize.json").read_text())
    assert quantize["verification"]["bit_exact_tensors"] == 210 and quantize["versions"]["amd-quark"] == "0.13"
    second = mxspec("run", recipe, "--out", tmp_path / "out")
    assert second.returncode == 0 and second.stderr.count("up to date (skipped)") == 4
