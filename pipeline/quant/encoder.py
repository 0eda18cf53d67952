"""The MXFP4 encoders file-to-file mode can run (`admission` chooses between them).

Quark is the quantizer of record. `QuarkEncoder` runs its per-weight routine (the one its own
file-to-file flow calls), on a CUDA or ROCm device when one is present. `KernelEncoder` runs
`mxfp4_kernel.c`, a C loop compiled on first use, about 25x faster per core than Quark's CPU path;
it runs only where `proof.prove_kernel` has shown it bit-identical to Quark's routine on every input
of the run's dtype, and the quantize report says which encoder ran and on what proof."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import BadInputError, ExternalError
from pipeline.quant.mxfp4 import GROUP_SIZE

__all__ = ["ENCODERS", "KERNEL_SOURCE", "cache_dir", "EncoderChoice", "QuarkEncoder", "KernelEncoder",
    "load_kernel", "kernel_key", "encode_threads"]

ENCODERS = ("auto", "quark", "kernel")
KERNEL_SOURCE = Path(__file__).with_name("mxfp4_kernel.c")
# No fast-math and no contraction: the loop must do exactly the IEEE operations the proof checked.
_FLAGS = ("-O3", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off")
_NATIVE = ("-march=native",)
_load_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    """Where compiled kernels and their proofs are kept: $MXSPEC_CACHE, else ~/.cache/mxspec."""
    return Path(os.environ.get("MXSPEC_CACHE") or Path.home() / ".cache" / "mxspec")


def encode_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class EncoderChoice:
    """What encoded the run's weights, as the quantize report records it."""

    name: str  # "quark" or "kernel"
    device: str  # "cpu", "cuda:0", ...
    proof: str | None = None  # for the kernel: what it was proven identical to Quark on
    reason: str = ""  # why this encoder (auto's decision, or the recipe's)


