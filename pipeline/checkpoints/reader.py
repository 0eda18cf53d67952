"""Reading a checkpoint tensor by tensor, as the quantizer sees it: safetensors shards opened once,
FP8 block-scaled weights dequantized on the way out, one expert of a fused MoE tensor at a time.

The file-to-file writer, the export's verification and the source model loader all read through
`CheckpointReader`, so they see the same float32 (or bf16) values."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from pipeline.checkpoints import fp8
from pipeline.checkpoints.folder import read_checkpoint, shard_files
from pipeline.checkpoints.fp8 import is_fp8_source
from pipeline.errors import BadInputError

__all__ = ["load_source", "TORCH_DTYPES", "ShardReader", "CheckpointReader"]


def load_source(folder: Path, model_class=None):
    """The source model in float32, for transformers to run: bf16 weights upcast; an FP8 source's weights
    dequantized as the quantizer sees them (`CheckpointReader`), its config without the FP8
    quantization_config (transformers' own FP8 loader dequantizes to bf16 on a CPU, not what the encoder
    sees). `model_class` defaults to the config's architecture."""
    import torch
    import transformers

    from pipeline.checkpoints.reader import CheckpointReader

    checkpoint = read_checkpoint(folder)
    model_class = model_class or getattr(transformers, checkpoint.config["architectures"][0])
    if not is_fp8_source(checkpoint.config):
        return model_class.from_pretrained(folder, dtype=torch.float32)
    with CheckpointReader(checkpoint.folder, checkpoint.config) as reader:
        state = {name: reader.get(name) for name in reader.listing()}
    plain = {key: value for key, value in checkpoint.config.items() if key != "quantization_config"}
    model = model_class.from_pretrained(None, config=transformers.AutoConfig.for_model(**plain), state_dict=state,
                                        dtype=torch.float32)
    # No source path: Quark's export would restore the MTP head from it as stored (FP8);
    # `_carry_over` writes it dequantized, as file-to-file mode does.
    model.config._name_or_path = ""
    return model


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

    def fp8_parts(self, name: str, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 codes, float32 tile scales) of an FP8 weight (or of its `index`-th slice), undequantized:
        what `get` multiplies together."""
        scale = fp8.scale_name(name)
        return self.shards[self.where[name]].get(name, index), self.shards[self.where[scale]].get(scale, index)

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
