"""Real Qwen3.5 architectures on the meta device, and the tiny Qwen3.5 checkpoints the builder makes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import architectures as arch
from pipeline.checkpoints.folder import text_config
from pipeline.speculative.dflash import DFlashConfig, DFlashDrafter
from pipeline.stages.pair import drafter_target_mismatches

ROOT = Path(__file__).resolve().parents[1]

# Published figures (qwen35-configs.md): tensors, params, bf16 GB, and the language/mtp/visual split.
PUBLISHED = {
    "qwen3.5-27b": {"tensors": 1199, "params": 27_781_427_952, "gb": 55.56, "language": 851, "mtp": 15, "visual": 333},
    "qwen3.5-35b-a3b": {"tensors": 1811, "params": 35_951_822_704, "gb": 71.90, "language": 693, "mtp": 785, "visual": 333},
}
REVISIONS = {
    "qwen3.5-27b": ("Qwen/Qwen3.5-27B", "fc05daec18b0a78c049392ed2e771dde82bdf654"),
    "qwen3.5-35b-a3b": ("Qwen/Qwen3.5-35B-A3B", "59d61f3ce65a6d9863b86d2e96597125219dc754"),
    "qwen3.5-27b-dflash": ("z-lab/Qwen3.5-27B-DFlash", "b0400439c04be32c24e04d9dce3821b582c1a68a"),
    "qwen3.5-35b-a3b-dflash": ("z-lab/Qwen3.5-35B-A3B-DFlash", "a6ab3a277f856d91c43f28711611e7929073d56d"),
    "qwen3.5-397b-a17b-fp8": ("Qwen/Qwen3.5-397B-A17B-FP8", "ea5b4f81096f3901c91dea97f81324302495781d"),
    # reconstructed or unpinned: no revision could be confirmed from public sources (see each `source`)
    "qwen3.5-9b": ("Qwen/Qwen3.5-9B", None),
    "qwen3.5-122b-a10b": ("Qwen/Qwen3.5-122B-A10B", None),
    "qwen3.5-122b-a10b-dflash": ("z-lab/Qwen3.5-122B-A10B-DFlash", None),
    "qwen3.5-4b-dflash": ("z-lab/Qwen3.5-4B-DFlash", None),
}
GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _split(names) -> dict[str, list[str]]:
    parts = {"language": [], "mtp": [], "visual": []}
    for name in names:
        if name.startswith("mtp."):
            parts["mtp"].append(name)
        elif name.startswith("model.visual."):
            parts["visual"].append(name)
        else:
            parts["language"].append(name)
    return parts


# --- stored configs ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", arch.NAMES)
def test_stored_config_is_a_loadable_hf_config_with_its_source(name):
    config = arch.load_config(name)
    assert "source" not in config
    source = arch.provenance(name)
    assert (source["repo"], source["revision"]) == REVISIONS[name]
    assert source["obtained"]
    if arch.is_drafter(config):
        cfg = DFlashConfig.from_dict(config)
        assert len(config["layer_types"]) == cfg.num_hidden_layers
    else:
        hf = arch.hf_config(name)
        text = hf.text_config
        assert hf.model_type == config["model_type"]
        assert len(text.layer_types) == text.num_hidden_layers
        assert text.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
        assert text.layer_types.count("full_attention") == text.num_hidden_layers // 4


def test_unknown_name_is_rejected():
    with pytest.raises(KeyError, match="unknown architecture"):
        arch.load_config("qwen3.5-9000b")


# --- meta-device targets ----------------------------------------------------------------------
@pytest.mark.parametrize("name", arch.TARGETS)
def test_meta_model_allocates_nothing_and_has_checkpoint_names(name):
    import transformers  # noqa: F401  (imported before measuring)

    before = _rss_bytes()
    model = arch.meta_model(name)
    grown = _rss_bytes() - before
    assert type(model).__name__ == arch.load_config(name)["architectures"][0]
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert grown < 512 * 2**20, f"meta instantiation grew RSS by {grown / 2**20:.0f} MiB"

    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ckpt = arch.checkpoint_tensor_names(name)
    # transformers' names ARE the checkpoint's names, except the mtp head it does not build
    assert state == {k: v for k, v in ckpt.items() if not k.startswith("mtp.")}
    assert "lm_head.weight" in state
    assert "model.language_model.embed_tokens.weight" in state
    assert any(k.startswith("model.visual.blocks.26.") for k in state)
    assert not any(k.startswith("mtp.") for k in state)
    modules = dict(model.named_modules())
    assert "model.language_model" in modules and "model.visual" in modules and "lm_head" in modules


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_tensor_counts_and_parameter_totals_match_published(name):
    ckpt = arch.checkpoint_tensor_names(name)
    published = PUBLISHED[name]
    assert len(ckpt) == published["tensors"]
    assert {part: len(names) for part, names in _split(ckpt).items()} == {
        part: published[part] for part in ("language", "mtp", "visual")
    }
    params = arch.parameter_count(name)
    assert params == published["params"]
    assert round(params * 2 / 1e9, 2) == published["gb"]  # bf16 bytes
    assert arch.provenance(name)["published"]["params"] == params


def test_122b_a10b_reconstructed_config_gives_the_published_totals():
    """Tensors and parameters exactly. The published bytes exceed 2 x parameters by what storing each
    gated-delta-net layer's A_log (64) and norm (128) in float32 adds: 36 x 192 x 2 bytes."""
    published = arch.provenance("qwen3.5-122b-a10b")["published"]
    assert len(arch.checkpoint_tensor_names("qwen3.5-122b-a10b")) == published["tensors"] == 1949
    assert arch.parameter_count("qwen3.5-122b-a10b") == published["params"] == 125_086_497_008
    assert published["bytes"] - 2 * published["params"] == 36 * (64 + 128) * 2


