"""Bad input, as a new user gives it: recipes, models, reports, output folders and Hub settings.

Every case runs the real `mxspec` command and states three things: the exit code (2: bad input),
one line on stderr naming what is wrong, where, and how to fix it (no traceback, no "internal
error"), and what is on disk afterwards (nothing half-written, nothing of the user's touched).
"""

from __future__ import annotations

import fcntl
import json
import math
import subprocess
from pathlib import Path

import pytest

from pipeline.run.atomic import OWNER_MARK
from tests.conftest import RECIPES, REFERENCE_DRAFTER, REFERENCE_TARGET, TINY
from tests.stages.test_gate import write_report

BASE = f"""name = "bad-input"
[target]
path = "{REFERENCE_TARGET}"
[drafter]
path = "{REFERENCE_DRAFTER}"
[quantization]
scheme = "mxfp4"
[validation]
workloads = ["gsm8k"]
budgets = [4, 8]
concurrency = [1]
methods = ["ar", "dflash"]
backends = ["reference"]
num_prompts = 4
max_tokens = 16
[gate]
max_acceptance_length_drop = 0.5
max_position_gap = 0.1
[publish]
repo_id = "local-user/bad-input"
"""


REFERENCE_RECIPE = RECIPES / "reference-cpu.toml"


@pytest.fixture
def mxspec(mxspec, tmp_path):
    """The CLI, with the rule every case here shares checked on each refused command: the test's folder
    lists the same files and folders before and after (a refused command creates and deletes nothing)."""
    def listing() -> list[str]:
        return sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))

    def run(*args, **kwargs):
        before = listing()
        result = mxspec(*args, **kwargs)
        if result.returncode not in (0, 1):
            assert listing() == before, f"mxspec {' '.join(map(str, args))} (exit {result.returncode}) changed {tmp_path}"
        return result

    run.exe = mxspec.exe
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (what 'untouched' means)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_clear_line(result, exit_code: int, *words: str) -> str:
    output = result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert result.returncode == exit_code, output
    assert len(lines) == 1, output
    assert "Traceback" not in output and "internal error" not in output, output
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


# ---------------------------------------------------------------------------------------------- recipes

