"""Writing a safetensors shard as a stream: the header is computed up front from the tensors' names,
dtypes and shapes, then each tensor's bytes are appended as soon as they exist, so a writer holds one
tensor in memory, not one shard."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from pipeline.checkpoints.reader import _DTYPE_BYTES, _TORCH_NAMES

__all__ = ["StreamingSafetensorsWriter"]


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
        self.handle.write(tensor.contiguous().view(torch.uint8).numpy().data)  # no copy: file.write takes a buffer
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