def test_9b_reconstructed_config_gives_the_published_size_with_float32_vectors():
    """As for 122B-A10B: 24 gated-delta-net layers x (A_log 32 + norm 128) in float32 are the 7,680 bytes
    between the published size and 2 x this config's parameters."""
    published = arch.provenance("qwen3.5-9b")["published"]
    names = arch.checkpoint_tensor_names("qwen3.5-9b")
    assert published["bytes"] - 2 * arch.parameter_count("qwen3.5-9b") == 24 * (32 + 128) * 2
    assert {part: len(v) for part, v in _split(names).items() if part != "language"} == \
        {"mtp": published["tensors_mtp"], "visual": published["tensors_visual"]}


def test_27b_checkpoint_shapes():
    ckpt = arch.checkpoint_tensor_names("qwen3.5-27b")
    L = "model.language_model.layers"
    assert ckpt[f"{L}.3.self_attn.q_proj.weight"] == (12288, 5120)  # double width: output gate
    assert ckpt[f"{L}.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert ckpt[f"{L}.0.linear_attn.conv1d.weight"] == (2 * 16 * 128 + 48 * 128, 1, 4)
    assert ckpt[f"{L}.0.linear_attn.A_log"] == (48,)
    assert ckpt["lm_head.weight"] == (248320, 5120)
    assert ckpt["mtp.fc.weight"] == (5120, 10240)
    assert ckpt["mtp.layers.0.mlp.down_proj.weight"] == (5120, 17408)
    assert ckpt["model.visual.merger.linear_fc2.weight"] == (5120, 4608)


def test_35b_a3b_checkpoint_shapes():
    ckpt = arch.checkpoint_tensor_names("qwen3.5-35b-a3b")
    L = "model.language_model.layers"
    assert ckpt[f"{L}.3.self_attn.q_proj.weight"] == (8192, 2048)
    assert ckpt[f"{L}.0.mlp.gate.weight"] == (256, 2048)
    assert ckpt[f"{L}.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)  # fused, no .weight
    assert ckpt[f"{L}.0.mlp.experts.down_proj"] == (256, 2048, 512)
    assert ckpt[f"{L}.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert ckpt[f"{L}.0.mlp.shared_expert.down_proj.weight"] == (2048, 512)
    assert ckpt["model.visual.merger.linear_fc2.weight"] == (2048, 4608)
    mtp_experts = [k for k in ckpt if k.startswith("mtp.layers.0.mlp.experts.")]
    assert len(mtp_experts) == 256 * 3  # stored per expert
    assert ckpt["mtp.layers.0.mlp.experts.255.gate_proj.weight"] == (512, 2048)
    assert ckpt["mtp.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 512)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" not in ckpt


# --- Linear layers (what quantization exclusions match) ----------------------------------------
def _layer(names: list[str], prefix: str) -> set[str]:
    return {n.removeprefix(prefix) for n in names if n.startswith(prefix)}


def test_linear_layers_27b():
    names = arch.linear_layers("qwen3.5-27b")
    assert len(names) == len(set(names))
    L = "model.language_model.layers."
    assert _layer(names, L + "0.") == {f"linear_attn.{p}" for p in GDN} | {f"mlp.{p}" for p in MLP}
    assert _layer(names, L + "3.") == {f"self_attn.{p}" for p in ATTN} | {f"mlp.{p}" for p in MLP}
    assert _layer(names, "mtp.") == {"fc"} | {f"layers.0.self_attn.{p}" for p in ATTN} | {f"layers.0.mlp.{p}" for p in MLP}
    assert "lm_head" in names
    assert {"model.visual.blocks.0.attn.qkv", "model.visual.blocks.0.attn.proj",
            "model.visual.blocks.0.mlp.linear_fc1", "model.visual.blocks.0.mlp.linear_fc2",
            "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2"} <= set(names)
    # convolutions, embeddings and norms are not Linear
    assert not any("conv1d" in n or "embed" in n or n.endswith("norm") for n in names)
    # 48 GDN layers x 8 + 16 attention layers x 7 + mtp 1 + 7 + lm_head + visual 27 x 4 + 2
    assert len(names) == 48 * 8 + 16 * 7 + 8 + 1 + 27 * 4 + 2


def test_linear_layers_35b_a3b():
    names = arch.linear_layers("qwen3.5-35b-a3b")
    assert len(names) == len(set(names))
    L = "model.language_model.layers."
    experts = {f"mlp.experts.{e}.{p}" for e in range(256) for p in MLP}
    moe = {"mlp.gate", "mlp.shared_expert_gate"} | {f"mlp.shared_expert.{p}" for p in MLP} | experts
    assert _layer(names, L + "0.") == {f"linear_attn.{p}" for p in GDN} | moe
    assert _layer(names, L + "39.") == {f"self_attn.{p}" for p in ATTN} | moe
    assert _layer(names, "mtp.layers.0.") == {f"self_attn.{p}" for p in ATTN} | moe
    assert not any(re.search(r"\.mlp\.(gate|up|down)_proj$", n) for n in names)  # no dense MLP
    assert len(names) == 30 * (5 + 773) + 10 * (4 + 773) + (1 + 4 + 773) + 1 + 27 * 4 + 2


@pytest.mark.parametrize("name", arch.TARGETS)
def test_vllm_fused_groups_are_complete(name):
    """vLLM fuses these groups: every member must exist wherever one does."""
    names = set(arch.linear_layers(name))
    groups = [("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"), ("q_proj", "k_proj", "v_proj"),
              ("gate_proj", "up_proj")]
    for group in groups:
        for n in names:
            parent, _, leaf = n.rpartition(".")
            if leaf in group:
                assert {f"{parent}.{m}" for m in group} <= names


# --- drafters ---------------------------------------------------------------------------------
@pytest.mark.parametrize("target", sorted(arch.DRAFTERS))
def test_drafter_config_consistent_with_target(target):
    drafter = arch.load_config(arch.DRAFTERS[target])
    config = arch.load_config(target)
    assert drafter_target_mismatches(drafter, config) == []
    text = text_config(config)
    cfg = DFlashConfig.from_dict(drafter)
    assert cfg.hidden_size == text["hidden_size"]
    assert cfg.vocab_size == text["vocab_size"]
    assert max(cfg.target_layer_ids) < text["num_hidden_layers"] == cfg.num_target_layers
    assert cfg.mask_token_id in (248070, 248077)  # z-lab's earlier and current drafters
    assert cfg.mask_token_id < text["vocab_size"]
    assert cfg.block_size == 16


def test_drafter_mismatches_are_reported():
    drafter = arch.load_config("qwen3.5-35b-a3b-dflash")
    bad = {**drafter, "hidden_size": 5120, "dflash_config": {"mask_token_id": 248320, "target_layer_ids": [1, 40]}}
    problems = drafter_target_mismatches(bad, arch.load_config("qwen3.5-35b-a3b"))
    assert len(problems) == 3 and any("hidden_size" in p for p in problems)


def test_drafter_parameter_totals():
    assert arch.parameter_count("qwen3.5-27b-dflash") == 1_730_213_120
    assert round(arch.parameter_count("qwen3.5-35b-a3b-dflash") / 1e6, 1) == 474.0
    names = arch.checkpoint_tensor_names("qwen3.5-27b-dflash")
    assert names["fc.weight"] == (5120, 5 * 5120)
    assert not any("embed" in n or "lm_head" in n for n in names)


# --- tiny checkpoints (built by `make` into models/tiny; fixture `tiny` in conftest) ---------
def test_tiny_builder_is_deterministic(tmp_path):
    """The random models `make` trains from (scripts/train_tiny_qwen35.py) are the same on every build."""
    for build in ("first", "second"):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "build_tiny_qwen35.py"), str(tmp_path / build)],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("qwen3.5-tiny", "qwen3.5-moe-tiny-dflash"):
        first, second = (tmp_path / b / name / "model.safetensors" for b in ("first", "second"))
        assert first.read_bytes() == second.read_bytes()


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as handle:
        return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}


def test_tiny_builder_layout(tiny):
    expected = {"qwen3.5-tiny", "qwen3.5-tiny-dflash", "qwen3.5-moe-tiny", "qwen3.5-moe-tiny-dflash",
                "qwen3.5-moe-tiny-fp8"}  # the last by scripts/build_tiny_fp8.py
    assert {p.name for p in tiny.iterdir()} == expected  # no temp leftovers
    for name in ("qwen3.5-tiny", "qwen3.5-moe-tiny"):
        config = json.loads((tiny / name / "config.json").read_text())
        text = text_config(config)
        assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
        assert text["mtp_num_hidden_layers"] == 1


def test_tiny_dense_loads_with_transformers_and_carries_mtp(tiny):
    from transformers import AutoModelForImageTextToText

    path = tiny / "qwen3.5-tiny"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5" and "vision_config" in config
    shapes = _safetensors_shapes(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mtp = arch.mtp_tensor_shapes(config)
    assert len(mtp) == 15
    assert shapes == {**state, **mtp}  # real names: model.language_model.*, model.visual.*, lm_head, mtp.*
    assert any(k.startswith("model.visual.blocks.") for k in shapes)
    assert shapes["mtp.fc.weight"] == (256, 512)
    ids = torch.tensor([[257, 104, 105, 258]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.shape == (1, 4, 512)
    assert len(out.hidden_states) == 5


def test_tiny_moe_config_names_and_mtp_experts(tiny):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny / "qwen3.5-moe-tiny"
    config = json.loads((path / "config.json").read_text())
    hf = AutoConfig.from_pretrained(path)
    assert hf.model_type == "qwen3_5_moe_text" and hf.num_experts == 8
    shapes = _safetensors_shapes(path)
    E, H, I = 8, 256, 128
    L = "model.language_model.layers"
    assert shapes[f"{L}.0.mlp.experts.gate_up_proj"] == (E, 2 * I, H)
    assert shapes[f"{L}.3.mlp.experts.down_proj"] == (E, H, I)
    assert shapes[f"{L}.0.mlp.gate.weight"] == (E, H)
    assert shapes[f"{L}.0.mlp.shared_expert_gate.weight"] == (1, H)
    assert not any(k.startswith("model.layers.") for k in shapes)
    mtp = arch.mtp_tensor_shapes(config)
    assert {k: v for k, v in shapes.items() if k.startswith("mtp.")} == mtp
    assert len([k for k in mtp if ".mlp.experts." in k]) == E * 3
    assert shapes["mtp.layers.0.mlp.experts.7.up_proj.weight"] == (I, H)
    # the checkpoint layout (language_model prefix, fused experts) loads back into transformers
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert len(model.state_dict()) == len(shapes) - len(mtp)
    linear = arch.linear_layers_from_tensors(shapes)
    assert f"{L}.0.mlp.experts.7.down_proj" in linear and "mtp.layers.0.mlp.experts.7.down_proj" in linear


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_tiny_drafter_matches_its_target(tiny, name):
    from transformers import AutoTokenizer

    target = json.loads((tiny / name / "config.json").read_text())
    drafter_path = tiny / f"{name}-dflash"
    drafter_cfg = json.loads((drafter_path / "config.json").read_text())
    assert drafter_cfg["architectures"] == ["DFlashDraftModel"]
    assert drafter_target_mismatches(drafter_cfg, target) == []
    tokenizer = AutoTokenizer.from_pretrained(tiny / name)
    assert len(tokenizer) == text_config(target)["vocab_size"]
    assert tokenizer.convert_ids_to_tokens(drafter_cfg["dflash_config"]["mask_token_id"]) == "<|dflash_mask|>"
    text = "Hello, wörld! 你好"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    drafter = DFlashDrafter.from_pretrained(drafter_path)
    cfg = drafter.cfg
    ctx = drafter.fuse_context(torch.randn(1, 3, len(cfg.target_layer_ids) * cfg.hidden_size))
    out = drafter(torch.randn(1, cfg.block_size, cfg.hidden_size), ctx, torch.arange(3)[None],
                  torch.arange(3, 3 + cfg.block_size)[None])
    assert out.shape == (1, cfg.block_size, cfg.hidden_size)
