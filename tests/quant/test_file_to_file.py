"""File-to-file pieces on their own: the pread shard reader, the streaming writer, and the shard plan
that splits fused experts into per-expert MXFP4 weights (end to end it is tested in test_quantize)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.checkpoints.reader import ShardReader
from pipeline.checkpoints.writer import StreamingSafetensorsWriter
from pipeline.quant.file_to_file import _plan_shard

TENSORS = {
    "a.weight": torch.randn(4, 64, dtype=torch.bfloat16),
    "b.bias": torch.randn(7, dtype=torch.float32),
    "c.codes": torch.arange(12, dtype=torch.uint8).view(3, 4),
    "d.index": torch.tensor([1, -2, 3], dtype=torch.int64),
}


def test_the_reader_returns_each_tensor_bit_for_bit(tmp_path):
    save_file(TENSORS, tmp_path / "shard.safetensors")
    reader = ShardReader(tmp_path / "shard.safetensors")
    try:
        for name, tensor in TENSORS.items():
            assert reader.shape(name) == tuple(tensor.shape)
            got = reader.get(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    finally:
        reader.close()


def test_the_streaming_writer_makes_a_file_safetensors_reads(tmp_path):
    path = tmp_path / "out.safetensors"
    writer = StreamingSafetensorsWriter(path, [(n, {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8",
                                                    torch.int64: "I64"}[t.dtype], tuple(t.shape))
                                              for n, t in TENSORS.items()])
    for name, tensor in TENSORS.items():
        writer.write(name, tensor)
    writer.close()
    loaded = load_file(path)
    assert set(loaded) == set(TENSORS) and all(torch.equal(loaded[n], t) for n, t in TENSORS.items())


def test_the_streaming_writer_refuses_what_its_header_did_not_announce(tmp_path):
    writer = StreamingSafetensorsWriter(tmp_path / "x.safetensors", [("a", "F32", (2,)), ("b", "F32", (2,))])
    with pytest.raises(RuntimeError, match="expected"):
        writer.write("b", torch.zeros(2))  # out of order
    writer.write("a", torch.zeros(2))
    with pytest.raises(RuntimeError, match="wrote 1 of 2 tensors"):
        writer.close()


def test_the_plan_splits_fused_experts_into_mxfp4_weights_and_keeps_the_rest():
    prefix = "model.layers.0.mlp.experts"
    header = {f"{prefix}.gate_up_proj": ((2, 2 * 8, 64), "BF16"), f"{prefix}.down_proj": ((2, 64, 8), "BF16"),
              "model.layers.0.self_attn.q_proj.weight": ((32, 64), "BF16"), "model.norm.weight": ((64,), "BF16")}
    quantized = {f"{prefix}.{e}.{k}" for e in range(2) for k in ("gate_proj", "up_proj")}  # down_proj excluded
    entries, work = _plan_shard(header, list(header), quantized)
    shapes = {name: (dtype, shape) for name, dtype, shape in entries}
    for e in range(2):
        for kind in ("gate_proj", "up_proj"):
            assert shapes[f"{prefix}.{e}.{kind}.weight"] == ("U8", (8, 32))  # [out, in/2] packed FP4 codes
            assert shapes[f"{prefix}.{e}.{kind}.weight_scale"] == ("U8", (8, 2))  # [out, in/32] E8M0 scales
    assert shapes[f"{prefix}.down_proj"] == ("BF16", (2, 64, 8))  # an excluded block keeps its fused layout
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ("BF16", (32, 64))  # not in `quantized`
    assert shapes["model.norm.weight"] == ("BF16", (64,))
    assert (f"{prefix}.gate_up_proj", 1, "up_proj", f"{prefix}.1.up_proj.weight") in work
