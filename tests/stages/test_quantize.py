"""Quantize stage: Quark MXFP4 exports of dense, MoE and hybrid targets, verified bit for bit.

Fast tests check the planning done before Quark runs; `slow` tests run real Quark on the reference
target and on the tiny Qwen3.5 dense (hybrid GDN + vision + MTP) and MoE checkpoints.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

import pipeline.quant.export as export_module
from pipeline.checkpoints.folder import read_checkpoint
from pipeline.checkpoints.qwen35 import checkpoint_tensors
from pipeline.errors import BadInputError, ExternalError
from pipeline.quant.export import choose_mode, plan_exclusions, quantize_checkpoint
from pipeline.quant.memory import mxfp4_bytes
from pipeline.quant.quark import import_quark
from pipeline.quant.verify import verify_export
from pipeline.recipe import Calibration, Quantization


# --- planning (no Quark) -----------------------------------------------------------------------
def test_checkpoint_headers_list_layers_without_reading_weights(reference_target, tiny):
    reference = read_checkpoint(reference_target)
    assert "lm_head" in reference.linear_layers()  # tied head: a module with no tensor of its own
    assert "model.layers.0.self_attn.q_proj" in reference.linear_layers()
    moe = read_checkpoint(tiny / "qwen3.5-moe-tiny")
    assert moe.is_moe and "model.language_model.layers.0.mlp.experts.7.down_proj" in moe.linear_layers()


def test_missing_shard_is_bad_input(tmp_path, tiny):
    folder = shutil.copytree(tiny / "qwen3.5-tiny", tmp_path / "model")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(BadInputError, match="shard model-00001-of-00002.safetensors .* is missing"):
        read_checkpoint(folder)


def test_corrupted_safetensors_is_bad_input(tmp_path, tiny):
    folder = shutil.copytree(tiny / "qwen3.5-tiny", tmp_path / "model")
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(BadInputError, match="not a valid safetensors file"):
        read_checkpoint(folder)


def test_family_defaults_drop_what_the_variant_lacks(tiny):
    dense = plan_exclusions(read_checkpoint(tiny / "qwen3.5-tiny"), Quantization())
    assert dense == ["lm_head", "model.visual.*", "*mtp*"]
    moe = plan_exclusions(read_checkpoint(tiny / "qwen3.5-moe-tiny"), Quantization())
    assert "model.visual.*" not in moe and "*mlp.gate" in moe  # text-only MoE: no visual tower


def test_explicit_exclusions_keep_mtp_bf16_unless_switched(tiny):
    checkpoint = read_checkpoint(tiny / "qwen3.5-tiny")
    assert plan_exclusions(checkpoint, Quantization(exclude=["lm_head"])) == ["lm_head", "*mtp*"]
    assert plan_exclusions(checkpoint, Quantization(exclude=["lm_head"], quantize_mtp=True)) == ["lm_head"]


def test_bad_exclusions_fail_before_quark(tiny):
    checkpoint = read_checkpoint(tiny / "qwen3.5-tiny")
    with pytest.raises(BadInputError, match="matches no layer"):
        plan_exclusions(checkpoint, Quantization(exclude=["lm_haed"]))
    with pytest.raises(BadInputError, match="fused group in_proj_ba"):
        plan_exclusions(checkpoint, Quantization(exclude=["*.linear_attn.in_proj_a"]))


def test_a_per_tensor_fp8_source_is_refused_before_quark(tmp_path, tiny):
    source = tmp_path / "fp8"
    shutil.copytree(tiny / "qwen3.5-tiny", source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(BadInputError, match="per-tensor FP8 is not supported"):
        quantize_checkpoint(source, tmp_path / "out", Quantization(mode="in_memory"))
    assert not (tmp_path / "out").exists()


def test_an_fp8_source_is_held_in_float32_to_quantize_in_memory(tiny_fp8, monkeypatch):
    checkpoint = read_checkpoint(tiny_fp8)
    elements = sum(math.prod(shape) for name, (shape, _, _) in checkpoint.tensors.items()
                   if not name.endswith("_scale_inv"))
    monkeypatch.setattr(export_module, "available_memory_bytes", lambda: int(elements * 4 * 2.5) + 1)
    assert choose_mode(Quantization(mode="auto"), checkpoint) == "in_memory"
    monkeypatch.setattr(export_module, "available_memory_bytes", lambda: int(elements * 4 * 2.5) - 1)
    assert choose_mode(Quantization(mode="auto"), checkpoint) == "file_to_file"


def test_mode_choice(tiny):
    checkpoint = read_checkpoint(tiny / "qwen3.5-tiny")
    assert choose_mode(Quantization(mode="file_to_file"), checkpoint) == "file_to_file"
    assert choose_mode(Quantization(mode="auto"), checkpoint) == "in_memory"  # 11 MB fits anywhere
    # transformers builds no MTP head: only file to file can quantize it
    assert choose_mode(Quantization(mode="auto", quantize_mtp=True), checkpoint) == "file_to_file"


@pytest.mark.slow
def test_a_quantized_mtp_head_is_written_in_mxfp4(tiny, tmp_path):
    checkpoint = read_checkpoint(tiny / "qwen3.5-tiny")
    summary = quantize_checkpoint(checkpoint.folder, tmp_path / "out", Quantization(quantize_mtp=True))
    export = read_checkpoint(tmp_path / "out")
    mtp_linears = [m for m in checkpoint.linear_layers() if m.startswith("mtp.")]
    assert summary.mode == "file_to_file" and "mtp.fc" in mtp_linears
    assert all(f"{m}.weight_scale" in export.tensors for m in mtp_linears)
    assert not any(m.startswith("mtp.") for m in export.config["quantization_config"]["exclude"])


# --- real Quark ----------------------------------------------------------------------------
def _quantized_tensors(folder: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    names = [n.removesuffix("_scale") for n in tensors if n.endswith(".weight_scale")]
    return {n: tensors[n].numpy().tobytes() + tensors[n + "_scale"].numpy().tobytes() for n in names}


SAFETENSORS_BYTES = {"BF16": 2, "F32": 4, "U8": 1}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp4_weight_only"])
def test_tiny_qwen35_both_modes_are_bit_exact_and_agree(tmp_path, tiny, name, scheme):
    results = {}
    for mode in ("in_memory", "file_to_file"):
        summary = quantize_checkpoint(tiny / name, tmp_path / mode, Quantization(scheme=scheme, mode=mode))
        assert summary.mode == mode and summary.verification["bit_exact_tensors"] == summary.quantized_layers > 0
        assert summary.encoder["name"] == ("kernel" if mode == "file_to_file" else "quark")  # a CPU with a compiler
        config = json.loads((tmp_path / mode / "config.json").read_text())["quantization_config"]
        assert config["quant_method"] == "quark"
        assert config["global_quant_config"]["weight"]["dtype"] == "fp4"
        inputs = config["global_quant_config"]["input_tensors"]
        assert (inputs is None) == (scheme == "mxfp4_weight_only")
        if inputs is not None:
            assert inputs["is_dynamic"] is True
        files = {p.name for p in (tmp_path / mode).iterdir()}
        assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= files
        exported = read_checkpoint(tmp_path / mode)
        assert any(n.startswith("mtp.") for n in exported.tensors), "the MTP head was not carried over"
        assert not any(n.startswith("mtp.") and n.endswith("_scale") for n in exported.tensors)
        assert not any("conv1d" in n and n.endswith("_scale") for n in exported.tensors)
        # pipeline.quant.memory sizes the export from the source config alone, to the byte
        source_config = json.loads((tiny / name / "config.json").read_text())
        assert sum(math.prod(shape) * SAFETENSORS_BYTES[dtype] for shape, dtype, _ in exported.tensors.values()) == \
            mxfp4_bytes(checkpoint_tensors(source_config), summary.exclude)
        if "moe" in name:
            experts = summary.verification["moe_experts_quantized"]
            assert experts == 4 * 8 * 3  # 4 layers x 8 experts x gate/up/down
            assert summary.quantized_layers == experts  # only routed experts, by the family defaults
        results[mode] = _quantized_tensors(tmp_path / mode)
        # vLLM reads exclude entries as exact names: every kept Linear (the carried MTP head included) is named
        kept = [m for m in exported.linear_layers() if f"{m}.weight_scale" not in exported.tensors]
        assert config["exclude"] == kept and any(m.startswith("mtp.") for m in kept)
    assert results["in_memory"] == results["file_to_file"]
    # The export reloads through Quark's importer and still computes the source model's function: its
    # logits point the way the bf16 source's do (a random tiny model loses more to MXFP4 than a trained
    # one; mean cosine here is 0.87-0.96), and differ from them (it really is quantized).
    import torch

    from pipeline.study.targets import load_target

    reloaded = import_quark().import_model_from_safetensors(None, str(tmp_path / "file_to_file"), device="cpu")
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantized, source = reloaded.float().eval()(ids).logits[0], load_target(tiny / name, "bf16")(ids).logits[0]
    assert torch.nn.functional.cosine_similarity(quantized, source, dim=-1).mean() > 0.8
    assert not torch.allclose(quantized, source, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp4_weight_only"])
def test_an_fp8_source_gives_the_same_bytes_in_both_modes_and_is_verified(tmp_path, tiny_fp8, scheme):
    """Qwen's FP8 release layout in (fused experts and per-expert MTP weights e4m3 with 128x128 scales, one
    scale in another shard): both modes encode the float32 dequantized weights, keep the rest dequantized
    in bf16, drop the scales, and agree to the byte."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.checkpoints.reader import load_source

    def as_bytes(tensor) -> bytes:
        return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    exports = {}
    for mode, encoder in (("in_memory", "quark"), ("file_to_file", "kernel"), ("file_to_file_quark", "quark")):
        spec = Quantization(scheme=scheme, mode=mode.removesuffix("_quark"), encoder=encoder)
        summary = quantize_checkpoint(tiny_fp8, tmp_path / mode, spec)
        assert summary.encoder["name"] == encoder
        verification = summary.verification
        assert verification["source_format"] == "fp8" and verification["bit_exact_tensors"] == 4 * 8 * 3
        # attention, GDN and shared-expert projections of 4 layers, and the MTP layer's FP8 weights
        assert verification["dequantized_kept_tensors"] == 56
        exported = read_checkpoint(tmp_path / mode)
        assert {dtype for _, dtype, _ in exported.tensors.values()} == {"BF16", "U8"}  # no float8 or float32 left
        assert not any(name.endswith("_scale_inv") for name in exported.tensors)
        assert exported.tensors["mtp.layers.0.self_attn.q_proj.weight"][1] == "BF16"  # the MTP head, dequantized
        config = json.loads((tmp_path / mode / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "quark" and config["dtype"] == "bfloat16"
        exports[mode] = {name: as_bytes(tensor) for file in sorted((tmp_path / mode).glob("*.safetensors"))
                         for name, tensor in load_file(file).items()}
    # names included: a text-only class names its decoder model.*; the kernel reads e4m3 codes, Quark float32
    assert exports["in_memory"] == exports["file_to_file"] == exports["file_to_file_quark"]
    # The export reloads in Quark's importer and computes about what the dequantized source computes.
    source = read_checkpoint(tiny_fp8)
    reloaded = import_quark().import_model_from_safetensors(None, str(tmp_path / "file_to_file"), device="cpu")
    dequantized = load_source(tiny_fp8).eval()
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = reloaded.float().eval()(ids).logits[0], dequantized(ids).logits[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).mean() > 0.8
    # The check of kept weights can fail: one kept weight one bf16 ulp off is refused.
    name = "model.layers.0.linear_attn.out_proj.weight"
    file = tmp_path / "file_to_file" / exported.tensors[name][2]
    tensors = load_file(file)
    tensors[name] = (tensors[name].view(torch.int16) + 1).view(torch.bfloat16)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ExternalError, match="is not its FP8 source weight dequantized"):
        verify_export(source, tmp_path / "file_to_file", summary.exclude)


@pytest.mark.slow
def test_moe_export_that_kept_bf16_experts_fails(tmp_path, tiny, monkeypatch):
    # Skip Quark's MoE preparation: its export then keeps the fused bf16 experts and still writes a
    # quark quantization_config. The verification must refuse it.
    monkeypatch.setattr(export_module, "prepare_moe", lambda model: None)
    with pytest.raises(ExternalError) as info:
        quantize_checkpoint(tiny / "qwen3.5-moe-tiny", tmp_path / "out", Quantization(mode="in_memory"))
    assert "routed experts in bf16" in str(info.value) or "holds no MXFP4 tensor" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["mxfp4", "mxfp4_weight_only"])
