"""Where the speed went: speedup / served AL and the weight bandwidth a served row achieved."""

from __future__ import annotations

import pytest

from pipeline.report.markdown import speed_accounting_table
from pipeline.run.artifacts import ServedRow
from pipeline.study.served import speed_accounting, weight_bytes


def row(method: str, concurrency: int, speedup: float, al: float | None, precision: str = "mxfp4") -> ServedRow:
    return ServedRow(workload="gsm8k", precision=precision, method=method, budget=None if method == "ar" else 8,
                     concurrency=concurrency, num_prompts=4, output_tokens=1000, wall_s=10.0, throughput_tok_s=100.0,
                     latency_p50_s=2.0, latency_max_s=3.0, mean_acceptance_length=al,
                     per_position_acceptance=None if al is None else [0.5] * 7, num_drafts=0 if al is None else 100,
                     speedup=speedup)


def test_speedup_over_al_is_one_when_a_speculative_step_costs_an_ar_step():
    ar, dflash = speed_accounting([row("ar", 1, 1.0, None), row("dflash", 1, 4.0, 4.0)], {"mxfp4": 10**9}, None)
    assert ar.speedup_over_al is None and dflash.speedup_over_al == pytest.approx(1.0)
    (costly,) = speed_accounting([row("dflash", 1, 2.0, 4.0)], {"mxfp4": 10**9}, None)
    assert costly.speedup_over_al == pytest.approx(0.5)


def test_weight_bandwidth_is_checkpoint_bytes_times_target_steps_per_second():
    gb = 10**9
    (ar,) = speed_accounting([row("ar", 1, 1.0, None)], {"mxfp4": 2 * gb}, 8.0)
    assert ar.weight_bandwidth_gb_s == pytest.approx(2 * 1000 / 10.0)  # 1000 steps in 10 s, 2 GB each
    assert ar.bandwidth_share == pytest.approx(200 / 8000)
    (dflash,) = speed_accounting([row("dflash", 1, 3.0, 4.0)], {"mxfp4": 2 * gb}, None)
    assert dflash.weight_bandwidth_gb_s == pytest.approx(2 * 250 / 10.0) and dflash.bandwidth_share is None
    (batched,) = speed_accounting([row("ar", 32, 1.0, None)], {"mxfp4": 2 * gb}, None)
    assert batched.weight_bandwidth_gb_s == pytest.approx(2 * 1000 / 32 / 10.0)  # 32 sequences share a step
    (unknown,) = speed_accounting([row("ar", 1, 1.0, None, precision="bf16")], {"mxfp4": gb}, None)
    assert unknown.weight_bandwidth_gb_s is None


def test_weight_bytes_counts_the_weight_files_only(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes(tmp_path) == 500


def test_the_report_table_shows_each_accounted_row():
    rows = speed_accounting([row("ar", 1, 1.0, None), row("dflash", 1, 3.0, 4.0)], {"mxfp4": 10**9}, 8.0)
    text = "\n".join(speed_accounting_table(rows))
    assert "| gsm8k | mxfp4 | DFLASH B=8 | 1 | 3.00 | 4.000 | 0.75 | 25.0 | 0.3% |" in text
    assert speed_accounting_table([row("ar", 1, 1.0, None)]) == []


def test_the_serving_tables_say_when_vllm_served_a_subset_of_the_acceptance_prompts():
    from pipeline.report.markdown import served_subset_line
    from pipeline.run.artifacts import ReportSettings, ValidateReport

    settings = ReportSettings(workloads=["gsm8k", "mbpp"], precisions=["bf16", "mxfp4"], budgets=[8], num_prompts=4,
                              max_tokens=64, seed=0, prompt_source="packaged", prompt_sets={}, enforce_eager=True)
    report = ValidateReport(recipe="r", backend="reference", target="/t", drafter="/d", settings=settings, versions={},
                            cells=[], drift=[], serving=[row("ar", 1, 1.0, None).model_copy(update={"num_prompts": 3})])
    line = served_subset_line(report)
    assert line.startswith("vLLM served gsm8k, the first 3 of the 4 prompts per workload above. Servers ran eager")
    whole = report.model_copy(update={"serving": [row("ar", 1, 1.0, None).model_copy(update={"num_prompts": 4})]})
    assert served_subset_line(whole).startswith("vLLM served gsm8k, 4 prompts per workload.")
