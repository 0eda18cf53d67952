"""`mxspec run` end to end on the reference pair (a smaller matrix than the demo): every stage through
gate and publish to a local Hub over real HTTP, then resumed (nothing redone, nothing re-committed)."""

from __future__ import annotations

import json
import subprocess

import pytest
from huggingface_hub import HfApi

from tests.conftest import RECIPES, local_hub

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]
TOKEN = "hf_pipeline_test_secret_77aa"


def small_reference_recipe(tmp_path):
    text = (RECIPES / "reference-cpu.toml").read_text()
    text = text.replace('workloads = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]', 'workloads = ["gsm8k", "mbpp"]')
    text = text.replace("budgets = [4, 8, 16]", "budgets = [4, 8]").replace("num_prompts = 6", "num_prompts = 2")
    text = text.replace("max_tokens = 96", "max_tokens = 24")
    text = text.replace('path = "../models/', f'path = "{RECIPES.parent}/models/')
    recipe = tmp_path / "small.toml"
    recipe.write_text(text)
    return recipe


def test_run_end_to_end_then_resume(mxspec, tmp_path, reference_target):
    recipe = small_reference_recipe(tmp_path)
    out = tmp_path / "out"
    # a user without a Hub login gets every artifact, then one line on how to publish or stop earlier
    no_login = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "empty-home")}
    until_gate = mxspec("run", recipe, "--out", out, "--until", "gate", env=no_login, timeout=1800)
    assert until_gate.returncode == 0, until_gate.stderr[-3000:]
    assert (out / "gate" / "verdict.json").is_file() and not (out / "publish").exists()
    missing = mxspec("run", recipe, "--out", out, env=no_login)
    assert missing.returncode == 2 and "HF_TOKEN" in missing.stderr and "--until gate" in missing.stderr
    assert "Traceback" not in missing.stderr and not (out / "publish").exists()

    url, hub = local_hub.start_local_hub_process(tmp_path / "hub", TOKEN, stderr=subprocess.DEVNULL)
    env = {"HF_ENDPOINT": url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home")}
    try:
        first = mxspec("run", recipe, "--out", out, env=env, timeout=1800)
        assert first.returncode == 0, first.stderr[-3000:]
        for stage in ("resolve", "quantize", "pair", "validate", "gate", "publish"):
            manifest = json.loads((out / stage / "manifest.json").read_text())
            assert manifest["stage"] == stage and manifest["outputs"]
        report = json.loads((out / "validate" / "report.json").read_text())
        assert len(report["cells"]) == 2 * 2 * 2 and report["verdict"] in {"pass", "fail", "inconclusive"}
        quantize = json.loads((out / "quantize" / "mxspec-quantize.json").read_text())
        assert quantize["verification"]["bit_exact_tensors"] == 210 and quantize["versions"]["amd-quark"] == "0.13"
        verdict = json.loads((out / "gate" / "verdict.json").read_text())
        assert verdict["passed"] and len(verdict["checks"]) == 4
        published = json.loads((out / "publish" / "publish.json").read_text())
        repo = "mxspec-demo/smollm2-135m-instruct-mxfp4"
        assert published["repo_id"] == repo and published["verified"] == len(published["files"])
        api = HfApi(endpoint=url, token=TOKEN)
        assert api.model_info(repo).private and "model.safetensors" in api.list_repo_files(repo)
        history = [c.commit_id for c in api.list_repo_commits(repo)]

        second = mxspec("run", recipe, "--out", out, env=env)
        assert second.returncode == 0, second.stderr[-3000:]
        assert second.stderr.count("up to date (skipped)") == 5  # publish always re-verifies the remote
        assert "unchanged, no commit" in second.stderr
        assert [c.commit_id for c in api.list_repo_commits(repo)] == history
        assert TOKEN not in first.stdout + first.stderr + second.stdout + second.stderr
    finally:
        hub.kill()
        hub.wait()
