"""Pair stage: compatibility errors are one clear line each; a changed drafter byte is caught."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pipeline.errors import BadInputError
from pipeline.recipe import ModelRef
from pipeline.run.hashing import HashCache, digest_of
from pipeline.stages.pair import check_compatibility, check_unchanged, mtp_declaration_problems
from pipeline.stages.resolve import resolve_model


def resolved(path: Path, role: str):
    return resolve_model(ModelRef(path=path), role)


def test_tiny_pairs_fit(tiny):
    for name in ("qwen3.5-tiny", "qwen3.5-moe-tiny"):
        check_compatibility(resolved(tiny / name, "target"), resolved(tiny / f"{name}-dflash", "drafter"), [4, 8, 16])


def test_hidden_size_mismatch(tiny, reference_target):
    with pytest.raises(BadInputError, match="hidden_size 256 != target 576"):
        check_compatibility(resolved(reference_target, "target"), resolved(tiny / "qwen3.5-tiny-dflash", "drafter"), [8])


def test_budget_beyond_block_size(tiny):
    target, drafter = resolved(tiny / "qwen3.5-tiny", "target"), resolved(tiny / "qwen3.5-tiny-dflash", "drafter")
    block = drafter.config["block_size"]
    with pytest.raises(BadInputError, match=f"budget {block * 2} exceeds the drafter's block_size {block}"):
        check_compatibility(target, drafter, [4, block * 2])


def test_layer_ids_beyond_the_target(tmp_path, tiny):
    folder = shutil.copytree(tiny / "qwen3.5-tiny-dflash", tmp_path / "drafter")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 40]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInputError, match=r"target_layer_ids \[40\] outside \[0, 4\)"):
        check_compatibility(resolved(tiny / "qwen3.5-tiny", "target"), resolved(folder, "drafter"), [4])


def test_different_tokenizer_files(tmp_path, tiny):
    folder = shutil.copytree(tiny / "qwen3.5-tiny-dflash", tmp_path / "drafter")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(BadInputError, match="tokenizer.json differs between drafter and target"):
        check_compatibility(resolved(tiny / "qwen3.5-tiny", "target"), resolved(folder, "drafter"), [4])


def test_not_a_dflash_checkpoint(tiny):
    with pytest.raises(BadInputError, match="is not DFlashDraftModel"):
        check_compatibility(resolved(tiny / "qwen3.5-tiny", "target"), resolved(tiny / "qwen3.5-tiny", "drafter"), [4])


def test_one_changed_byte_fails_the_unchanged_check(tmp_path, tiny):
    folder = shutil.copytree(tiny / "qwen3.5-tiny-dflash", tmp_path / "drafter")
    drafter = resolved(folder, "drafter")
    assert check_unchanged(drafter, drafter.digest, HashCache()) == drafter.files
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(BadInputError, match="drafter file model.safetensors changed since it was resolved"):
        check_unchanged(drafter, None, HashCache())
    # Resolved again after the change, only the pinned digest can tell: it does.
    with pytest.raises(BadInputError, match="is not the pinned drafter"):
        check_unchanged(resolved(folder, "drafter"), drafter.digest, HashCache())


def test_hub_blob_must_match_its_content_hash(tmp_path, tiny, monkeypatch):
    revision = "1" * 40
    repo = tmp_path / "hub" / "models--z-lab--tiny-dflash"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for src in (tiny / "qwen3.5-tiny-dflash").iterdir():
        blob = repo / "blobs" / ("0" * 64 if src.name == "model.safetensors" else src.name)
        shutil.copy(src, blob)
        (repo / "snapshots" / revision / src.name).symlink_to(blob)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    drafter = resolve_model(ModelRef(id="z-lab/tiny-dflash", revision=revision), "drafter")
    with pytest.raises(BadInputError, match="differs from the Hub's content hash"):
        check_unchanged(drafter, None, HashCache())


@pytest.mark.slow
def test_pair_stage_writes_manifest_with_launch_commands(mxspec, tmp_path, tiny):
    recipe = tmp_path / "recipe.toml"
    drafter_digest = digest_of(resolved(tiny / "qwen3.5-tiny-dflash", "drafter").files)
    recipe.write_text(
        f'name = "p"\n[target]\npath = "{tiny / "qwen3.5-tiny"}"\n'
        f'[drafter]\npath = "{tiny / "qwen3.5-tiny-dflash"}"\nsha256 = "{drafter_digest}"\n'
        "[quantization]\nmode = 'in_memory'\n[validation]\nbudgets = [4, 8]\n"
        "[serving]\ndtype = 'float32'\nenv = { VLLM_ROCM_USE_AITER = '1' }\n"
    )
    result = mxspec("pair", recipe, "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    pair = json.loads((tmp_path / "out" / "pair" / "pair.json").read_text())
    assert pair["drafter"]["digest"] == drafter_digest
    commands = pair["launch_commands"]
    mxfp4 = commands[f"mxfp4_dflash_block{pair['block_size']}"]
    assert mxfp4.startswith("VLLM_ROCM_USE_AITER=1 vllm serve ") and "quantize/checkpoint" in mxfp4
    assert '"method": "dflash"' in mxfp4 and str(tiny / "qwen3.5-tiny-dflash") in mxfp4

    # The export declares its MTP head as vLLM reads a Quark config; undeclared or dropped, pair refuses it
    export = tmp_path / "out" / "quantize" / "checkpoint"
    source = json.loads((tiny / "qwen3.5-tiny" / "config.json").read_text())
    assert mtp_declaration_problems(export, source) == []
    doctored = tmp_path / "doctored"
    shutil.copytree(export, doctored)
    config = json.loads((doctored / "config.json").read_text())
    exclude = config["quantization_config"]["exclude"]
    config["quantization_config"]["exclude"] = [name for name in exclude if not name.startswith("mtp.")]
    (doctored / "config.json").write_text(json.dumps(config))
    problems = mtp_declaration_problems(doctored, source)
    assert problems and problems[0].startswith("MTP layer mtp.") and "vLLM would build it as MXFP4" in problems[0]
    for shard in doctored.glob("*.safetensors"):  # a head dropped from the export entirely
        tensors = load_file(shard)
        save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, shard, metadata={"format": "pt"})
    assert "randomly initialised head" in mtp_declaration_problems(doctored, source)[0]


def test_vllm_reads_an_exclude_entry_as_mxspec_says_it_does():
    """`served_as_kept` is vLLM's own matcher: exact names and `re:` regexes; globs exclude nothing."""
    from vllm.model_executor.layers.quantization.quark.utils import should_ignore_layer

    from pipeline.quant.exclusions import served_as_kept

    exclude = ["mtp.fc", "re:mtp\\.layers\\.0\\.self_attn\\..*", "*mtp*", "lm_head"]
    for layer in ("mtp.fc", "mtp.layers.0.self_attn.o_proj", "mtp.layers.0.mlp.down_proj", "lm_head",
                  "model.layers.0.mlp.up_proj", "mtp.fc2"):
        assert served_as_kept(layer, exclude) == should_ignore_layer(layer, exclude), layer
    assert not served_as_kept("mtp.layers.0.mlp.down_proj", ["*mtp*"])
