"""File-to-file MXFP4 quantization that holds a few tensors at a time, not one shard.

Quark's own file-to-file flow (`ModelQuantizer.direct_quantize_checkpoint`) loads a whole shard,
quantizes it and saves it: peak memory is a shard plus its output. Here each input shard is read
tensor by tensor (pread) and the output shard is written as a stream: its safetensors header is
computed up front from the input header (MXFP4 shapes are known: `[out, in/2]` packed codes and
`[out, in/32]` e8m0 scales), then each tensor's bytes are appended as soon as they are encoded. Pool
threads read ahead and encode; the calling thread writes behind them. The encoder is Quark's per-weight
routine (the one its file-to-file flow calls) or mxspec's kernel where it is proven identical to it
(`encoder`), and the config.json is written by Quark's own exporter, so the flows produce the same
bytes; the tests check that.

An FP8 block-scaled source (`pipeline.checkpoints.fp8`) is read through `CheckpointReader`, which hands each
weight over dequantized to float32, as Quark's FP8 flow does, one tensor (or one expert) at a time; the
kernel instead takes the e4m3 codes and their tile scales and does the same multiplication as it encodes.
"""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

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
from pipeline.quant.admission import build_encoder, choose_encoder
from pipeline.quant.encoder import EncoderChoice, KernelEncoder, encode_threads
from pipeline.quant.mxfp4 import GROUP_SIZE

__all__ = ["quantize_shard", "quantize_file_to_file", "encoder_input_dtypes"]


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


@dataclass(frozen=True)
class _ReadUnit:
    """One read from the source (a tensor, or one expert of a fused tensor) and the output tensors made
    from it, in write order: (kind of expert rows or None, output name)."""

    source: str
    expert: int | None
    outputs: tuple[tuple[str | None, str], ...]


def _read_units(work) -> list[_ReadUnit]:
    units: list[_ReadUnit] = []
    for source, expert, kind, out_name in work:
        if units and (units[-1].source, units[-1].expert) == (source, expert):
            units[-1] = _ReadUnit(source, expert, (*units[-1].outputs, (kind, out_name)))
        else:
            units.append(_ReadUnit(source, expert, ((kind, out_name),)))
    return units


