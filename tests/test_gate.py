"""The gate as CI meets it: verdicts from the report's intervals, exit codes, Markdown, JUnit XML."""

from __future__ import annotations

import json
import random
from xml.etree import ElementTree

import pytest

from pipeline.acceptance import AcceptanceStats
from pipeline.artifacts import ServedRow, write_artifact
from pipeline.gate import gate_report
from pipeline.recipe import Gate, Recipe
from pipeline.validate import build_report, report_settings


def per_prompt_stats(accept: float, n: int, seed: int, block: int, steps: int = 30) -> list[AcceptanceStats]:
    """Per-prompt counts of a drafter whose drafts are each accepted with probability `accept` in turn
    (the same seed stands for the same prompts: equal `accept` gives identical counts)."""
    rng = random.Random(seed)
    stats = []
    for _ in range(n):
        lengths = []
        for _ in range(steps):
            accepted = 0
            while accepted < block - 1 and rng.random() < accept:
                accepted += 1
            lengths.append(accepted + 1)
        stats.append(AcceptanceStats.from_lengths(lengths, block))
    return stats


def write_report(tmp_path, quant_accept: dict[str, float], num_prompts=40, gate: Gate | None = None, serving=None):
    """A real validate report (validate.build_report) for gsm8k/mbpp at blocks 4 and 8, bf16 accept 0.7."""
    recipe = Recipe.model_validate({"name": "gate-test", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                                    "gate": (gate or Gate()).model_dump(),
                                    "validation": {"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8],
                                                   "num_prompts": num_prompts}})
    per_prompt = {}
    for w_index, workload in enumerate(("gsm8k", "mbpp")):
        for block in (4, 8):
            per_prompt[(workload, "bf16", block)] = per_prompt_stats(0.7, num_prompts, 10 * w_index + block, block)
            per_prompt[(workload, "mxfp4", block)] = per_prompt_stats(quant_accept[workload], num_prompts, 10 * w_index + block, block)
    report = build_report(recipe, per_prompt, {"recipe": recipe.name, "backend": "reference", "target": "/t",
                                               "drafter": "/d", "settings": report_settings(recipe),
                                               "gate": recipe.gate, "versions": {}},
                          serving=None if serving is None else [ServedRow(**row) for row in serving])
    path = tmp_path / "validate" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_artifact(report, path)
    return path


def test_an_unchanged_drafter_on_a_faithful_target_passes(tmp_path):
    result = gate_report(write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}), Gate(max_position_gap=0.1))
    assert result.verdict == "pass" and result.passed and result.exit_code == 0
    assert {c.name for c in result.checks} == {"gsm8k B=4", "gsm8k B=8", "mbpp B=4", "mbpp B=8"}


def test_a_significant_drop_fails_only_the_cells_that_dropped(tmp_path):
    result = gate_report(write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.3}), Gate(max_position_gap=0.1))
    assert result.verdict == "fail" and not result.passed and result.exit_code == 1
    verdicts = {c.name: c.verdict for c in result.checks}
    assert verdicts["mbpp B=8"] == "fail" and verdicts["mbpp B=4"] == "fail"
    assert verdicts["gsm8k B=8"] == "pass"
    assert "mean AL drop" in next(c for c in result.checks if c.name == "mbpp B=8").reason


@pytest.mark.parametrize("policy, passed", [("fail", False), ("pass", True)])
def test_too_few_prompts_are_inconclusive_and_the_recipe_sets_the_policy(tmp_path, policy, passed):
    gate = Gate(max_acceptance_length_drop=0.25, max_position_gap=0.5, on_inconclusive=policy)
    result = gate_report(write_report(tmp_path, {"gsm8k": 0.62, "mbpp": 0.7}, num_prompts=3, gate=gate), gate)
    assert result.verdict == "inconclusive" and result.passed is passed


def test_per_position_drops_are_gated_with_their_intervals(tmp_path):
    # the mean-AL drop is tolerated, but early positions lose far more than 5 points
    gate = Gate(max_acceptance_length_drop=2.0, max_position_gap=0.05)
    result = gate_report(write_report(tmp_path, {"gsm8k": 0.45, "mbpp": 0.7}), gate)
    check = next(c for c in result.checks if c.name == "gsm8k B=8")
    assert check.verdict == "fail" and "worst position" in check.reason


def served_row(**fields) -> dict:
    """A report["serving"] row of a DFlash B=8 server on gsm8k at concurrency 1."""
    row = {"workload": "gsm8k", "precision": "bf16", "method": "dflash", "budget": 8, "concurrency": 1,
           "num_prompts": 40, "output_tokens": 4000, "wall_s": 40.0, "throughput_tok_s": 100.0, "latency_p50_s": 1.0,
           "latency_max_s": 2.0, "mean_acceptance_length": 2.5, "per_position_acceptance": [0.6] * 7, "num_drafts": 1600}
    return {**row, **fields}


