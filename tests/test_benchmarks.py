"""Every benchmark script the docs cite starts from a fresh clone and runs end to end in a small mode.

The figures come from full-size runs (docs/benchmarks.md); these runs are small so that an import order,
a renamed function or a missing install step breaks a test, not the next person's benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def bench(script: str, *args: str, timeout: float = 900) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_bench_quantize_runs_every_flow_and_checks_the_export(tmp_path):
    out = bench("bench_quantize.py", "--out", tmp_path, "--layers", "1", "--hidden", "256", "--profile", "--jobs", "2")
    summary = json.loads((tmp_path / "results.json").read_text())
    assert set(summary["results"]) == {"plain_io", "quark_encode", "kernel_encode", "mxspec_file_to_file",
                                       "mxspec_file_to_file_quark_encoder", "quark_file_to_file",
                                       "quark_example_in_memory", "profile"}
    assert summary["encoder"] == "kernel" and summary["export"]["same_tensors_as_quark_flow"]
    assert summary["export"]["differing_tensors"] == [] and summary["export"]["bit_exact_tensors"] > 0
    assert "x plain I/O" in out and "encode, Quark: packing" in out
    fp8 = bench("bench_quantize.py", "--out", tmp_path, "--fp8", "--jobs", "2")  # the checkpoint above, converted
    summary = json.loads((tmp_path / "results-fp8.json").read_text())
    assert summary["source"] == "fp8" and summary["export"]["bit_exact_tensors"] > 0 and "(target <= 2.0)" in fp8


@pytest.mark.ray
def test_bench_executors_quantizes_with_both_encoders_here_and_on_ray(tmp_path):
    bench("bench_executors.py", "--out", tmp_path, "--skip-study", "--layers", "1", "--hidden", "256")
    results = json.loads((tmp_path / "results.json").read_text())["shards"]
    assert results["outputs_identical"] == {"kernel": True, "quark": True} and results["encoders_identical"]


def test_bench_replay_compares_replay_with_the_online_loop():
    out = bench("bench_replay.py", "--prompts", "1", "--max-tokens", "8", "--block-sizes", "4")
    assert "identical continuation: 1/1 runs; identical per-step acceptance: 1/1 runs" in out


def test_bench_serving_serves_the_reference_pair(tmp_path):
    """The MXFP4 half: its export from the recipe's stages and the CPU plugin's servers (the bf16 half runs
    the same lines on the recipe's own target)."""
    out = bench("bench_serving.py", "--prompts", "1", "--max-tokens", "8", "--precisions", "mxfp4",
                "--out", tmp_path / "run", timeout=1500)
    result = json.loads((tmp_path / "run" / "bench-serving.json").read_text())
    assert "| mxfp4 |" in out and [s["precision"] for s in result["summary"]] == ["mxfp4"]
    assert [p["precision"] for p in result["per_prompt"]] == ["mxfp4"] and result["mxfp4_lift"] is None
