"""Quantize stage: the target -> an MXFP4 checkpoint with AMD Quark that vLLM loads (quant_method quark).

Two execution modes, chosen from the checkpoint size and the machine's memory (recipe can force):
  - in_memory: transformers loads the model, Quark quantizes, freezes and exports it;
  - file_to_file: shard by shard and tensor by tensor with Quark's weight quantizer and a streaming
    writer (`file_to_file`), so a 70 GB checkpoint needs about one tensor of memory.
The source is bf16, or FP8 block-scaled (`fp8`): then both modes encode the float32 dequantized weights,
as Quark's FP8 flow does, and write what stays unquantized dequantized, in the config's dtype (bf16).
Before any work the exclusions are checked against the checkpoint's real layer names (see
`exclusions`); after the export every quantized tensor is compared byte for byte with the project's
own MXFP4 encoder (`mxfp4`), MoE layers must have packed weights for every routed expert, and
(for models transformers can run here) logits are compared with the bf16 target.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.checkpoints.folder import (
    Checkpoint,
    copy_side_files,
    expert_rows,
    export_name,
    fused_source,
    has_mtp_head,
    read_checkpoint,
    split_fused_experts,
    write_index,
)
from pipeline.checkpoints.fp8 import SCALE_SUFFIX, block_size, is_fp8_source
from pipeline.errors import BadInputError, ExternalError
from pipeline.quant.exclusions import check_exclusions, excluded_layers, exclusion_patterns
from pipeline.quant.memory import IN_MEMORY_BYTES_PER_ELEMENT, available_memory_bytes, quantize_mode_for
from pipeline.recipe import Calibration, Cluster, Quantization
from pipeline.run.artifacts import QuantizeReport, write_artifact
from pipeline.run.atomic import is_disk_full
from pipeline.run.layout import CHECKPOINT, QUANTIZE_REPORT
from pipeline.run.runner import StageContext

# Quark model templates by config model_type; text-only variants use their family's template.
TEMPLATES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# Tensors transformers does not instantiate (so an in-memory export lacks them) but vLLM serves.
CARRIED_OVER = re.compile(r"^mtp\.")


def plan_exclusions(checkpoint: Checkpoint, spec: Quantization) -> list[str]:
    """The exclude patterns to hand Quark, validated against the checkpoint's layer names."""
    layers = checkpoint.linear_layers()
    patterns = exclusion_patterns(layers, checkpoint.model_type, spec.exclude, spec.quantize_mtp)
    check_exclusions(layers, patterns)
    return patterns


def choose_mode(spec: Quantization, checkpoint: Checkpoint) -> str:
    """`memory.quantize_mode_for` for this checkpoint: a bf16 model is held at its size on disk, an FP8 one
    dequantized to float32; a quantized MTP head needs file_to_file."""
    if spec.mode != "auto":
        return spec.mode
    held = checkpoint.size_bytes
    if is_fp8_source(checkpoint.config):
        elements = sum(math.prod(shape) for name, (shape, _, _) in checkpoint.tensors.items()
                       if not name.endswith(SCALE_SUFFIX))
        held = elements * IN_MEMORY_BYTES_PER_ELEMENT["fp8"]
    return quantize_mode_for(held, available_memory_bytes(), spec.quantize_mtp and has_mtp_head(checkpoint.config))


@dataclass
class QuantizeSummary:
    scheme: str
    mode: str
    template: str
    exclude: list[str]
    quantized_layers: int
    excluded_layers: int
    carried_over_tensors: int
    verification: dict = field(default_factory=dict)


def _quark():
    """Import Quark with torch.compile disabled for freeze (10x faster, identical bytes)."""
    os.environ.setdefault("QUARK_DISABLE_COMPILE", "1")
    try:
        import quark.torch as quark_torch
    except Exception as exc:
        raise ExternalError(f"AMD Quark failed to import ({exc.__class__.__name__}: {exc}); reinstall amd-quark==0.13") from exc
    return quark_torch


def _prepare_moe(model) -> None:
    """Fused experts -> per-expert Linears; without it Quark's export silently keeps bf16 experts."""
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization

    preprocess_for_quantization(model)


