"""Proof that mxspec's MXFP4 kernel writes exactly Quark's bytes, on every input of a dtype.

Quark 0.13's per-weight routine (`file2file_quantization._single_stage_quantize_weight`) does, per block
of 32 inputs: `scale = even_round(amax)` (its observer; a function of the block's largest magnitude
alone), `nibbles = pack(fake_quantize_fp4(x / scale))` (element by element once the scale is known),
`byte = to_e8m0_uint8(scale)`. An element's nibble therefore depends on its value and its block's scale
only, and the scale on the amax only. Both proofs below rest on that structure, read from Quark's
source; everything else is run, not assumed.

* bfloat16, end to end (about 11 million inputs, a second): through Quark's whole routine and the kernel,
  - `[a, 0, ..., 0]` for every finite bfloat16 `a` of either sign: the scale of every possible amax;
  - for each scale, the largest amax that gets it, then every finite bfloat16 value no larger, of
    either sign: every element a block with that scale can hold.
* float32, in two halves (about 2.2 billion inputs, a minute or two):
  - nibbles: blocks led by the largest float32 below 7 (scale 1, so `x / scale` is `x`) holding every
    float32 `y` with `|y| < 7`, through Quark's whole routine: in "even" mode `|x| / scale < 7`, so these
    are all the values Quark rounds;
  - scales: Quark's `even_round` and `to_e8m0_uint8` against the kernel's on every finite float32 amax.
  The kernel computes `|x| * 2^-e` where Quark computes `x / 2^e`: the same real number, correctly
  rounded by both, so the same float32.

A proof is kept in the cache (`encoder.cache_dir()/proofs`) under the kernel's build key, the weight
config, and the Quark and torch versions; any change to one of them proves again.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from pipeline.errors import BadInputError, EncoderMismatchError
from pipeline.quant.encoder import KernelEncoder, cache_dir, kernel_key
from pipeline.quant.mxfp4 import GROUP_SIZE, shared_exponent
from pipeline.run.atomic import atomic_write_text
from pipeline.run.hashing import canonical_sha256

__all__ = ["PROVABLE_DTYPES", "KernelProof", "prove_kernel"]

PROVABLE_DTYPES = ("bfloat16", "float32")
_LARGEST_BELOW_7 = 0x40DFFFFF  # float32 bits of 6.9999995
_F32_CHUNK = 31 << 20  # inputs per Quark call in the float32 nibble half (1M blocks)


class KernelProof(BaseModel):
    """What a proof ran: `inputs` elements through Quark and the kernel with no byte differing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str
    inputs: int
    scales: int
    seconds: float
    kernel: str
    quark: str
    torch: str

    def summary(self) -> str:
        scope = "every finite bfloat16 block shape" if self.dtype == "bfloat16" else \
            "every float32 value below 7 in magnitude and every float32 amax"
        return (f"{self.dtype}: {self.inputs:,} inputs and {self.scales:,} scales, identical to amd-quark {self.quark} "
                f"({scope})")


def _check_config(weight_config) -> None:
    """The kernel implements one scheme: fp4 e2m1 in groups of 32 along the input, e8m0 "even" scales."""
    mode = getattr(weight_config, "scale_calculation_mode", None)
    facts = (str(getattr(weight_config.dtype, "value", weight_config.dtype)), weight_config.group_size,
             weight_config.scale_format, mode in (None, "even"), getattr(weight_config.qscheme, "value", None))
    if facts != ("fp4", GROUP_SIZE, "e8m0", True, "per_group"):
        raise BadInputError(f"the MXFP4 kernel implements fp4 / group {GROUP_SIZE} / e8m0 'even' scales, not {facts}; "
                            "set encoder = 'quark'")


