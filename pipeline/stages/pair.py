"""Pair stage: prove the drafter fits the target and is byte-for-byte the drafter that was named.

Checks, each one clear error, before any expensive validation: the drafter is a DFlash checkpoint;
hidden size and vocabulary match the target (tokenizer files hashed where the drafter ships any);
every `target_layer_ids` entry is a target layer; the mask token is in the vocabulary; the block size
covers the recipe's budgets; the MXFP4 target keeps the bf16 target's tokenizer and declares its MTP
head so that vLLM loads it as stored (`mtp_declaration_problems`). Then the drafter's
files are hashed again and compared with their source: the recipe's pinned digest for a local
drafter, the Hub's content hashes (LFS blob names) for a Hub snapshot. The pair manifest names both
targets, the drafter, revisions and hashes, and the exact vLLM launch commands.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.checkpoints.folder import MTP_PREFIX, has_mtp_head, read_checkpoint, text_config
from pipeline.checkpoints.tokenizer import tokenizer_hashes
from pipeline.errors import BadInputError
from pipeline.run.artifacts import DrafterRef, ModelRef, PairManifest, QuantizedRef, ResolvedModel, write_artifact
from pipeline.run.hashing import HashCache, digest_of, list_files
from pipeline.run.layout import PAIR_FILE
from pipeline.run.runner import StageContext
from pipeline.serving.server import launch_commands
from pipeline.stages.resolve import read_resolved

__all__ = ["drafter_target_mismatches", "pairing_problems", "check_compatibility", "check_unchanged",
    "mtp_declaration_problems", "PairStage"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def drafter_target_mismatches(drafter: dict, target: dict) -> list[str]:
    """Why a DFlash drafter config cannot pair with a target config (empty list: it can)."""
    if not isinstance(drafter.get("dflash_config"), dict):
        return ["the drafter config has no dflash_config: not a DFlash drafter"]
    text = text_config(target)
    dflash = drafter["dflash_config"]
    missing = ([f"drafter config lacks an integer '{k}'" for k in ("hidden_size", "vocab_size") if not _is_int(drafter.get(k))]
               + [f"drafter dflash_config lacks '{k}'" for k in ("target_layer_ids", "mask_token_id") if k not in dflash]
               + [f"target config lacks an integer '{k}'" for k in ("hidden_size", "vocab_size", "num_hidden_layers")
                  if not isinstance(text, dict) or not _is_int(text.get(k))])
    if missing:
        return missing
    problems = []
    if drafter["hidden_size"] != text["hidden_size"]:
        problems.append(f"hidden_size {drafter['hidden_size']} != target {text['hidden_size']}")
    if drafter["vocab_size"] != text["vocab_size"]:
        problems.append(f"vocab_size {drafter['vocab_size']} != target {text['vocab_size']}")
    layers = text["num_hidden_layers"]
    if drafter.get("num_target_layers", layers) != layers:
        problems.append(f"num_target_layers {drafter['num_target_layers']} != target {layers}")
    bad = [i for i in dflash["target_layer_ids"] if not 0 <= i < layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside [0, {layers})")
    if not 0 <= dflash["mask_token_id"] < text["vocab_size"]:
        problems.append(f"mask_token_id {dflash['mask_token_id']} outside the vocabulary")
    return problems


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pairing_problems(drafter: dict, target: dict, budgets: list[int],
                     drafter_tokenizer: dict[str, str], target_tokenizer: dict[str, str]) -> list[str]:
    """Why a drafter cannot pair with a target, from their configs and tokenizer-file hashes alone
    (so `recipe check` and the start of a run find it before any quantization)."""
    if "DFlashDraftModel" not in (drafter.get("architectures") or []):
        return [f"architectures {drafter.get('architectures')} is not DFlashDraftModel"]
    problems = drafter_target_mismatches(drafter, target)
    block_size = drafter.get("block_size") or drafter.get("dflash_config", {}).get("block_size")
    if not isinstance(block_size, int) or not 2 <= block_size <= 64:
        problems.append(f"block_size {block_size!r} is not a sane DFlash block (2..64)")
    elif max(budgets) > block_size:
        problems.append(f"the recipe's budget {max(budgets)} exceeds the drafter's block_size {block_size}")
    for name in sorted(drafter_tokenizer.keys() & target_tokenizer.keys()):
        if drafter_tokenizer[name] != target_tokenizer[name]:
            problems.append(f"{name} differs between drafter and target (different tokenizers)")
    return problems


def check_compatibility(target: ResolvedModel, drafter: ResolvedModel, budgets: list[int]) -> None:
    problems = pairing_problems(drafter.config, target.config, budgets, tokenizer_hashes(Path(drafter.path), drafter.files),
                                tokenizer_hashes(Path(target.path), target.files))
    if problems:
        raise BadInputError(f"drafter {drafter.ref} does not pair with target {target.ref}: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def check_unchanged(drafter: ResolvedModel, pinned_digest: str | None, hashes: HashCache) -> dict[str, str]:
    """Hash the drafter's files now and compare with their source; returns the fresh hashes."""
    folder = Path(drafter.path)
    now = {name: hashes.file(folder / name) for name in list_files(folder)}
    if now.keys() != drafter.files.keys():
        added, removed = sorted(now.keys() - drafter.files.keys()), sorted(drafter.files.keys() - now.keys())
        raise BadInputError(f"drafter {drafter.ref} changed since it was resolved: files added {added} removed {removed}")
    for name, sha in now.items():
        if sha != drafter.files[name]:
            raise BadInputError(f"drafter file {name} changed since it was resolved (sha256 {drafter.files[name][:12]} -> {sha[:12]})")
        blob = (folder / name).resolve().name
        if drafter.source == "hub" and _SHA256.match(blob) and blob != sha:
            raise BadInputError(f"drafter file {name} differs from the Hub's content hash {blob[:12]} (sha256 {sha[:12]}); "
                                "delete it from the Hub cache and download again")
    if pinned_digest is not None and digest_of(now) != pinned_digest:
        raise BadInputError(
            f"drafter {drafter.ref} is not the pinned drafter: digest {digest_of(now)[:16]}... != drafter.sha256 "
            f"{pinned_digest[:16]}...; a byte of it changed (restore it, or pin the new digest if intended)"
        )
    return now