def test_reference_target_quantizes_and_reloads(tmp_path, reference_target, scheme):
    summary = quantize_checkpoint(
        reference_target, tmp_path / "out", Quantization(scheme=scheme, exclude=["lm_head"], mode="in_memory"),
        Calibration(num_samples=2, seq_len=128),
    )
    assert summary.quantized_layers == 30 * 7  # q,k,v,o,gate,up,down in each of 30 layers
    logits = summary.verification["logits"]
    assert logits["tokens"] == 256
    assert 0.3 < logits["top1_agreement"] <= 1.0 and logits["kl_bf16_to_mxfp4"] > 0
    print(f"{scheme}: top-1 {logits['top1_agreement']:.3f}, KL {logits['kl_bf16_to_mxfp4']:.4f}")


# --- the CLI on bad input -------------------------------------------------------------------
def _recipe(tmp_path: Path, target: Path, drafter: Path, quantization: str = "") -> Path:
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f'name = "q"\n[target]\npath = "{target}"\n[drafter]\npath = "{drafter}"\n'
        f"[quantization]\nmode = 'in_memory'\n{quantization}"
    )
    return recipe


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, quantization, words",
    [
        ("shard", "", "is missing"),
        ("corrupt", "", "not a valid safetensors file"),
        (None, "exclude = ['lm_head', '*.mlp.gate_prj']", "matches no layer"),
        (None, "exclude = ['lm_head', '*.self_attn.q_proj']", "fused group qkv_proj"),
        (None, "scheme = 'mxfp8'", "quantization.scheme"),
    ],
)
def test_bad_input_exits_2_and_leaves_no_output(mxspec, tmp_path, tiny, damage, quantization, words):
    target = shutil.copytree(tiny / "qwen3.5-tiny", tmp_path / "target")
    if damage == "shard":
        (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x.weight": "model-2.safetensors"}}))
    elif damage == "corrupt":
        (target / "model.safetensors").write_bytes(b"not safetensors")
    recipe = _recipe(tmp_path, target, tiny / "qwen3.5-tiny-dflash", quantization)
    result = mxspec("quantize", recipe, "--out", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "quantize").exists()
    leftovers = [p.name for p in (tmp_path / "out").iterdir()] if (tmp_path / "out").exists() else []
    assert not [n for n in leftovers if ".tmp-" in n]