def _quark_routine(weight_config):
    from pipeline.quant.quark import weight_quantizer

    quantize = weight_quantizer()

    def run(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        produced: dict[str, torch.Tensor] = {}
        quantize(blocks, "w", "w", weight_config, produced, "")
        return produced["w"], produced["w_scale"]

    return run


def _mismatches(ours: tuple[torch.Tensor, torch.Tensor], quark: tuple[torch.Tensor, torch.Tensor]) -> int:
    return int((ours[0] != quark[0]).sum()) + int((ours[1] != quark[1]).sum())


def _bf16_blocks() -> torch.Tensor:
    """The bfloat16 proof's input, [blocks, 32] (see the module docstring)."""
    finite = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # non-negative
    signed = torch.cat([finite, -finite])  # -0.0 included
    lone = torch.zeros((len(signed), GROUP_SIZE), dtype=torch.bfloat16)
    lone[:, 0] = signed
    exponents = shared_exponent(finite.float().numpy())
    groups = []
    for exponent in np.unique(exponents):
        anchor = finite[torch.from_numpy(np.flatnonzero(exponents == exponent)[-1:])]
        members = signed[signed.abs() <= anchor]
        members = torch.cat([members, torch.zeros(-len(members) % (GROUP_SIZE - 1), dtype=torch.bfloat16)])
        rows = members.view(-1, GROUP_SIZE - 1)
        groups.append(torch.cat([anchor.expand(len(rows), 1), rows], dim=1))
    return torch.cat([lone, *groups])


def _prove_bf16(kernel, quark) -> tuple[int, int, int]:
    blocks = _bf16_blocks()
    bad = _mismatches(kernel.encode(blocks), quark(blocks))
    return bad, blocks.numel(), len(blocks)


def _prove_f32(kernel, quark, fp4, progress: Callable[[int, int], None]) -> tuple[int, int, int]:
    from pipeline.quant.quark import scale_functions

    even_round, to_e8m0_uint8 = scale_functions()

    bad = inputs = 0
    values = _LARGEST_BELOW_7 + 1
    chunks = [(start, min(start + _F32_CHUNK, values)) for start in range(0, values, _F32_CHUNK)]
    steps = 2 * len(chunks) + 32
    anchor = torch.tensor([_LARGEST_BELOW_7], dtype=torch.int32).view(torch.float32)
    for step, (sign, (start, stop)) in enumerate((s, c) for s in (1.0, -1.0) for c in chunks):
        ys = torch.arange(start, stop, dtype=torch.int32).view(torch.float32) * sign
        ys = torch.cat([ys, torch.zeros(-len(ys) % (GROUP_SIZE - 1))]).view(-1, GROUP_SIZE - 1)
        blocks = torch.cat([anchor.expand(len(ys), 1), ys], dim=1)
        bad += _mismatches(kernel.encode(blocks), quark(blocks))
        inputs += blocks.numel()
        progress(step + 1, steps)
    # Scales: every finite non-negative float32 amax, in 32 slices.
    finite, scales = 0x7F800000, 0
    for part in range(32):
        start, stop = part * finite // 32, (part + 1) * finite // 32
        amax = torch.arange(start, stop, dtype=torch.int32).view(torch.float32)
        quark_scale = even_round(amax.clone(), fp4)
        inverse, byte = kernel.block_scales(amax)
        bad += int((quark_scale * inverse != 1.0).sum()) + int((to_e8m0_uint8(quark_scale) != byte).sum())
        scales += len(amax)
        progress(2 * len(chunks) + part + 1, steps)
    return bad, inputs, scales


def _cache_path(dtype: str, weight_config):
    key = canonical_sha256([kernel_key(), dtype, repr(weight_config), version("amd-quark"), torch.__version__])[:20]
    return cache_dir() / "proofs" / f"{dtype}-{key}.json"


def prove_kernel(dtype: str, weight_config, say: Callable[[str], None] = print,
                 progress: Callable[[int, int], None] | None = None) -> KernelProof:
    """The kernel's proof for inputs of `dtype`, from the cache or made now; EncoderMismatchError when a
    byte differs, BadInputError for a dtype or a weight config the kernel does not implement."""
    if dtype not in PROVABLE_DTYPES:
        raise BadInputError(f"the MXFP4 kernel reads {' or '.join(PROVABLE_DTYPES)} weights, not {dtype}")
    _check_config(weight_config)
    path = _cache_path(dtype, weight_config)
    if path.exists():
        return KernelProof.model_validate_json(path.read_text())
    with _one_prover(say):
        if path.exists():  # made by the process we waited for
            return KernelProof.model_validate_json(path.read_text())
        return _prove(dtype, weight_config, path, say, progress)


@contextmanager
def _one_prover(say: Callable[[str], None]) -> Iterator[None]:
    """One proof at a time per cache: processes sharing it (two runs on one machine, Ray workers on one
    node) wait for the one proving, then read its proof. The lock dies with its holder."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "proofs.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("  waiting for another process proving the MXFP4 kernel")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _prove(dtype: str, weight_config, path, say: Callable[[str], None],
           progress: Callable[[int, int], None] | None) -> KernelProof:
    kernel, quark = KernelEncoder(), _quark_routine(weight_config)
    if dtype == "float32":
        say("  proving the MXFP4 kernel identical to Quark on every float32 input (once per machine, 1-2 min)")
    started = time.perf_counter()
    bad, inputs, scales = _prove_bf16(kernel, quark) if dtype == "bfloat16" else \
        _prove_f32(kernel, quark, weight_config.dtype, progress or (lambda done, total: None))
    if bad:
        raise EncoderMismatchError(f"the MXFP4 kernel differs from Quark on {bad} of {inputs:,} {dtype} inputs; "
                                   "set encoder = 'quark' and report this", dtype=dtype, mismatches=bad)
    proof = KernelProof(dtype=dtype, inputs=inputs, scales=scales, seconds=round(time.perf_counter() - started, 2),
                        kernel=kernel_key(), quark=version("amd-quark"), torch=torch.__version__)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(proof.model_dump(), indent=2) + "\n")
    return proof
