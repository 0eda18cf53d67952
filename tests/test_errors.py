"""Every error mxspec raises on purpose is defined in pipeline/errors.py and carries what a caller needs."""

from __future__ import annotations

import ast
import socket

import pytest

from pipeline import errors
from pipeline.errors import BadInputError, CellFailedError, MxspecError, RecipeError, ServerError
from tests.conftest import ROOT


def exception_classes_defined_in(path) -> list[str]:
    """Classes in `path` whose bases name an Error, an Exception or an mxspec error."""
    tree = ast.parse(path.read_text())
    names = {name for name in dir(errors) if isinstance(getattr(errors, name), type)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base).split(".")[-1] for base in node.bases]
            if any(b.endswith(("Error", "Exception")) or b in names for b in bases):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return found


def test_no_error_class_is_defined_outside_the_errors_module():
    modules = [p for p in (ROOT / "pipeline").rglob("*.py") if p != ROOT / "pipeline" / "errors.py"]
    assert len(modules) > 40
    assert [found for path in modules for found in exception_classes_defined_in(path)] == []


def test_the_scan_finds_an_error_class_where_there_is_one(tmp_path):
    probe = ROOT / "pipeline" / "errors.py"
    assert len(exception_classes_defined_in(probe)) >= 9


def test_every_error_has_an_exit_code_the_cli_can_return():
    classes = [cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, MxspecError)]
    assert {cls.exit_code for cls in classes} <= {1, 2, 3}
    assert BadInputError.exit_code == 2 and RecipeError.exit_code == 2 and ServerError.exit_code == 3


def test_a_recipe_error_names_the_recipe(tmp_path):
    from pipeline.recipe import load_recipe

    broken = tmp_path / "broken.toml"
    broken.write_text("name = [unclosed\n")
    with pytest.raises(RecipeError) as raised:
        load_recipe(broken)
    assert raised.value.path == broken and raised.value.exit_code == 2


def test_a_server_that_does_not_answer_is_a_server_error_with_its_url():
    from pipeline.serving.client import scrape_metrics

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError) as raised:
        scrape_metrics(f"http://127.0.0.1:{port}", timeout=2.0)
    assert raised.value.url == f"http://127.0.0.1:{port}/metrics"


def test_a_failed_cell_names_its_cell_and_keeps_its_exit_code():
    failed = CellFailedError("cell x failed", cell="x", exit_code=2)
    assert (failed.cell, failed.log, failed.exit_code, str(failed)) == ("x", None, 2, "cell x failed")
