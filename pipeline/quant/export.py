"""An MXFP4 export of a checkpoint with AMD Quark that vLLM loads (quant_method quark).

Two execution modes, chosen from the checkpoint size and the machine's memory (recipe can force):
  - in_memory: transformers loads the model, Quark quantizes, freezes and exports it;
  - file_to_file: shard by shard and tensor by tensor with Quark's weight quantizer and a streaming
    writer (`file_to_file`), so a 70 GB checkpoint needs about one tensor of memory.
The source is bf16, or FP8 block-scaled (`checkpoints.fp8`): then both modes encode the float32
dequantized weights, as Quark's FP8 flow does, and write what stays unquantized dequantized, in the
config's dtype (bf16). Before any work the exclusions are checked against the checkpoint's real layer
names (`exclusions`); after the export `verify` holds every quantized tensor to the project's own
MXFP4 encoder."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.checkpoints.folder import (
    MTP_PREFIX,
    Checkpoint,
    copy_side_files,
    has_mtp_head,
    read_checkpoint,
    write_index,
)
from pipeline.checkpoints.fp8 import SCALE_SUFFIX, block_size, is_fp8_source
from pipeline.checkpoints.reader import load_source
from pipeline.errors import BadInputError, ExternalError
from pipeline.quant.encoder import EncoderChoice
from pipeline.quant.exclusions import check_exclusions, excluded_layers, exclusion_patterns
from pipeline.quant.memory import available_memory_bytes, quantize_mode_for
from pipeline.quant.quark import import_quark, prepare_moe, quark_config
from pipeline.quant.verify import logit_agreement, verify_export
from pipeline.recipe import Calibration, Cluster, Quantization
from pipeline.run.atomic import is_disk_full

__all__ = ["TEMPLATES", "CARRIED_OVER", "plan_exclusions", "choose_mode", "QuantizeSummary", "quantize_checkpoint"]

# Quark model templates by config model_type; text-only variants use their family's template.
TEMPLATES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


# Tensors transformers does not instantiate (so an in-memory export lacks them) but vLLM serves.
CARRIED_OVER = re.compile("^" + re.escape(MTP_PREFIX))


def plan_exclusions(checkpoint: Checkpoint, spec: Quantization) -> list[str]:
    """The exclude patterns to hand Quark, validated against the checkpoint's layer names."""
    layers = checkpoint.linear_layers()
    patterns = exclusion_patterns(layers, checkpoint.model_type, spec.exclude, spec.quantize_mtp)
    check_exclusions(layers, patterns)
    return patterns


def choose_mode(spec: Quantization, checkpoint: Checkpoint) -> str:
    """The recipe's mode, or `memory.quantize_mode_for` this checkpoint's weights (FP8 scales not counted)."""
    if spec.mode != "auto":
        return spec.mode
    elements = sum(math.prod(shape) for name, (shape, _, _) in checkpoint.tensors.items()
                   if not name.endswith(SCALE_SUFFIX))
    source = "fp8" if is_fp8_source(checkpoint.config) else "bf16"
    return quantize_mode_for(elements, source, available_memory_bytes(),
                             spec.quantize_mtp and has_mtp_head(checkpoint.config))


@dataclass
class QuantizeSummary:
    scheme: str
    mode: str
    template: str
    exclude: list[str]
    quantized_layers: int
    excluded_layers: int
    carried_over_tensors: int
    encoder: dict = field(default_factory=dict)
    verification: dict = field(default_factory=dict)


def _quantize_in_memory(checkpoint: Checkpoint, out: Path, quant_config) -> None:
    import torch
    import transformers

    from pipeline.checkpoints.fp8 import output_dtype
    from pipeline.checkpoints.reader import TORCH_DTYPES

    quark_torch = import_quark()
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
        prepare_moe(model)
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


def _quantize_file_to_file(checkpoint: Checkpoint, out: Path, quant_config, patterns: list[str], cluster, encoder: str,
                           say) -> EncoderChoice:
    from pipeline.quant.file_to_file import quantize_file_to_file

    layers = checkpoint.linear_layers()
    return quantize_file_to_file(checkpoint.folder, out, quant_config, set(layers) - excluded_layers(layers, patterns),
                                 cluster, encoder, say)


def _carry_over(source: Checkpoint, out: Path) -> int:
    """Copy side files and the tensors the export lacks (the MTP head of an in-memory export; dequantized
    if FP8) into `out`, one tensor at a time rather than a second copy of the head beside the model."""
    from pipeline.checkpoints.reader import CheckpointReader
    from pipeline.checkpoints.writer import StreamingSafetensorsWriter

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


def quantize_checkpoint(source: Path, out: Path, spec: Quantization, calibration: Calibration | None = None,
                        cluster: Cluster | None = None, say=print) -> QuantizeSummary:
    """Quantize `source` into the (empty or absent) folder `out`; verify it; return the summary. In
    file-to-file mode a Ray `cluster` quantizes the shards as Ray tasks (same bytes), and `spec.encoder`
    picks the MXFP4 encoder (`admission.choose_encoder`); in-memory mode is Quark's ModelQuantizer."""
    checkpoint = read_checkpoint(source)
    if is_fp8_source(checkpoint.config):
        block_size(checkpoint.config)  # block-scaled, or one line now rather than half an export
    patterns = plan_exclusions(checkpoint, spec)
    mode = choose_mode(spec, checkpoint)
    template = spec.template or TEMPLATES.get(checkpoint.model_type, checkpoint.model_type)
    quant_config = quark_config(template, spec.scheme, patterns)
    out.mkdir(parents=True, exist_ok=True)
    try:
        if mode == "in_memory":
            _quantize_in_memory(checkpoint, out, quant_config)
            encoder = EncoderChoice("quark", "cpu", None, "in_memory mode: Quark's ModelQuantizer freezes the model")
        else:
            encoder = _quantize_file_to_file(checkpoint, out, quant_config, patterns, cluster, spec.encoder, say)
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
        encoder=asdict(encoder),
        verification=verification,
    )