RECIPE_EDITS = {
    # id: (edit: (old, new) replacement or text appended to the base, words in the message)
    "typo-key": (("max_tokens = 16", "max_token = 16"), ["validation.max_token", "did you mean 'max_tokens'"]),
    "missing-name": (('name = "bad-input"', ""), ["'name'", "missing"]),
    "unknown-section": ("[servng]\nenv = {}\n", ["servng"]),
    "id-and-path": (('path = "' + str(REFERENCE_TARGET) + '"', f'path = "{REFERENCE_TARGET}"\nid = "a/b"\nrevision = "{"0" * 40}"'),
                    ["target", "exactly one"]),
    "bad-target-id": (('path = "' + str(REFERENCE_TARGET) + '"', 'id = "not a valid/repo id!!"\nrevision = "main"'),
                      ["target", "not a Hub repo id"]),
    "id-without-revision": (('path = "' + str(REFERENCE_TARGET) + '"', 'id = "Qwen/Qwen3.5-27B"'), ["revision"]),
    "revision-on-path": (('path = "' + str(REFERENCE_TARGET) + '"', f'path = "{REFERENCE_TARGET}"\nrevision = "main"'),
                         ["'revision' only applies"]),
    "bad-sha256": (('path = "' + str(REFERENCE_DRAFTER) + '"', f'path = "{REFERENCE_DRAFTER}"\nsha256 = "abc"'),
                   ["drafter.sha256"]),
    "repo-id-invalid": (('repo_id = "local-user/bad-input"', 'repo_id = "not a valid/repo id!!"'),
                        ["publish", "not a Hub repo id"]),
    "repo-id-double-dash": (('repo_id = "local-user/bad-input"', 'repo_id = "local-user/bad--input"'), ["not a Hub repo id"]),
    "repo-id-no-owner": (('repo_id = "local-user/bad-input"', 'repo_id = "bad-input"'), ["not a Hub repo id"]),
    "endpoint-not-http": ("endpoint = 'ftp://hub.example'\n", ["endpoint", "http(s) URL"]),
    "num-prompts-huge": (("num_prompts = 4", "num_prompts = 1000000000000"), ["validation.num_prompts", "10000"]),
    "num-prompts-zero": (("num_prompts = 4", "num_prompts = 0"), ["validation.num_prompts"]),
    "num-prompts-float": (("num_prompts = 4", "num_prompts = 4.5"), ["validation.num_prompts"]),
    "max-tokens-huge": (("max_tokens = 16", "max_tokens = 1000000000"), ["validation.max_tokens"]),
    "budget-one": (("budgets = [4, 8]", "budgets = [1]"), ["validation.budgets"]),
    "budgets-empty": (("budgets = [4, 8]", "budgets = []"), ["validation.budgets"]),
    "budgets-twice": (("budgets = [4, 8]", "budgets = [8, 8]"), ["budgets lists 8 more than once"]),
    "unknown-workload": (('workloads = ["gsm8k"]', 'workloads = ["gsm9k"]'), ["validation.workloads", "gsm8k"]),
    "vllm-without-c1": (('concurrency = [1]\nmethods = ["ar", "dflash"]\nbackends = ["reference"]',
                         'concurrency = [32]\nmethods = ["ar", "dflash"]\nbackends = ["vllm"]'), ["add 1 to concurrency"]),
    "methods-without-dflash": (('methods = ["ar", "dflash"]', 'methods = ["ar"]'), ["'dflash'"]),
    "drop-inf": (("max_acceptance_length_drop = 0.5", "max_acceptance_length_drop = inf"),
                 ["gate.max_acceptance_length_drop", "finite"]),
    "drop-nan": (("max_acceptance_length_drop = 0.5", "max_acceptance_length_drop = nan"), ["finite"]),
    "drop-negative": (("max_acceptance_length_drop = 0.5", "max_acceptance_length_drop = -1"),
                      ["gate.max_acceptance_length_drop"]),
    "gap-above-one": (("max_position_gap = 0.1", "max_position_gap = 2"), ["gate.max_position_gap"]),
    "policy-unknown": ("on_inconclusive = 'maybe'\n", ["on_inconclusive"]),
    "scheme-unknown": (('scheme = "mxfp4"', 'scheme = "nvfp4"'), ["quantization.scheme", "mxfp4_weight_only"]),
    "mode-unknown": (('scheme = "mxfp4"', 'scheme = "mxfp4"\nmode = "fast"'), ["quantization.mode"]),
    "calibration-file-without-path": ("[calibration]\ndataset = 'file'\n", ["calibration", "path"]),
    "name-empty": (('name = "bad-input"', 'name = ""'), ["'name'"]),
    "lift-inf": (("max_position_gap = 0.1", "max_position_gap = 0.1\nmin_throughput_lift = inf"), ["finite"]),
    "tp-zero": ("[serving]\ntensor_parallel_size = 0\n", ["serving.tensor_parallel_size"]),
    "prompt-source-unknown": (("max_tokens = 16", 'max_tokens = 16\nprompt_source = "web"'),
                              ["validation.prompt_source", "packaged"]),
}


@pytest.mark.parametrize("case", sorted(RECIPE_EDITS))
def test_a_bad_recipe_value_is_named_with_its_key(mxspec, tmp_path, case):
    edit, words = RECIPE_EDITS[case]
    text = BASE.replace(*edit, 1) if isinstance(edit, tuple) else BASE + edit
    assert text != BASE
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text)
    line = assert_one_clear_line(mxspec("recipe", "check", recipe), 2, *words)
    assert str(recipe) in line


def test_publishing_to_the_drafters_repo_is_refused(mxspec, tmp_path):
    text = (Path("recipes/qwen3.5-27b-mxfp4.toml").read_text()
            .replace('repo_id = ', 'repo_id = "z-lab/Qwen3.5-27B-DFlash"\n# ', 1))
    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    assert_one_clear_line(mxspec("recipe", "check", recipe), 2, "drafter's repo")


def bad_recipe_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "recipe.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink-loop":
        path.symlink_to(tmp_path / "loop.toml")
        (tmp_path / "loop.toml").symlink_to(path)
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00name")
    elif kind == "invalid-toml":
        path.write_text("name = 'x\n[target\n")
    elif kind == "empty":
        path.write_text("")
    return path


@pytest.mark.parametrize("kind, words", [("missing", ["recipe not found"]), ("directory", ["cannot read the recipe"]),
                                         ("symlink-loop", ["symbolic links"]), ("binary", ["UTF-8"]),
                                         ("invalid-toml", ["not valid TOML"]), ("empty", ["the recipe is empty"])])
