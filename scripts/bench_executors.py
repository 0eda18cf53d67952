"""Benchmark the executors: validate's cells and file-to-file quantization, here vs on Ray.

Measured side by side in one run, on this machine:
  1. the reference study (recipes/reference-cpu.toml, reference backend: one cell per precision and
     workload) through validate with the local executor, then with Ray on a local cluster of 2 CPU
     workers (`mxspec run ... --executor ray`, each in its own process, Ray's start-up included);
     the two reports must be byte-identical;
  2. file-to-file quantization of the 2-shard benchmark checkpoint (scripts/bench_quantize.py builds
     it) with each encoder (the proven kernel, Quark's routine) shard by shard here, and as one Ray task
     per shard on 2 workers; all four outputs must be identical;
     the peak RSS of each worker that quantized a shard (VmHWM, imports included) against the largest shard;
and, from the recipe alone, the planner's estimate of the MI355X study (recipes/qwen3.5-27b-mxfp4.toml)
on 1 GPU, one 8-GPU node and 4 x 8 GPUs. Prints a Markdown table and writes OUT/results.json.

Usage: python scripts/bench_executors.py [--out build/bench-executors] [--prompts N] [--layers 18] [--hidden 2048]
                                         [--skip-study]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")


def study_recipe(out: Path, prompts: int | None) -> Path:
    """The reference recipe with its model paths made absolute (and fewer prompts, if asked)."""
    text = (ROOT / "recipes" / "reference-cpu.toml").read_text().replace('path = "../', f'path = "{ROOT}/')
    text = text.replace('backends = ["reference", "vllm"]', 'backends = ["reference"]')  # the reference study alone
    assert 'backends = ["reference"]' in text, "recipes/reference-cpu.toml changed its backends line"
    if prompts is not None:
        text = "\n".join(f"num_prompts = {prompts}" if line.startswith("num_prompts") else line for line in text.splitlines())
    path = out / "reference-cpu.toml"
    path.write_text(text + "\n")
    return path


def mxspec(*args: str) -> float:
    """Wall seconds of one `mxspec` command in its own process; fails loudly."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from pipeline.cli import main; main()", *args], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"mxspec {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def bench_study(out: Path, prompts: int | None) -> dict:
    recipe = study_recipe(out, prompts)
    prepared = out / "prepared"
    if not (prepared / "pair").is_dir():
        print("preparing the reference pair (resolve, quantize, pair) ...", flush=True)
        mxspec("run", str(recipe), "--out", str(prepared), "--until", "pair")
    seconds = {}
    for executor in ("local", "ray"):
        run = out / f"study-{executor}"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(prepared, run, ignore=shutil.ignore_patterns("validate", "gate", "publish", "cells", "logs", "lock"))
        print(f"validate, {executor} executor ...", flush=True)
        seconds[executor] = mxspec("run", str(recipe), "--out", str(run), "--until", "validate", "--executor", executor)
        print(f"  {seconds[executor]:.1f} s", flush=True)
    same = (out / "study-local/validate/report.json").read_bytes() == (out / "study-ray/validate/report.json").read_bytes()
    cells = len(list((out / "study-local/.mxspec/cells").glob("*/cell.json")))
    return {"cells": cells, "seconds": seconds, "reports_identical": same}


def bench_shards(out: Path, layers: int, hidden: int = 2048) -> dict:
    from bench_quantize import build_checkpoint

    from pipeline.checkpoints.folder import read_checkpoint
    from pipeline.quant.exclusions import excluded_layers
    from pipeline.quant.export import plan_exclusions
    from pipeline.quant.file_to_file import quantize_file_to_file
    from pipeline.quant.quark import quark_config
    from pipeline.recipe import Cluster, Quantization
    from pipeline.run.ray_session import ray_session

    source = out / "checkpoint"
    if not (source / "config.json").exists():
        print("building the 2-shard benchmark checkpoint ...", flush=True)
        build_checkpoint(source, layers, hidden)
    checkpoint = read_checkpoint(source)
    patterns = plan_exclusions(checkpoint, Quantization())
    layers_ = checkpoint.linear_layers()
    quantized = set(layers_) - excluded_layers(layers_, patterns)
    config = quark_config("qwen3_5", "mxfp4", patterns)
    shards = len(list(source.glob("*.safetensors")))
    seconds, identical, peaks = {}, {}, []
    for encoder in ("kernel", "quark"):
        for where in ("local", "ray"):
            target = out / f"quantized-{encoder}-{where}"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            cluster = Cluster(executor="ray", cpus_per_cell=1) if where == "ray" else None
            print(f"file-to-file, {encoder} encoder, {where} ...", flush=True)
            started = time.perf_counter()
            if cluster is None:
                quantize_file_to_file(source, target, config, quantized, encoder=encoder)
            else:
                with ray_session(cluster), PeakRss("ray::quantize-") as workers:  # Ray's start-up counted
                    quantize_file_to_file(source, target, config, quantized, cluster, encoder=encoder)
                peaks += workers.peaks.values()
            seconds[f"{encoder}, {where}"] = time.perf_counter() - started
            print(f"  {seconds[f'{encoder}, {where}']:.1f} s", flush=True)
        names = sorted(p.name for p in (out / f"quantized-{encoder}-local").iterdir())
        _, mismatch, errors = filecmp.cmpfiles(out / f"quantized-{encoder}-local", out / f"quantized-{encoder}-ray",
                                               names, shallow=False)
        identical[encoder] = not mismatch and not errors
    _, mismatch, errors = filecmp.cmpfiles(out / "quantized-kernel-local", out / "quantized-quark-local", names,
                                           shallow=False)
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    largest = max(p.stat().st_size for p in source.glob("*.safetensors"))
    return {"shards": shards, "checkpoint_bytes": size, "largest_shard_bytes": largest, "seconds": seconds,
            "outputs_identical": identical, "encoders_identical": not mismatch and not errors,
            "worker_peak_rss_bytes": sorted(peaks)}


