"""The planner: the study's cells with their estimated cost, and longest-first schedules on GPUs."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import BadInputError
from pipeline.recipe import Recipe, load_recipe
from pipeline.study.plan import PlannedCell, StudyPlan, plan_study, schedule, study_cells
from tests.conftest import RECIPES


def recipe(**validation) -> Recipe:
    return Recipe.model_validate({"name": "plan-test", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                                  "validation": validation})


def cell(name: str, seconds: float, gpus: int = 1, after: tuple[str, ...] = ()) -> PlannedCell:
    return PlannedCell(name=name, kind="serving", gpus=gpus, output_tokens=0, estimate_s=seconds, after=after)


def test_a_serving_cell_is_one_server_of_the_matrix_costed_by_the_documented_arithmetic():
    study = recipe(workloads=["gsm8k", "mbpp"], budgets=[4, 8], concurrency=[1, 32], methods=["ar", "dflash"],
                   num_prompts=10, max_tokens=100)
    cells = {c.name: c for c in study_cells(study) if c.kind == "serving"}
    assert set(cells) == {f"serve-{p}-{m}" for p in ("bf16", "mxfp4") for m in ("ar", "dflash-b4", "dflash-b8")} | {"score-mxfp4"}
    rates = study.plan
    # per workload: 10 prompts x 100 tokens at concurrency 1 and at 32 (aggregate rate x batch_gain), and
    # the AR servers' prefill of 10 texts of 100 tokens for the served fidelity
    per_workload = 10 * 100 / 80.0 + 10 * 100 / (80.0 * rates.batch_gain)
    scoring = 10 * 100 / rates.prefill_tok_s
    assert cells["serve-bf16-ar"].estimate_s == pytest.approx(rates.server_start_s + 2 * (per_workload + scoring))
    assert cells["serve-mxfp4-ar"].after == (), "the AR servers run side by side"
    assert cells["score-mxfp4"].after == ("serve-bf16-ar",), "an MXFP4 AR server scores bf16's served text after it"
    assert cells["score-mxfp4"].estimate_s == pytest.approx(rates.server_start_s + 2 * scoring)
    assert cells["serve-bf16-dflash-b8"].estimate_s == pytest.approx(
        rates.server_start_s + 2 * (10 * 100 / 400.0 + 10 * 100 / (400.0 * rates.batch_gain)))
    assert cells["serve-mxfp4-ar"].estimate_s < cells["serve-bf16-ar"].estimate_s  # mxfp4_speedup
    assert cells["serve-bf16-ar"].output_tokens == 2 * 2 * 10 * 100
    assert list(cells.values()) == sorted(cells.values(), key=lambda c: -c.estimate_s)  # longest first


def test_serving_cells_cost_the_subset_vllm_serves():
    study = Recipe.model_validate({"name": "plan-test", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                                   "validation": {"workloads": ["gsm8k", "mbpp"], "budgets": [4, 8], "concurrency": [1],
                                                  "methods": ["ar", "dflash"], "backends": ["reference", "vllm"],
                                                  "num_prompts": 10, "max_tokens": 100},
                                   "serving": {"workloads": ["gsm8k"], "budgets": [8], "num_prompts": 2}})
    cells = {c.name: c for c in study_cells(study)}
    assert {n for n in cells if n.startswith("serve-")} == {f"serve-{p}-{m}" for p in ("bf16", "mxfp4")
                                                            for m in ("ar", "dflash-b8")}
    assert "score-mxfp4" in cells, "fidelity by the served kernels beside the reference backend's"
    assert cells["serve-bf16-ar"].output_tokens == 1 * 2 * 100  # one workload, two prompts
    assert cells["reference-bf16-mbpp"].output_tokens == 10 * 100  # the reference backend measures everything


def test_reference_cells_are_precision_by_workload_and_mxfp4_waits_for_bf16s_text():
    study = recipe(workloads=["gsm8k", "mbpp"], backends=["reference"], concurrency=[1], num_prompts=6, max_tokens=96)
    cells = {c.name: c for c in study_cells(study)}
    assert set(cells) == {f"reference-{p}-{w}" for p in ("bf16", "mxfp4") for w in ("gsm8k", "mbpp")}
    assert cells["reference-mxfp4-gsm8k"].after == ("reference-bf16-gsm8k",)
    assert cells["reference-bf16-gsm8k"].estimate_s == pytest.approx(6 * 96 / study.plan.reference_tok_s["bf16"])
    placed = {p.cell: p for p in schedule(list(cells.values()), nodes=1, gpus_per_node=4).placements}
    for workload in ("gsm8k", "mbpp"):
        assert placed[f"reference-mxfp4-{workload}"].start_s >= placed[f"reference-bf16-{workload}"].end_s


def test_a_vllm_only_study_replays_along_the_served_text_after_the_ar_servers():
    study = recipe(workloads=["gsm8k", "mbpp"], budgets=[4, 8], concurrency=[1], methods=["ar", "dflash"],
                   num_prompts=10, max_tokens=100)
    cells = {c.name: c for c in study_cells(study) if c.kind == "replay"}
    assert set(cells) == {f"replay-{p}-{w}" for p in ("bf16", "mxfp4") for w in ("gsm8k", "mbpp")}
    assert cells["replay-bf16-gsm8k"].after == ("serve-bf16-ar",)
    assert cells["replay-mxfp4-gsm8k"].after == ("serve-mxfp4-ar", "replay-bf16-gsm8k")
    assert cells["replay-mxfp4-gsm8k"].estimate_s == pytest.approx(10 * 100 / study.plan.replay_tok_s["mxfp4"])
    without_ar = recipe(workloads=["gsm8k"], budgets=[4], concurrency=[1], methods=["dflash"])
    assert not [c for c in study_cells(without_ar) if c.kind == "replay"], "no AR text to replay along"


def test_the_schedule_places_the_longest_cell_first_on_the_gpus_that_free_up_first():
    cells = [cell("e", 2), cell("c", 5), cell("a", 10), cell("d", 4), cell("b", 7)]  # any order in
    two = schedule(cells, nodes=1, gpus_per_node=2)
    # a on GPU 0 (0-10), b on GPU 1 (0-7), c after b (7-12), d after a (10-14), e after c (12-14)
    assert two.wall_s == 14
    assert schedule(cells, nodes=1, gpus_per_node=1).wall_s == 28
    assert schedule(cells, nodes=3, gpus_per_node=2).wall_s == 10  # the longest cell bounds any cluster


def test_a_tensor_parallel_server_takes_gpus_of_one_node():
    cells = [cell("wide", 10, gpus=2), cell("narrow", 3)]
    placed = {p.cell: p for p in schedule(cells, nodes=2, gpus_per_node=2).placements}
    assert len(placed["wide"].gpus) == 2 and placed["narrow"].node != placed["wide"].node
    wide = recipe(workloads=["gsm8k"], budgets=[4], methods=["dflash"]).model_copy(
        update={"serving": Recipe.model_fields["serving"].default.model_copy(update={"tensor_parallel_size": 4})})
    with pytest.raises(BadInputError, match="needs 4 GPUs .* a node has 2"):
        plan_study(wide, gpus_per_node=2)


def test_more_gpus_never_take_longer_and_the_totals_add_up():
    study = plan_study(load_recipe(RECIPES / "qwen3.5-27b-mxfp4.toml"), gpus_per_node=8, nodes=4)
    one, node, cluster = (s.wall_s for s in study.schedules)
    assert len(study.cells) == 14 + 1 + 10 and one == pytest.approx(study.total_s)  # 14 servers, score-mxfp4, 10 replays
    assert one > node >= cluster >= max(c.estimate_s for c in study.cells)


def test_the_recipe_names_a_rate_for_every_method_it_serves():
    with pytest.raises(ValueError, match=r"plan.tok_s.mtp: no rate"):
        Recipe.model_validate({"name": "r", "target": {"path": "/t"}, "drafter": {"path": "/d"},
                               "plan": {"tok_s": {"ar": 50.0, "dflash": 200.0}}})


@pytest.mark.parametrize("name, source", [("qwen3.5-27b", "bf16"), ("qwen3.5-35b-a3b", "bf16"), ("qwen3.5-9b", "bf16"),
                                          ("qwen3.5-122b-a10b", "bf16"), ("qwen3.5-397b-a17b", "fp8")])
def test_the_quantize_stage_is_estimated_from_the_targets_sizes_and_the_plan_rates(name, source):
    from pipeline.quant.memory import BF16_BYTES
    from pipeline.stages.preflight import memory_plan

    recipe = load_recipe(RECIPES / f"{name}-mxfp4.toml")
    memory = memory_plan(recipe)
    q = plan_study(recipe, memory=memory).quantize
    rates = recipe.plan
    assert q.source_format == source and q.source_bytes == memory.source_bytes and q.export_bytes == memory.mxfp4_bytes
    assert q.io_s == pytest.approx((q.source_bytes + q.export_bytes) / (rates.storage_gb_s * 1e9))
    assert q.encode_s == pytest.approx(q.encoded_weights * rates.encode_ns_per_weight[source] * 1e-9 / rates.quantize_cpus)
    assert q.estimate_s == pytest.approx(q.io_s + q.encode_s)
    # the encoder sees the quantized weights only: fewer than the model holds, more than half for a dense one
    assert 0 < q.encoded_weights < memory.source_bytes / (1 if source == "fp8" else BF16_BYTES)
    faster = recipe.model_copy(update={"plan": rates.model_copy(update={"quantize_cpus": 2 * rates.quantize_cpus})})
    assert plan_study(faster, memory=memory).quantize.encode_s == pytest.approx(q.encode_s / 2)


def test_cli_prints_cells_wall_times_and_writes_the_plan_as_json(mxspec, tmp_path):
    done = mxspec("plan", RECIPES / "qwen3.5-27b-mxfp4.toml", "--gpus", "8", "--nodes", "4", "--json", tmp_path / "plan.json")
    assert done.returncode == 0, done.stderr
    assert "serve-mxfp4-dflash-b16" in done.stdout and "wall time on 4 nodes x 8 GPUs" in done.stdout
    assert "replay-mxfp4-gsm8k" in done.stdout, "the same-text replay along vLLM's text is estimated too"
    assert "quantize: " in done.stdout and "bf16 55.6 GB -> MXFP4 19.8 GB" in done.stdout
    plan = StudyPlan.model_validate(json.loads((tmp_path / "plan.json").read_text()))
    assert 55.5e9 < plan.quantize.source_bytes < 55.7e9 and plan.quantize.estimate_s > 0
    assert [(s.nodes, s.gpus_per_node) for s in plan.schedules] == [(1, 1), (1, 8), (4, 8)]


def test_cli_refuses_a_cluster_without_gpus_in_one_line(mxspec):
    done = mxspec("plan", RECIPES / "qwen3.5-27b-mxfp4.toml", "--gpus", "0")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--gpus 0" in done.stderr


def test_cli_shows_each_kept_cells_measured_time_beside_its_estimate(mxspec, tmp_path):
    from pipeline.study.cells import TIMING_FILE, Measured

    cells = tmp_path / "run" / ".mxspec" / "cells"
    (cells / "serve-bf16-ar").mkdir(parents=True)
    (cells / "serve-bf16-ar" / TIMING_FILE).write_text(Measured(seconds=5400.0, where="node ab12cd34").model_dump_json())
    done = mxspec("plan", RECIPES / "qwen3.5-27b-mxfp4.toml", "--run", tmp_path / "run")
    assert done.returncode == 0, done.stderr
    rows = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 4}
    assert "1.5 h on node ab12cd34" in rows["serve-bf16-ar"] and rows["serve-mxfp4-ar"].rstrip("│ ").endswith("-")
    missing = mxspec("plan", RECIPES / "qwen3.5-27b-mxfp4.toml", "--run", tmp_path / "nothing")
    assert missing.returncode == 2 and "no validate cells there" in missing.stderr