def test_an_unreadable_recipe_file_is_one_line(mxspec, tmp_path, kind, words):
    recipe = bad_recipe_file(tmp_path, kind)
    for argv in (("recipe", "check", recipe), ("run", recipe, "--out", tmp_path / "out")):
        assert_one_clear_line(mxspec(*argv), 2, *words)
    assert not (tmp_path / "out").exists()


def test_brackets_in_a_file_name_and_a_message_are_printed_verbatim(mxspec, tmp_path):
    recipe = tmp_path / "run[final].toml"
    recipe.write_text(BASE.replace("methods = [\"ar\", \"dflash\"]", "methods = [\"ar\"]"))
    line = assert_one_clear_line(mxspec("recipe", "check", recipe), 2)
    assert "run[final].toml" in line and "[validation]" in line


# ---------------------------------------------------------------------- models (checked before any stage)

def model_copy(tmp_path: Path, source: Path, name: str, config=None) -> Path:
    """A copy of a model folder (weights linked, not copied) with an optional replacement config.json."""
    folder = tmp_path / name
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).symlink_to(item)
    if config is not None:
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


MODEL_CASES = {
    # id: (target folder, drafter folder, extra recipe text, words); "T"/"D" build edited copies
    "target-missing": (lambda t: t / "nowhere", None, "", ["target.path", "not a folder"]),
    "drafter-missing": (None, lambda t: t / "nowhere", "", ["drafter.path", "not a folder"]),
    "target-config-empty-object": (lambda t: model_copy(t, REFERENCE_TARGET, "T", {}), None, "", ["config.json", "not a model config"]),
    "target-config-list": (lambda t: model_copy(t, REFERENCE_TARGET, "T", []), None, "", ["config.json", "not a model config"]),
    "target-config-not-json": (lambda t: model_copy(t, REFERENCE_TARGET, "T", "{oops"), None, "", ["config.json", "unreadable"]),
    "target-without-model-type": (lambda t: model_copy(t, REFERENCE_TARGET, "T", {"hidden_size": 576}), None, "", ["model_type"]),
    "target-without-config": (lambda t: (t / "T").mkdir() or t / "T", None, "", ["has no config.json"]),
    "drafter-config-empty": (None, lambda t: model_copy(t, REFERENCE_DRAFTER, "D", {}), "", ["not a model config"]),
    "drafter-is-the-target": (None, lambda t: REFERENCE_TARGET, "", ["does not pair", "not DFlashDraftModel"]),
    "drafter-of-another-target": (None, lambda t: TINY / "qwen3.5-tiny-dflash", "", ["does not pair", "hidden_size"]),
    "mtp-on-llama": (None, None, "", ["'mtp' needs a target with an MTP head"]),
    "calibration-file-missing": (None, None, "[calibration]\ndataset = 'file'\npath = 'nowhere.txt'\n", ["calibration.path"]),
    "budget-beyond-block": (None, None, "", ["exceeds the drafter's block_size 16"]),
    "exclude-matching-nothing": (None, None, "", ["[quantization] exclude", "pattern 'model.layerz.*.mlp' matches no layer"]),
    "target-per-tensor-fp8": (lambda t: model_copy(t, TINY / "qwen3.5-tiny", "T", {
        **json.loads((TINY / "qwen3.5-tiny" / "config.json").read_text()),
        "quantization_config": {"quant_method": "fp8"}}), None, "",
        ["weight_block_size", "per-tensor FP8 is not supported"]),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_a_model_that_cannot_work_is_refused_before_any_stage(mxspec, tmp_path, case):
    target, drafter, extra, words = MODEL_CASES[case]
    text = BASE
    if target:
        text = text.replace(f'"{REFERENCE_TARGET}"', f'"{target(tmp_path)}"')
    if drafter:
        text = text.replace(str(REFERENCE_DRAFTER), str(drafter(tmp_path)))
    if case == "mtp-on-llama":
        text = text.replace('methods = ["ar", "dflash"]', 'methods = ["ar", "mtp", "dflash"]')
    if case == "budget-beyond-block":
        text = text.replace("budgets = [4, 8]", "budgets = [4, 32]")
    if case == "exclude-matching-nothing":
        text = text.replace('scheme = "mxfp4"', 'scheme = "mxfp4"\nexclude = ["lm_head", "model.layerz.*.mlp"]')
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text + extra)
    assert_one_clear_line(mxspec("recipe", "check", recipe), 2, *words)
    assert_one_clear_line(mxspec("run", recipe, "--out", tmp_path / "out"), 2, *words)
    assert not (tmp_path / "out").exists(), "a refused run must not create its run folder"