def test_throughput_lift_uses_serving_rows_when_asked(tmp_path):
    serving = [served_row(precision=p, throughput_tok_s=t) for p, t in (("bf16", 100.0), ("mxfp4", 104.0))]
    path = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}, serving=serving)
    assert gate_report(path, Gate(max_position_gap=0.1, min_throughput_lift=0.02)).passed
    failed = gate_report(path, Gate(max_position_gap=0.1, min_throughput_lift=0.10))
    assert failed.verdict == "fail" and any(c.kind == "throughput" and c.verdict == "fail" for c in failed.checks)
    unmeasured = gate_report(write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}), Gate(max_position_gap=0.1, min_throughput_lift=0.1))
    assert unmeasured.verdict == "inconclusive"


def test_cli_writes_summary_junit_and_verdict_and_exits_1_on_fail(mxspec, tmp_path):
    report = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.3}, gate=Gate(max_position_gap=0.1))
    result = mxspec("gate", report)
    assert result.returncode == 1, result.stderr
    out = tmp_path / "gate"
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["schema"] == "mxspec.gate/1" and verdict["verdict"] == "fail" and verdict["exit_code"] == 1
    suite = ElementTree.parse(out / "junit.xml").getroot()
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == {"gsm8k B=4", "gsm8k B=8", "mbpp B=4", "mbpp B=8"}
    assert cases["mbpp B=8"].find("failure") is not None and cases["gsm8k B=8"].find("failure") is None
    assert suite.get("failures") == str(sum(c.find("failure") is not None for c in cases.values()))
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## mxspec gate: FAIL") and "| mbpp B=8 | FAIL |" in summary


def test_cli_passes_with_thresholds_from_a_recipe(mxspec, tmp_path):
    report = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.66}, gate=Gate(max_acceptance_length_drop=0.0, max_position_gap=0.0))
    assert mxspec("gate", report, "--out", tmp_path / "strict").returncode == 1
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "r"\n[target]\npath = "/t"\n[drafter]\npath = "/d"\n'
                      "[gate]\nmax_acceptance_length_drop = 1.0\nmax_position_gap = 0.3\n")
    result = mxspec("gate", report, "--recipe", recipe, "--out", tmp_path / "lenient")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "lenient" / "verdict.json").read_text())["thresholds"]["max_acceptance_length_drop"] == 1.0


@pytest.mark.parametrize("content, words", [(None, "report not found"), ("{oops", "not a JSON report"),
                                            ('{"schema": "other"}', "schema"),
                                            ('{"schema": "mxspec.validate/1", "drift": []}', "regenerate it")])
def test_bad_reports_exit_2_with_one_line(mxspec, tmp_path, content, words):
    report = tmp_path / "validate" / "report.json"
    if content is not None:
        report.parent.mkdir()
        report.write_text(content)
    result = mxspec("gate", report)
    assert result.returncode == 2 and words in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "gate").exists()


@pytest.mark.slow
def test_a_deliberately_degraded_target_fails_the_gate(tmp_path, reference_target):
    """MXFP4 export of the reference target with 5% of its packed weight bytes randomised: its greedy
    continuations change, the unchanged drafter's acceptance collapses, and the gate says so."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.quantize import quantize_checkpoint
    from pipeline.recipe import Quantization, load_recipe
    from pipeline.validate import greedy_continuations, load_target, validate
    from pipeline.workloads import load_prompts
    from tests.conftest import RECIPES

    degraded = tmp_path / "degraded"
    quantize_checkpoint(reference_target, degraded, Quantization(scheme="mxfp4_weight_only", exclude=["lm_head"]))
    generator = torch.Generator().manual_seed(0)
    for shard in degraded.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, packed in tensors.items():
            if packed.dtype == torch.uint8 and name.endswith(".weight"):
                hit = torch.rand(packed.shape, generator=generator) < 0.05
                packed[hit] = torch.randint(0, 256, (int(hit.sum()),), generator=generator, dtype=torch.uint8)
        save_file(tensors, shard, metadata={"format": "pt"})

    recipe = load_recipe(RECIPES / "reference-cpu.toml")
    recipe = recipe.model_copy(update={
        "validation": recipe.validation.model_copy(update={"workloads": ["gsm8k"], "budgets": [8], "num_prompts": 6, "max_tokens": 48}),
        "gate": Gate(max_acceptance_length_drop=0.2, max_position_gap=0.1, on_inconclusive="fail"),
    })
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reference_target)
    prompts = load_prompts("gsm8k", 6, 0)
    base = greedy_continuations(load_target(reference_target, "bf16"), tokenizer, prompts, 48)
    broken = greedy_continuations(load_target(degraded, "mxfp4"), tokenizer, prompts, 48)
    assert sum(a != b for a, b in zip(base, broken)) >= 5, "the perturbation must change greedy continuations"

    report = validate(recipe, reference_target, degraded, recipe.drafter.path, tmp_path / "logs")
    path = tmp_path / "validate" / "report.json"
    path.parent.mkdir()
    write_artifact(report, path)
    result = gate_report(path, recipe.gate)
    assert result.verdict == "fail" and result.exit_code == 1
    check = result.checks[0]
    assert check.name == "gsm8k B=8" and check.verdict == "fail" and "mean AL drop" in check.reason
    print(check.reason)
