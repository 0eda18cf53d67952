"""File-to-file MXFP4 quantization that holds one tensor at a time, not one shard.

Quark's own file-to-file flow (`ModelQuantizer.direct_quantize_checkpoint`) loads a whole shard,
quantizes it and saves it: peak memory is a shard plus its output. Here each input shard is read
tensor by tensor from its memory map and the output shard is written as a stream: its safetensors
header is computed up front from the input header (MXFP4 shapes are known: `[out, in/2]` packed
codes and `[out, in/32]` e8m0 scales), then each tensor's bytes are appended as soon as Quark's
weight quantizer has produced them. The quantization itself is Quark's (the same per-weight routine
its file-to-file flow calls), and the config.json is written by Quark's own exporter, so both flows
produce the same bytes; the tests check that.

An FP8 block-scaled source (`pipeline.checkpoints.fp8`) is read through `CheckpointReader`, which hands each weight
over dequantized to float32, as Quark's FP8 flow does, one tensor (or one expert) at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.checkpoints.folder import (
    copy_side_files,
    expert_rows,
    export_name,
    shard_files,
    split_fused_experts,
    write_index,
)
from pipeline.checkpoints.reader import TORCH_DTYPES, CheckpointReader
from pipeline.checkpoints.writer import StreamingSafetensorsWriter
from pipeline.quant.mxfp4 import GROUP_SIZE

__all__ = ["quantize_shard", "quantize_file_to_file"]


def _plan_shard(header: dict[str, tuple[tuple[int, ...], str]], order: list[str], quantized: set[str]):
    """(output entries, work items) for one shard. A work item is (source name, expert, kind, out name)."""
    entries, work = [], []

    def add_weight(out_name: str, shape: tuple[int, ...], dtype: str, source: str, expert, kind) -> None:
        module = out_name.removesuffix(".weight")
        if module in quantized:
            rows, cols = shape
            entries.append((out_name, "U8", (rows, cols // 2)))
            entries.append((out_name + "_scale", "U8", (rows, cols // GROUP_SIZE)))
        else:
            entries.append((out_name, dtype, shape))
        work.append((source, expert, kind, out_name))

    for name in order:
        shape, dtype = header[name]
        pieces = split_fused_experts(name, shape)
        if pieces is not None:
            if not any(piece.module in quantized for piece in pieces):
                entries.append((name, dtype, shape))  # an excluded MoE block keeps its fused layout
                work.append((name, None, None, name))
                continue
            for piece in pieces:
                add_weight(piece.name, piece.shape, dtype, name, piece.expert, piece.kind)
        elif name.endswith(".weight") and len(shape) == 2:
            add_weight(name, shape, dtype, name, None, None)
        else:
            entries.append((name, dtype, shape))
            work.append((name, None, None, name))
    return entries, work


def quantize_shard(source: Path, out: Path, shard: str, weight_config, quantized_modules: set[str]) -> dict[str, str]:
    """Quantize one shard of `source` into out/shard, tensor by tensor; returns its part of the weight map."""
    from quark.torch.quantization.file2file_quantization import _single_stage_quantize_weight

    weight_map: dict[str, str] = {}
    config = json.loads((source / "config.json").read_text())
    with CheckpointReader(source, config) as reader:
        header = reader.listing(shard)
        order = sorted(header)  # deterministic output order
        entries, work = _plan_shard(header, order, quantized_modules)
        if not entries:
            return weight_map  # a shard of FP8 scales alone: its scales are read, nothing is written
        dtypes = {name: TORCH_DTYPES[dtype] for name, dtype, _ in entries}
        with StreamingSafetensorsWriter(out / shard, [(export_name(name, config), dtype, shape)
                                                       for name, dtype, shape in entries]) as writer:
            cached_key, cached = None, None  # one expert of a fused tensor feeds its gate and up work items
            for source_name, expert, kind, out_name in work:
                if (source_name, expert) != cached_key:
                    cached_key, cached = (source_name, expert), reader.get(source_name, expert)
                tensor = cached
                if expert is not None:
                    tensor = expert_rows(tensor, kind).contiguous()
                name = export_name(out_name, config)
                if out_name.removesuffix(".weight") in quantized_modules:
                    produced: dict[str, torch.Tensor] = {}
                    _single_stage_quantize_weight(tensor, out_name, out_name.removesuffix(".weight"),
                                                  weight_config, produced, shard)
                    writer.write(name, produced[out_name])
                    writer.write(name + "_scale", produced[out_name + "_scale"])
                    weight_map[name + "_scale"] = shard
                else:
                    writer.write(name, tensor.to(dtypes[out_name]))
                weight_map[name] = shard
    return weight_map


def quantize_file_to_file(source: Path, out: Path, quant_config, quantized_modules: set[str],
                          cluster=None) -> dict[str, str]:
    """Quantize every shard of `source` into `out`; returns the weight map. Peak memory: ~one tensor.

    With a Ray `cluster` ([cluster] executor = "ray"), each shard is a Ray task writing its output shard
    into `out`, which every node must see (shared storage); the bytes are the same as shard by shard here."""
    from quark.torch.quantization.file2file_quantization import _export_quant_config

    weight_config = quant_config.global_quant_config.weight
    shards = shard_files(source)
    jobs = [(source, out, shard, weight_config, quantized_modules) for shard in shards]
    if cluster is not None and cluster.executor == "ray":
        from pipeline.run.ray_session import map_on_ray

        parts = map_on_ray(cluster, quantize_shard, jobs, names=[f"quantize-{shard}" for shard in shards])
    else:
        parts = [quantize_shard(*job) for job in jobs]
    weight_map = {name: shard for part in parts for name, shard in part.items()}
    copy_side_files(source, out, overwrite=True)
    write_index(out, weight_map)
    _export_quant_config(json.loads((source / "config.json").read_text()), quant_config, str(out))
    return weight_map
