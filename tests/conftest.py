"""Shared fixtures: paths of the models `make` builds, and a runner for the real CLI."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
REFERENCE_TARGET = ROOT / "models" / "smollm2-135m-instruct"
REFERENCE_DRAFTER = ROOT / "models" / "smollm2-135m-instruct-dflash"
TINY = ROOT / "models" / "tiny"


def load_script(name: str):
    """scripts/NAME.py as a module (scripts are not package code, but tests read some of them)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


local_hub = load_script("local_hub")  # the Hub stand-in that publishing is tested against


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def mxspec():
    """Run the installed `mxspec` console script in a subprocess, as a user would."""

    exe = Path(sys.executable).with_name("mxspec")

    def run(*args: str, env: dict | None = None, timeout: float = 600) -> CliResult:
        proc = subprocess.run(
            [str(exe), *map(str, args)], capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "COLUMNS": "200", **(env or {})},
        )
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    run.exe = exe  # for tests that drive the process themselves (kill it, read it while it runs)
    return run


@pytest.fixture
def reference_target() -> Path:
    assert (REFERENCE_TARGET / "config.json").is_file(), "reference target missing: run `make install`"
    return REFERENCE_TARGET


@pytest.fixture(scope="session")
def tiny() -> Path:
    """Tiny random Qwen3.5 dense (with vision) and MoE checkpoints + drafters, built by `make`."""
    assert (TINY / "qwen3.5-tiny" / "config.json").is_file(), "tiny models missing: run `make install`"
    return TINY


def tiny_reference_recipe(folder: Path, tiny: Path, extra: str = "") -> Path:
    """folder/recipe.toml: the tiny Qwen3.5 pair through the reference backend, 2 workloads x 2 precisions
    (4 cells), a few seconds a cell."""
    path = folder / "recipe.toml"
    path.write_text(
        f'name = "tiny-validate"\n[target]\npath = "{tiny / "qwen3.5-tiny"}"\n'
        f'[drafter]\npath = "{tiny / "qwen3.5-tiny-dflash"}"\n'
        "[quantization]\nmode = 'in_memory'\n"
        "[validation]\nworkloads = ['gsm8k', 'humaneval']\nbudgets = [4, 8]\nmethods = ['ar', 'dflash']\n"
        "backends = ['reference']\nnum_prompts = 3\nmax_tokens = 12\n" + extra
    )
    return path
