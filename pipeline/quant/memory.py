"""How big a Qwen3.5 target is in bf16 and in MXFP4, and whether its MXFP4 export plus its drafter fit
one MI355X, from config.json alone (no weights, no torch).

`checkpoint_tensors` spells out every tensor a Qwen3.5 checkpoint carries (the language model, lm_head,
the vision tower, the MTP head) from the config. Tests hold it to transformers' own layout on the meta
device (`pipeline.architectures`) name for name and shape for shape, and to the tiny checkpoints'
safetensors headers.

Bytes:
  bf16    2 per element. (Real checkpoints appear to keep each gated-delta-net layer's A_log and norm in
          float32: two published totals exceed 2 bytes x parameters by exactly that, a few KB, ignored.)
  mxfp4   a quantized Linear weight [out, in] takes out*in/2 bytes of packed e2m1 and out*in/32 e8m0
          scales (`pipeline.quant.mxfp4`); every other tensor, and every Linear the exclusion patterns keep,
          stays bf16.
Serving one sequence of L tokens holds, besides the weights: bf16 K and V for each full-attention layer
of the target (and of its MTP layer, or of the DFlash drafter) per token, and for each gated-delta-net
layer a recurrent state [value heads, key dim, value dim] (`mamba_ssm_dtype`, float32) plus a bf16
convolution state [conv dim, kernel - 1], times the extra blocks speculation keeps. Activations, CUDA graphs and fragmentation are not counted. Like vLLM at start-up, a pair fits
when the weights and one sequence of `max_model_len` tokens fit in `gpu_memory_utilization` of the GPUs;
the plan also says how many such sequences fit at once (shorter ones share the rest).
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pipeline.checkpoints.folder import has_mtp_head, linear_modules, mtp_layers, text_config
from pipeline.checkpoints.fp8 import block_size, is_fp8_source
from pipeline.checkpoints.qwen35 import checkpoint_tensors, drafter_tensors
from pipeline.quant.exclusions import excluded_layers
from pipeline.quant.mxfp4 import GROUP_SIZE

__all__ = ["MI355X_BYTES", "BF16_BYTES", "FLOAT32_BYTES", "IN_MEMORY_FACTOR", "IN_MEMORY_BYTES_PER_ELEMENT",
    "bf16_bytes", "mxfp4_bytes", "encoded_elements", "fp8_bytes", "source_format", "quantize_mode_for", "available_memory_bytes",
    "VLLM_GPU_MEMORY_UTILIZATION", "MemoryPlan", "kv_bytes", "state_bytes_per_sequence", "plan_memory"]

MI355X_BYTES = 288 * 10**9  # HBM3E per MI355X, AMD's data sheet "288 GB"; if that means GiB, this errs low
BF16_BYTES = 2
FLOAT32_BYTES = 4
# A bf16 checkpoint quantizes in memory when this many times its size is free: the model, its quantized
# copy and Quark's working set. `quantize.choose_mode` applies it.
IN_MEMORY_FACTOR = 2.5
# Bytes per element of a model held in memory to quantize it: bf16 as stored; an FP8 source dequantized to
# float32, the precision Quark's FP8 flow encodes from (`pipeline.checkpoints.fp8`).
IN_MEMORY_BYTES_PER_ELEMENT = {"bf16": BF16_BYTES, "fp8": FLOAT32_BYTES}


def bf16_bytes(tensors: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in tensors.values()) * BF16_BYTES


def _encoded(tensors: dict[str, tuple[int, ...]], exclude: list[str]):
    """(name, shape, {module: ((rows, cols), encoded?)}) per tensor: which Linear weights the export encodes
    to MXFP4 (not matched by `exclude`, inputs divisible by 32); the one rule the sizes below share."""
    for name, shape in tensors.items():
        modules = linear_modules(name, shape)
        kept = excluded_layers(modules, exclude)
        yield name, shape, {module: ((rows, cols), module not in kept and cols % GROUP_SIZE == 0)
                            for module, (rows, cols) in modules.items()}


def mxfp4_bytes(tensors: dict[str, tuple[int, ...]], exclude: list[str]) -> int:
    """The MXFP4 export's tensor bytes: Linear weights not matched by `exclude` packed, the rest bf16."""
    total = 0
    for _, shape, modules in _encoded(tensors, exclude):
        if not modules:
            total += math.prod(shape) * BF16_BYTES
        for (rows, cols), encoded in modules.values():
            total += rows * cols // 2 + rows * cols // GROUP_SIZE if encoded else rows * cols * BF16_BYTES
    return total


