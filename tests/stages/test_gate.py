"""The gate as CI meets it: verdicts from the report's intervals, exit codes, Markdown, JUnit XML."""

from __future__ import annotations

import json
import random
from pathlib import Path
from xml.etree import ElementTree

import pytest

from pipeline.recipe import Gate, Recipe
from pipeline.run.artifacts import ServedRow, read_validate_report, write_artifact
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.stages.gate import gate_report, summary_markdown
from pipeline.study.answers import Answer
from pipeline.study.assembly import build_report, report_settings
from pipeline.study.drift import decide, drop_interval
from pipeline.study.fidelity import PromptFidelity
from pipeline.study.reference import ReferenceMeasurements


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


def write_report(tmp_path, quant_accept: dict[str, float], num_prompts=40, serving=None,
                 reference: ReferenceMeasurements | None = None, mtp_accept: tuple[float, float] | None = None):
    """A real validate report (validate.build_report) for gsm8k/mbpp at blocks 4 and 8, bf16 accept 0.7."""
    recipe = Recipe.model_validate({"name": "gate-test", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                                    "validation": {"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8],
                                                   "num_prompts": num_prompts}})
    per_prompt = {}
    for w_index, workload in enumerate(("gsm8k", "mbpp")):
        for block in (4, 8):
            per_prompt[(workload, "bf16", block)] = per_prompt_stats(0.7, num_prompts, 10 * w_index + block, block)
            per_prompt[(workload, "mxfp4", block)] = per_prompt_stats(quant_accept[workload], num_prompts, 10 * w_index + block, block)
    report = build_report(recipe, per_prompt, {"recipe": recipe.name, "backend": "reference", "target": "/t",
                                               "drafter": "/d", "settings": report_settings(recipe),
                                               "versions": {}},
                          serving=None if serving is None else [ServedRow(**row) for row in serving],
                          reference=reference, mtp_per_prompt=None if mtp_accept is None else {
                              (w, p, 4): per_prompt_stats(rate, num_prompts, 3, 4)
                              for w in ("gsm8k", "mbpp") for p, rate in zip(("bf16", "mxfp4"), mtp_accept)})
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
    result = gate_report(write_report(tmp_path, {"gsm8k": 0.62, "mbpp": 0.7}, num_prompts=3), gate)
    assert result.verdict == "inconclusive" and result.passed is passed


def test_per_position_drops_are_gated_with_their_intervals(tmp_path):
    # the mean-AL drop is tolerated, but early positions lose far more than 5 points
    gate = Gate(max_acceptance_length_drop=2.0, max_position_gap=0.05)
    result = gate_report(write_report(tmp_path, {"gsm8k": 0.45, "mbpp": 0.7}), gate)
    check = next(c for c in result.checks if c.name == "gsm8k B=8")
    assert check.verdict == "fail" and "worst position" in check.reason


def reference_measurements(same_accept: float, kl: float, agreement: float, correct: tuple[float, float] = (0.8, 0.8),
                           num_prompts: int = 40) -> ReferenceMeasurements:
    """What the reference backend adds for gsm8k/mbpp: the MXFP4 target's acceptance on bf16's text
    (drafts accepted with probability `same_accept`), per-prompt KL around `kl` and top-1 agreement
    `agreement` over 100 positions, and gsm8k answers right at the (bf16, MXFP4) rates `correct`."""
    rng = random.Random(7)
    measured = ReferenceMeasurements()
    for w_index, workload in enumerate(("gsm8k", "mbpp")):
        for block in (4, 8):
            measured.same_text[(workload, block)] = per_prompt_stats(same_accept, num_prompts, 10 * w_index + block, block)
        measured.fidelity[workload] = [PromptFidelity(100, round(100 * agreement), 100 * kl * rng.uniform(0.8, 1.2))
                                       for _ in range(num_prompts)]
    for precision, rate in zip(("bf16", "mxfp4"), correct):
        measured.answers[("gsm8k", precision)] = [Answer(True, i < rate * num_prompts) for i in range(num_prompts)]
    return measured


