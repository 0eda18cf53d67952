"""Benchmark the quantize stage's file-to-file mode on a synthetic multi-shard Qwen3.5 checkpoint.

Builds a random-weight `qwen3_5_text` checkpoint of at least 2 GB in two shards, then measures, each
flow in its own process (peak RSS is that process's own, imports included):
  - plain I/O: read every shard and write the same bytes (the floor for any file-to-file tool);
  - Quark's encode time: its per-weight MXFP4 quantizer on tensors already in memory;
  - mxspec file-to-file (tensor-by-tensor streaming, pipeline/quant/file_to_file.py);
  - Quark's own file-to-file flow (`direct_quantize_checkpoint`, shard by shard);
  - Quark's example flow: load the whole model with transformers, quantize, freeze, export.
It prints the targets: mxspec peak RSS <= 1.5x the largest input shard, and mxspec wall time <=
1.3x (plain I/O + Quark encode). Results also go to OUT/results.json.

With --fp8 the checkpoint is converted to FP8 block-scaled (scripts/build_tiny_fp8.py, Qwen's FP8 release
layout) and only plain I/O and mxspec file-to-file run on it (Quark's own FP8 flow needs a CUDA device):
the same memory target, against the largest FP8 shard. Results go to OUT/results-fp8.json.

Usage: python scripts/bench_quantize.py [--out build/bench-quantize] [--layers 18] [--fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")


def config_dict(layers: int) -> dict:
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "attn_output_gate": True, "attention_bias": False,
        "full_attention_interval": 4, "layer_types": types, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_value_head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    }


def build_checkpoint(folder: Path, layers: int) -> None:
    """Random bf16 weights for every tensor of the model, streamed into two shards."""
    import torch
    import transformers

    from pipeline.checkpoints.writer import StreamingSafetensorsWriter

    config = config_dict(layers)
    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**config))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    names = sorted(shapes)
    half, acc, split = sum(_numel(s) for s in shapes.values()) / 2, 0, len(names)
    for i, name in enumerate(names):
        acc += _numel(shapes[name])
        if acc >= half:
            split = i + 1
            break
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for index, part in enumerate((names[:split], names[split:]), start=1):
        shard = f"model-{index:05d}-of-00002.safetensors"
        writer = StreamingSafetensorsWriter(folder / shard, [(n, "BF16", shapes[n]) for n in part])
        for name in part:
            writer.write(name, (torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16))
            weight_map[name] = shard
        writer.close()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


# --- workers: each runs in its own process and prints {"seconds", "peak_rss_bytes", ...} ---------
def work_plain_io(source: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for shard in sorted(source.glob("*.safetensors")):
        with open(shard, "rb") as src, open(out / shard.name, "wb") as dst:
            while chunk := src.read(64 << 20):
                dst.write(chunk)
    return {"seconds": time.perf_counter() - started}


def quark_config(scheme: str, patterns: list[str]):
    from quark.torch import LLMTemplate

    return LLMTemplate.get("qwen3_5").get_config(scheme=scheme, exclude_layers=patterns)


def _plan(source: Path):
    from pipeline.checkpoints.folder import read_checkpoint
    from pipeline.quant.exclusions import excluded_layers
    from pipeline.quant.export import plan_exclusions
    from pipeline.recipe import Quantization

    checkpoint = read_checkpoint(source)
    patterns = plan_exclusions(checkpoint, Quantization(scheme="mxfp4"))
    layers = checkpoint.linear_layers()
    return checkpoint, patterns, set(layers) - excluded_layers(layers, patterns)


def work_quark_encode(source: Path, out: Path) -> dict:
    """Quark's per-weight MXFP4 routine on each quantized weight, timed without any I/O."""
    from quark.torch.quantization.file2file_quantization import _single_stage_quantize_weight
    from safetensors import safe_open

    checkpoint, patterns, quantized = _plan(source)
    weight_config = quark_config("mxfp4", patterns).global_quant_config.weight
    seconds = 0.0
    for shard in sorted({f for _, _, f in checkpoint.tensors.values()}):
        with safe_open(source / shard, framework="pt") as handle:
            for name in handle.keys():
                module = name.removesuffix(".weight")
                if module in quantized and name.endswith(".weight"):
                    tensor = handle.get_tensor(name)
                    started = time.perf_counter()
                    _single_stage_quantize_weight(tensor, name, module, weight_config, {}, shard)
                    seconds += time.perf_counter() - started
    return {"seconds": seconds}