class PeakRss:
    """The peak resident memory (VmHWM) of every process that ran a Ray task whose name starts with
    `prefix`, read from /proc while they live (Ray renames a worker `ray::<task name>` while it runs one)."""

    def __init__(self, prefix: str):
        self.prefix, self.peaks, self.stop = prefix, {}, threading.Event()

    def __enter__(self) -> PeakRss:
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    title = cmdline.read_bytes().split(b"\0")[0].decode(errors="replace")
                    if title.startswith(self.prefix) or cmdline.parent.name in self.peaks:
                        status = (cmdline.parent / "status").read_text()
                        hwm = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) * 1024
                        self.peaks[cmdline.parent.name] = max(hwm, self.peaks.get(cmdline.parent.name, 0))
                except (OSError, StopIteration, ValueError):
                    continue


def planner() -> dict:
    from pipeline.recipe import load_recipe
    from pipeline.study.plan import plan_study

    plan = plan_study(load_recipe(ROOT / "recipes" / "qwen3.5-27b-mxfp4.toml"), gpus_per_node=8, nodes=4)
    return {"cells": len(plan.cells), "hours": {f"{s.nodes} x {s.gpus_per_node} GPUs": s.wall_s / 3600 for s in plan.schedules}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench-executors")
    parser.add_argument("--prompts", type=int, help="prompts per workload (default: the recipe's)")
    parser.add_argument("--layers", type=int, default=18, help="layers of the benchmark checkpoint (18: about 2 GB)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the benchmark checkpoint")
    parser.add_argument("--skip-study", action="store_true", help="only the quantization and the planner")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from pipeline.run.versions import tool_versions

    results = {"cpus": os.cpu_count(), "versions": tool_versions(),
               "study": None if args.skip_study else bench_study(args.out.resolve(), args.prompts),
               "shards": bench_shards(args.out.resolve(), args.layers, args.hidden), "planner": planner()}
    study, shards, plan = results["study"], results["shards"], results["planner"]
    print(f"\n{os.cpu_count()} CPUs; measured in one run:\n")
    print("| work | local | Ray, 2 workers | same output |\n|---|---|---|---|")
    if study is not None:
        print(f"| reference study, validate ({study['cells']} cells) | {study['seconds']['local']:.0f} s | "
              f"{study['seconds']['ray']:.0f} s | {'yes' if study['reports_identical'] else 'NO'} |")
    for encoder, same in shards["outputs_identical"].items():
        print(f"| file-to-file, {encoder} encoder, {shards['shards']} shards, {shards['checkpoint_bytes'] / 1e9:.2f} GB | "
              f"{shards['seconds'][f'{encoder}, local']:.1f} s | {shards['seconds'][f'{encoder}, ray']:.1f} s | "
              f"{'yes' if same else 'NO'} |")
    print(f"\nthe kernel's export and Quark's encoder's are {'identical' if shards['encoders_identical'] else 'NOT identical'}")
    peaks = shards["worker_peak_rss_bytes"]
    print(f"\npeak RSS of the Ray workers that quantized a shard: "
          f"{', '.join(f'{b / 1e9:.2f} GB' for b in peaks) or 'not seen'}; largest shard {shards['largest_shard_bytes'] / 1e9:.2f} GB"
          + (f"; ratio {max(peaks) / shards['largest_shard_bytes']:.2f} (target <= 1.5)" if peaks else ""))
    print(f"\nplanner, Qwen3.5-27B MI355X study ({plan['cells']} cells; estimates from the recipe's [plan] rates):")
    for where, hours in plan["hours"].items():
        print(f"  {where}: {hours:.1f} h")
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
