"""A safetensors checkpoint folder as mxspec reads and writes it, stated once.

The quantize stage (both modes), the file-to-file writer and the architecture checks must agree on
the same facts: which files are weights and which ride along, the index's name and format, where a
config keeps its language-model part, and how a fused MoE tensor maps to the per-expert Linears
Quark and vLLM use. Each fact lives here so the writers cannot drift apart. Torch is not imported
at module level: light modules import this one.

Fused experts: `...mlp.experts.gate_up_proj` [E, 2I, H] holds, for expert e, the rows of
`...mlp.experts.{e}.gate_proj.weight` (first I rows) then `...up_proj.weight` (last I rows);
`...mlp.experts.down_proj` [E, H, I] holds `...mlp.experts.{e}.down_proj.weight` [H, I].
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.errors import BadInputError

__all__ = ["WEIGHT_INDEX", "SIDE_FILES", "FUSED_EXPERTS", "PER_EXPERT", "is_side_file", "copy_side_files",
    "shard_files", "write_index", "text_config", "MTP_PREFIX", "mtp_layers", "has_mtp_head", "export_name",
    "ExpertPiece", "split_fused_experts", "fused_source", "expert_slice", "expert_rows", "linear_modules",
    "linear_layers_from_tensors", "Checkpoint", "read_checkpoint"]

WEIGHT_INDEX = "model.safetensors.index.json"
# Files copied next to the weights: tokenizer, chat template, generation config, and the like.
SIDE_FILES = re.compile(r".*\.(json|jinja|txt|model|tiktoken|py|md)$")
# Written by the quantizer itself, never copied from the source.
_NOT_SIDE_FILES = frozenset({"config.json", WEIGHT_INDEX})

FUSED_EXPERTS = re.compile(r"^(?P<prefix>(?:.*\.)?mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?mlp\.experts)\.(?P<index>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)$")
_EXPERT_KINDS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_FUSED_KIND = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
_EMBEDDINGS = ("embed_tokens.weight", "pos_embed.weight")


# --- files ------------------------------------------------------------------------------------
def is_side_file(name: str) -> bool:
    """Whether a file of a checkpoint folder is copied unchanged into a quantized checkpoint."""
    return bool(SIDE_FILES.match(name)) and name not in _NOT_SIDE_FILES


def copy_side_files(source: Path, out: Path, *, overwrite: bool) -> list[str]:
    """Copy `source`'s side files into `out`; with `overwrite=False` a file already in `out` stays.
    Returns the names copied."""
    copied = []
    for path in sorted(Path(source).iterdir()):
        if path.is_file() and is_side_file(path.name) and (overwrite or not (Path(out) / path.name).exists()):
            shutil.copy2(path, Path(out) / path.name)
            copied.append(path.name)
    return copied


def shard_files(folder: Path) -> list[str]:
    """The weight files of a checkpoint: those the index's weight_map names, else every
    `*.safetensors` in the folder; sorted. Listed files are not checked to exist."""
    folder = Path(folder)
    index = folder / WEIGHT_INDEX
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return sorted(p.name for p in folder.glob("*.safetensors"))


def write_index(out: Path, weight_map: dict[str, str]) -> Path:
    """Write `out`'s weight index: tensor name -> file, sorted by name, 2-space JSON, final newline."""
    path = Path(out) / WEIGHT_INDEX
    path.write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return path


