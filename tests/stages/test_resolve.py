"""Resolving target and drafter: local folders, the Hub cache when offline, and clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import BadInputError, ModelNotAvailableError
from pipeline.recipe import ModelRef
from pipeline.run.hashing import sha256_file
from pipeline.stages.resolve import resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


def test_local_folder_is_hashed_file_by_file(tmp_path):
    folder = make_checkpoint(tmp_path / "model")
    resolved = resolve_model(ModelRef(path=folder), "target")
    assert resolved.source == "local" and resolved.revision is None
    assert resolved.files == {
        "config.json": sha256_file(folder / "config.json"),
        "model.safetensors": sha256_file(folder / "model.safetensors"),
    }
    assert resolved.config == {"model_type": "llama"}


def test_local_folder_must_be_a_checkpoint(tmp_path):
    with pytest.raises(BadInputError, match="target.path: .* is not a folder"):
        resolve_model(ModelRef(path=tmp_path / "absent"), "target")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError, match="has no config.json"):
        resolve_model(ModelRef(path=tmp_path / "empty"), "drafter")


def _hub_cache(root: Path, repo_id: str, revision: str) -> Path:
    """The folder layout huggingface_hub keeps: models--owner--name/{refs,snapshots/<commit>}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    make_checkpoint(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo / "snapshots" / revision


def test_offline_hub_model_comes_from_the_cache(tmp_path, monkeypatch):
    snapshot = _hub_cache(tmp_path / "hub", "org/model", REVISION)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    resolved = resolve_model(ModelRef(id="org/model", revision=REVISION), "target")
    assert resolved.source == "hub" and resolved.revision == REVISION
    assert Path(resolved.path) == snapshot.resolve()
    assert resolved.ref == f"org/model@{REVISION}"


def test_offline_and_not_cached_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotAvailableError) as info:
        resolve_model(ModelRef(id="z-lab/Qwen3.5-27B-DFlash", revision=REVISION), "drafter")
    message = str(info.value)
    assert "not in the local Hub cache" in message and "HF_HUB_OFFLINE" in message
    assert f"hf download z-lab/Qwen3.5-27B-DFlash --revision {REVISION}" in message
    assert info.value.exit_code == 3


def test_resolve_stage_records_the_reference_pair(tmp_path, reference_target):
    from pipeline.entrypoints import run_pipeline
    from pipeline.recipe import load_recipe

    recipe = load_recipe("recipes/reference-cpu.toml")
    first = run_pipeline(recipe, tmp_path / "out", until="resolve")
    resolved = {role: json.loads((tmp_path / "out" / "resolve" / f"{role}.json").read_text()) for role in ("target", "drafter")}
    assert resolved["target"]["files"]["model.safetensors"] == sha256_file(reference_target / "model.safetensors")
    assert resolved["drafter"]["source"] == "local" and "model.safetensors" in resolved["drafter"]["files"]
    assert not first[0].skipped
    assert run_pipeline(recipe, tmp_path / "out", until="resolve")[0].skipped
