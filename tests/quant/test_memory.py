"""pipeline.quant.memory: a Qwen3.5 checkpoint's tensors, bytes and one-GPU fit from its config alone, held to
transformers on the meta device, to the tiny checkpoints on disk and to the published totals."""

from __future__ import annotations

import pytest

from pipeline import architectures as arch
from pipeline.checkpoints import qwen35
from pipeline.checkpoints.folder import read_checkpoint, split_fused_experts, text_config
from pipeline.quant import memory
from pipeline.quant.exclusions import default_exclusions


@pytest.mark.parametrize("name", arch.TARGETS)
def test_the_layout_from_the_config_is_transformers_layout_name_for_name(name):
    config = arch.load_config(name)
    assert qwen35.checkpoint_tensors(config) == arch.checkpoint_tensor_names(name)
    published = arch.provenance(name)["published"]
    if "params" in published:
        assert memory.bf16_bytes(qwen35.checkpoint_tensors(config)) == 2 * published["params"]
    if "tensors_mtp" in published:
        assert len(qwen35.mtp_tensor_shapes(config)) == published["tensors_mtp"]


@pytest.mark.parametrize("name", arch.TARGETS)
def test_the_mtp_layer_is_a_full_attention_decoder_layer_of_transformers(name):
    """The MTP head is not instantiated by transformers; its layer is its full-attention decoder layer,
    with routed experts stored per expert."""
    import torch

    config = arch.load_config(name)
    text = text_config(config)
    if "moe" in text["model_type"]:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer
    hf_text = arch.hf_config(text)
    with torch.device("meta"):
        layer = Layer(hf_text, list(hf_text.layer_types).index("full_attention"))
    expected = {}
    for key, tensor in layer.state_dict().items():
        pieces = split_fused_experts(key, tuple(tensor.shape))
        expected |= {key: tuple(tensor.shape)} if pieces is None else {p.name: p.shape for p in pieces}
    mtp = qwen35.mtp_tensor_shapes(config)
    assert {k.removeprefix("mtp.layers.0."): v for k, v in mtp.items() if k.startswith("mtp.layers.0.")} == expected


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "qwen3.5-moe-tiny"])
def test_the_layout_matches_the_tiny_checkpoints_on_disk(tiny, name):
    on_disk = read_checkpoint(tiny / name)
    assert qwen35.checkpoint_tensors(on_disk.config) == {k: shape for k, (shape, _, _) in on_disk.tensors.items()}


@pytest.mark.parametrize("name", [n for n in (*arch.DRAFTERS.values(), *arch.UNPAIRED_DRAFTERS)
                                  if "params" in arch.provenance(n)["published"]])
def test_drafter_parameters_match_the_published_count(name):
    published = arch.provenance(name)["published"]["params"]
    assert memory.bf16_bytes(qwen35.drafter_tensors(arch.load_config(name))) / 2 == pytest.approx(published, rel=1e-3)


