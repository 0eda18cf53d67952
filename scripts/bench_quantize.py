"""Benchmark the quantize stage's file-to-file mode on a synthetic two-shard Qwen3.5 checkpoint.

Builds a random-weight `qwen3_5_text` checkpoint (2.07 GB in two shards at the default 18 layers), then
measures, each flow in its own process (peak RSS is that process's own, imports included):
  - plain I/O: read every shard and write the same bytes (the floor for any file-to-file tool);
  - encoding alone, on weights already in memory: Quark's per-weight routine, and mxspec's kernel;
  - mxspec file-to-file (pipeline/quant/file_to_file.py) with its default encoder (auto, here the
    kernel proven bit-identical to Quark by pipeline/quant/proof.py), and with encoder = "quark";
  - Quark's own file-to-file flow (`direct_quantize_checkpoint`, shard by shard);
  - Quark's example flow: load the whole model with transformers, quantize, freeze, export.
Then it checks that mxspec's export holds the bytes of Quark's own flow and passes the export's
verification (every quantized tensor against pipeline/quant/mxfp4.py), and prints the targets: mxspec
at most 1.5x plain I/O, faster than Quark's own flow, peak RSS at most 1.5x the largest shard.
`--profile` adds where the time of one shard goes, phase by phase.

With --fp8 the checkpoint is converted to FP8 block-scaled (scripts/build_tiny_fp8.py, Qwen's FP8 release
layout) and plain I/O and mxspec file-to-file run on it (Quark's own FP8 flow needs a CUDA device); the
target there is at most 2x plain I/O. The kernel's proof is made (or found in the cache) before any
timed run and is not counted. Results go to OUT/results.json (OUT/results-fp8.json).

Usage: python scripts/bench_quantize.py [--out build/bench-quantize] [--layers 18] [--hidden 2048] [--fp8]
                                        [--profile] [--jobs 1]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
import pipeline  # noqa: E402,F401  (before Quark: installs the torchvision compat that Quark's imports need)

ROOT = Path(__file__).resolve().parents[1]


def config_dict(layers: int, hidden: int = 2048) -> dict:
    types = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": hidden,
        "intermediate_size": 3 * hidden, "num_hidden_layers": layers, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 128, "attn_output_gate": True, "attention_bias": False,
        "full_attention_interval": 4, "layer_types": types, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_value_head_dim": 128, "vocab_size": 1024, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    }


def build_checkpoint(folder: Path, layers: int, hidden: int = 2048) -> None:
    """Random bf16 weights for every tensor of the model, streamed into two shards."""
    import torch
    import transformers

    from pipeline.checkpoints.writer import StreamingSafetensorsWriter

    config = config_dict(layers, hidden)
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


def _plan(source: Path):
    """(checkpoint, exclude patterns, quantized modules, Quark config) as the quantize stage makes them."""
    from pipeline.checkpoints.folder import read_checkpoint
    from pipeline.quant.exclusions import excluded_layers
    from pipeline.quant.export import plan_exclusions
    from pipeline.quant.quark import quark_config
    from pipeline.recipe import Quantization

    checkpoint = read_checkpoint(source)
    patterns = plan_exclusions(checkpoint, Quantization(scheme="mxfp4"))
    layers = checkpoint.linear_layers()
    return checkpoint, patterns, set(layers) - excluded_layers(layers, patterns), quark_config("qwen3_5", "mxfp4", patterns)


def _quantized_weights(source: Path, quantized: set[str]):
    """(name, tensor) of every weight the export quantizes, as the encoder receives it (FP8 dequantized)."""
    import json as json_

    from pipeline.checkpoints.reader import CheckpointReader

    with CheckpointReader(source, json_.loads((source / "config.json").read_text())) as reader:
        for name in sorted(reader.listing()):
            if name.removesuffix(".weight") in quantized:
                yield name, reader.get(name)


def _encode_alone(source: Path, encoder_name: str) -> dict:
    from pipeline.quant.encoder import KernelEncoder, QuarkEncoder

    _, _, quantized, config = _plan(source)
    encoder = KernelEncoder() if encoder_name == "kernel" else QuarkEncoder(config.global_quant_config.weight)
    seconds = 0.0
    for name, tensor in _quantized_weights(source, quantized):
        started = time.perf_counter()
        encoder.encode(tensor, name)
        seconds += time.perf_counter() - started
    return {"seconds": seconds}


def work_quark_encode(source: Path, out: Path) -> dict:
    """Quark's per-weight MXFP4 routine on each quantized weight, one at a time, timed without any I/O."""
    return _encode_alone(source, "quark")


