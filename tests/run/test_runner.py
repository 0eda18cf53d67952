"""The stage runner: atomic stage folders, manifests, skip/redo, locking, and kill-and-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.errors import BadInputError
from pipeline.recipe import load_recipe
from pipeline.run.artifacts import StageManifest, volatile_fields
from pipeline.run.layout import MANIFEST
from pipeline.run.runner import read_manifest, run_stages
from pipeline.run.stage_log import VERBOSE_ENV

RECIPE = """
name = "runner-test"
[target]
path = "target"
[drafter]
path = "drafter"
"""


@dataclass
class CopyStage:
    """Writes a transformed copy of an input file; counts its runs."""

    source: Path
    name: str = "first"
    version: int = 1
    sections: tuple = ("quantization",)
    requires: tuple = ()
    tools: tuple = ()
    runs: int = 0
    fail: bool = False

    def external_inputs(self, ctx):
        return {"source": self.source}

    def run(self, ctx, workdir):
        self.runs += 1
        (workdir / "data.txt").write_text(self.source.read_text().upper() + ctx.recipe.quantization.scheme)
        if self.fail:
            raise RuntimeError("boom")
        return {"runs_so_far": float(self.runs)}  # a measurement of the work, different on every run


@dataclass
class ConcatStage:
    name: str = "second"
    version: int = 1
    sections: tuple = ()
    requires: tuple = ("first",)
    tools: tuple = ()
    runs: int = 0

    def external_inputs(self, ctx):
        return {}

    def run(self, ctx, workdir):
        self.runs += 1
        text = (ctx.stage_dir("first") / "data.txt").read_text()
        (workdir / "sub").mkdir()
        (workdir / "sub" / "twice.txt").write_text(text * 2)


@pytest.fixture
def setup(tmp_path):
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "recipe.toml").write_text(RECIPE)
    source = tmp_path / "source.txt"
    source.write_text("hello")
    return tmp_path, load_recipe(tmp_path / "recipe.toml"), source


def test_stages_write_folders_with_manifests(setup):
    tmp, recipe, source = setup
    first, second = CopyStage(source), ConcatStage()
    results = run_stages(recipe, tmp / "out", [first, second])
    assert [r.skipped for r in results] == [False, False]
    assert (tmp / "out/second/sub/twice.txt").read_text() == "HELLOmxfp4" * 2
    manifest = read_manifest(tmp / "out/first")
    assert manifest.fingerprint and manifest.recipe_sha256 and manifest.config_sha256
    assert list(manifest.outputs) == ["data.txt"]
    assert "source" in manifest.inputs and manifest.versions["mxspec"]
    assert list(read_manifest(tmp / "out/second").outputs) == ["sub/twice.txt"]
    assert "stage:first" in read_manifest(tmp / "out/second").inputs


def test_second_run_skips_everything(setup):
    tmp, recipe, source = setup
    first, second = CopyStage(source), ConcatStage()
    run_stages(recipe, tmp / "out", [first, second])
    results = run_stages(recipe, tmp / "out", [first, second])
    assert [r.skipped for r in results] == [True, True]
    assert (first.runs, second.runs) == (1, 1)


def test_changed_input_redoes_the_stage_and_its_dependents(setup):
    tmp, recipe, source = setup
    first, second = CopyStage(source), ConcatStage()
    run_stages(recipe, tmp / "out", [first, second])
    source.write_text("bye")
    results = run_stages(recipe, tmp / "out", [first, second])
    assert [r.skipped for r in results] == [False, False]
    assert (tmp / "out/second/sub/twice.txt").read_text() == "BYEmxfp4" * 2


def test_recipe_sections_decide_what_is_redone(setup):
    tmp, recipe, source = setup
    first = CopyStage(source)
    run_stages(recipe, tmp / "out", [first])
    unrelated = recipe.model_copy(update={"description": "changed"})
    assert run_stages(unrelated, tmp / "out", [first])[0].skipped
    related = recipe.model_copy(update={"quantization": recipe.quantization.model_copy(update={"scheme": "mxfp4_weight_only"})})
    assert not run_stages(related, tmp / "out", [first])[0].skipped
    assert (tmp / "out/first/data.txt").read_text().endswith("mxfp4_weight_only")


def test_measurements_go_to_the_manifest_and_redo_nothing_downstream(setup):
    tmp, recipe, source = setup
    first, second = CopyStage(source), ConcatStage()
    run_stages(recipe, tmp / "out", [first, second])
    assert read_manifest(tmp / "out" / "first").measured == {"runs_so_far": 1.0}
    run_stages(recipe, tmp / "out", [first, second], force=["first"])
    assert read_manifest(tmp / "out" / "first").measured == {"runs_so_far": 2.0}
    assert (first.runs, second.runs) == (2, 1)  # same outputs, so the next stage is still up to date
    assert volatile_fields(StageManifest) == {"started_at", "finished_at", "duration_s", "measured"}


def test_a_stage_folder_from_before_ownership_marks_is_still_replaced(setup):
    tmp, recipe, source = setup
    run_stages(recipe, tmp / "out", [CopyStage(source)])
    (tmp / "out" / "first" / ".mxspec-output").unlink()  # as an older mxspec wrote it
    source.write_text("changed")
    run_stages(recipe, tmp / "out", [CopyStage(source)])
    assert (tmp / "out" / "first" / "data.txt").read_text().startswith("CHANGED")


def test_corrupted_or_missing_output_is_redone(setup):
    tmp, recipe, source = setup
    first = CopyStage(source)
    run_stages(recipe, tmp / "out", [first])
    (tmp / "out/first/data.txt").write_text("tampered")
    assert not run_stages(recipe, tmp / "out", [first])[0].skipped
    assert (tmp / "out/first/data.txt").read_text() == "HELLOmxfp4"
    (tmp / "out/first/data.txt").unlink()
    assert not run_stages(recipe, tmp / "out", [first])[0].skipped


def test_failed_stage_leaves_previous_output_and_no_partial(setup):
    tmp, recipe, source = setup
    first = CopyStage(source)
    run_stages(recipe, tmp / "out", [first])
    before = (tmp / "out/first/data.txt").read_text()
    source.write_text("new")
    first.fail = True
    with pytest.raises(RuntimeError):
        run_stages(recipe, tmp / "out", [first])
    assert (tmp / "out/first/data.txt").read_text() == before
    assert sorted(p.name for p in (tmp / "out").iterdir()) == [".mxspec", "first"]


def test_a_stage_needs_its_predecessor(setup):
    tmp, recipe, _ = setup
    with pytest.raises(BadInputError, match="needs the outputs of 'first'"):
        run_stages(recipe, tmp / "out", [ConcatStage()])


def test_force_redoes_a_stage(setup):
    tmp, recipe, source = setup
    first = CopyStage(source)
    run_stages(recipe, tmp / "out", [first])
    assert not run_stages(recipe, tmp / "out", [first], force=("first",))[0].skipped


def test_one_run_per_output_folder(setup):
    tmp, recipe, source = setup

    @dataclass
    class Reentrant(CopyStage):
        def run(self, ctx, workdir):
            with pytest.raises(BadInputError, match="in use by another mxspec run"):
                run_stages(recipe, tmp / "out", [CopyStage(source)])
            super().run(ctx, workdir)

    run_stages(recipe, tmp / "out", [Reentrant(source)])


# --- kill-and-resume ------------------------------------------------------------------------

SLOW_PIPELINE = textwrap.dedent(
    """
    import hashlib, sys, time
    from pathlib import Path
    from pipeline.recipe import load_recipe
    from pipeline.run.runner import run_stages

    class Slow:
        version, sections, requires, tools = 1, (), (), ()
        def __init__(self, name, requires=()):
            self.name, self.requires = name, requires
        def external_inputs(self, ctx):
            return {}
        def run(self, ctx, workdir):
            seed = b"".join((ctx.stage_dir(r) / "part-7.bin").read_bytes() for r in self.requires) or b"root"
            for i in range(8):  # several files, so a kill can land mid-stage
                data = hashlib.sha256(seed + bytes([i])).digest() * 4096
                (workdir / f"part-{i}.bin").write_bytes(data)
                print(f"{self.name} wrote part {i}", flush=True)  # the test kills after the n-th line
                time.sleep(0.05)

    recipe = load_recipe(sys.argv[1])
    run_stages(recipe, Path(sys.argv[2]), [Slow("a"), Slow("b", ("a",)), Slow("c", ("b",))])
    """
)


def _outputs(out: Path) -> dict[str, dict]:
    return {stage: read_manifest(out / stage).outputs for stage in ("a", "b", "c")}


def test_killed_at_any_moment_resumes_to_the_same_artifacts(setup):
    tmp, _, _ = setup
    script = tmp / "slow.py"
    script.write_text(SLOW_PIPELINE)
    # MXSPEC_VERBOSE: the stages' prints, which time the kills, stay on stdout instead of the stage logs
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), VERBOSE_ENV: "1"}

    def start(out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(script), str(tmp / "recipe.toml"), str(out)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    clean = start(tmp / "clean")
    assert clean.wait(timeout=120) == 0, clean.stderr.read()
    expected = _outputs(tmp / "clean")

    out = tmp / "killed"
    kills = 0
    # Kill after the n-th file write of each run (counted from the run's own output, not by a clock,
    # so the kills land mid-pipeline on a fast machine as on a slow one): inside a stage, right after
    # its last file, and in the next stage's first writes.
    for writes_before_kill in (2, 5, 9, 3, 7, 12, 4):
        proc = start(out)
        lines = 0
        while lines < writes_before_kill and proc.stdout.readline():
            lines += 1
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(timeout=60)
        # Whatever is on disk now either is complete (manifest + hashes) or will be redone.
        for stage in ("a", "b", "c"):
            manifest = read_manifest(out / stage)
            if (out / stage).exists():
                assert manifest is not None, f"{stage} folder without manifest after a kill"
    assert kills >= 3, kills
    final = start(out)
    assert final.wait(timeout=120) == 0, final.stderr.read()
    assert _outputs(out) == expected
    leftovers = [p.name for p in out.iterdir() if p.name not in {"a", "b", "c", ".mxspec"}]
    assert leftovers == []
    assert not (out / "c" / MANIFEST).read_text() == ""
    assert json.loads((out / "c" / MANIFEST).read_text())["stage"] == "c"


CHATTY_PIPELINE = textwrap.dedent(
    """
    import logging, os, sys
    from pathlib import Path
    from pipeline.recipe import load_recipe
    from pipeline.run.runner import run_stages

    logging.basicConfig(stream=sys.stderr, level=logging.INFO)  # as Quark and transformers set up theirs

    class Chatty:
        version, sections, requires, tools = 1, (), (), ()
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail
        def external_inputs(self, ctx):
            return {}
        def run(self, ctx, workdir):
            print(f"{self.name}: python stdout chatter")
            sys.stderr.write(f"{self.name}: python stderr chatter\\n")
            os.write(1, f"{self.name}: descriptor chatter\\n".encode())  # as a C extension writes
            logging.getLogger("quark").info(f"{self.name}: logger chatter")
            ctx.console.print(f"{self.name}: mxspec's own line")
            (workdir / "out.txt").write_text(self.name)
            if self.fail:
                raise RuntimeError(f"{self.name} failed")

    recipe = load_recipe(sys.argv[1])
    try:
        run_stages(recipe, Path(sys.argv[2]), [Chatty("first"), Chatty("second", fail=True)])
    except RuntimeError as exc:
        print(f"after the run: {exc}", file=sys.stderr)
    """
)


@pytest.mark.parametrize("verbose", [False, True])
def test_other_tools_output_goes_to_the_stage_log_and_mxspec_lines_to_the_terminal(setup, verbose):
    tmp, _, _ = setup
    script = tmp / "chatty.py"
    script.write_text(CHATTY_PIPELINE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), VERBOSE_ENV: "1" if verbose else ""}
    out = tmp / "out"
    done = subprocess.run([sys.executable, str(script), str(tmp / "recipe.toml"), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    terminal = done.stdout + done.stderr
    for name in ("first", "second"):
        assert f"{name}: mxspec's own line" in terminal
        chatter = [f"{name}: {kind} chatter" for kind in ("python stdout", "python stderr", "descriptor", "logger")]
        log = out / ".mxspec" / "logs" / f"{name}.log"
        if verbose:
            assert all(line in terminal for line in chatter) and not log.exists()
        else:
            assert not any(line in terminal for line in chatter), terminal
            assert all(line in log.read_text() for line in chatter)
    # a stage that raised gave the descriptors back: what the program prints afterwards reaches the terminal
    assert "after the run: second failed" in done.stderr