# --------------------------------------------------------------------------------------------- reports

def report_edit(kind: str):
    """A change to a valid report (bf16 vs MXFP4 on gsm8k and mbpp at blocks 4 and 8)."""
    def edit(report: dict) -> dict | str:
        drift, cells = report["drift"], report["cells"]
        if kind == "old-schema":
            report["schema"] = "mxspec.validate/1"
        elif kind == "missing-cells":
            del report["cells"]
        elif kind == "string-interval":
            drift[0]["ci95"] = "narrow"
        elif kind == "nan-delta":
            drift[0]["delta"] = math.nan
        elif kind == "infinite-interval":
            drift[0]["ci95"] = [-math.inf, 0.0]
        elif kind == "drift-edited-to-no-drop":
            for row in drift:
                row.update(delta=0.0, ci95=[-0.01, 0.01])
        elif kind == "one-drift-row-deleted":
            del drift[1]
        elif kind == "all-drift-rows-deleted":
            report["drift"] = []
        elif kind == "cell-deleted":
            del cells[0]
        elif kind == "drift-row-twice":
            drift.append(dict(drift[0]))
        elif kind == "prompt-count-mismatch":
            cells[0]["num_prompts"] = 7
        elif kind == "reversed-interval":
            drift[0]["position_drop_ci95"][0] = [0.2, -0.2]
        elif kind == "unknown-key":
            report["extra"] = 1
        elif kind == "block-of-one":
            drift[0]["budget"] = 1
        elif kind == "no-prompts":
            drift[0]["num_prompts"] = 0
        elif kind == "not-an-object":
            return "[]"
        elif kind == "rate-above-one":
            cells[0]["per_position_acceptance"][0] = 1.5
        return json.dumps(report)
    return edit


REPORT_CASES = {"old-schema": "mxspec.validate/1", "missing-cells": "'cells'", "string-interval": "drift.0.ci95",
                "nan-delta": "drift.0.delta", "infinite-interval": "drift.0.ci95", "drift-edited-to-no-drop": "delta",
                "one-drift-row-deleted": "no drift row", "all-drift-rows-deleted": "no drift row",
                "cell-deleted": "no bf16 cell", "drift-row-twice": "appears twice",
                "prompt-count-mismatch": "7 prompts", "reversed-interval": "reversed",
                "unknown-key": "'extra'", "block-of-one": "drift.0.budget",
                "no-prompts": "drift.0.num_prompts", "not-an-object": "schema None", "rate-above-one": "cells.0"}


@pytest.mark.parametrize("case", sorted(REPORT_CASES))
def test_a_report_that_does_not_hold_together_is_refused_by_the_gate(mxspec, tmp_path, case):
    report = write_report(tmp_path, {"gsm8k": 0.7, "mbpp": 0.3}, num_prompts=10)
    report.write_text(report_edit(case)(json.loads(report.read_text())))
    line = assert_one_clear_line(mxspec("gate", report), 2, REPORT_CASES[case], str(report))
    assert "regenerate" in line or "drift rows" in line
    assert not (tmp_path / "gate").exists()


@pytest.mark.parametrize("kind", ["missing", "directory", "not-json"])
def test_an_unreadable_report_is_one_line(mxspec, tmp_path, kind):
    report = tmp_path / "validate" / "report.json"
    report.parent.mkdir()
    if kind == "directory":
        report.mkdir()
    elif kind == "not-json":
        report.write_text("{oops")
    assert_one_clear_line(mxspec("gate", report), 2, str(report))
    assert not (tmp_path / "gate").exists()


# -------------------------------------------------------------------------------------- output folders

@pytest.fixture
def report(tmp_path) -> Path:
    return write_report(tmp_path / "run", {"gsm8k": 0.7, "mbpp": 0.7}, num_prompts=10)