def _quant_config(template: str, scheme: str, patterns: list[str]):
    quark_torch = _quark()
    try:
        return quark_torch.LLMTemplate.get(template).get_config(scheme=scheme, exclude_layers=patterns)
    except (KeyError, ValueError) as exc:
        raise BadInputError(
            f"Quark has no template {template!r} for scheme {scheme!r} ({exc}); set [quantization] template"
        ) from exc


def load_source(folder: Path, model_class=None):
    """The source model in float32, for transformers to run: bf16 weights upcast; an FP8 source's weights
    dequantized as the quantizer sees them (`CheckpointReader`), its config without the FP8
    quantization_config (transformers' own FP8 loader dequantizes to bf16 on a CPU, not what the encoder
    sees). `model_class` defaults to the config's architecture."""
    import torch
    import transformers

    from pipeline.quant.file_to_file import CheckpointReader

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


def _quantize_in_memory(checkpoint: Checkpoint, out: Path, quant_config) -> None:
    import torch
    import transformers

    from pipeline.checkpoints.fp8 import output_dtype
    from pipeline.quant.file_to_file import TORCH_DTYPES

    quark_torch = _quark()
    architecture = checkpoint.config["architectures"][0]
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise BadInputError(f"transformers has no class {architecture}; use mode = 'file_to_file'")
    fp8_source = is_fp8_source(checkpoint.config)
    if fp8_source:  # Quark's FP8 flow encodes float32 weights: hold the model in float32
        model = load_source(checkpoint.folder, model_class).eval()
    else:
        model = model_class.from_pretrained(checkpoint.folder, dtype=torch.bfloat16).eval()
    if checkpoint.is_moe:
        _prepare_moe(model)
    quantizer = quark_torch.ModelQuantizer(quant_config)
    model = quantizer.quantize_model(model, None)  # MXFP4 weight scales need no calibration data
    model = quantizer.freeze(model)
    if fp8_source:  # what stays unquantized is written as file_to_file writes it (packed bytes are not floats)
        dtype = TORCH_DTYPES[output_dtype(checkpoint.config)]
        model = model.to(dtype)
        model.config.dtype = dtype
    quark_torch.export_safetensors(
        model, str(out), custom_mode="quark", weight_format="real_quantized", pack_method="reorder"
    )


def _quantize_file_to_file(checkpoint: Checkpoint, out: Path, quant_config, patterns: list[str], cluster=None) -> None:
    from pipeline.quant.file_to_file import quantize_file_to_file

    layers = checkpoint.linear_layers()
    quantize_file_to_file(checkpoint.folder, out, quant_config, set(layers) - excluded_layers(layers, patterns), cluster)


def _carry_over(source: Checkpoint, out: Path) -> int:
    """Copy side files and the tensors the export lacks (the MTP head of an in-memory export; dequantized
    if FP8) into `out`, one tensor at a time rather than a second copy of the head beside the model."""
    from pipeline.quant.file_to_file import CheckpointReader, StreamingSafetensorsWriter

    copy_side_files(source.folder, out, overwrite=False)
    exported = read_checkpoint(out)
    extra = "model-carried-over.safetensors"
    with CheckpointReader(source.folder, source.config) as reader:
        listing = reader.listing()
        missing = sorted(n for n in listing if CARRIED_OVER.match(n) and n not in exported.tensors)
        if not missing:
            return 0
        with StreamingSafetensorsWriter(out / extra, [(name, listing[name][1], listing[name][0]) for name in missing]) \
                as writer:
            for name in missing:
                writer.write(name, reader.written(name))
    weight_map = {name: file for name, (_, _, file) in exported.tensors.items()}
    weight_map.update(dict.fromkeys(missing, extra))
    write_index(out, weight_map)
    return len(missing)