def test_mxfp4_bytes_pack_half_a_byte_per_weight_plus_a_scale_per_32_and_keep_exclusions_bf16():
    tensors = {"a.weight": (64, 128), "lm_head.weight": (8, 64), "norm.weight": (64,),
               "mlp.experts.gate_up_proj": (2, 64, 32), "mlp.experts.down_proj": (2, 32, 32)}
    packed = 64 * 128 // 2 + 64 * 128 // 32
    experts = 2 * (64 * 32 // 2 + 64 * 32 // 32) + 2 * (32 * 32 // 2 + 32 * 32 // 32)
    assert memory.mxfp4_bytes(tensors, ["lm_head"]) == packed + 8 * 64 * 2 + 64 * 2 + experts
    assert memory.mxfp4_bytes(tensors, ["lm_head", "mlp.experts.*"]) == \
        packed + 8 * 64 * 2 + 64 * 2 + 2 * (2 * 64 * 32 + 2 * 32 * 32)


def test_auto_quantizes_in_memory_only_with_room_for_two_and_a_half_copies_as_held():
    assert memory.quantize_mode_for(5, "bf16", 26) == "in_memory"  # 10 bytes held in bf16
    assert memory.quantize_mode_for(5, "bf16", 25) == "file_to_file"
    assert memory.quantize_mode_for(5, "fp8", 51) == "in_memory"  # 20 bytes: an FP8 source is held in float32
    assert memory.quantize_mode_for(5, "fp8", 50) == "file_to_file"
    assert memory.quantize_mode_for(5, "bf16", 10**9, quantizes_mtp_head=True) == "file_to_file"  # no head in memory


def test_a_quantized_mtp_head_is_planned_file_to_file_only_where_there_is_a_head():
    qwen = arch.load_config("qwen3.5-27b")
    headless_config = {**qwen, "text_config": {**qwen["text_config"], "mtp_num_hidden_layers": 0}}
    roomy = {"max_model_len": 4096, "available_bytes": 10**13}
    assert memory.plan_memory(qwen, None, [], quantize_mtp=True, **roomy).quantize_mode_here == "file_to_file"
    assert memory.plan_memory(qwen, None, [], **roomy).quantize_mode_here == "in_memory"
    headless = memory.plan_memory(headless_config, None, [], quantize_mtp=True, **roomy)
    assert headless.quantize_mode_here == "in_memory" and not headless.quantizes_mtp_head


def test_the_27b_pair_fits_one_mi355x_and_the_largest_server_sets_the_need():
    config, drafter = arch.load_config("qwen3.5-27b"), arch.load_config("qwen3.5-27b-dflash")
    plan = memory.plan_memory(config, drafter, default_exclusions("qwen3_5"), max_model_len=None,
                              speculative_tokens=15, available_bytes=100 * 10**9)
    assert plan.max_model_len == text_config(config)["max_position_embeddings"] == 262144
    # one server per method: MTP adds its layer's KV (4 KV heads x 256), DFlash the drafter's weights and
    # 5 layers of 8 KV heads x 128; the target's 16 full-attention layers are in both
    mtp_token, dflash_token = (16 + 1) * 2 * 4 * 256 * 2, 16 * 2 * 4 * 256 * 2 + 5 * 2 * 8 * 128 * 2
    # 48 gated-delta-net layers, 1 + 15 state blocks: 48 value heads x 128 x 128 float32 and a conv state of
    # 3 + 15 columns x (2*16*128 + 48*128) bf16
    states = 48 * 16 * (48 * 128 * 128 * 4 + 18 * (2 * 16 * 128 + 48 * 128) * 2)
    mtp = plan.mxfp4_bytes + 262144 * mtp_token + states
    dflash = plan.mxfp4_bytes + plan.drafter_bytes + 262144 * dflash_token + states
    assert plan.largest_server == ("mtp" if mtp > dflash else "dflash")
    assert plan.need_bytes_per_gpu == max(mtp, dflash) and plan.fits
    assert plan.source_format == "bf16" and plan.quantize_mode_here == "file_to_file"  # 55.6 GB x 2.5 > 100 GB
    assert 19e9 < plan.mxfp4_bytes < 21e9 and plan.drafter_bytes == 2 * 1730213120
    ar_only = memory.plan_memory(config, drafter, default_exclusions("qwen3_5"), max_model_len=None,
                                 methods=("ar",), available_bytes=100 * 10**9)
    assert ar_only.largest_server == "ar" and ar_only.need_bytes_per_gpu < plan.need_bytes_per_gpu
    budget = int(memory.MI355X_BYTES * 0.9)
    assert ar_only.full_length_sequences == (budget - ar_only.mxfp4_bytes) // ar_only.sequence_bytes


def test_a_sliding_window_drafter_layer_keeps_at_most_its_window():
    drafter = arch.load_config("qwen3.5-122b-a10b-dflash")  # 5 sliding layers of 4096 tokens, then a full one
    config = arch.load_config("qwen3.5-122b-a10b")
    per_layer_token = 2 * 8 * 128 * 2
    grown = memory.kv_bytes(config, drafter, False, 100_000) - memory.kv_bytes(config, None, False, 100_000)
    assert grown == per_layer_token * (5 * 4096 + 100_000)
    assert memory.kv_bytes(config, drafter, False, 1000) - memory.kv_bytes(config, None, False, 1000) == \
        per_layer_token * 6 * 1000


def test_an_fp8_source_counts_a_byte_per_weight_and_a_float32_scale_per_128_block():
    tensors = {"a.weight": (256, 300), "lm_head.weight": (64, 128), "norm.weight": (300,),
               "mlp.experts.gate_up_proj": (2, 256, 128)}
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["lm_head"]}}
    expected = 256 * 300 + 2 * 3 * 4 + 64 * 128 * 2 + 300 * 2 + 4 * (128 * 128 + 1 * 1 * 4)
    assert memory.fp8_bytes(tensors, fp8) == expected
    assert memory.source_format(fp8) == "fp8" and memory.source_format({}) == "bf16"


