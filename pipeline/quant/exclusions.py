"""Which layers stay in bf16: the default exclusions per model family, and the checks run before
any quantization starts.

Patterns are fnmatch globs over module names, the way Quark matches its `exclude` list. Two rules
come from vLLM, which fuses some projections into one kernel at load time:
  - a fused group (GDN `in_proj_qkv`+`in_proj_z`, `in_proj_b`+`in_proj_a`; attention q/k/v; MLP
    gate/up) is excluded whole or not at all: vLLM rejects a partial one with a ValueError;
  - any exclusion under `mlp.experts.` unquantizes that layer's whole MoE block, so it must cover
    every expert of the layer.
A pattern that matches no layer is a mistake too (usually a typo), not a no-op.
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from collections.abc import Iterable

from pipeline.errors import BadInputError

__all__ = ["DEFAULT_EXCLUDE", "MTP_PATTERN", "FUSED_GROUPS", "default_exclusions", "exclusion_patterns",
    "excluded_layers", "check_exclusions", "served_as_kept"]

# Quark's own template defaults (amd-quark 0.13, quark/torch/quantization/config/template.py), which
# vLLM serves: lm_head, the visual tower and the MTP head stay bf16; for MoE only the routed experts
# are quantized.
_DENSE_QWEN35 = ["lm_head", "model.visual.*", "*mtp*"]
_MOE_QWEN35 = [*_DENSE_QWEN35, "*mlp.gate", "*shared_expert_gate*", "*.linear_attn.*", "*.self_attn.*", "*.shared_expert.*"]
DEFAULT_EXCLUDE: dict[str, list[str]] = {
    "qwen3_5": _DENSE_QWEN35,
    "qwen3_5_text": _DENSE_QWEN35,
    "qwen3_5_moe": _MOE_QWEN35,
    "qwen3_5_moe_text": _MOE_QWEN35,
    "llama": ["lm_head"],
}
MTP_PATTERN = "*mtp*"

# vLLM's fused projections: member suffix -> fused group name.
FUSED_GROUPS = {
    "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
    "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba",
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}


def default_exclusions(model_type: str, quantize_mtp: bool = False) -> list[str]:
    """The family's default patterns; `quantize_mtp` drops the MTP exclusion."""
    if model_type not in DEFAULT_EXCLUDE:
        raise BadInputError(
            f"no default exclusions for model_type {model_type!r}; list them in [quantization] exclude"
        )
    patterns = list(DEFAULT_EXCLUDE[model_type])
    return [p for p in patterns if p != MTP_PATTERN] if quantize_mtp else patterns


def exclusion_patterns(layers: list[str], model_type: str, exclude: list[str] | None, quantize_mtp: bool) -> list[str]:
    """The patterns a recipe's [quantization] means for a model with these Linear layers: its `exclude`
    (plus the MTP head unless `quantize_mtp`), or the family defaults that apply to this variant."""
    if exclude is None:
        # A family default that does not apply to this variant (no visual tower, no MTP) is dropped.
        return [p for p in default_exclusions(model_type, quantize_mtp) if excluded_layers(layers, [p])]
    patterns = list(exclude)
    if not quantize_mtp and excluded_layers(layers, [MTP_PATTERN]) and MTP_PATTERN not in patterns:
        patterns.append(MTP_PATTERN)
    return patterns


def excluded_layers(layers: Iterable[str], patterns: Iterable[str]) -> set[str]:
    patterns = list(patterns)
    return {name for name in layers if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def _group_of(name: str) -> tuple[str, str] | None:
    """(owner, group) of a layer that vLLM fuses with siblings, else None."""
    if ".mlp.experts." in name:
        owner = name.split(".mlp.experts.")[0] + ".mlp.experts"
        return owner, "experts"
    owner, _, leaf = name.rpartition(".")
    return (owner, FUSED_GROUPS[leaf]) if leaf in FUSED_GROUPS else None


def check_exclusions(layers: Iterable[str], patterns: Iterable[str]) -> set[str]:
    """Validate patterns against the model's quantizable layer names; return the excluded set.

    Raises BadInputError naming the pattern that matches nothing, or the fused group cut in two.
    """
    layers, patterns = sorted(set(layers)), list(patterns)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in layers):
            raise BadInputError(
                f"[quantization] exclude: pattern {pattern!r} matches no layer of this model; "
                "fix or remove it (patterns are fnmatch globs over module names, e.g. 'model.layers.*.mlp.down_proj')"
            )
    excluded = excluded_layers(layers, patterns)
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name in layers:
        if (group := _group_of(name)) is not None:
            groups[group].append(name)
    for (owner, group), members in sorted(groups.items()):
        inside = [m for m in members if m in excluded]
        if inside and len(inside) != len(members):
            outside = sorted(set(members) - set(inside))
            what = "MoE experts" if group == "experts" else f"fused group {group}"
            raise BadInputError(
                f"[quantization] exclude: {what} of {owner} is split: {len(inside)} of {len(members)} members "
                f"excluded (e.g. {inside[0][len(owner) + 1:]!r} but not {outside[0][len(owner) + 1:]!r}); "
                "vLLM fuses them, so exclude all of them or none"
            )
    return excluded


def served_as_kept(layer: str, exclude: Iterable[str]) -> bool:
    """Whether vLLM builds `layer` unquantized from a Quark export's `exclude` list: an entry equal to the
    layer's checkpoint name, or a `re:` regex matching it from its start. vLLM's Quark config reads no
    globs (`should_ignore_layer`), so a glob there excludes nothing."""
    return any(re.match(entry[3:], layer) if entry.startswith("re:") else entry == layer for entry in exclude)