def encoded_elements(tensors: dict[str, tuple[int, ...]], exclude: list[str]) -> int:
    """How many weights the MXFP4 encoder sees: what the quantize stage's encoding time scales with."""
    return sum(rows * cols for _, _, modules in _encoded(tensors, exclude)
               for (rows, cols), encoded in modules.values() if encoded)


def fp8_bytes(tensors: dict[str, tuple[int, ...]], config: dict[str, Any]) -> int:
    """An FP8 block-scaled checkpoint's tensor bytes (Qwen's FP8 releases, `pipeline.checkpoints.fp8`): each Linear
    weight not in `modules_to_not_convert` is e4m3 (1 byte per element) with a float32 `weight_scale_inv`
    per tile; the rest bf16. Routed experts are counted per expert."""
    rows_block, cols_block = block_size(config)
    keep = set(config["quantization_config"].get("modules_to_not_convert") or [])
    total = 0
    for name, shape in tensors.items():
        modules = linear_modules(name, shape)
        if not modules:
            total += math.prod(shape) * BF16_BYTES
        for module, (rows, cols) in modules.items():
            if module in keep:
                total += rows * cols * BF16_BYTES
            else:
                tiles = -(-rows // rows_block) * -(-cols // cols_block)
                total += rows * cols + tiles * FLOAT32_BYTES
    return total


def source_format(config: dict[str, Any]) -> Literal["bf16", "fp8"]:
    return "fp8" if is_fp8_source(config) else "bf16"


def quantize_mode_for(elements: int, source: Literal["bf16", "fp8"], available_bytes: int,
                      quantizes_mtp_head: bool = False) -> Literal["in_memory", "file_to_file"]:
    """What `mode = "auto"` picks for a model of `elements` weights: file to file for a quantized MTP head
    (`recipe.NO_MTP_HEAD_IN_MEMORY`), else in memory when the model as held
    (IN_MEMORY_BYTES_PER_ELEMENT of its source format) fits IN_MEMORY_FACTOR times in free RAM."""
    if quantizes_mtp_head:
        return "file_to_file"
    held = elements * IN_MEMORY_BYTES_PER_ELEMENT[source]
    return "in_memory" if held * IN_MEMORY_FACTOR < available_bytes else "file_to_file"


def available_memory_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default when a recipe sets none


class MemoryPlan(BaseModel):
    """One recipe's sizes and its one-GPU fit (bytes; GB = 1e9 bytes in what people read)."""

    model_config = ConfigDict(frozen=True)

    source_format: Literal["bf16", "fp8"]
    source_bytes: int  # the source checkpoint's tensors, in its format
    mxfp4_bytes: int
    encoded_elements: int  # weights the MXFP4 encoder sees
    drafter_bytes: int | None  # None: the drafter's config is not known here, so it is not counted
    quantize_mode_here: Literal["in_memory", "file_to_file"]
    quantizes_mtp_head: bool  # quantize_mtp on a target with an MTP head: auto then quantizes file to file
    available_bytes: int
    max_model_len: int
    tensor_parallel_size: int
    largest_server: Literal["ar", "mtp", "dflash"]  # the method whose server needs the most memory
    sequence_bytes: int  # its one sequence of max_model_len: KV caches and gated-delta-net states
    gpu_bytes: int
    gpu_memory_utilization: float
    need_bytes_per_gpu: int  # its weights and one sequence of max_model_len, split across the GPUs
    fits: bool
    full_length_sequences: int  # how many sequences of max_model_len fit at once on it


def kv_bytes(config: dict[str, Any], drafter: dict[str, Any] | None, with_mtp_head: bool, tokens: int) -> int:
    """bf16 K and V of one sequence of `tokens` tokens: the target's full-attention layers, its MTP layers
    when MTP runs, and the drafter's layers (a sliding-window layer keeps at most its window)."""
    text = text_config(config)
    per_token = 2 * int(text["num_key_value_heads"]) * int(text["head_dim"]) * BF16_BYTES
    layers = list(text["layer_types"]).count("full_attention")
    layers += mtp_layers(config) if with_mtp_head else 0
    total = layers * per_token * tokens
    if drafter is not None:
        heads = int(drafter["num_attention_heads"])
        head_dim = int(drafter.get("head_dim") or int(drafter["hidden_size"]) // heads)
        per_token = 2 * int(drafter["num_key_value_heads"]) * head_dim * BF16_BYTES
        kinds = drafter.get("layer_types") or ["full_attention"] * int(drafter["num_hidden_layers"])
        window = drafter.get("sliding_window") or tokens
        total += sum(per_token * (min(tokens, window) if kind == "sliding_attention" else tokens) for kind in kinds)
    return total


def state_bytes_per_sequence(config: dict[str, Any], speculative_tokens: int = 0) -> int:
    """Gated-delta-net states of one sequence. vLLM keeps 1 + `speculative_tokens` state blocks per request
    when it speculates, each with a convolution window of kernel - 1 + `speculative_tokens` columns
    (`vllm/model_executor/layers/mamba/mamba_utils.py`)."""
    text = text_config(config)
    layers = list(text["layer_types"]).count("linear_attention")
    if layers == 0:
        return 0
    k_heads, v_heads = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    k_dim, v_dim = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    ssm_bytes = BF16_BYTES if text.get("mamba_ssm_dtype") in ("bfloat16", "float16") else FLOAT32_BYTES
    recurrent = v_heads * k_dim * v_dim * ssm_bytes
    columns = int(text["linear_conv_kernel_dim"]) - 1 + speculative_tokens
    conv = (2 * k_heads * k_dim + v_heads * v_dim) * columns * BF16_BYTES
    return layers * (1 + speculative_tokens) * (recurrent + conv)


def plan_memory(config: dict[str, Any], drafter: dict[str, Any] | None, exclude: list[str], *,
                max_model_len: int | None, methods: tuple[str, ...] = ("ar", "mtp", "dflash"),
                speculative_tokens: int = 0, tensor_parallel_size: int = 1,
                gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION, gpu_bytes: int = MI355X_BYTES,
                available_bytes: int | None = None, quantize_mtp: bool = False) -> MemoryPlan:
    """Sizes of the target (source format, MXFP4) and drafter, `auto`'s quantize mode on this machine, and
    whether the largest server of `methods` (one method per server: MTP adds its layer's KV, DFlash the
    drafter's weights and KV; both keep 1 + `speculative_tokens` state blocks) with one sequence of
    `max_model_len` tokens (the model's own limit when None) fits on `tensor_parallel_size` GPUs of
    `gpu_bytes`. Weights and caches are split evenly; at TP > 1 vLLM replicates KV heads when there are
    fewer than GPUs, which this does not count."""
    tensors = checkpoint_tensors(config)
    fmt = source_format(config)
    bf16 = bf16_bytes(tensors)
    source = fp8_bytes(tensors, config) if fmt == "fp8" else bf16
    mxfp4 = mxfp4_bytes(tensors, exclude)
    drafter_size = bf16_bytes(drafter_tensors(drafter)) if drafter is not None else None
    length = max_model_len or int(text_config(config)["max_position_embeddings"])
    servers = {  # method -> (weights, one sequence)
        "ar": (mxfp4, kv_bytes(config, None, False, length) + state_bytes_per_sequence(config)),
        "mtp": (mxfp4, kv_bytes(config, None, True, length) + state_bytes_per_sequence(config, speculative_tokens)),
        "dflash": (mxfp4 + (drafter_size or 0),
                   kv_bytes(config, drafter, False, length) + state_bytes_per_sequence(config, speculative_tokens)),
    }
    largest = max((m for m in servers if m in methods), key=lambda m: sum(servers[m]))
    weights, sequence = servers[largest]
    budget = int(gpu_bytes * gpu_memory_utilization) * tensor_parallel_size
    available = available_memory_bytes() if available_bytes is None else available_bytes
    quantizes_mtp_head = quantize_mtp and has_mtp_head(config)
    return MemoryPlan(source_format=fmt, source_bytes=source, mxfp4_bytes=mxfp4,
                      encoded_elements=encoded_elements(tensors, exclude), drafter_bytes=drafter_size,
                      quantize_mode_here=quantize_mode_for(bf16 // BF16_BYTES, fmt, available, quantizes_mtp_head),
                      quantizes_mtp_head=quantizes_mtp_head,
                      available_bytes=available,
                      max_model_len=length, tensor_parallel_size=tensor_parallel_size, largest_server=largest,
                      sequence_bytes=sequence, gpu_bytes=gpu_bytes, gpu_memory_utilization=gpu_memory_utilization,
                      need_bytes_per_gpu=(weights + sequence) // tensor_parallel_size,
                      fits=weights + sequence <= budget, full_length_sequences=max(0, (budget - weights) // sequence))
