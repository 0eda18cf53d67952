"""Real Qwen3.5 target and DFlash drafter architectures, as data, for meta-device checks.

The configs live in `pipeline/checkpoints/configs/<name>.json`: each file is the model's config.json
(loadable by transformers; `layer_types` written out in full) plus a top-level `source` entry that
says where it came from (Hub repo, pinned revision, how it was obtained, published totals). The
weights are never available here: everything below works on the `meta` device.

Checkpoint names versus the transformers model (transformers 5.x):
- The targets are instantiated as `Qwen3_5ForConditionalGeneration` /
  `Qwen3_5MoeForConditionalGeneration`. Their state-dict names are the checkpoint's names for the
  language model (`model.language_model.*`, `lm_head.weight`) and the vision tower (`model.visual.*`),
  including the MoE's fused `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj`
  [E, H, I] (no `.weight` suffix).
- The checkpoint also holds the multi-token-prediction head `mtp.*`, which transformers does not
  instantiate (it ignores `^mtp.*` on load). `mtp_tensor_shapes` (`pipeline.checkpoints.qwen35`) supplies it: `mtp.fc` [H, 2H], three
  norms, and `mtp.layers.0.*` = one full-attention decoder layer; in MoE checkpoints its routed
  experts are stored PER EXPERT: `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`.
- The text-only classes (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) name the language model
  `model.*` instead of `model.language_model.*` (transformers and vLLM map the prefix on load).
- Quark's `preprocess_for_quantization` replaces fused experts with per-expert Linear modules
  `mlp.experts.{e}.{gate,up,down}_proj`; `linear_layers` lists routed experts under those names.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from pipeline.checkpoints.folder import linear_layers_from_tensors
from pipeline.checkpoints.qwen35 import mtp_tensor_shapes
from pipeline.checkpoints.stored_configs import DATA_DIR

__all__ = ["TARGETS", "DRAFTERS", "UNPAIRED_DRAFTERS", "NAMES", "load_config", "provenance", "is_drafter",
    "hf_config", "meta_model", "checkpoint_tensor_names", "linear_layers", "parameter_count"]

TARGETS: tuple[str, ...] = ("qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.5-9b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b-fp8")
DRAFTERS: dict[str, str] = {  # target -> its drafter, where both configs are stored
    "qwen3.5-27b": "qwen3.5-27b-dflash",
    "qwen3.5-35b-a3b": "qwen3.5-35b-a3b-dflash",
    "qwen3.5-122b-a10b": "qwen3.5-122b-a10b-dflash",
}
UNPAIRED_DRAFTERS: tuple[str, ...] = ("qwen3.5-4b-dflash",)  # its target's full config was not found
NAMES: tuple[str, ...] = (*TARGETS, *DRAFTERS.values(), *UNPAIRED_DRAFTERS)



def _data(name: str) -> dict[str, Any]:
    path = DATA_DIR / f"{name.lower()}.json"
    if not path.is_file():
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(NAMES)}")
    return json.loads(path.read_text())


def load_config(name: str) -> dict[str, Any]:
    """The model's config.json as a dict (without the `source` note)."""
    data = _data(name)
    data.pop("source", None)
    return data


def provenance(name: str) -> dict[str, Any]:
    """Where the stored config came from: repo, pinned revision, how obtained, published totals."""
    return _data(name)["source"]


def is_drafter(config: dict[str, Any]) -> bool:
    return "DFlashDraftModel" in config.get("architectures", [])


def hf_config(config: str | dict[str, Any]):
    """A transformers `PretrainedConfig` for a stored name or a config dict."""
    from transformers import AutoConfig

    data = load_config(config) if isinstance(config, str) else dict(config)
    data.pop("source", None)
    return AutoConfig.for_model(**data)


def _target_model_class(architecture: str) -> type[nn.Module]:
    import transformers

    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {architecture}")
    return cls


def meta_model(name: str) -> nn.Module:
    """The target (or drafter) built on the `meta` device: right names and shapes, no storage.

    Targets become `Qwen3_5(Moe)ForConditionalGeneration` (what `AutoModelForImageTextToText`
    picks for these configs): `model.language_model.*`, `model.visual.*`, `lm_head`. Drafters
    become `pipeline.speculative.dflash.DFlashDrafter`.
    """
    config = load_config(name)
    if is_drafter(config):
        from pipeline.speculative.dflash import DFlashConfig, DFlashDrafter

        with torch.device("meta"):
            return DFlashDrafter(DFlashConfig.from_dict(config))
    from transformers import AutoModelForImageTextToText

    cfg = hf_config(config)
    expected = config["architectures"][0]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
        if type(model).__name__ != expected:  # pragma: no cover - transformers changed its auto mapping
            model = _target_model_class(expected)._from_config(cfg)
    return model


@lru_cache(maxsize=None)
def _checkpoint_tensor_names(name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config = load_config(name)
    model = meta_model(name)
    items = [(key, tuple(t.shape)) for key, t in model.state_dict().items()]
    if not is_drafter(config):
        items += list(mtp_tensor_shapes(config).items())
    return tuple(items)


def checkpoint_tensor_names(name: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of the real safetensors checkpoint: name -> shape (`mtp.*` included)."""
    return dict(_checkpoint_tensor_names(name))


def linear_layers(name: str) -> list[str]:
    """Module names of every Linear-like layer of a stored architecture (see above)."""
    return linear_layers_from_tensors(checkpoint_tensor_names(name))


def parameter_count(name: str) -> int:
    """Total parameters of the real checkpoint (`mtp.*` included)."""
    total = 0
    for shape in checkpoint_tensor_names(name).values():
        count = 1
        for dim in shape:
            count *= dim
        total += count
    return total
