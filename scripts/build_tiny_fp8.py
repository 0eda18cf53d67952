"""Build an FP8 block-scaled copy of a tiny bf16 Qwen3.5 checkpoint, in the layout of Qwen's FP8 releases.

Every Linear weight is stored as float8 e4m3 with a float32 `weight_scale_inv` per 128 x 128 tile
(`pipeline.checkpoints.fp8.quantize`: each tile's largest magnitude maps to 448), except the modules Qwen's FP8
releases keep in bf16 (their `modules_to_not_convert`: lm_head, embeddings, GDN conv1d / in_proj_a /
in_proj_b, MoE routers and shared-expert gates, the vision tower, mtp.fc). Fused expert tensors
`[E, rows, cols]` get `[E, rows/128, cols/128]` scales; the MTP head's per-expert weights get their own.
The config gains the releases' `quantization_config` (fp8, dynamic activations, block [128, 128]).

The weights go into two shards cut between one weight and its scale, so a reader must find a scale in
another shard (real checkpoints do this too). Written through a temp dir + rename.

Usage: python scripts/build_tiny_fp8.py SOURCE OUT
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pipeline.checkpoints import fp8  # noqa: E402
from pipeline.checkpoints.folder import copy_side_files, linear_modules, shard_files, write_index  # noqa: E402
from pipeline.run.atomic import atomic_directory  # noqa: E402

BLOCK = (128, 128)
# The modules Qwen/Qwen3.5-397B-A17B-FP8 keeps in bf16 (its config's modules_to_not_convert, as patterns).
NOT_CONVERTED = ["lm_head", "*embed_tokens", "*.linear_attn.conv1d", "*.linear_attn.in_proj_a",
                 "*.linear_attn.in_proj_b", "*.mlp.gate", "*.mlp.shared_expert_gate", "model.visual.*", "mtp.fc"]


def converted(name: str, shape: tuple[int, ...]) -> str | None:
    """The module a tensor is the FP8 weight of (a fused expert tensor counts as one), else None."""
    modules = linear_modules(name, shape)
    if not modules or any(fnmatch.fnmatchcase(module, p) for module in modules for p in NOT_CONVERTED):
        return None
    return name.removesuffix(".weight")


def to_fp8(source: Path, out: Path) -> None:
    state: dict[str, torch.Tensor] = {}
    for file in shard_files(source):
        state.update(load_file(source / file))
    tensors, kept = {}, set()
    for name, tensor in sorted(state.items()):
        module = converted(name, tuple(tensor.shape))
        if module is None:
            tensors[name] = tensor
            if any(fnmatch.fnmatchcase(name.removesuffix(".weight"), p) for p in NOT_CONVERTED):
                kept.add(name.removesuffix(".weight"))
            continue
        tensors[name], tensors[fp8.scale_name(name)] = fp8.quantize(tensor, BLOCK)
    names = sorted(tensors)
    # Cut after the first FP8 weight past the middle: its scale opens the second shard.
    cut = next(i + 1 for i in range(len(names) // 2, len(names)) if fp8.scale_name(names[i]) in tensors)
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    for file, members in shards.items():
        save_file({n: tensors[n].contiguous() for n in members}, out / file, metadata={"format": "pt"})
        (out / file).chmod(0o644)
    write_index(out, {n: file for file, members in shards.items() for n in members})
    copy_side_files(source, out, overwrite=True)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK), "modules_to_not_convert": sorted(kept)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "SOURCE.md").write_text(
        f"FP8 block-scaled copy of {source.name} built by scripts/build_tiny_fp8.py: e4m3 weights with a float32 "
        f"weight_scale_inv per {BLOCK[0]}x{BLOCK[1]} tile, Qwen's FP8 release layout. Random weights; not trained.\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    with atomic_directory(args.out) as tmp:
        to_fp8(args.source, tmp)
    print(f"built {args.out}")


if __name__ == "__main__":
    main()
