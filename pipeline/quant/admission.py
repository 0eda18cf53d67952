"""Which MXFP4 encoder a run uses: the recipe's `encoder`, with the kernel admitted only on its proof.

[quantization] encoder: "auto" (the proven kernel, else Quark), "quark" (Quark's routine, on the
accelerator when torch sees one, else on the CPU) or "kernel" (an error, not a fallback, when it cannot
run). Auto prefers the kernel over an accelerator: on a few cores it keeps up with storage, so the stage
is I/O-bound either way, and its bytes are proven to be Quark's CPU bytes, which a GPU kernel's are
not (scripts/gpu_check.sh compares them on the tiny models).

Apart from `encoder` so that the proof (`proof.py`) can use the encoders it checks and this module can
use the proof, with no import running back."""

from __future__ import annotations

import torch

from pipeline.errors import BadInputError, ExternalError
from pipeline.quant.encoder import ENCODERS, EncoderChoice, KernelEncoder, QuarkEncoder, load_kernel
from pipeline.quant.proof import prove_kernel

__all__ = ["choose_encoder", "build_encoder"]


def _accelerator() -> str | None:
    """The accelerator torch sees (ROCm builds report theirs as cuda), or None."""
    return "cuda:0" if torch.cuda.is_available() else None


def choose_encoder(choice: str, input_dtypes: set[str], weight_config, say=print) -> EncoderChoice:
    """Resolve the recipe's `encoder` for a run whose quantized weights reach the encoder in `input_dtypes`
    ("bfloat16", "float32"). The kernel is admitted only with a proof for each of them
    (`proof.prove_kernel`, kept in the cache once made); "kernel" raises where "auto" falls back."""
    if choice not in ENCODERS:
        raise BadInputError(f"encoder {choice!r} is not one of {', '.join(ENCODERS)}")
    device = _accelerator() or "cpu"
    if choice == "quark":
        return EncoderChoice("quark", device, None, "the recipe asks for Quark")
    try:
        proofs = [prove_kernel(dtype, weight_config, say) for dtype in sorted(input_dtypes)]
        load_kernel()
    except (ExternalError, BadInputError) as exc:  # a mismatch (EncoderMismatchError) is an ExternalError
        if choice == "kernel":
            raise
        return EncoderChoice("quark", device, None, f"auto: the kernel cannot run ({exc})")
    return EncoderChoice("kernel", "cpu", "; ".join(p.summary() for p in proofs),
                         f"{choice}: proven identical to Quark for {', '.join(sorted(input_dtypes))} inputs")


def build_encoder(choice: EncoderChoice, input_dtypes: set[str], weight_config) -> KernelEncoder | QuarkEncoder:
    """The encoder `choice` names, in this process (a Ray worker checks the kernel's proof on its own
    machine: another CPU compiles another build, which is proven again)."""
    if choice.name == "quark":
        return QuarkEncoder(weight_config, choice.device if _accelerator() else "cpu")
    choose_encoder("kernel", input_dtypes, weight_config)
    return KernelEncoder()
