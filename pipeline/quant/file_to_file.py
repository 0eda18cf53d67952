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
import os
import struct
from pathlib import Path

import torch

from pipeline.checkpoints import fp8
from pipeline.checkpoints.folder import (
    copy_side_files,
    expert_rows,
    export_name,
    shard_files,
    split_fused_experts,
    write_index,
)
from pipeline.errors import BadInputError
from pipeline.quant.mxfp4 import GROUP_SIZE

_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "F64": 8, "BOOL": 1,
                fp8.SAFETENSORS_DTYPE: 1}
_TORCH_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8",
                torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.float64: "F64", torch.bool: "BOOL",
                torch.float8_e4m3fn: fp8.SAFETENSORS_DTYPE}
TORCH_DTYPES = {name: dtype for dtype, name in _TORCH_NAMES.items()}  # safetensors dtype -> torch


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

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name`, or only its `index`-th slice along the first dimension (one expert of a
        fused expert tensor), read from disk alone."""
        begin, end = self.header[name]["data_offsets"]
        shape = self.shape(name)
        if index is not None:
            if not 0 <= index < shape[0]:
                raise IndexError(f"{self.path}: {name} has {shape[0]} slices, not {index + 1}")
            step = (end - begin) // shape[0]
            begin, end, shape = begin + index * step, begin + (index + 1) * step, shape[1:]
        buffer = bytearray(end - begin)
        if os.preadv(self.fd, [buffer], self.data_start + begin) != len(buffer):
            raise OSError(f"{self.path}: short read of {name}")
        return torch.frombuffer(buffer, dtype=TORCH_DTYPES[self.dtype(name)]).view(shape)

    def close(self) -> None:
        os.close(self.fd)


class CheckpointReader:
    """A checkpoint folder's tensors by name, one at a time, from whichever shard holds each.

    For an FP8 block-scaled source a weight with a `weight_scale_inv` comes back dequantized to float32
    (`fp8.dequantize`, from the scale wherever it is stored, another shard included), its scale is not
    listed, and its listed dtype is the one it is written in when it stays unquantized (`fp8.output_dtype`).
    A bf16 source reads as it is stored.
    """

    def __init__(self, folder: Path, config: dict):
        self.shards = {file: ShardReader(Path(folder) / file) for file in shard_files(folder)}
        self.where = {name: file for file, shard in self.shards.items() for name in shard.header}
        self.block = fp8.block_size(config) if fp8.is_fp8_source(config) else None
        self.dequantized_dtype = fp8.output_dtype(config) if self.block else None

    def is_fp8(self, name: str) -> bool:
        return self.block is not None and fp8.scale_name(name) in self.where

    def is_scale(self, name: str) -> bool:
        return self.block is not None and name.endswith(fp8.SCALE_SUFFIX) \
            and name.removesuffix(fp8.SCALE_SUFFIX) in self.where

    def listed(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype) of a tensor as `get` returns it; for an FP8 weight, the dtype it is written in."""
        shard = self.shards[self.where[name]]
        shape, dtype = shard.shape(name), shard.dtype(name)
        if self.is_fp8(name):
            return shape, self.dequantized_dtype
        if name.endswith(fp8.SCALE_SUFFIX) and self.block is not None:
            raise BadInputError(f"{self.where[name]}: {name} has no weight {name.removesuffix(fp8.SCALE_SUFFIX)}; "
                                "the checkpoint is incomplete, re-download it")
        if dtype not in TORCH_DTYPES:
            raise BadInputError(f"{self.where[name]}: {name} is {dtype}, which mxspec does not read "
                                f"(it reads {', '.join(sorted(TORCH_DTYPES))})")
        if dtype == fp8.SAFETENSORS_DTYPE:
            raise BadInputError(f"{self.where[name]}: {name} is float8 but has no {fp8.scale_name(name)} "
                                "(or the config does not say quant_method 'fp8'); the checkpoint is incomplete")
        return shape, dtype

    def listing(self, shard: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> `listed(name)` for the tensors in `shard` (all when None); FP8 scales are not listed."""
        return {name: self.listed(name) for name, file in self.where.items()
                if (shard is None or file == shard) and not self.is_scale(name)}

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor (or its `index`-th slice along the first dimension), dequantized if FP8."""
        raw = self.shards[self.where[name]].get(name, index)
        if not self.is_fp8(name):
            return raw
        scale = fp8.scale_name(name)
        return fp8.dequantize(raw, self.shards[self.where[scale]].get(scale, index), self.block)

    def written(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor (or its `index`-th slice) as it is written when it stays unquantized: in its listed dtype."""
        return self.get(name, index).to(TORCH_DTYPES[self.listed(name)[1]])

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, error_type, *_) -> None:
        if error_type is None:
            self.close()
        else:
            self.handle.close()  # the error is the one to report, not the short file


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
        from pipeline.study.ray_executor import map_on_ray

        parts = map_on_ray(cluster, quantize_shard, jobs, names=[f"quantize-{shard}" for shard in shards])
    else:
        parts = [quantize_shard(*job) for job in jobs]
    weight_map = {name: shard for part in parts for name, shard in part.items()}
    copy_side_files(source, out, overwrite=True)
    write_index(out, weight_map)
    _export_quant_config(json.loads((source / "config.json").read_text()), quant_config, str(out))
    return weight_map