def _list_kept_layers(out: Path) -> None:
    """Write the export's `quantization_config.exclude` as every Linear-like layer it keeps unquantized, by
    exact name, whatever the mode. vLLM matches exclude entries exactly (or as `re:` regexes), not as the
    recipe's globs, and builds every layer not listed as MXFP4; Quark's own file-to-file flow resolves its
    patterns the same way, while its in-memory export lists what its model held (not a carried-over head)."""
    export = read_checkpoint(out)
    kept = [layer for layer in export.linear_layers() if f"{layer}.weight_scale" not in export.tensors]
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["exclude"] = kept
    (out / "config.json").write_text(json.dumps(config, indent=4, ensure_ascii=False) + "\n")


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
    from pipeline.quant.file_to_file import CheckpointReader

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

    quark_torch = _quark()
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


def quantize_checkpoint(source: Path, out: Path, spec: Quantization, calibration: Calibration | None = None,
                        cluster: Cluster | None = None) -> QuantizeSummary:
    """Quantize `source` into the (empty or absent) folder `out`; verify it; return the summary. In
    file-to-file mode a Ray `cluster` quantizes the shards as Ray tasks (same bytes)."""
    checkpoint = read_checkpoint(source)
    if is_fp8_source(checkpoint.config):
        block_size(checkpoint.config)  # block-scaled, or one line now rather than half an export
    patterns = plan_exclusions(checkpoint, spec)
    mode = choose_mode(spec, checkpoint)
    template = spec.template or TEMPLATES.get(checkpoint.model_type, checkpoint.model_type)
    quant_config = _quant_config(template, spec.scheme, patterns)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if mode == "in_memory":
            _quantize_in_memory(checkpoint, out, quant_config)
        else:
            _quantize_file_to_file(checkpoint, out, quant_config, patterns, cluster)
    except (BadInputError, ExternalError):
        raise
    except Exception as exc:
        if is_disk_full(exc):
            raise  # the machine's problem, not Quark's: the runner says so
        raise ExternalError(f"Quark failed to quantize {source} ({exc.__class__.__name__}: {exc})") from exc
    carried = _carry_over(checkpoint, out)
    _list_kept_layers(out)
    verification = verify_export(checkpoint, out, patterns)
    layers = checkpoint.linear_layers()
    if calibration is not None and not checkpoint.is_moe and "ForCausalLM" in checkpoint.config["architectures"][0]:
        from transformers import AutoTokenizer

        from pipeline.quant.calibration import calibration_windows

        windows = calibration_windows(calibration, AutoTokenizer.from_pretrained(source))
        verification["logits"] = logit_agreement(checkpoint, out, windows)
    return QuantizeSummary(
        scheme=spec.scheme,
        mode=mode,
        template=template,
        exclude=patterns,
        quantized_layers=verification["bit_exact_tensors"],
        excluded_layers=len(excluded_layers(layers, patterns)),
        carried_over_tensors=carried,
        verification=verification,
    )


class QuantizeStage:
    name = "quantize"
    version = 5  # 5: exclude lists every kept layer by exact name (vLLM reads no globs); 4: FP8 sources
    sections = ("quantization", "calibration")
    requires = ("resolve/target.json",)  # the target only: a drafter change never re-quantizes
    tools = ("amd-quark", "torch", "transformers", "safetensors")

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> dict[str, float]:
        from pipeline.run.versions import tool_versions
        from pipeline.stages.resolve import read_resolved

        target = read_resolved(ctx.stage_dir("resolve"))["target"]
        ctx.console.print(f"  quantizing {target.ref} to {ctx.recipe.quantization.scheme} with AMD Quark")
        summary = quantize_checkpoint(
            Path(target.path), workdir / CHECKPOINT, ctx.recipe.quantization, ctx.recipe.calibration, ctx.recipe.cluster
        )
        report = QuantizeReport(target=target.ref, target_digest=target.digest, versions=tool_versions(),
                                **asdict(summary))
        write_artifact(report, workdir / QUANTIZE_REPORT)
        logits = report.verification.logits
        ctx.console.print(
            f"  {summary.quantized_layers} layers MXFP4 ({summary.mode}), {summary.excluded_layers} kept bf16; "
            f"bit-exact vs the OCP MX encoder"
            + (f"; top-1 agreement {logits.top1_agreement:.3f}, KL {logits.kl_bf16_to_mxfp4:.4f}" if logits else "")
        )
        # The process's peak so far: quantize is the run's first heavy stage, so this is its peak.
        return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