def test_a_target_whose_own_text_got_easier_but_whose_distribution_moved_fails_as_target_degraded(tmp_path):
    # MXFP4 acceptance rose on its own text (0.8 against bf16's 0.7); on bf16's text it held; KL is far out
    path = write_report(tmp_path, {"gsm8k": 0.8, "mbpp": 0.8}, reference=reference_measurements(0.7, kl=0.9, agreement=0.5))
    result = gate_report(path, Gate(max_position_gap=0.1, min_top1_agreement=0.8, max_kl=0.25))
    assert result.verdict == "fail" and result.exit_code == 1
    for check in result.checks:
        assert check.verdict == "fail" and check.reason.startswith("target degraded: ")
        assert "-> pass" in check.reason.split("; same-text")[0], "own text held, and the reason says so"
        assert "vs max 0.25: " in check.reason and " over -> fail" in check.reason, "KL: by how much it missed"
        assert "top-1 agreement 0.500" in check.reason and "vs min 0.8: 0.300 short -> fail" in check.reason
        assert check.measured["kl"] == pytest.approx(0.9, abs=0.1) and check.measured["top1_agreement"] == 0.5
    summary = summary_markdown(result)
    assert "| gsm8k B=8 | FAIL | target degraded: " in summary and "KL <= 0.25" in summary


def test_own_text_that_is_only_inconclusive_still_counts_as_held_when_fidelity_fails(tmp_path):
    # 3 prompts and no measurable own-text change: the own-text interval straddles the threshold
    gate = Gate(max_acceptance_length_drop=0.25, max_position_gap=0.5, max_kl=0.25, on_inconclusive="pass")
    reference = reference_measurements(0.62, kl=0.9, agreement=0.5, num_prompts=3)
    path = write_report(tmp_path, {"gsm8k": 0.62, "mbpp": 0.7}, num_prompts=3, reference=reference)
    check = next(c for c in gate_report(path, gate).checks if c.name == "gsm8k B=8")
    assert "-> inconclusive" in check.reason.split("; same-text")[0]
    assert check.verdict == "fail" and check.reason.startswith("target degraded: ")


def test_a_drafter_that_lost_alignment_on_the_same_text_fails_with_the_same_text_drop(tmp_path):
    path = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}, reference=reference_measurements(0.3, kl=0.01, agreement=0.98))
    result = gate_report(path, Gate(max_position_gap=0.1, max_same_text_drop=0.25))
    assert result.verdict == "fail"
    check = next(c for c in result.checks if c.name == "mbpp B=8")
    assert check.reason.startswith("same-text acceptance dropped: ") and "same-text mean AL drop" in check.reason
    assert check.measured["same_text_delta"] < -0.25


def test_a_barely_changed_target_passes_every_measure(tmp_path):
    path = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}, reference=reference_measurements(0.7, kl=0.01, agreement=0.97))
    result = gate_report(path, Gate(max_position_gap=0.1, min_top1_agreement=0.8, max_kl=0.25, max_accuracy_drop=0.1))
    assert result.verdict == "pass" and result.passed
    reason = result.checks[0].reason
    assert all(word in reason for word in ("mean AL drop", "same-text mean AL drop", "top-1 agreement", "KL", "accuracy drop"))


def test_an_accuracy_drop_fails_only_when_the_recipe_sets_a_threshold(tmp_path):
    path = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7},
                        reference=reference_measurements(0.7, kl=0.01, agreement=0.97, correct=(0.8, 0.3)))
    assert gate_report(path, Gate(max_position_gap=0.1)).passed
    result = gate_report(path, Gate(max_position_gap=0.1, max_accuracy_drop=0.1))
    verdicts = {c.name: c.verdict for c in result.checks}
    assert verdicts == {"gsm8k B=4": "fail", "gsm8k B=8": "fail", "mbpp B=4": "pass", "mbpp B=8": "pass"}
    check = next(c for c in result.checks if c.name == "gsm8k B=4")
    assert check.reason.startswith("target degraded: ") and "accuracy drop +0.500" in check.reason
    assert check.measured["accuracy_delta"] == pytest.approx(-0.5)


def test_unfinished_answers_leave_accuracy_unmeasured_and_say_why(tmp_path):
    measured = reference_measurements(0.7, kl=0.01, agreement=0.97)
    measured.answers[("gsm8k", "mxfp4")] = [Answer(False, False)] * 40
    report = read_validate_report(write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}, reference=measured))
    row = report.accuracy[0]
    assert not row.measured and row.delta is None and "raise max_tokens" in row.note
    assert report.accuracy_row("gsm8k") is None


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
    """Without a recipe the gate applies the [gate] defaults: a report carries measurements, never thresholds."""
    report = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.3})
    result = mxspec("gate", report)
    assert result.returncode == 1, result.stderr
    out = tmp_path / "gate"
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["schema"] == "mxspec.gate/1" and verdict["verdict"] == "fail" and verdict["exit_code"] == 1
    assert verdict["thresholds"] == Gate().model_dump()
    suite = ElementTree.parse(out / "junit.xml").getroot()
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == {"gsm8k B=4", "gsm8k B=8", "mbpp B=4", "mbpp B=8"}
    assert cases["mbpp B=8"].find("failure") is not None and cases["gsm8k B=8"].find("failure") is None
    assert suite.get("failures") == str(sum(c.find("failure") is not None for c in cases.values()))
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## mxspec gate: FAIL") and "| mbpp B=8 | FAIL |" in summary