def work_kernel_encode(source: Path, out: Path) -> dict:
    """mxspec's kernel on each quantized weight, one thread, timed without any I/O."""
    return _encode_alone(source, "kernel")


def _mxspec(source: Path, out: Path, encoder: str) -> dict:
    from pipeline.quant.file_to_file import quantize_file_to_file

    _, _, quantized, config = _plan(source)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    choice = quantize_file_to_file(source, out, config, quantized, encoder=encoder)
    return {"seconds": time.perf_counter() - started, "encoder": choice.name}


def work_mxspec_file_to_file(source: Path, out: Path) -> dict:
    return _mxspec(source, out, "auto")


def work_mxspec_file_to_file_quark_encoder(source: Path, out: Path) -> dict:
    return _mxspec(source, out, "quark")


def work_quark_file_to_file(source: Path, out: Path) -> dict:
    from pipeline.quant.quark import import_quark, quark_config

    _, patterns, _, _ = _plan(source)
    config = quark_config("qwen3_5", "mxfp4", patterns + ["*conv1d"])
    started = time.perf_counter()
    import_quark().ModelQuantizer(config).direct_quantize_checkpoint(str(source), str(out), device="cpu")
    return {"seconds": time.perf_counter() - started}


def work_quark_example(source: Path, out: Path) -> dict:
    """Quark's documented flow: load the whole model, quantize, freeze, export."""
    import torch
    import transformers

    from pipeline.quant.quark import import_quark

    quark_torch = import_quark()
    _, _, _, config = _plan(source)
    started = time.perf_counter()
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    quantizer = quark_torch.ModelQuantizer(config)
    model = quantizer.freeze(quantizer.quantize_model(model, None))
    quark_torch.export_safetensors(model, str(out), custom_mode="quark", weight_format="real_quantized",
                                   pack_method="reorder")
    return {"seconds": time.perf_counter() - started}


def work_profile(source: Path, out: Path) -> dict:
    """Where the time of the first shard goes, one phase at a time on one thread: read (pread), FP8
    dequantize, encode with the kernel, encode with Quark's routine (its steps timed one by one, as
    `_single_stage_quantize_weight` runs them: observer, rounding, packing, scale bytes), write."""
    import quark.torch.kernel as quark_kernel
    from quark.torch.quantization.file2file_quantization import FakeQuantizeBase
    from quark.torch.quantization.file2file_quantization import create_pack_method as pack_for
    from quark.torch.utils.numerics import to_e8m0_uint8

    from pipeline.checkpoints import fp8
    from pipeline.checkpoints.folder import shard_files
    from pipeline.checkpoints.reader import CheckpointReader
    from pipeline.quant.encoder import KernelEncoder

    _, _, quantized, config = _plan(source)
    weight_config = config.global_quant_config.weight
    shard = shard_files(source)[0]
    phases: dict[str, float] = {}

    def timed(phase: str, fn):
        started = time.perf_counter()
        result = fn()
        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - started
        return result

    def quark_steps(weight):
        quantizer = FakeQuantizeBase.get_fake_quantize(weight_config)
        quantizer.enable_observer()
        quantizer.disable_fake_quant()
        timed("encode, Quark: observer (amax, even_round)", lambda: quantizer(weight))
        rounded = timed("encode, Quark: rounding (scaled_real_quantize)", lambda: quark_kernel.scaled_real_quantize(
            weight_config.dtype.value, weight, quantizer.scale, quantizer.zero_point, weight_config.ch_axis,
            weight_config.group_size, quantizer.quant_min, quantizer.quant_max, weight_config.round_method.value,
            weight_config.qscheme.value))
        pack = pack_for(qscheme=weight_config.qscheme.value, dtype=weight_config.dtype.value)
        timed("encode, Quark: packing (Pack_fp4.pack)", lambda: pack.pack(rounded, False))
        timed("encode, Quark: scale bytes (to_e8m0_uint8)", lambda: to_e8m0_uint8(quantizer.scale))

    out.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(source, json.loads((source / "config.json").read_text())) as reader:
        names = sorted(n for n in reader.listing(shard) if n.removesuffix(".weight") in quantized)
        raw = {n: timed("read", lambda n=n: reader.fp8_parts(n) if reader.is_fp8(n) else (reader.shards[shard].get(n),))
               for n in names}
        weights = {n: timed("FP8 dequantize", lambda p=p: fp8.dequantize(*p, reader.block)) if len(p) == 2 else p[0]
                   for n, p in raw.items()}
        kernel = KernelEncoder()
        outputs = [timed("encode, mxspec kernel", lambda w=w: kernel.encode(w)) for w in weights.values()]
        for weight in weights.values():
            quark_steps(weight)
    with open(out / "scratch.bin", "wb") as handle:
        for packed, scales in outputs:
            timed("write", lambda p=packed, s=scales: (handle.write(p.numpy().data), handle.write(s.numpy().data)))
        timed("write", handle.flush)
    return {"seconds": sum(phases.values()), "shard": shard, "elements": sum(w.numel() for w in weights.values()),
            "phases": phases}


