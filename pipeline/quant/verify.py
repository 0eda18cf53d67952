"""What the quantize stage checks of an export before anything reads it.

Every quantized tensor is compared byte for byte with the project's own MXFP4 encoder (`mxfp4`, the
executable spec), MoE layers must have packed weights for every routed expert, an FP8 source's kept
weights must be their dequantized values, and (for models transformers can run here) logits are
compared with the source on calibration windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.checkpoints.folder import (
    Checkpoint,
    expert_rows,
    export_name,
    fused_source,
    read_checkpoint,
    split_fused_experts,
)
from pipeline.checkpoints.reader import load_source
from pipeline.errors import ExternalError
from pipeline.quant.exclusions import excluded_layers
from pipeline.quant.quark import import_quark

__all__ = ["verify_export", "logit_agreement"]


def _source_weight(reader, module: str, cache: dict) -> np.ndarray | None:
    """The source weight of a quantized module as the encoder saw it, as float32: bf16 widened, FP8
    dequantized; one expert of a fused tensor."""

    def load(name: str, expert: int | None = None):
        if (name, expert) not in cache:
            cache.clear()  # hold one source tensor (or expert) at a time
            cache[name, expert] = reader.get(name, expert).float().numpy()
        return cache[name, expert]

    for candidate in (module, module.replace("model.", "model.language_model.", 1)):
        if f"{candidate}.weight" in reader.where:
            return load(f"{candidate}.weight")
        fused = fused_source(candidate)
        if fused is not None and fused[0] in reader.where:
            name, expert, kind = fused
            return expert_rows(load(name, expert), kind)
    return None


def _check_dequantized_kept(reader, out: Path, exported: Checkpoint, config: dict) -> int:
    """Every FP8 source weight the export keeps unquantized equals its dequantized value in the config's
    dtype, bit for bit (a fused expert tensor may be kept fused or per expert). Returns how many were checked."""
    import torch
    from safetensors import safe_open

    checked = 0
    for name in (n for n in reader.listing() if reader.is_fp8(n)):
        if export_name(name, config) in exported.tensors:
            kept = {export_name(name, config): lambda name=name: reader.written(name)}
        else:
            pieces = split_fused_experts(name, reader.listed(name)[0]) or []
            kept = {export_name(p.name, config): lambda p=p, name=name: expert_rows(reader.written(name, p.expert), p.kind)
                    for p in pieces if export_name(p.name, config) in exported.tensors}
        for out_name, expected in kept.items():
            if exported.tensors[out_name][1] == "U8":
                continue  # quantized: checked against the MXFP4 encoder
            with safe_open(out / exported.tensors[out_name][2], framework="pt") as handle:
                got = handle.get_tensor(out_name)
            want = expected()
            if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                raise ExternalError(f"{out_name} is not its FP8 source weight dequantized to "
                                    f"{reader.dequantized_dtype}; the export is wrong")
            checked += 1
    return checked


def verify_export(source: Checkpoint, out: Path, patterns: list[str]) -> dict:
    """Every quantized tensor equals mxfp4.encode of its source weight (FP8: dequantized), bit for bit;
    no layer that should be quantized (MoE experts included) was silently kept in bf16."""
    from pipeline.checkpoints.reader import CheckpointReader

    with CheckpointReader(source.folder, source.config) as reader:
        return _verify_export(source, reader, out, patterns)


def _verify_export(source: Checkpoint, reader, out: Path, patterns: list[str]) -> dict:
    from safetensors import safe_open

    from pipeline.quant import mxfp4

    exported = read_checkpoint(out)
    quantized = sorted(n.removesuffix(".weight_scale") for n in exported.tensors if n.endswith(".weight_scale"))
    if not quantized:
        raise ExternalError(f"Quark export in {out} holds no MXFP4 tensor; nothing was quantized")
    cache: dict = {}
    mismatched, unmatched = [], []
    for module in quantized:
        shape, dtype, file = exported.tensors[f"{module}.weight"]
        if dtype != "U8":
            raise ExternalError(f"{module}.weight has a scale but dtype {dtype}, not packed uint8")
        reference = _source_weight(reader, module, cache)
        if reference is None:
            unmatched.append(module)
            continue
        packed, scales = mxfp4.encode(reference)
        with safe_open(out / file, framework="pt") as handle:
            ours_packed = handle.get_tensor(f"{module}.weight").numpy()
        with safe_open(out / exported.tensors[f"{module}.weight_scale"][2], framework="pt") as handle:
            ours_scales = handle.get_tensor(f"{module}.weight_scale").numpy()
        if not (np.array_equal(packed, ours_packed) and np.array_equal(scales, ours_scales)):
            mismatched.append(module)
    if unmatched:
        raise ExternalError(f"quantized {unmatched[0]} has no source weight to check against ({len(unmatched)} such)")
    if mismatched:
        raise ExternalError(
            f"{len(mismatched)} quantized tensors differ from the OCP MX encoding of their source, e.g. {mismatched[0]}"
        )
    expected = set(source.linear_layers()) - excluded_layers(source.linear_layers(), patterns)
    expected -= {"lm_head"} if "lm_head" not in source.tensors and "lm_head.weight" not in exported.tensors else set()
    kept_bf16 = sorted({export_name(n, source.config) for n in expected} - set(quantized))
    if kept_bf16:
        what = "routed experts" if any(".mlp.experts." in n for n in kept_bf16) else "layers"
        raise ExternalError(
            f"Quark export kept {len(kept_bf16)} {what} in bf16 that should be MXFP4, e.g. {kept_bf16[0]}"
            + ("; MoE needs preprocess_for_quantization" if what == "routed experts" else "")
        )
    experts = [n for n in quantized if ".mlp.experts." in n]
    return {
        "bit_exact_tensors": len(quantized),
        "moe_experts_quantized": len(experts),
        "encoder": "pipeline.quant.mxfp4.encode (OCP MX v1.0, Quark 'even' scale mode)",
        "source_format": "fp8" if reader.block else "bf16",
        "dequantized_kept_tensors": _check_dequantized_kept(reader, out, exported, source.config) if reader.block else 0,
    }


def logit_agreement(source: Checkpoint, out: Path, windows) -> dict:
    """Logit error, KL(source || MXFP4) and top-1 agreement of the reloaded export on calibration
    windows. The export is reloaded through Quark's importer, so W+A runs its activation quantizer."""
    import torch
    from transformers import AutoModelForCausalLM

    quark_torch = import_quark()
    reference = load_source(source.folder, AutoModelForCausalLM).eval()
    quantized = quark_torch.import_model_from_safetensors(None, str(out), device="cpu").float().eval()
    abs_err, kl_sum, agree, count = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for window in windows:
            ids = window[None]
            ref = reference(ids).logits[0].float()
            got = quantized(ids).logits[0].float()
            abs_err += float((ref - got).abs().mean())
            log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
            kl_sum += float((log_p.exp() * (log_p - log_q)).sum(-1).sum())
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            count += ids.shape[1]
    return {
        "tokens": count,
        "mean_abs_logit_error": abs_err / len(windows),
        "kl_bf16_to_mxfp4": kl_sum / count,
        "top1_agreement": agree / count,
    }
