"""The one door to AMD Quark: every call mxspec makes into Quark goes through this module.

Quark is the quantizer of record (its config, its MXFP4 quantizer, its export format and importer).
Some of what mxspec needs is reachable only through Quark internals (the file-to-file weight quantizer,
the export's quant config writer, a Quark linear's packed-weight decoder); keeping every such call here
means a Quark upgrade is checked in one file, against the pin (amd-quark 0.13)."""

from __future__ import annotations

import os

import torch

from pipeline.errors import BadInputError, ExternalError

__all__ = ["import_quark", "prepare_moe", "quark_config", "decode_weights_once", "weight_quantizer",
    "scale_functions", "export_quant_config"]


def import_quark():
    """Import Quark with torch.compile disabled for freeze (10x faster, identical bytes)."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    try:
        import quark.torch as quark_torch
    except Exception as exc:
        raise ExternalError(f"AMD Quark failed to import ({exc.__class__.__name__}: {exc}); reinstall amd-quark==0.13") from exc
    return quark_torch


def prepare_moe(model) -> None:
    """Fused experts -> per-expert Linears; without it Quark's export silently keeps bf16 experts."""
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    preprocess_for_quantization(model)


def quark_config(template: str, scheme: str, patterns: list[str]):
    quark_torch = import_quark()
    try:
        return quark_torch.LLMTemplate.get(template).get_config(scheme=scheme, exclude_layers=patterns)
    except (KeyError, ValueError) as exc:
        raise BadInputError(
            f"Quark has no template {template!r} for scheme {scheme!r} ({exc}); set [quantization] template"
        ) from exc


def weight_quantizer():
    """Quark's per-weight MXFP4 routine, the one its own file-to-file flow calls:
    `(tensor, tensor_name, layer_name, weight_config, out_dict, shard_name)` fills `out_dict` with the
    packed weight under `tensor_name` and its e8m0 scales under `tensor_name + "_scale"`."""
    import_quark()
    from quark.torch.quantization.file2file_quantization import _single_stage_quantize_weight

    return _single_stage_quantize_weight


def scale_functions():
    """(even_round, to_e8m0_uint8): how Quark's observer turns a block's amax into its scale, and how its
    writer turns the scale into the stored byte. `proof` checks the kernel's scales against these."""
    import_quark()
    from quark.torch.quantization.utils import even_round
    from quark.torch.utils.numerics import to_e8m0_uint8

    return even_round, to_e8m0_uint8


def export_quant_config(config: dict, quant_config, out) -> None:
    """Write Quark's quantization_config into out/config.json, as its own file-to-file flow does."""
    import_quark()
    from quark.torch.quantization.file2file_quantization import _export_quant_config

    _export_quant_config(config, quant_config, str(out))


@torch.no_grad()
def decode_weights_once(model, dtype: torch.dtype = torch.float32):
    """Replace each Quark linear's packed MXFP4 weight by its dequantized value, decoded once by Quark.

    Quark's importer keeps weights packed and unpacks them on every forward, which is most of the cost
    of a CPU decode step; weights are static, so decoding them once gives identical outputs. Activation
    quantizers (W+A schemes) are left in place and still run on every forward."""
    for module in model.modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is None or not hasattr(module, "_get_qweight"):
            continue
        decoded = module._get_qweight(module.weight).to(dtype)
        module.weight = torch.nn.Parameter(decoded, requires_grad=False)
        module.weight_quantizer = None
        if getattr(module, "_quant_dict", None):
            module._quant_dict.pop("weight_quantizer", None)
    return model