@pytest.fixture
def read_only(tmp_path):
    """A read-only mount (a bind mount of a folder, remounted read-only)."""
    source, mount = tmp_path / "ro-source", tmp_path / "ro"
    source.mkdir()
    mount.mkdir()
    subprocess.run(["mount", "--bind", str(source), str(mount)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def users_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("years of work")
    return path


OUT_CASES = {
    # id: (make the --out path, words)
    "existing-foreign-folder": (lambda t: users_folder(t / "mine"), ["not written by mxspec"]),
    "existing-file": (lambda t: (t / "notes.txt").write_text("keep me") and t / "notes.txt", ["existing file"]),
    "under-a-file": (lambda t: (t / "notes.txt").write_text("keep me") and t / "notes.txt" / "gate", ["notes.txt/gate", "file"]),
    "in-proc": (lambda t: Path("/proc/mxspec-out"), ["/proc/mxspec-out"]),
    "symlink-loop": (lambda t: (t / "a").symlink_to(t / "b") or (t / "b").symlink_to(t / "a") or t / "a", ["symlink"]),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
@pytest.mark.parametrize("command", ["gate", "run"])
def test_an_unusable_output_path_is_refused_and_left_as_it_was(mxspec, tmp_path, report, case, command):
    make, words = OUT_CASES[case]
    out = make(tmp_path)
    before = snapshot(tmp_path)
    if command == "gate":
        result = mxspec("gate", report, "--out", out)
    else:
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(BASE)
        before = snapshot(tmp_path)
        result = mxspec("run", recipe, "--out", out, "--until", "resolve")
    assert_one_clear_line(result, 2, *words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["gate", "run"])
def test_a_read_only_mount_is_bad_input_not_an_internal_error(mxspec, tmp_path, report, read_only, command):
    if command == "gate":
        result = mxspec("gate", report, "--out", read_only / "gate")
    else:
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(BASE)
        result = mxspec("run", recipe, "--out", read_only / "run", "--until", "resolve")
    assert_one_clear_line(result, 2, "read-only file system")


def test_the_default_gate_folder_never_replaces_a_users_folder(mxspec, tmp_path, report):
    users = users_folder(tmp_path / "run" / "gate")
    before = snapshot(users)
    assert_one_clear_line(mxspec("gate", report), 2, "not written by mxspec", str(users))
    assert snapshot(users) == before


def test_gate_out_dot_is_refused(mxspec, tmp_path, report):
    users_folder(tmp_path / "here")
    result = subprocess.run([str(mxspec.exe), "gate", str(report), "--out", "."], cwd=tmp_path / "here",
                            capture_output=True, text=True)
    assert_one_clear_line(result, 2, "current folder")
    assert snapshot(tmp_path / "here") == {"thesis.tex": b"years of work"}


def test_an_earlier_gate_output_is_replaced(mxspec, tmp_path, report):
    """The positive control: what mxspec wrote, it may write again."""
    out = tmp_path / "verdicts"
    assert mxspec("gate", report, "--out", out).returncode == 0
    (out / "verdict.json").write_text("stale")
    assert mxspec("gate", report, "--out", out).returncode == 0
    assert json.loads((out / "verdict.json").read_text())["verdict"] == "pass" and (out / OWNER_MARK).is_file()


def test_the_gate_waits_for_no_other_run_in_a_locked_run_folder(mxspec, tmp_path, report):
    run = report.parent.parent
    (run / ".mxspec").mkdir()
    with open(run / ".mxspec" / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert_one_clear_line(mxspec("gate", report), 2, "in use by another mxspec run")
    assert not (run / "gate").exists()
    assert mxspec("gate", report).returncode == 0  # once the other run is gone


def test_a_run_folder_inside_the_target_is_refused(mxspec, tmp_path):
    target = model_copy(tmp_path, REFERENCE_TARGET, "T")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(BASE.replace(f'"{REFERENCE_TARGET}"', f'"{target}"'))
    assert_one_clear_line(mxspec("run", recipe, "--out", target / "runs"), 2, "inside the target's folder")
    assert not (target / "runs").exists()


def test_an_empty_folder_is_a_fine_run_folder(mxspec, tmp_path):
    """The positive control: a folder the user just made is used, not refused."""
    (tmp_path / "empty").mkdir()
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(BASE)
    result = mxspec("run", recipe, "--out", tmp_path / "empty", "--until", "resolve")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "empty" / "resolve" / "target.json").is_file()


# ----------------------------------------------------------------------------------------- Hub settings

def test_publish_without_a_repo_id_is_one_line(mxspec, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(BASE.replace('repo_id = "local-user/bad-input"', ""))
    result = mxspec("publish", recipe, "--out", tmp_path / "out")
    assert result.returncode == 2 and "repo_id is not set" in result.stderr and "Traceback" not in result.stderr


def test_publish_of_a_run_that_has_not_happened_is_one_line(mxspec, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(BASE)
    for dry_run in ((), ("--dry-run",)):
        result = mxspec("publish", recipe, "--out", tmp_path / "never-ran", *dry_run, env={"HF_TOKEN": "hf_never_printed_0000"})
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "holds no mxspec run; run `mxspec run RECIPE --out" in result.stderr
        assert "hf_never_printed_0000" not in result.stderr + result.stdout
        assert not (tmp_path / "never-ran").exists(), "a refused publish creates no run folder and no state"


def test_publish_of_a_missing_recipe_is_one_line(mxspec, tmp_path):
    assert_one_clear_line(mxspec("publish", tmp_path / "nope.toml"), 2, "recipe not found")


def test_a_bad_hf_endpoint_is_named_by_recipe_check(mxspec, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(BASE + "endpoint = 'localhost:8000'\n")
    assert_one_clear_line(mxspec("recipe", "check", recipe), 2, "publish", "http(s) URL")


def test_hub_prompts_while_offline_are_refused_before_any_stage(mxspec, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(BASE.replace("max_tokens = 16", 'max_tokens = 16\nprompt_source = "hub"'))
    line = assert_one_clear_line(mxspec("run", recipe, "--out", tmp_path / "out", env={"HF_HUB_OFFLINE": "1"}), 2,
                                 "prompt_source is 'hub'", "HF_HUB_OFFLINE")
    assert "packaged" in line
    assert not (tmp_path / "out").exists()


HUB_ONLY = """name = "hub-only"
[target]
id = "Qwen/Qwen3.5-27B"
revision = "fc05daec18b0a78c049392ed2e771dde82bdf654"
[drafter]
id = "z-lab/Qwen3.5-27B-DFlash"
revision = "b0400439c04be32c24e04d9dce3821b582c1a68a"
"""


@pytest.mark.parametrize("out", ["absent", "empty"])
def test_a_run_refused_because_the_hub_is_offline_leaves_nothing_behind(mxspec, tmp_path, out):
    """The resolve stage fails (exit 3, one line); the run folder it created, or the empty folder it was
    given, is as it was: no lock, no hash cache, no logs."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(HUB_ONLY)
    folder = tmp_path / "out"
    if out == "empty":
        folder.mkdir()
    result = mxspec("run", recipe, "--out", folder, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 3 and "HF_HUB_OFFLINE is set" in result.stderr and "Traceback" not in result.stderr
    assert folder.exists() == (out == "empty") and (out == "absent" or not any(folder.iterdir()))


@pytest.mark.parametrize("kind, words", [("directory", ["is a folder"]), ("no-parent", ["does not exist"]),
                                         ("dangling", ["broken or looping symlink"])])
def test_a_bad_plan_json_path_is_one_line_before_any_work(mxspec, tmp_path, kind, words):
    path = {"directory": tmp_path, "no-parent": tmp_path / "nowhere" / "plan.json", "dangling": tmp_path / "link"}[kind]
    if kind == "dangling":
        path.symlink_to(tmp_path / "missing")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = mxspec("plan", REFERENCE_RECIPE, "--json", path)
    assert_one_clear_line(result, 2, "--json file", *words)
    assert result.stdout == "", "refused before the plan is printed"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_recipe_check_refuses_an_exclusion_of_a_hub_recipe_from_its_stored_config(mxspec, tmp_path):
    """No weights here: the 27B's layers come from its stored config, and a typo is caught before download."""
    text = (RECIPES / "qwen3.5-27b-mxfp4.toml").read_text().replace(
        "# exclude omitted: the qwen3_5 family defaults (lm_head, visual tower, MTP head) apply",
        'exclude = ["lm_head", "model.language_model.layers.*.mlp.gate_prj"]')
    assert "gate_prj" in text
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(text)
    assert_one_clear_line(mxspec("recipe", "check", recipe), 2, "pattern 'model.language_model.layers.*.mlp.gate_prj'",
                          "matches no layer")
    recipe.write_text(text.replace("gate_prj", "gate_proj"))  # half of vLLM's fused gate_up_proj
    assert_one_clear_line(mxspec("recipe", "check", recipe), 2, "fused group gate_up_proj", "exclude all of them or none")
    recipe.write_text(text.replace("gate_prj", "down_proj"))
    assert mxspec("recipe", "check", recipe).returncode == 0