def test_cli_passes_with_thresholds_from_a_recipe(mxspec, tmp_path):
    report = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.66})
    head = 'name = "r"\n[target]\npath = "/t"\n[drafter]\npath = "/d"\n[gate]\n'
    strict, recipe = tmp_path / "strict.toml", tmp_path / "r.toml"
    strict.write_text(head + "max_acceptance_length_drop = 0.0\nmax_position_gap = 0.0\n")
    recipe.write_text(head + "max_acceptance_length_drop = 1.0\nmax_position_gap = 0.3\n")
    assert mxspec("gate", report, "--recipe", strict, "--out", tmp_path / "strict").returncode == 1
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
    """MXFP4 export of the reference target with 5% of its packed weight bytes randomised: it no longer
    predicts bf16's text, the unchanged drafter's acceptance collapses, and the gate says so."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.quant.export import quantize_checkpoint
    from pipeline.recipe import Quantization
    from tests.conftest import reference_recipe_with

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

    recipe = reference_recipe_with(workloads=["gsm8k"], budgets=[8], num_prompts=6, max_tokens=48)
    recipe = recipe.model_copy(update={"gate": Gate(max_acceptance_length_drop=0.2, max_position_gap=0.1,
                                                    on_inconclusive="fail")})
    report, result = _validate_and_gate(tmp_path, recipe, reference_target, degraded)
    assert report.fidelity[0].top1_agreement < 0.5, "the perturbation must change what the target predicts"
    assert result.verdict == "fail" and result.exit_code == 1
    check = result.checks[0]
    assert check.name == "gsm8k B=8" and check.verdict == "fail" and "mean AL drop" in check.reason
    assert not check.reason.startswith("target degraded"), "own-text acceptance fell: the cause is not hidden text drift"
    print(check.reason)


def _validate_and_gate(tmp_path, recipe, bf16: Path, export: Path):
    """validate (reference backend) and the gate over its report, as the pipeline runs them."""
    from pipeline.study.measure import measure_study

    report = measure_study(recipe, bf16, export, recipe.drafter.path, tmp_path / "logs").report
    path = tmp_path / "validate" / "report.json"
    path.parent.mkdir(parents=True)
    write_artifact(report, path)
    return report, gate_report(path, recipe.gate)


@pytest.fixture(scope="module")
def mt_bench_recipe():
    """The reference recipe on MT-Bench at block 8, six prompts of 96 tokens, with its own gate."""
    from tests.conftest import reference_recipe_with

    return reference_recipe_with(workloads=["mt-bench"], budgets=[8], num_prompts=6, max_tokens=96)


@pytest.mark.slow
def test_a_damaged_target_whose_own_text_got_easier_to_draft_fails_as_target_degraded(tmp_path, reference_target,
                                                                                         mt_bench_recipe):
    """The reference recipe's W+A export (weights and activations MXFP4 on a 135M model) writes text the
    drafter accepts *more* of on MT-Bench, yet it no longer predicts bf16's text: the gate fails it for
    the target, not for the drafter."""
    from pipeline.quant.export import quantize_checkpoint
    from pipeline.report.markdown import report_markdown

    export = tmp_path / "wa"
    quantize_checkpoint(reference_target, export, mt_bench_recipe.quantization)
    report, result = _validate_and_gate(tmp_path, mt_bench_recipe, reference_target, export)
    own, fidelity = report.drift[0], report.fidelity[0]
    print(f"own-text delta {own.delta:+.3f}, same-text delta {report.same_text_drift[0].delta:+.3f}, "
          f"top-1 agreement {fidelity.top1_agreement:.3f}, KL {fidelity.kl:.3f}")
    assert own.delta > 0 and decide(drop_interval(own.ci95), mt_bench_recipe.gate.max_acceptance_length_drop) != "fail", \
        "the damaged target's own text must be at least as easy to draft"
    check = result.checks[0]
    assert result.verdict == "fail" and check.verdict == "fail" and check.reason.startswith("target degraded: ")
    assert fidelity.kl_ci95[0] > mt_bench_recipe.gate.max_kl
    table = report_markdown(report)
    assert "MXFP4 target fidelity on bf16's text" in table and "MXFP4 on bf16 text" in table


@pytest.mark.slow
def test_an_export_that_barely_changes_the_target_passes_every_measure(tmp_path, reference_target, mt_bench_recipe):
    """Only layer 0's MLP quantized (weight-only): the same drafter, the same text, the same verdict."""
    from pipeline.quant.export import quantize_checkpoint
    from pipeline.recipe import Quantization

    export = tmp_path / "layer0"
    quantize_checkpoint(reference_target, export, Quantization(
        scheme="mxfp4_weight_only", mode="in_memory", exclude=["lm_head", "*.self_attn.*", "model.layers.[1-9]*"]))
    report, result = _validate_and_gate(tmp_path, mt_bench_recipe, reference_target, export)
    fidelity = report.fidelity[0]
    print(f"own-text delta {report.drift[0].delta:+.3f}, same-text delta {report.same_text_drift[0].delta:+.3f}, "
          f"top-1 agreement {fidelity.top1_agreement:.3f}, KL {fidelity.kl:.3f}")
    assert fidelity.kl < 0.05 and fidelity.top1_agreement > 0.9
    assert result.passed and all(c.verdict != "fail" for c in result.checks), [c.reason for c in result.checks]