def test_the_397b_fp8_release_sizes_and_amds_exclusions_fit_one_mi355x():
    """AMD's amd/Qwen3.5-397B-A17B-MoE-MXFP4 card quantizes this FP8 release with these exclusions
    (routed and shared experts only)."""
    config = arch.load_config("qwen3.5-397b-a17b-fp8")
    amd = ["lm_head", "model.visual.*", "mtp.*", "*mlp.gate", "*shared_expert_gate*", "*.linear_attn.*", "*.self_attn.*"]
    plan = memory.plan_memory(config, None, amd, max_model_len=None)
    assert plan.source_format == "fp8"
    assert 400e9 < plan.source_bytes < 410e9 < 800e9 < memory.bf16_bytes(qwen35.checkpoint_tensors(config))
    assert plan.mxfp4_bytes < 0.6 * plan.source_bytes and plan.fits
    # To quantize it in memory the model is held dequantized to float32: 4 bytes per weight (1.6 TB), x 2.5;
    # 3 TB would do for a bf16 source of the same size (2 bytes per weight)
    roomy = memory.plan_memory(config, None, amd, max_model_len=None, available_bytes=5 * 10**12)
    tight = memory.plan_memory(config, None, amd, max_model_len=None, available_bytes=3 * 10**12)
    assert roomy.quantize_mode_here == "in_memory" and tight.quantize_mode_here == "file_to_file"


def test_a_pair_that_needs_more_than_the_gpus_does_not_fit_and_tensor_parallel_splits_it():
    config, drafter = arch.load_config("qwen3.5-35b-a3b"), arch.load_config("qwen3.5-35b-a3b-dflash")
    exclude = default_exclusions("qwen3_5_moe")
    small = memory.plan_memory(config, drafter, exclude, max_model_len=4096, gpu_bytes=20 * 10**9)
    assert not small.fits  # 24.6 GB of MXFP4 weights
    split = memory.plan_memory(config, drafter, exclude, max_model_len=4096, gpu_bytes=20 * 10**9,
                               tensor_parallel_size=2)
    assert split.fits and split.need_bytes_per_gpu * 2 == pytest.approx(small.need_bytes_per_gpu, abs=2)


def test_the_plan_reads_no_torch():
    import subprocess
    import sys

    code = ("import sys, pipeline.quant.memory as m, pipeline.checkpoints.stored_configs as d;"
            "m.plan_memory(d.stored_for_repo('Qwen/Qwen3.5-27B'), None, [], max_model_len=8192);"
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_stored_configs_are_found_by_their_hub_repo():
    from pipeline.checkpoints.stored_configs import stored_for_repo

    assert stored_for_repo("Qwen/Qwen3.5-27B")["source"]["revision"] == arch.provenance("qwen3.5-27b")["revision"]
    assert stored_for_repo("Qwen/Qwen3.5-1000B") is None
    assert stored_for_repo("z-lab/Qwen3.5-27B-DFlash")["architectures"] == ["DFlashDraftModel"]