# --- config -----------------------------------------------------------------------------------
def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a (possibly multimodal) config."""
    return config.get("text_config", config)


MTP_PREFIX = "mtp."  # Qwen3.5's multi-token-prediction head, in checkpoint names


def mtp_layers(config: dict[str, Any]) -> int:
    """How many decoder layers the model's multi-token-prediction head has (`mtp_num_hidden_layers`; 0 when
    it has no head)."""
    return int(text_config(config).get("mtp_num_hidden_layers") or 0)


def has_mtp_head(config: dict[str, Any]) -> bool:
    """Whether the model has a multi-token-prediction head (Qwen3.5's `mtp.*`)."""
    return mtp_layers(config) > 0


def export_name(name: str, config: dict[str, Any]) -> str:
    """The name a tensor takes in an MXFP4 export. A text-only `*ForCausalLM` names its decoder `model.*`;
    a checkpoint that stores it as `model.language_model.*` (Qwen3.5's multimodal layout) is renamed, as
    Quark's in-memory export renames it: Quark's importer needs the class's own names, and vLLM reads both."""
    if config["architectures"][0].endswith("ForCausalLM") and name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


# --- fused experts ----------------------------------------------------------------------------
class ExpertPiece(NamedTuple):
    """One per-expert weight cut from a fused tensor."""

    name: str  # `...mlp.experts.{expert}.{kind}.weight`
    expert: int
    kind: str  # gate_proj | up_proj | down_proj
    shape: tuple[int, int]

    @property
    def module(self) -> str:
        return self.name.removesuffix(".weight")


def split_fused_experts(name: str, shape: tuple[int, ...]) -> list[ExpertPiece] | None:
    """The per-expert weights a fused 3-D expert tensor holds, expert by expert (gate before up);
    None when `name`/`shape` is not a fused expert tensor."""
    fused = FUSED_EXPERTS.match(name)
    if fused is None or len(shape) != 3:
        return None
    experts, rows, cols = shape
    if fused["kind"] == "gate_up_proj":
        rows //= 2
    return [ExpertPiece(f"{fused['prefix']}.{e}.{kind}.weight", e, kind, (rows, cols))
            for e in range(experts) for kind in _EXPERT_KINDS[fused["kind"]]]


def fused_source(module: str) -> tuple[str, int, str] | None:
    """For a per-expert module name `...mlp.experts.{e}.{kind}`: (fused tensor name, e, kind);
    None for any other name."""
    match = PER_EXPERT.match(module)
    if match is None:
        return None
    kind = match["kind"]
    return f"{match['prefix']}.{_FUSED_KIND[kind]}", int(match["index"]), kind


def expert_slice(tensor, expert: int, kind: str):
    """Expert `expert`'s `kind` weight out of a fused tensor (torch tensor or numpy array): a view."""
    return expert_rows(tensor[expert], kind)


def expert_rows(weight, kind: str):
    """One kind's rows of one expert's weight from a fused tensor: gate_proj / up_proj are the first /
    second half of the expert's gate_up rows; down_proj is all of it. A view."""
    if kind == "down_proj":
        return weight
    rows = weight.shape[0]
    if rows % 2:
        raise ValueError(f"fused gate_up_proj has an odd row count {rows}")
    if kind == "gate_proj":
        return weight[: rows // 2]
    if kind == "up_proj":
        return weight[rows // 2:]
    raise ValueError(f"unknown expert weight kind {kind!r}")


def linear_modules(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """The Linear-like layers one checkpoint tensor holds, module name -> (out, in); empty for any other
    tensor. A fused 3-D expert tensor holds one per expert and kind (see `linear_layers_from_tensors`)."""
    pieces = split_fused_experts(name, shape)
    if pieces is not None:
        return {piece.module: piece.shape for piece in pieces}
    if name.endswith(".weight") and len(shape) == 2 and not name.endswith(_EMBEDDINGS):
        return {name.removesuffix(".weight"): shape}
    return {}


def linear_layers_from_tensors(tensors: dict[str, tuple[int, ...]]) -> list[str]:
    """Module names of the Linear-like layers in a checkpoint's tensor listing.

    A Linear-like layer is a 2-D `X.weight` that is not an embedding table (`embed_tokens`,
    `pos_embed`); this includes `lm_head`, `mtp.fc`, the MoE router `mlp.gate` and
    `shared_expert_gate`, and the vision tower's Linears. Convolutions (`conv1d`, the vision
    `patch_embed.proj`) are not Linear. Fused 3-D experts expand to the per-expert names Quark and
    vLLM use: `mlp.experts.{e}.gate_proj`, `.up_proj`, `.down_proj`.
    """
    return [module for key, shape in tensors.items() for module in linear_modules(key, shape)]


# --- reading ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """A safetensors checkpoint as seen from its headers: no weight is read."""

    folder: Path
    config: dict
    tensors: dict[str, tuple[tuple[int, ...], str, str]]  # name -> (shape, dtype, file)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def text_config(self) -> dict:
        return text_config(self.config)

    @property
    def size_bytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in {t[2] for t in self.tensors.values()})

    @property
    def is_moe(self) -> bool:
        return "moe" in self.model_type or any(".mlp.experts." in name for name in self.tensors)

    def linear_layers(self) -> list[str]:
        layers = linear_layers_from_tensors({name: shape for name, (shape, _, _) in self.tensors.items()})
        if self.config.get("tie_word_embeddings") or self.text_config.get("tie_word_embeddings"):
            layers.append("lm_head")  # the tied head is a module even without its own tensor
        return sorted(set(layers))


def read_checkpoint(folder: Path) -> Checkpoint:
    """Read config.json and every shard's header; one clear error for a missing or broken shard."""
    from safetensors import safe_open

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{folder}/config.json unreadable ({exc.__class__.__name__}); is this a HF checkpoint?") from exc
    files = shard_files(folder)
    if (folder / WEIGHT_INDEX).exists():
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise BadInputError(f"{folder}: shard {missing[0]} listed in {WEIGHT_INDEX} is missing; re-download the checkpoint")
    if not files:
        raise BadInputError(f"{folder}: no *.safetensors weights; mxspec quantizes safetensors checkpoints")
    tensors = {}
    for file in files:
        try:
            with safe_open(folder / file, framework="pt") as handle:
                for name in handle.keys():
                    part = handle.get_slice(name)
                    tensors[name] = (tuple(part.get_shape()), part.get_dtype(), file)
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise BadInputError(
                f"{folder}/{file} is not a valid safetensors file ({exc.__class__.__name__}); re-download it"
            ) from exc
    return Checkpoint(folder, config, tensors)