def test_an_mtp_head_that_collapsed_in_the_mxfp4_checkpoint_fails_its_own_checks(tmp_path):
    """Served MTP acceptance collapsing to ~1 (a head vLLM loaded wrongly) fails while DFlash holds."""
    path = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}, mtp_accept=(0.8, 0.02))
    result = gate_report(path, Gate(max_position_gap=0.1, max_mtp_acceptance_drop=0.25))
    checks = {c.name: c for c in result.checks}
    assert checks["gsm8k B=8"].verdict == "pass" and result.verdict == "fail"
    mtp = checks["gsm8k MTP B=4"]
    assert mtp.verdict == "fail" and mtp.reason.startswith("MTP head degraded: served MTP mean AL drop +")
    assert len([c for c in result.checks if "MTP" in c.name]) == 2, "one MTP check per (workload, steps)"
    assert "served MTP mean AL drop <= 0.25" in summary_markdown(result)
    held = gate_report(write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.7}, mtp_accept=(0.8, 0.8)), Gate(max_position_gap=0.1))
    assert held.checks and {c.name: c.verdict for c in held.checks}["mbpp MTP B=4"] == "pass"
    unset = gate_report(path, Gate(max_position_gap=0.1, max_mtp_acceptance_drop=None))
    assert not [c for c in unset.checks if "MTP" in c.name]


def test_served_acceptance_at_a_higher_concurrency_is_gated_per_prompt_pair(tmp_path):
    """Rows above concurrency 1 come from vLLM's per-request metrics and meet the own-text thresholds."""
    recipe = Recipe.model_validate({"name": "gate-test", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                                    "validation": {"workloads": ["gsm8k"], "budgets": [8], "num_prompts": 40,
                                                   "concurrency": [1, 32], "precisions": ["bf16", "mxfp4"]}})
    base = per_prompt_stats(0.7, 40, 1, 8)
    per_prompt = {("gsm8k", "bf16", 8): base, ("gsm8k", "mxfp4", 8): base}
    per_request = {("dflash", "gsm8k", "bf16", 8, 32): base, ("dflash", "gsm8k", "mxfp4", 8, 32): per_prompt_stats(0.3, 40, 2, 8)}
    report = build_report(recipe, per_prompt, {"recipe": recipe.name, "backend": "vllm", "target": "/t", "drafter": "/d",
                                               "settings": report_settings(recipe), "versions": {}}, per_request=per_request)
    assert report.per_request_acceptance and [(d.concurrency, d.method) for d in report.served_drift] == [(32, "dflash")]
    path = tmp_path / "report.json"
    write_artifact(report, path)
    [check] = gate_report(path, Gate(max_position_gap=0.1)).checks
    assert check.name == "gsm8k B=8" and check.verdict == "fail", "one check per cell, with every concurrency's measure"
    concurrency_1, concurrency_32 = check.reason.split("; worst position")[:2]
    assert concurrency_1.startswith("mean AL drop -0.000 ") and "at concurrency 32: mean AL drop +" in concurrency_32