def mtp_declaration_problems(export: Path, source_config: dict) -> list[str]:
    """Why vLLM would not load the export's MTP head as stored (empty list: it would). A source with a head
    must keep it in the export, and each of its layers must be declared as vLLM reads a Quark config: a layer
    stored unquantized named in `quantization_config.exclude` (else vLLM builds it MXFP4 and the load fails
    or reads garbage), a quantized one not named there. A head that is missing is built randomly initialised."""
    from pipeline.quant.exclusions import served_as_kept

    if not has_mtp_head(source_config):
        return []
    checkpoint = read_checkpoint(export)
    exclude = (checkpoint.config.get("quantization_config") or {}).get("exclude") or []
    head = [layer for layer in checkpoint.linear_layers() if layer.startswith(MTP_PREFIX)]
    if not head:
        return [f"the export has no {MTP_PREFIX}* tensors but its source has an MTP head: vLLM would serve MTP "
                "from a randomly initialised head; re-run quantize"]
    problems = []
    for layer in head:
        stored_kept = f"{layer}.weight_scale" not in checkpoint.tensors
        if stored_kept and not served_as_kept(layer, exclude):
            problems.append(f"MTP layer {layer} is stored unquantized but quantization_config.exclude does not name "
                            "it, so vLLM would build it as MXFP4; re-run quantize")
        elif not stored_kept and served_as_kept(layer, exclude):
            problems.append(f"MTP layer {layer} is stored as MXFP4 but quantization_config.exclude names it, so vLLM "
                            "would build it unquantized; re-run quantize")
    return problems


class PairStage:
    name = "pair"
    version = 3
    sections = ("drafter", "validation", "serving")
    requires = ("resolve", "quantize")
    tools = ()

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> None:

        resolved = read_resolved(ctx.stage_dir("resolve"))
        target, drafter = resolved["target"], resolved["drafter"]
        check_compatibility(target, drafter, ctx.recipe.validation.budgets)
        hashes = check_unchanged(drafter, ctx.recipe.drafter.sha256, ctx.hashes)
        quantized_dir = ctx.run.checkpoint
        quantized_files = {name: ctx.hashes.file(quantized_dir / name) for name in list_files(quantized_dir)}
        for name in sorted(tokenizer_hashes(Path(target.path), target.files)):
            if quantized_files.get(name) != target.files[name]:
                raise BadInputError(f"the MXFP4 checkpoint's {name} differs from the target's; re-run quantize")
        if problems := mtp_declaration_problems(quantized_dir, target.config):
            raise BadInputError(f"{quantized_dir}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        block_size = drafter.config.get("block_size") or drafter.config["dflash_config"]["block_size"]
        drafter_ref = drafter.ref.split("@")[0] if drafter.source == "hub" else drafter.path
        target_ref = target.ref.split("@")[0] if target.source == "hub" else target.path
        manifest = PairManifest(
            target=ModelRef(ref=target.ref, revision=target.revision, digest=target.digest),
            quantized_target=QuantizedRef(path=str(quantized_dir), digest=digest_of(quantized_files)),
            drafter=DrafterRef(ref=drafter.ref, revision=drafter.revision, digest=digest_of(hashes), files=hashes),
            block_size=block_size,
            launch_commands=launch_commands(ctx.recipe, target_ref, str(quantized_dir), drafter_ref, block_size),
        )
        write_artifact(manifest, workdir / PAIR_FILE)
        ctx.console.print(f"  drafter {drafter.ref} pairs with {target.ref}; unchanged (digest {digest_of(hashes)[:12]})")
