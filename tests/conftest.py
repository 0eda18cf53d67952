"""Shared fixtures: paths of the models `make` builds, and a runner for the real CLI."""

from __future__ import annotations

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


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers on two cores), each worker and what it starts
    compute on one OpenMP thread, so that two workers do not put four threads on the two cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """How pytest-xdist's workers share the suite (with `--dist loadgroup`, see `pytest_xdist_make_scheduler`).
    A module's tests run on one worker, in order, so its module fixtures (a vLLM server, a finished
    study) are made once. The tests marked `ray` run on one worker, one after another: each starts or
    joins a Ray cluster on this machine, and `ray.init()` joins the last cluster started here (a module
    whose fixtures a Ray test shares is marked whole). They go first, then the slow modules: the longest
    work starts at once, and the short tests fill in at the end."""
    slow = {_module(item.nodeid) for item in items if item.get_closest_marker("slow")}
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))  # xdist appends "@ray" to its node id
    items.sort(key=lambda item: 0 if item.get_closest_marker("ray") else 1 if _module(item.nodeid) in slow else 2)


def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadgroup`: xdist's scheduling by scope, where a scope is a test's module, or the `ray`
    group (xdist's own loadgroup would send each test of no group on its own)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RAY_GROUP if nodeid.endswith(f"@{RAY_GROUP}") else _module(nodeid)

    return ByModule(config, log)


RAY_GROUP = "ray"


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


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
    """Tiny Qwen3.5 dense (with vision) and MoE checkpoints + drafters, built and briefly trained by `make`."""
    assert (TINY / "qwen3.5-moe-tiny" / "training.json").is_file(), "tiny models missing: run `make install`"
    return TINY


@pytest.fixture(scope="session")
def tiny_fp8(tiny) -> Path:
    """The tiny MoE target as an FP8 block-scaled checkpoint (scripts/build_tiny_fp8.py), built by `make`."""
    folder = tiny / "qwen3.5-moe-tiny-fp8"
    assert (folder / "config.json").is_file(), "tiny FP8 checkpoint missing: run `make install`"
    return folder


def reference_recipe_with(**validation):
    """The reference recipe with `validation` keys set, re-validated: the reference backend alone unless
    `backends` is given, and vLLM serving the whole matrix (not the recipe's demo subset)."""
    from pipeline.recipe import SERVED_SUBSET, Recipe, load_recipe

    data = load_recipe(RECIPES / "reference-cpu.toml").model_dump()
    data["validation"] |= {"backends": ["reference"], **validation}
    data["serving"] |= dict.fromkeys(SERVED_SUBSET)
    return Recipe.model_validate(data)


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


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory, tiny) -> Path:
    """A folder with the tiny reference study's recipe.toml and its finished run in out/, run once for the
    session. Read-only: a test that changes the run works on `copy_run(tiny_reference_run, ...)`."""
    from pipeline.entrypoints import run_pipeline
    from pipeline.recipe import load_recipe

    folder = tmp_path_factory.mktemp("tiny-reference")
    run_pipeline(load_recipe(tiny_reference_recipe(folder, tiny)), folder / "out")
    return folder


def copy_run(folder: Path, dest: Path, out: str = "out") -> Path:
    """dest/recipe.toml and dest/OUT: a copy of a fixture's recipe and finished run, for a test to change."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(folder / "recipe.toml", dest / "recipe.toml")
    shutil.copytree(folder / "out", dest / out, symlinks=True)
    return dest


def validate_killed_once_a_cell_is_kept(recipe: Path, out: Path, *extra: str) -> list[str]:
    """`mxspec run RECIPE --until validate` in its own process group, SIGKILLed (with everything it
    started) as soon as its first cell is kept; returns the command, to run it again."""
    import signal
    import time

    from pipeline.study.cells import CELL_FILE

    command = [sys.executable, "-c", "from pipeline.cli import main; main()", "run", str(recipe), "--out", str(out),
               "--until", "validate", *extra]
    proc = subprocess.Popen(command, env=cli_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    cells, deadline = out / ".mxspec" / "cells", time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline and not list(cells.glob(f"*/{CELL_FILE}")):
        time.sleep(0.01)
    assert proc.poll() is None, f"validate ended (exit {proc.returncode}) before a cell was kept"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return command


def processes(fragment: str, tag: str | None = None):
    """(pid, command line) of each other process whose command line contains `fragment`; with `tag`, only
    those whose environment holds MXSPEC_TEST_TAG=tag: what a process started with `cli_env(tag)` started,
    however deep, and nothing that another test or pytest worker started."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if tag is not None and f"MXSPEC_TEST_TAG={tag}".encode() not in (cmdline.parent / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        if fragment in line and int(cmdline.parent.name) != os.getpid():
            yield int(cmdline.parent.name), line


def cli_env(tag: str | None = None) -> dict[str, str]:
    """The environment of an mxspec subprocess that imports this checkout's code; with `tag`, marked for
    `processes(..., tag)`."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **({"MXSPEC_TEST_TAG": tag} if tag else {})}
