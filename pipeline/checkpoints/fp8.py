"""FP8 block-scaled source checkpoints (the layout of Qwen's FP8 releases), stated as code.

A checkpoint is FP8 when its config carries `quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}`. Then:

* a converted Linear weight `X.weight [rows, cols]` is stored as float8 e4m3 (safetensors `F8_E4M3`)
  beside `X.weight_scale_inv` float32 `[ceil(rows/128), ceil(cols/128)]`, one scale per 128 x 128 tile;
  a fused expert tensor `[E, rows, cols]` has scales `[E, ceil(rows/128), ceil(cols/128)]`;
* the real weight is `float32(e4m3) * weight_scale_inv` of its tile (despite the name, the scale
  multiplies); the last tile of a row or column may be partial;
* the modules in `modules_to_not_convert` (embeddings, lm_head, routers, GDN `in_proj_a/b`, ...) are
  plain bf16 tensors with no scale.

mxspec reads such a checkpoint as Quark 0.13's own FP8-to-MXFP4 flow does
(`quark/torch/quantization/file2file_quantization.py`: `_weight_dequant_fp8`, `_recover_fp8_weights`):
each weight is dequantized to float32 (the product above, one rounding) and that float32 tensor is what
the MXFP4 encoder sees; a dequantized weight that stays unquantized is written in the config's dtype
(bf16 for every Qwen3.5 release), and the scales are dropped. Torch is imported inside the functions
that need it: light modules (`memory`) import this one.
"""

from __future__ import annotations

from typing import Any

from pipeline.checkpoints.folder import text_config
from pipeline.errors import BadInputError

__all__ = ["SCALE_SUFFIX", "E4M3_MAX", "SAFETENSORS_DTYPE", "is_fp8_source", "block_size", "output_dtype",
    "scale_name", "dequantize", "quantize"]

SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value
SAFETENSORS_DTYPE = "F8_E4M3"
# What a config's dtype may name, as safetensors dtype strings (what unquantized weights are written in).
_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def is_fp8_source(config: dict[str, Any]) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == "fp8"


def block_size(config: dict[str, Any]) -> tuple[int, int]:
    """The FP8 tiles' (rows, cols); one clear line when the config does not describe block scaling."""
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise BadInputError(
            f"quantization_config.weight_block_size is {block!r}: mxspec reads block-scaled FP8 checkpoints "
            "(two positive ints, e.g. [128, 128]); per-tensor FP8 is not supported, use the bf16 release")
    return block[0], block[1]


def output_dtype(config: dict[str, Any]) -> str:
    """The safetensors dtype a dequantized weight that stays unquantized is written in: the config's
    `dtype` (text config first, as Quark resolves it), bf16 when it names none."""
    named = (text_config(config).get("dtype") or text_config(config).get("torch_dtype")
             or config.get("torch_dtype") or config.get("dtype"))
    return _CONFIG_DTYPES.get(str(named).lower(), "BF16")


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def _tile_scales(scale_inv, shape, block: tuple[int, int]):
    """Each element's scale: the tile scales repeated over their tiles and cut to `shape`."""
    rows, cols = shape[-2:]
    full = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def dequantize(weight, scale_inv, block: tuple[int, int]):
    """float32 weights of an e4m3 tensor `[..., rows, cols]` and its tile scales
    `[..., ceil(rows/b0), ceil(cols/b1)]`: each element times its tile's scale, one float32 multiplication
    (by broadcasting over whole tiles; a weight with partial tiles repeats the scales instead)."""
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise BadInputError(f"FP8 scale shape {tuple(scale_inv.shape)} does not tile weight {tuple(weight.shape)} "
                            f"in {block[0]}x{block[1]} blocks (expected {expected}); the checkpoint is damaged")
    if rows % block[0] or cols % block[1]:
        return weight.float() * _tile_scales(scale_inv, weight.shape, block)
    tiles = weight.float().unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [..., R, b0, C, b1]
    return (tiles * scale_inv.float()[..., :, None, :, None]).reshape(weight.shape)


def quantize(weight, block: tuple[int, int]):
    """(e4m3 weight, float32 tile scales) of a float weight `[..., rows, cols]`: each tile is scaled so that
    its largest magnitude maps to E4M3_MAX (an all-zero tile gets scale 1). Builds FP8 test checkpoints;
    `dequantize` inverts it up to e4m3 rounding."""
    import torch

    rows, cols = weight.shape[-2:]
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block[1], 0, -rows % block[0]))
    tiles = padded.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [..., R, b0, C, b1]
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (weight.float() / _tile_scales(scale, weight.shape, block)).clamp(-E4M3_MAX, E4M3_MAX)
    return codes.to(torch.float8_e4m3fn), scale