def _rows(kind: str | None, rows: int) -> tuple[int, int]:
    """The rows [first, stop) one kind of expert weight takes of its expert's fused rows (`expert_rows`)."""
    if kind is None or kind == "down_proj":
        return 0, rows
    return (0, rows // 2) if kind == "gate_proj" else (rows // 2, rows)


def _produce(unit: _ReadUnit, reader: CheckpointReader, encoder, quantized: set[str], dtypes, config):
    """Read one unit and make its outputs: [(name in the export, tensor), ...]. Runs on a pool thread."""
    made = []
    fused_fp8 = isinstance(encoder, KernelEncoder) and reader.is_fp8(unit.source) \
        and any(out.removesuffix(".weight") in quantized for _, out in unit.outputs)
    if fused_fp8:  # the kernel dequantizes as it encodes: no float32 copy of the weight
        codes, scale_inv = reader.fp8_parts(unit.source, unit.expert)
    else:
        tensor = reader.get(unit.source, unit.expert)
    for kind, out_name in unit.outputs:
        name = export_name(out_name, config)
        if out_name.removesuffix(".weight") in quantized:
            if fused_fp8:
                first, stop = _rows(kind, codes.shape[0])
                packed, scales = encoder.encode_fp8(codes[first:stop], scale_inv, reader.block, first, name)
            else:
                weight = expert_rows(tensor, kind) if unit.expert is not None else tensor
                packed, scales = encoder.encode(weight.contiguous(), out_name)
            made += [(name, packed), (name + "_scale", scales)]
        else:
            source = tensor if not fused_fp8 else reader.get(unit.source, unit.expert)
            weight = expert_rows(source, kind) if unit.expert is not None else source
            made.append((name, weight.to(dtypes[out_name])))
    return made


def _unit_bytes(unit: _ReadUnit, reader: CheckpointReader) -> int:
    shard = reader.shards[reader.where[unit.source]]
    begin, end = shard.header[unit.source]["data_offsets"]
    size = end - begin
    return size // shard.shape(unit.source)[0] if unit.expert is not None else size


def quantize_shard(source: Path, out: Path, shard: str, encoder_choice: EncoderChoice, input_dtypes: set[str],
                   weight_config, quantized_modules: set[str]) -> dict[str, str]:
    """Quantize one shard of `source` into out/shard; returns its part of the weight map.

    Pool threads read ahead (pread releases the GIL) and encode; this thread writes behind them, in the
    header's order. Reads in flight are held to a quarter of the shard (at least one unit), so peak
    memory stays near one shard's worth of page-sized buffers, not a second copy of it."""
    encoder = build_encoder(encoder_choice, input_dtypes, weight_config)
    weight_map: dict[str, str] = {}
    config = json.loads((source / "config.json").read_text())
    with CheckpointReader(source, config) as reader:
        header = reader.listing(shard)
        order = sorted(header)  # deterministic output order
        entries, work = _plan_shard(header, order, quantized_modules)
        if not entries:
            return weight_map  # a shard of FP8 scales alone: its scales are read, nothing is written
        dtypes = {name: TORCH_DTYPES[dtype] for name, dtype, _ in entries}
        units = _read_units(work)
        budget = (source / shard).stat().st_size // 4
        threads = 1 if encoder.name == "quark" and encoder.device != "cpu" else encode_threads()
        with StreamingSafetensorsWriter(out / shard, [(export_name(name, config), dtype, shape)
                                                       for name, dtype, shape in entries]) as writer, \
                ThreadPoolExecutor(threads, thread_name_prefix="quantize") as pool:
            pending: deque = deque()
            in_flight = 0
            for unit in units:
                size = _unit_bytes(unit, reader)
                while pending and (in_flight + size > budget or len(pending) > 2 * threads):
                    in_flight -= _write(pending.popleft(), writer, weight_map, shard)
                pending.append((pool.submit(_produce, unit, reader, encoder, quantized_modules, dtypes, config), size))
                in_flight += size
            while pending:
                _write(pending.popleft(), writer, weight_map, shard)
    return weight_map


def _write(entry, writer: StreamingSafetensorsWriter, weight_map: dict[str, str], shard: str) -> int:
    future, size = entry
    for name, tensor in future.result():
        writer.write(name, tensor)
        weight_map[name] = shard
    return size


def quantize_file_to_file(source: Path, out: Path, quant_config, quantized_modules: set[str],
                          cluster=None, encoder: str = "auto", say=print) -> EncoderChoice:
    """Quantize every shard of `source` into `out`; returns the encoder that ran. Peak memory: about one
    shard's reads in flight.

    With a Ray `cluster` ([cluster] executor = "ray"), each shard is a Ray task writing its output shard
    into `out`, which every node must see (shared storage); the bytes are the same as shard by shard here."""
    from pipeline.quant.quark import export_quant_config

    weight_config = quant_config.global_quant_config.weight
    config = json.loads((source / "config.json").read_text())
    input_dtypes = encoder_input_dtypes(source, config, quantized_modules)
    choice = choose_encoder(encoder, input_dtypes, weight_config, say)
    shards = shard_files(source)
    jobs = [(source, out, shard, choice, input_dtypes, weight_config, quantized_modules) for shard in shards]
    if cluster is not None and cluster.executor == "ray":
        from pipeline.run.ray_session import map_on_ray

        parts = map_on_ray(cluster, quantize_shard, jobs, names=[f"quantize-{shard}" for shard in shards])
    else:
        parts = [quantize_shard(*job) for job in jobs]
    weight_map = {name: shard for part in parts for name, shard in part.items()}
    copy_side_files(source, out, overwrite=True)
    write_index(out, weight_map)
    export_quant_config(config, quant_config, out)
    return choice


def encoder_input_dtypes(source: Path, config: dict, quantized_modules: set[str]) -> set[str]:
    """The dtypes the encoder will see: float32 for FP8 weights (dequantized), else as stored."""
    names = {"BF16": "bfloat16", "F32": "float32", "F16": "float16"}
    found = set()
    with CheckpointReader(source, config) as reader:
        for name, (shape, dtype) in reader.listing().items():
            pieces = split_fused_experts(name, shape)
            modules = [p.module for p in pieces] if pieces else [name.removesuffix(".weight")]
            if any(module in quantized_modules for module in modules):
                stored = reader.shards[reader.where[name]].dtype(name)
                found.add("float32" if reader.is_fp8(name) else names.get(stored, stored))
    return found
