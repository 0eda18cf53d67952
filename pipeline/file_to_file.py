"""File-to-file MXFP4 quantization that holds one tensor at a time, not one shard.

Quark's own file-to-file flow (`ModelQuantizer.direct_quantize_checkpoint`) loads a whole shard,
quantizes it and saves it: peak memory is a shard plus its output. Here each input shard is read
tensor by tensor from its memory map and the output shard is written as a stream: its safetensors
header is computed up front from the input header (MXFP4 shapes are known: `[out, in/2]` packed
codes and `[out, in/32]` e8m0 scales), then each tensor's bytes are appended as soon as Quark's
weight quantizer has produced them. The quantization itself is Quark's (the same per-weight routine
its file-to-file flow calls), and the config.json is written by Quark's own exporter, so both flows
produce the same bytes; the tests check that.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from pipeline.checkpoint import (
    copy_side_files,
    expert_slice,
    shard_files,
    split_fused_experts,
    write_index,
)
from pipeline.mxfp4 import GROUP_SIZE

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "F64": 8, "BOOL": 1}
_TORCH_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8",
                torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.float64: "F64", torch.bool: "BOOL"}
_TORCH_DTYPES = {name: dtype for dtype, name in _TORCH_NAMES.items()}


class ShardReader:
    """Read one tensor of a safetensors file at a time with pread.

    Not a memory map: mapped pages of the whole shard would count in the process's resident memory
    as they are touched, which is exactly what file-to-file mode avoids.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.header = header
        self.fd = os.open(self.path, os.O_RDONLY)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def get(self, name: str) -> torch.Tensor:
        begin, end = self.header[name]["data_offsets"]
        buffer = bytearray(end - begin)
        if os.preadv(self.fd, [buffer], self.data_start + begin) != len(buffer):
            raise OSError(f"{self.path}: short read of {name}")
        return torch.frombuffer(buffer, dtype=_TORCH_DTYPES[self.dtype(name)]).view(self.shape(name))

    def close(self) -> None:
        os.close(self.fd)


class StreamingSafetensorsWriter:
    """Write a safetensors file whose tensor list is known in advance, one tensor at a time."""

    def __init__(self, path: Path, entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict | None = None):
        self.path = Path(path)
        self.expected = [(name, dtype, shape) for name, dtype, shape in entries]
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name, dtype, shape in self.expected:
            size = _DTYPE_BYTES[dtype]
            for dim in shape:
                size *= dim
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.handle = open(self.path, "wb")
        self.handle.write(struct.pack("<Q", len(raw)) + raw)
        self.position = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self.expected[self.position]
        got = (name, _TORCH_NAMES[tensor.dtype], tuple(tensor.shape))
        if got != (expected_name, dtype, tuple(shape)):
            raise RuntimeError(f"streaming writer expected {(expected_name, dtype, tuple(shape))}, got {got}")
        self.handle.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        self.position += 1

    def close(self) -> None:
        self.handle.close()
        if self.position != len(self.expected):
            raise RuntimeError(f"{self.path}: wrote {self.position} of {len(self.expected)} tensors")


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
    handle = ShardReader(source / shard)
    try:
        header = {name: (handle.shape(name), handle.dtype(name)) for name in handle.header}
        order = sorted(header)  # deterministic output order
        entries, work = _plan_shard(header, order, quantized_modules)
        writer = StreamingSafetensorsWriter(out / shard, entries)
        cached_name, cached = None, None  # a fused expert tensor feeds many work items
        for source_name, expert, kind, out_name in work:
            if source_name != cached_name:
                cached_name, cached = source_name, handle.get(source_name)
            tensor = cached
            if expert is not None:
                tensor = expert_slice(tensor, expert, kind).contiguous()
            if out_name.removesuffix(".weight") in quantized_modules:
                produced: dict[str, torch.Tensor] = {}
                _single_stage_quantize_weight(tensor, out_name, out_name.removesuffix(".weight"),
                                              weight_config, produced, shard)
                writer.write(out_name, produced[out_name])
                writer.write(out_name + "_scale", produced[out_name + "_scale"])
                weight_map[out_name + "_scale"] = shard
            else:
                writer.write(out_name, tensor)
            weight_map[out_name] = shard
        writer.close()
    finally:
        handle.close()
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
        from pipeline.ray_cells import map_on_ray

        parts = map_on_ray(cluster, quantize_shard, jobs, names=[f"quantize-{shard}" for shard in shards])
    else:
        parts = [quantize_shard(*job) for job in jobs]
    weight_map = {name: shard for part in parts for name, shard in part.items()}
    copy_side_files(source, out, overwrite=True)
    write_index(out, weight_map)
    _export_quant_config(json.loads((source / "config.json").read_text()), quant_config, str(out))
    return weight_map
