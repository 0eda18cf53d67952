"""Validate's work as cells: units that measure and nothing else, each kept on its own.

A cell is one server of the serving matrix (precision x method x budget, every workload and
concurrency) or one (precision, workload) of the reference backend. Each finished cell is a folder
OUT/.mxspec/cells/<cell>/ with its result files and `cell.json` (its fingerprint: the recipe keys,
inputs and tool versions the result depends on), written through a temp folder renamed into place.
So a validate killed or failed part-way starts again with every finished cell as it is (never
measured again, its files untouched), and a recipe change re-measures only the cells whose
fingerprint it changes: adding a budget serves only the new servers. The finished stage links the
cells it used into OUT/validate/cells/ and assembles the report from them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.atomic import OWNER_MARK, atomic_directory, make_dirs, sweep_partials

CELL_FILE = "cell.json"
RESULT_FILE = "result.json"  # a cell's measurements, in the model of the code that measures it
CELL_SCHEMA = "mxspec.cell/1"


def serving_cell_name(label: str) -> str:
    """e.g. 'serve-mxfp4-dflash-b8' for the server labelled 'mxfp4-dflash-b8'."""
    return f"serve-{label}"


def reference_cell_name(precision: str, workload: str) -> str:
    return f"reference-{precision}-{workload}"


def fingerprint(**parts) -> str:
    """sha256 of the parts, canonically serialised (JSON, sorted keys)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class CellRecord(BaseModel):
    """OUT/.mxspec/cells/<cell>/cell.json: the cell is finished, and what it was measured from."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["mxspec.cell/1"] = Field(CELL_SCHEMA, alias="schema")
    name: str
    fingerprint: str


@dataclass(frozen=True)
class Cell:
    name: str
    fingerprint: str
    measure: Callable[[Path], None]  # writes the cell's result files into the (empty) folder it is given
    after: tuple[str, ...] = ()  # cells whose results this one reads


class CellStore:
    """The finished cells of one run folder."""

    def __init__(self, root: Path):
        self.root = make_dirs(root, what="cell folder")
        sweep_partials(self.root)

    def folder(self, name: str) -> Path:
        return self.root / name

    def finished(self, cell: Cell) -> bool:
        try:
            record = CellRecord.model_validate_json((self.folder(cell.name) / CELL_FILE).read_bytes())
        except (OSError, ValueError):
            return False
        return record.name == cell.name and record.fingerprint == cell.fingerprint

    def measure(self, cell: Cell) -> Path:
        """Measure the cell into a temp folder renamed into place: a kill leaves no half cell."""
        with atomic_directory(self.folder(cell.name)) as tmp:
            cell.measure(tmp)
            record = CellRecord(name=cell.name, fingerprint=cell.fingerprint)
            (tmp / CELL_FILE).write_text(record.model_dump_json(by_alias=True, indent=2) + "\n")
        return self.folder(cell.name)

    def link_into(self, names: Iterable[str], dest: Path) -> None:
        """Hard links of the named cells' files under dest/<cell>/ (copies where links cannot be made)."""
        for name in names:
            source = self.folder(name)
            for path in sorted(source.rglob("*")):
                if not path.is_file() or path.name == OWNER_MARK:
                    continue
                target = dest / name / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)


def run_cells(store: CellStore, cells: list[Cell], *, remeasure: bool = False,
              on_start: Callable[[Cell], None] | None = None, on_kept: Callable[[Cell], None] | None = None) -> None:
    """Measure every cell not finished with its fingerprint, in order (a cell after those it reads);
    with `remeasure`, measure every cell again."""
    for cell in cells:
        if not remeasure and store.finished(cell):
            if on_kept:
                on_kept(cell)
            continue
        if on_start:
            on_start(cell)
        store.measure(cell)