def _cpu_signature() -> str:
    """The compiler target: -march=native code must not run on another CPU model."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}|{flags}".encode()).hexdigest()[:16]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def kernel_key() -> str:
    """Names one build: the source, the flags, the compiler and the CPU it targets."""
    compiler = _compiler() or "none"
    return hashlib.sha256(
        KERNEL_SOURCE.read_bytes() + " ".join((compiler, *_FLAGS, *_NATIVE, _cpu_signature())).encode()
    ).hexdigest()[:20]


def load_kernel() -> ctypes.CDLL:
    """The compiled kernel, built into the cache on first use (an atomic rename, so concurrent workers
    of a Ray cluster sharing the cache never load half a file). ExternalError when no C compiler works."""
    key = kernel_key()
    with _load_lock:
        if key in _loaded:
            return _loaded[key]
        library = cache_dir() / "kernels" / f"mxfp4-{key}.so"
        if not library.exists():
            _compile(library)
        lib = ctypes.CDLL(str(library))
        pointer = ctypes.c_void_p
        for name, args in (("mxfp4_encode_bf16", [pointer, ctypes.c_int64, pointer, pointer]),
                           ("mxfp4_encode_f32", [pointer, ctypes.c_int64, pointer, pointer]),
                           ("mxfp4_encode_fp8", [pointer, *[ctypes.c_int64] * 3, pointer, *[ctypes.c_int64] * 2,
                                                 pointer, pointer, pointer]),
                           ("mxfp4_block_scales", [pointer, ctypes.c_int64, pointer, pointer])):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, ctypes.c_int
        lib.mxfp4_block_scales.restype = None
        _loaded[key] = lib
        return lib


def _compile(library: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise ExternalError("no C compiler (cc) to build mxspec's MXFP4 kernel; install gcc or set encoder = 'quark'")
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f".{library.name}.{os.getpid()}.{threading.get_ident()}.partial")
    error = ""
    for extra in (_NATIVE, ()):
        proc = subprocess.run([compiler, *_FLAGS, *extra, str(KERNEL_SOURCE), "-o", str(partial)],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            os.replace(partial, library)
            return
        error = (proc.stderr.strip().splitlines() or ["no message"])[-1]
    partial.unlink(missing_ok=True)
    raise ExternalError(f"{compiler} failed to build {KERNEL_SOURCE.name} ({error}); set encoder = 'quark'")


def _pointer(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


class KernelEncoder:
    """mxspec's C loop: `encode(weight)` for bf16 or float32 weights `[rows, cols]`, `encode_fp8` for an
    FP8 block-scaled weight straight from its e4m3 codes. Returns (packed uint8 [rows, cols/2],
    scales uint8 [rows, cols/32]), the tensors Quark's routine writes."""

    name = "kernel"

    def __init__(self):
        self.lib = load_kernel()
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
        self.e4m3 = codes.float().contiguous()  # exact: every e4m3 value is a float32

    @staticmethod
    def _outputs(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        if cols % GROUP_SIZE:
            raise BadInputError(f"MXFP4 needs input columns divisible by {GROUP_SIZE}, got {cols}")
        return (torch.empty((rows, cols // 2), dtype=torch.uint8),
                torch.empty((rows, cols // GROUP_SIZE), dtype=torch.uint8))

    def encode(self, weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
        weight = weight.contiguous()
        rows, cols = weight.shape
        packed, scales = self._outputs(rows, cols)
        blocks = weight.numel() // GROUP_SIZE
        if weight.dtype == torch.bfloat16:
            status = self.lib.mxfp4_encode_bf16(_pointer(weight), blocks, _pointer(packed), _pointer(scales))
        elif weight.dtype == torch.float32:
            status = self.lib.mxfp4_encode_f32(_pointer(weight), blocks, _pointer(packed), _pointer(scales))
        else:
            raise BadInputError(f"{name} is {weight.dtype}; the MXFP4 kernel reads bfloat16 or float32")
        _check(status, name)
        return packed, scales

    def block_scales(self, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 / scale float32, scale byte) the kernel uses for blocks with these float32 amax; for the proof."""
        amax = amax.float().contiguous()
        inverse, byte = torch.empty_like(amax), torch.empty(amax.shape, dtype=torch.uint8)
        self.lib.mxfp4_block_scales(_pointer(amax), amax.numel(), _pointer(inverse), _pointer(byte))
        return inverse, byte

    def encode_fp8(self, codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], first_row: int = 0,
                   name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
        """`codes` e4m3 rows `first_row`.. of a weight whose tile scales are `scale_inv` (its 2-D
        [ceil(rows/b0), ceil(cols/b1)] float32); the float32 values are those `fp8.dequantize` gives."""
        if block[1] % GROUP_SIZE:
            raise BadInputError(f"{name}: FP8 tiles {block} are not a multiple of {GROUP_SIZE} wide")
        codes, scale_inv = codes.contiguous(), scale_inv.float().contiguous()
        rows, cols = codes.shape
        packed, scales = self._outputs(rows, cols)
        status = self.lib.mxfp4_encode_fp8(_pointer(codes.view(torch.uint8)), rows, cols, first_row, _pointer(scale_inv),
                                           block[0], block[1], _pointer(self.e4m3), _pointer(packed), _pointer(scales))
        _check(status, name)
        return packed, scales


def _check(status: int, name: str) -> None:
    if status != 0:
        raise BadInputError(f"{name} holds an inf or NaN weight, which MXFP4 cannot encode; the checkpoint is damaged")


class QuarkEncoder:
    """Quark's per-weight routine (`_single_stage_quantize_weight`), on `device`."""

    name = "quark"

    def __init__(self, weight_config, device: str = "cpu"):
        from pipeline.quant.quark import weight_quantizer

        self.weight_config, self.device, self._quantize = weight_config, device, weight_quantizer()

    def encode(self, weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
        produced: dict[str, torch.Tensor] = {}
        self._quantize(weight.to(self.device), name, name.removesuffix(".weight"), self.weight_config, produced, "")
        return produced[name].cpu(), produced[name + "_scale"].cpu()
