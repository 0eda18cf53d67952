"""The checkpoint facts in one place: side files, shard listing, the index, the config's text part,
and the split of fused MoE experts into per-expert weights."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pipeline.checkpoints.folder import (
    WEIGHT_INDEX,
    ExpertPiece,
    copy_side_files,
    expert_slice,
    fused_source,
    is_side_file,
    linear_layers_from_tensors,
    read_checkpoint,
    shard_files,
    split_fused_experts,
    text_config,
    write_index,
)
from pipeline.errors import BadInputError

PREFIX = "model.language_model.layers.0.mlp.experts"
E, I, H = 3, 4, 6  # experts, intermediate size, hidden size


def test_the_module_imports_without_torch():
    code = "import sys, pipeline.checkpoints.folder; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- fused experts --------------------------------------------------------------------------
def test_gate_up_splits_into_gate_then_up_per_expert_with_half_the_rows():
    pieces = split_fused_experts(f"{PREFIX}.gate_up_proj", (E, 2 * I, H))
    assert pieces == [
        ExpertPiece(f"{PREFIX}.{e}.{kind}.weight", e, kind, (I, H)) for e in range(E) for kind in ("gate_proj", "up_proj")
    ]
    assert pieces[0].module == f"{PREFIX}.0.gate_proj"


def test_down_splits_into_one_weight_per_expert_with_all_rows():
    pieces = split_fused_experts(f"{PREFIX}.down_proj", (E, H, I))
    assert pieces == [ExpertPiece(f"{PREFIX}.{e}.down_proj.weight", e, "down_proj", (H, I)) for e in range(E)]


@pytest.mark.parametrize("name, shape", [
    (f"{PREFIX}.gate_up_proj", (2 * I, H)),  # not 3-D
    (f"{PREFIX}.0.gate_proj.weight", (I, H)),  # already per expert
    ("model.layers.0.mlp.gate_up_proj", (E, 2 * I, H)),  # a dense MLP, not experts
    ("model.layers.0.mlp.shared_expert.down_proj.weight", (H, I)),
])
def test_other_tensors_are_not_fused_experts(name, shape):
    assert split_fused_experts(name, shape) is None


def test_fused_source_inverts_the_split():
    for fused, shape in ((f"{PREFIX}.gate_up_proj", (E, 2 * I, H)), (f"{PREFIX}.down_proj", (E, H, I))):
        for piece in split_fused_experts(fused, shape):
            assert fused_source(piece.module) == (fused, piece.expert, piece.kind)
    assert fused_source("mtp.layers.0.mlp.experts.12.up_proj") == ("mtp.layers.0.mlp.experts.gate_up_proj", 12, "up_proj")
    assert fused_source(f"{PREFIX}.0.gate_proj.weight") is None  # a tensor name, not a module
    assert fused_source("model.layers.0.mlp.gate_proj") is None


def _gate_up() -> np.ndarray:
    return np.arange(E * 2 * I * H, dtype=np.float32).reshape(E, 2 * I, H)


@pytest.mark.parametrize("as_torch", [False, True])
def test_expert_slice_takes_the_expert_then_the_documented_half(as_torch):
    gate_up, down = _gate_up(), np.arange(E * H * I, dtype=np.float32).reshape(E, H, I) + 1000
    fused_gate_up, fused_down = (torch.from_numpy(gate_up), torch.from_numpy(down)) if as_torch else (gate_up, down)
    for e in range(E):
        gate, up = (np.asarray(expert_slice(fused_gate_up, e, kind)) for kind in ("gate_proj", "up_proj"))
        np.testing.assert_array_equal(gate, gate_up[e, :I])
        np.testing.assert_array_equal(up, gate_up[e, I:])
        np.testing.assert_array_equal(np.asarray(expert_slice(fused_down, e, "down_proj")), down[e])
    # the slice shapes are the ones split_fused_experts announces
    pieces = split_fused_experts(f"{PREFIX}.gate_up_proj", gate_up.shape)
    assert all(tuple(expert_slice(fused_gate_up, p.expert, p.kind).shape) == p.shape for p in pieces)


def test_expert_slice_agrees_with_torch_chunk():
    fused = torch.randn(E, 2 * I, H)
    for e in range(E):
        gate, up = fused[e].chunk(2, dim=0)
        assert torch.equal(expert_slice(fused, e, "gate_proj"), gate)
        assert torch.equal(expert_slice(fused, e, "up_proj"), up)


def test_expert_slice_refuses_an_odd_gate_up_and_an_unknown_kind():
    with pytest.raises(ValueError, match="odd row count"):
        expert_slice(np.zeros((1, 5, 2)), 0, "gate_proj")
    with pytest.raises(ValueError, match="unknown expert weight kind"):
        expert_slice(np.zeros((1, 4, 2)), 0, "gate_up_proj")


def test_linear_layers_expand_fused_experts_and_skip_embeddings_and_non_2d():
    tensors = {
        f"{PREFIX}.gate_up_proj": (2, 2 * I, H),
        f"{PREFIX}.down_proj": (2, H, I),
        "model.language_model.embed_tokens.weight": (100, H),
        "model.visual.pos_embed.weight": (16, H),
        "model.language_model.layers.0.linear_attn.conv1d.weight": (8, 1, 4),
        "model.language_model.norm.weight": (H,),
        "lm_head.weight": (100, H),
    }
    assert linear_layers_from_tensors(tensors) == [
        f"{PREFIX}.0.gate_proj", f"{PREFIX}.0.up_proj", f"{PREFIX}.1.gate_proj", f"{PREFIX}.1.up_proj",
        f"{PREFIX}.0.down_proj", f"{PREFIX}.1.down_proj", "lm_head",
    ]


# --- config ---------------------------------------------------------------------------------
def test_text_config_is_the_nested_part_or_the_whole():
    text = {"hidden_size": 8}
    assert text_config({"model_type": "qwen3_5", "text_config": text}) is text
    flat = {"model_type": "qwen3_5_text", "hidden_size": 8}
    assert text_config(flat) is flat


# --- files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, side", [
    ("tokenizer.json", True), ("tokenizer_config.json", True), ("generation_config.json", True),
    ("chat_template.jinja", True), ("merges.txt", True), ("tokenizer.model", True), ("vocab.tiktoken", True),
    ("modeling_x.py", True), ("README.md", True),
    ("config.json", False), (WEIGHT_INDEX, False), ("model.safetensors", False), ("weights.bin", False),
    ("README.md.lock", False),
])
def test_side_file_rule(name, side):
    assert is_side_file(name) is side


def test_copy_side_files_overwrites_only_when_asked(tmp_path):
    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja", "config.json", WEIGHT_INDEX, "model.safetensors"):
        (source / name).write_text(f"source {name}")
    (source / "sub.json").mkdir()  # a folder is not a side file
    (out / "tokenizer.json").write_text("out")
    assert copy_side_files(source, out, overwrite=False) == ["chat_template.jinja"]
    assert (out / "tokenizer.json").read_text() == "out"
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "tokenizer.json"]
    assert copy_side_files(source, out, overwrite=True) == ["chat_template.jinja", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "source tokenizer.json"


def test_shard_files_without_an_index_are_the_sorted_safetensors(tmp_path):
    for name in ("b.safetensors", "a.safetensors", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert shard_files(tmp_path) == ["a.safetensors", "b.safetensors"]


def test_shard_files_with_an_index_are_the_files_it_names(tmp_path):
    (tmp_path / "stray.safetensors").write_bytes(b"")  # present but not indexed: not a shard
    write_index(tmp_path, {"x.weight": "m-2.safetensors", "y.weight": "m-1.safetensors", "z.weight": "m-2.safetensors"})
    assert shard_files(tmp_path) == ["m-1.safetensors", "m-2.safetensors"]


def test_write_index_round_trips_sorted_with_a_final_newline(tmp_path):
    weight_map = {"b.weight": "m-2.safetensors", "a.weight": "m-1.safetensors"}
    path = write_index(tmp_path, weight_map)
    assert path == tmp_path / WEIGHT_INDEX
    text = path.read_text()
    assert json.loads(text) == {"metadata": {}, "weight_map": weight_map}
    assert list(json.loads(text)["weight_map"]) == ["a.weight", "b.weight"]
    assert text.endswith("}\n") and text.startswith('{\n  "metadata"')


# --- reading --------------------------------------------------------------------------------
def _checkpoint(folder, config: dict | None = None):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "qwen3_5_moe_text"}))
    save_file({f"{PREFIX}.gate_up_proj": torch.zeros(2, 2 * I, H, dtype=torch.bfloat16)}, folder / "m-1.safetensors")
    save_file({"lm_head.weight": torch.zeros(10, H)}, folder / "m-2.safetensors")
    return folder


def test_read_checkpoint_lists_every_shard_header(tmp_path):
    folder = _checkpoint(tmp_path / "model")
    checkpoint = read_checkpoint(folder)
    assert checkpoint.tensors == {
        f"{PREFIX}.gate_up_proj": ((2, 2 * I, H), "BF16", "m-1.safetensors"),
        "lm_head.weight": ((10, H), "F32", "m-2.safetensors"),
    }
    assert checkpoint.is_moe and checkpoint.text_config == checkpoint.config
    assert checkpoint.linear_layers() == sorted(
        [f"{PREFIX}.{e}.{k}" for e in range(2) for k in ("gate_proj", "up_proj")] + ["lm_head"]
    )


def test_read_checkpoint_reads_only_indexed_shards(tmp_path):
    folder = _checkpoint(tmp_path / "model")
    write_index(folder, {"lm_head.weight": "m-2.safetensors"})
    assert list(read_checkpoint(folder).tensors) == ["lm_head.weight"]


def test_a_shard_listed_in_the_index_but_missing_is_bad_input(tmp_path):
    folder = _checkpoint(tmp_path / "model")
    write_index(folder, {"lm_head.weight": "m-2.safetensors", "x.weight": "m-3.safetensors"})
    with pytest.raises(BadInputError, match=f"shard m-3.safetensors listed in {WEIGHT_INDEX} is missing"):
        read_checkpoint(folder)


def test_a_folder_without_weights_or_config_is_bad_input(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(BadInputError, match="no \\*.safetensors weights"):
        read_checkpoint(tmp_path / "empty")
    with pytest.raises(BadInputError, match="config.json unreadable"):
        read_checkpoint(tmp_path / "absent")