def work_mxspec_file_to_file(source: Path, out: Path) -> dict:
    from pipeline.quant.file_to_file import quantize_file_to_file

    _, patterns, quantized = _plan(source)
    config = quark_config("mxfp4", patterns)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    quantize_file_to_file(source, out, config, quantized)
    return {"seconds": time.perf_counter() - started}


def work_quark_file_to_file(source: Path, out: Path) -> dict:
    from quark.torch import ModelQuantizer

    _, patterns, _ = _plan(source)
    config = quark_config("mxfp4", patterns + ["*conv1d"])
    started = time.perf_counter()
    ModelQuantizer(config).direct_quantize_checkpoint(str(source), str(out), device="cpu")
    return {"seconds": time.perf_counter() - started}


def work_quark_example(source: Path, out: Path) -> dict:
    """Quark's documented flow: load the whole model, quantize, freeze, export."""
    import torch
    import transformers
    from quark.torch import ModelQuantizer, export_safetensors

    _, patterns, _ = _plan(source)
    started = time.perf_counter()
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    quantizer = ModelQuantizer(quark_config("mxfp4", patterns))
    model = quantizer.freeze(quantizer.quantize_model(model, None))
    export_safetensors(model, str(out), custom_mode="quark", weight_format="real_quantized", pack_method="reorder")
    return {"seconds": time.perf_counter() - started}


WORKERS = {
    "plain_io": work_plain_io,
    "quark_encode": work_quark_encode,
    "mxspec_file_to_file": work_mxspec_file_to_file,
    "quark_file_to_file": work_quark_file_to_file,
    "quark_example_in_memory": work_quark_example,
}


def run_worker(name: str, source: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--source", str(source), "--worker-out", str(out)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/bench-quantize"))
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--worker")
    parser.add_argument("--source", type=Path)
    parser.add_argument("--worker-out", type=Path)
    parser.add_argument("--fp8", action="store_true", help="measure file-to-file on an FP8 block-scaled source")
    args = parser.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args.source, args.worker_out)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(result))
        return

    source = args.out / "source"
    if not (source / "config.json").exists():
        print("building the synthetic checkpoint ...", flush=True)
        build_checkpoint(source, args.layers)
    workers = list(WORKERS)
    if args.fp8:
        from build_tiny_fp8 import to_fp8

        bf16, source = source, args.out / "source-fp8"
        if not (source / "config.json").exists():
            print("converting it to FP8 block-scaled ...", flush=True)
            shutil.rmtree(source, ignore_errors=True)
            source.mkdir(parents=True)
            to_fp8(bf16, source)
        workers = ["plain_io", "mxspec_file_to_file"]
    shards = sorted(source.glob("*.safetensors"))
    total, largest = sum(s.stat().st_size for s in shards), max(s.stat().st_size for s in shards)
    print(f"checkpoint: {len(shards)} shards, {total / 1e9:.2f} GB, largest shard {largest / 1e9:.2f} GB", flush=True)
    results = {}
    for name in workers:
        results[name] = run_worker(name, source, args.out / f"out-{name}")
        r = results[name]
        print(f"  {name:26s} {r['seconds']:8.1f} s   peak RSS {r['peak_rss_bytes'] / 1e9:5.2f} GB", flush=True)

    ours = results["mxspec_file_to_file"]
    summary = {
        "source": "fp8" if args.fp8 else "bf16",
        "checkpoint_bytes": total,
        "largest_shard_bytes": largest,
        "rss_ratio_to_largest_shard": ours["peak_rss_bytes"] / largest,
        "results": results,
    }
    print(f"\nmxspec file-to-file peak RSS / largest shard = {summary['rss_ratio_to_largest_shard']:.2f} (target <= 1.5)")
    if not args.fp8:
        floor = results["plain_io"]["seconds"] + results["quark_encode"]["seconds"]
        summary["time_ratio_to_io_plus_encode"] = ours["seconds"] / floor
        print(f"mxspec file-to-file time / (plain I/O + Quark encode) = {summary['time_ratio_to_io_plus_encode']:.2f} "
              "(target <= 1.3)")
    print("\n| flow | wall time (s) | peak RSS (GB) |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['seconds']:.1f} | {r['peak_rss_bytes'] / 1e9:.2f} |")
    (args.out / ("results-fp8.json" if args.fp8 else "results.json")).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
