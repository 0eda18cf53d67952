"""`mxspec run` end to end on the reference pair (a smaller matrix than the demo): every stage through
the gate, then publishing to a local Hub over real HTTP, then resumed (nothing redone).

The 135M reference target loses acceptance under MXFP4 (README), so on this pair the gate is
expected to fail: `mxspec run` must then exit 1 and publish nothing, and only an explicit
`mxspec publish --force` may upload it, with the card saying the gate did not pass. The pass path of
`mxspec run` through publish is covered on the tiny Qwen3.5 pair (tests/stages/test_publish.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
from huggingface_hub import HfApi

from tests.conftest import RECIPES, ROOT, cli_env, tiny_reference_recipe
from tests.support import local_hub

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]
TOKEN = "hf_pipeline_test_secret_77aa"


def small_reference_recipe(tmp_path):
    text = (RECIPES / "reference-cpu.toml").read_text()
    text = text.replace('workloads = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]', 'workloads = ["gsm8k", "mbpp"]')
    text = text.replace("budgets = [4, 8, 16]", "budgets = [4, 8]").replace("num_prompts = 6", "num_prompts = 2")
    text = text.replace("max_tokens = 96", "max_tokens = 24").replace('backends = ["reference", "vllm"]', 'backends = ["reference"]')
    text = text.replace('path = "../models/', f'path = "{RECIPES.parent}/models/')
    # Strict thresholds, undecided counts as a failure: 2 prompts cannot show MXFP4 at least as good,
    # so the gate does not pass, and the test follows the refusal and the forced publish.
    text = text.replace("max_acceptance_length_drop = 0.5", "max_acceptance_length_drop = 0.0")
    text = text.replace("max_position_gap = 0.1", "max_position_gap = 0.0").replace('on_inconclusive = "pass"', 'on_inconclusive = "fail"')
    assert 'backends = ["reference"]' in text, "the reference backend alone: this test follows the gate, not vLLM"
    recipe = tmp_path / "small.toml"
    recipe.write_text(text)
    return recipe


def test_run_end_to_end_then_resume(mxspec, tmp_path, reference_target):
    recipe = small_reference_recipe(tmp_path)
    out = tmp_path / "out"
    url, hub = local_hub.start_local_hub_process(tmp_path / "hub", TOKEN, stderr=subprocess.DEVNULL)
    env = {"HF_ENDPOINT": url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home")}
    api = HfApi(endpoint=url, token=TOKEN)
    repo = "mxspec-demo/smollm2-135m-instruct-mxfp4"
    try:
        first = mxspec("run", recipe, "--out", out, env=env, timeout=1800)
        for stage in ("resolve", "quantize", "pair", "validate", "gate"):
            manifest = json.loads((out / stage / "manifest.json").read_text())
            assert manifest["stage"] == stage and manifest["outputs"]
        report = json.loads((out / "validate" / "report.json").read_text())
        assert len(report["cells"]) == 2 * 2 * 2 and len(report["drift"]) == 2 * 2
        quantize = json.loads((out / "quantize" / "mxspec-quantize.json").read_text())
        assert quantize["verification"]["bit_exact_tensors"] == 210 and quantize["versions"]["amd-quark"] == "0.13"
        verdict = json.loads((out / "gate" / "verdict.json").read_text())
        assert len(verdict["checks"]) == 4 and verdict["exit_code"] == (0 if verdict["passed"] else 1)
        assert first.returncode == verdict["exit_code"], first.stderr[-3000:]
        print("gate:", verdict["verdict"], [c["reason"] for c in verdict["checks"]])

        assert not verdict["passed"] and first.returncode == 1
        # refused, nothing uploaded; then an explicit, recorded override
        assert "refusing to publish" in first.stderr and not (out / "publish").exists()
        assert not api.repo_exists(repo)
        forced = mxspec("publish", f"{recipe}={out}", "--force", env=env)
        assert forced.returncode == 0, forced.stderr[-3000:]
        published = json.loads((out / "publish" / "publish.json").read_text())
        assert published["forced"] and "did not pass" in (out / "publish" / "README.md").read_text()
        assert published["repo_id"] == repo and published["verified"] == len(published["files"])
        assert api.model_info(repo).private and "model.safetensors" in api.list_repo_files(repo)
        history = [c.commit_id for c in api.list_repo_commits(repo)]

        second = mxspec("run", recipe, "--out", out, env=env)
        assert second.returncode == first.returncode, second.stderr[-3000:]
        assert second.stderr.count("up to date (skipped)") == 5  # publish always re-checks
        assert [c.commit_id for c in api.list_repo_commits(repo)] == history
        assert TOKEN not in first.stdout + first.stderr + second.stdout + second.stderr
        logs = {log.stem: log.read_text() for log in (out / ".mxspec" / "logs").glob("*.log")}
        assert {"quantize", "validate", "publish"} <= set(logs) and not any(TOKEN in text for text in logs.values())
        assert "QUARK-INFO" in logs["validate"] and "QUARK-INFO" not in first.stdout + first.stderr  # kept aside
    finally:
        hub.kill()
        hub.wait()


FLAT_LAYOUT = "a287ae76ba78c1ce55fdca04a3cd77cc89508aae"  # the last commit before the package was grouped by job


def test_a_run_made_with_the_flat_layout_is_up_to_date_after_the_regrouping(tmp_path, tiny):
    """Fingerprints are made of stage names and versions, recipe sections, input hashes and tool versions,
    never module paths, so a run folder written before `pipeline/` was grouped into subpackages resumes
    with every stage skipped (the cells included)."""
    flat = tmp_path / "flat"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", FLAT_LAYOUT, "pipeline", "calibration"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(flat, filter="data")
    recipe = tiny_reference_recipe(tmp_path, tiny)
    out = tmp_path / "run"
    cli = [sys.executable, "-c", "import sys, pipeline; from pipeline.cli import main; "
           "print(pipeline.__file__, file=sys.stderr); sys.exit(main())"]
    argv = ["run", str(recipe), "--out", str(out), "--until", "gate"]

    before = subprocess.run([*cli, *argv], env={**os.environ, "PYTHONPATH": str(flat)}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    assert before.stderr.startswith(str(flat / "pipeline" / "__init__.py")), before.stderr[:300]
    assert before.returncode in (0, 1) and "run complete" in before.stderr, before.stderr[-2000:]
    assert "validate (ran)" in before.stderr

    after = subprocess.run([*cli, *argv], env=cli_env(), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert after.stderr.startswith(str(ROOT / "pipeline" / "__init__.py")), after.stderr[:300]
    assert after.returncode == before.returncode, after.stderr[-2000:]
    stages = ("resolve", "quantize", "pair", "validate", "gate")
    assert ", ".join(f"{stage} (skipped)" for stage in stages) in after.stderr, after.stderr[-2000:]