WORKERS = {
    "plain_io": work_plain_io,
    "quark_encode": work_quark_encode,
    "kernel_encode": work_kernel_encode,
    "mxspec_file_to_file": work_mxspec_file_to_file,
    "mxspec_file_to_file_quark_encoder": work_mxspec_file_to_file_quark_encoder,
    "quark_file_to_file": work_quark_file_to_file,
    "quark_example_in_memory": work_quark_example,
    "profile": work_profile,
}
FP8_WORKERS = ["plain_io", "quark_encode", "kernel_encode", "mxspec_file_to_file", "mxspec_file_to_file_quark_encoder"]
KEPT = {"mxspec_file_to_file", "quark_file_to_file"}  # compared after the timings


def run_worker(name: str, source: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--source", str(source), "--worker-out", str(out)],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if name not in KEPT:
        shutil.rmtree(out, ignore_errors=True)
    return result


def prove(source: Path) -> str:
    """The kernel's proof for this checkpoint's inputs (made now, or read from the cache), untimed."""
    from pipeline.quant.admission import choose_encoder
    from pipeline.quant.file_to_file import encoder_input_dtypes

    _, _, quantized, config = _plan(source)
    dtypes = encoder_input_dtypes(source, json.loads((source / "config.json").read_text()), quantized)
    choice = choose_encoder("auto", dtypes, config.global_quant_config.weight)
    return f"{choice.name}: {choice.proof or choice.reason}"


def check_export(source: Path, ours: Path, quarks: Path | None) -> dict:
    """mxspec's export against Quark's own flow's (every tensor, byte for byte) and the export verification."""
    from safetensors import safe_open

    from pipeline.checkpoints.folder import read_checkpoint
    from pipeline.quant.verify import verify_export

    checkpoint, patterns, _, _ = _plan(source)
    verification = verify_export(checkpoint, ours, patterns)
    result = {"bit_exact_tensors": verification["bit_exact_tensors"]}
    if quarks is not None:
        def tensors(folder: Path) -> dict:
            found = {}
            for name, (_, _, file) in read_checkpoint(folder).tensors.items():
                with safe_open(folder / file, framework="pt") as handle:
                    found[name] = handle.get_tensor(name).contiguous().view(-1).view(__import__("torch").uint8)
            return found

        mine, theirs = tensors(ours), tensors(quarks)
        result["same_tensors_as_quark_flow"] = sorted(mine) == sorted(theirs)
        result["differing_tensors"] = sorted(n for n in mine if n in theirs and not mine[n].equal(theirs[n]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/bench-quantize"))
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (a smaller one for a quick run)")
    parser.add_argument("--fp8", action="store_true", help="measure file-to-file on an FP8 block-scaled source")
    parser.add_argument("--profile", action="store_true", help="also profile one shard phase by phase")
    parser.add_argument("--skip-example", action="store_true", help="leave out Quark's whole-model example flow")
    parser.add_argument("--jobs", type=int, default=1,
                        help="flows run this many at a time: a quick check that each one runs (times are then not figures)")
    parser.add_argument("--worker")
    parser.add_argument("--source", type=Path)
    parser.add_argument("--worker-out", type=Path)
    args = parser.parse_args()
    if args.worker:
        result = WORKERS[args.worker](args.source, args.worker_out)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(result))
        return

    source = args.out / "source"
    if not (source / "config.json").exists():
        print("building the synthetic checkpoint ...", flush=True)
        build_checkpoint(source, args.layers, args.hidden)
    workers = [w for w in WORKERS if w != "profile" and not (args.skip_example and w == "quark_example_in_memory")]
    if args.fp8:
        bf16, source = source, args.out / "source-fp8"
        if not (source / "config.json").exists():
            print("converting it to FP8 block-scaled ...", flush=True)
            shutil.rmtree(source, ignore_errors=True)
            subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_fp8.py"), str(bf16), str(source)],
                           check=True, stdout=subprocess.DEVNULL)
        workers = FP8_WORKERS
    if args.profile:
        workers.append("profile")
    shards = sorted(source.glob("*.safetensors"))
    total, largest = sum(s.stat().st_size for s in shards), max(s.stat().st_size for s in shards)
    print(f"checkpoint: {len(shards)} shards, {total / 1e9:.2f} GB, largest shard {largest / 1e9:.2f} GB", flush=True)
    print(f"encoder: {prove(source)}", flush=True)
    if args.jobs > 1:
        print(f"{args.jobs} flows at a time: the times below are not benchmark figures", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = dict(zip(workers, pool.map(lambda name: run_worker(name, source, args.out / f"out-{name}"), workers)))
    for name, r in results.items():
        print(f"  {name:34s} {r['seconds']:8.2f} s   peak RSS {r['peak_rss_bytes'] / 1e9:5.2f} GB", flush=True)

    ours, floor = results["mxspec_file_to_file"], results["plain_io"]["seconds"]
    quark_flow = results.get("quark_file_to_file")
    summary = {
        "source": "fp8" if args.fp8 else "bf16",
        "jobs": args.jobs,
        "checkpoint_bytes": total,
        "largest_shard_bytes": largest,
        "encoder": ours.get("encoder"),
        "time_ratio_to_plain_io": ours["seconds"] / floor,
        "rss_ratio_to_largest_shard": ours["peak_rss_bytes"] / largest,
        "export": check_export(source, args.out / "out-mxspec_file_to_file",
                               args.out / "out-quark_file_to_file" if quark_flow else None),
        "results": results,
    }
    limit = 2.0 if args.fp8 else 1.5
    print(f"\nmxspec file-to-file ({summary['encoder']} encoder) / plain I/O = {summary['time_ratio_to_plain_io']:.2f} "
          f"(target <= {limit})")
    if quark_flow:
        summary["speedup_over_quark_flow"] = quark_flow["seconds"] / ours["seconds"]
        print(f"Quark's own file-to-file flow / mxspec file-to-file = {summary['speedup_over_quark_flow']:.2f} (target > 1)")
    print(f"mxspec file-to-file peak RSS / largest shard = {summary['rss_ratio_to_largest_shard']:.2f} (target <= 1.5)")
    export = summary["export"]
    print(f"export verification: {export['bit_exact_tensors']} tensors bit-exact against pipeline/quant/mxfp4.py"
          + (f"; same bytes as Quark's own flow: {export['same_tensors_as_quark_flow'] and not export['differing_tensors']}"
             if quark_flow else ""))
    print("\n| flow | wall time (s) | x plain I/O | peak RSS (GB) |\n|---|---|---|---|")
    for name, r in results.items():
        if name != "profile":
            print(f"| {name} | {r['seconds']:.2f} | {r['seconds'] / floor:.2f} | {r['peak_rss_bytes'] / 1e9:.2f} |")
    if "profile" in results:
        profile = results["profile"]
        print(f"\nprofile of {profile['shard']} ({profile['elements'] / 1e6:.0f}M quantized elements), one thread:")
        print("| phase | seconds | ns per element |\n|---|---|---|")
        for phase, seconds in profile["phases"].items():
            print(f"| {phase} | {seconds:.2f} | {seconds / profile['elements'] * 1e9:.2f} |")
    for name in KEPT:
        shutil.rmtree(args.out / f"out-{name}", ignore_errors=True)
    (args.out / ("results-fp8.json" if args.fp8 else "results.json")).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
