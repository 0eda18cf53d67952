"""Typed artifacts: one model per file a stage writes, its JSON Schema published in docs/schemas/, and
the readers of finished runs (gate, card, publish, the CLI's light commands) free of torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pipeline.errors import BadInputError
from pipeline.run.artifacts import GateVerdict, json_schemas, read_artifact

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "docs" / "schemas"
LIGHT = ("pipeline.run.artifacts", "pipeline.stages.gate", "pipeline.report.card", "pipeline.stages.publish", "pipeline.jobs", "pipeline.cli",
         "pipeline.report.markdown", "pipeline.report.figures", "pipeline.study.plan",
         "pipeline.entrypoints")  # every stage's class: a run refused by its recipe or preflight loads no torch


def test_docs_schemas_match_the_models():
    expected = json_schemas()
    on_disk = {p.name: json.loads(p.read_text()) for p in SCHEMAS.glob("*.schema.json")}
    assert set(on_disk) == set(expected), "run `python scripts/export_schemas.py`"
    for name, schema in expected.items():
        assert on_disk[name] == schema, f"docs/schemas/{name} is stale: run `python scripts/export_schemas.py`"


def test_verdicts_are_a_closed_set():
    verdict = json_schemas()["gate.schema.json"]["properties"]["verdict"]
    assert sorted(verdict["enum"]) == ["fail", "inconclusive", "pass"]


def test_a_broken_artifact_is_refused_in_one_line(tmp_path):
    path = tmp_path / "verdict.json"
    path.write_text(json.dumps({"schema": "mxspec.gate/1", "verdict": "maybe"}))
    with pytest.raises(BadInputError, match=r"verdict.json: 'verdict' input should be 'pass', 'fail' or 'inconclusive'; redo"):
        read_artifact(path, GateVerdict, "redo")
    with pytest.raises(BadInputError, match="not found; redo"):
        read_artifact(tmp_path / "absent.json", GateVerdict, "redo")


def test_readers_of_finished_runs_do_not_import_torch():
    code = f"import sys\nfor m in {LIGHT!r}:\n    __import__(m)\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.slow
def test_every_module_imports_alone():
    """No import cycle hides behind import order: each module imports in a fresh interpreter."""
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "pipeline").rglob("*.py"))

    def import_alone(module: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                              check=False)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one interpreter per core at a time
        done = dict(zip(modules, pool.map(import_alone, modules)))
    failed = {m: d.stderr.strip().splitlines()[-1] for m, d in done.items() if d.returncode}
    assert len(done) == len(modules) > 40 and not failed
