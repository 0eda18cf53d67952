"""Validate's work as cells: units that measure and nothing else, each kept on its own.

A cell is one server of the serving matrix (precision x method x budget, every workload and
concurrency) or one (precision, workload) of the reference backend, which either generates its own
text or, in a vLLM-only study, replays along the text vLLM served (a replay cell). Each finished cell is a folder
OUT/.mxspec/cells/<cell>/ with its result files and `cell.json` (its fingerprint: the recipe keys,
inputs and tool versions the result depends on), written through a temp folder renamed into place.
So a validate killed or failed part-way starts again with every finished cell as it is (never
measured again, its files untouched), and a recipe change re-measures only the cells whose
fingerprint it changes: adding a budget serves only the new servers. The finished stage links the
cells it used into OUT/validate/cells/ and assembles the report from them.

An executor measures the cells to do: `LocalExecutor` one after another in this process, or
`pipeline.study.ray_executor.RayExecutor` as Ray tasks across a cluster. A cell's `measure` reads nothing but
its workspace (the folders of the cells it comes after) and what it captured (paths on shared
storage), so it runs the same on either.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from pipeline.run.atomic import OWNER_MARK, atomic_directory, make_dirs, sweep_partials
from pipeline.run.hashing import canonical_sha256

__all__ = ["CELL_FILE", "RESULT_FILE", "TIMING_FILE", "CELL_SCHEMA", "SCORE_CELL", "server_label",
    "serving_cell_name", "ar_cell_name", "reference_cell_name", "replay_cell_name", "ReferenceCellSpec",
    "reference_cell_specs", "fingerprint", "CellRecord", "CellWorkspace", "Cell", "Measured", "CellEvents",
    "CellStore", "read_timing", "Executor", "LocalExecutor", "run_cells"]

CELL_FILE = "cell.json"
RESULT_FILE = "result.json"  # a cell's measurements, in the model of the code that measures it
TIMING_FILE = "timing.json"  # how long it took and where: kept beside the cell, never linked into a stage
CELL_SCHEMA = "mxspec.cell/1"


SCORE_CELL = "score-mxfp4"  # an MXFP4 AR server scoring the bf16 AR server's text (served fidelity)


def server_label(precision: str, method: str, budget: int | None) -> str:
    """A server of the matrix, named: e.g. 'mxfp4-dflash-b8' (block size 8), 'bf16-ar'."""
    return f"{precision}-{method}" + (f"-b{budget}" if budget else "")


def serving_cell_name(label: str) -> str:
    """e.g. 'serve-mxfp4-dflash-b8' for the server labelled 'mxfp4-dflash-b8'."""
    return f"serve-{label}"


def ar_cell_name(precision: str) -> str:
    """The AR server's cell of one precision: its greedy text is what served fidelity and the replays read."""
    return serving_cell_name(server_label(precision, "ar", None))


def reference_cell_name(precision: str, workload: str) -> str:
    return f"reference-{precision}-{workload}"


def replay_cell_name(precision: str, workload: str) -> str:
    """The reference backend's cell that replays along vLLM's served text instead of generating its own."""
    return f"replay-{precision}-{workload}"


@dataclass(frozen=True)
class ReferenceCellSpec:
    """One cell of the reference backend and what it reads, before anything measures it."""

    name: str
    precision: str
    workload: str
    text_cell: str | None  # the AR serving cell whose greedy text it replays (None: it generates its own)
    bf16_cell: str | None  # the bf16 cell whose texts this MXFP4 cell verifies (same text, fidelity)

    @property
    def after(self) -> tuple[str, ...]:
        return tuple(cell for cell in (self.text_cell, self.bf16_cell) if cell)


def reference_cell_specs(precisions: Iterable[str], workloads: Iterable[str], *,
                         along_served_text: bool) -> list[ReferenceCellSpec]:
    """The reference backend's cells in the order they are measured, bf16 first: each MXFP4 cell verifies
    its workload's bf16 texts. Along the served text they are replay cells that read the AR servers' text.
    The study (`study.reference`) and its plan (`study.plan`) both list them from here."""
    name = replay_cell_name if along_served_text else reference_cell_name
    precisions = sorted(precisions, key=["bf16", "mxfp4"].index)
    return [ReferenceCellSpec(name=name(precision, workload), precision=precision, workload=workload,
                              text_cell=ar_cell_name(precision) if along_served_text else None,
                              bf16_cell=name("bf16", workload) if precision == "mxfp4" and "bf16" in precisions else None)
            for precision in precisions for workload in workloads]


def fingerprint(**parts) -> str:
    """sha256 of the parts, canonically serialised (JSON, sorted keys)."""
    return canonical_sha256(parts)


class CellRecord(BaseModel):
    """OUT/.mxspec/cells/<cell>/cell.json: the cell is finished, and what it was measured from."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["mxspec.cell/1"] = Field(CELL_SCHEMA, alias="schema")
    name: str
    fingerprint: str


@dataclass
class CellWorkspace:
    """What a cell's measurement is given, wherever it runs (this process or a Ray worker)."""

    out: Path  # an empty folder for the cell's result files
    inputs: dict[str, Path]  # cell name -> folder with that finished cell's files, for each cell in `after`
    logs: Path  # for logs that must outlive a failed cell (a server's log), named after the cell
    step: Callable[[], None] = lambda: None  # one of the cell's `steps` is done
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per phase of the work

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


@dataclass(frozen=True)
class Cell:
    name: str
    fingerprint: str
    measure: Callable[[CellWorkspace], None]  # writes the cell's result files into workspace.out
    after: tuple[str, ...] = ()  # cells whose results this one reads (workspace.inputs)
    steps: int = 1  # progress steps the measurement reports
    gpus: int = 1  # accelerators its work occupies: a server's tensor_parallel_size


class Measured(BaseModel):
    """OUT/.mxspec/cells/<cell>/timing.json: a cell's wall time, the phases within it, and where it ran.
    Not part of the cell's result: it differs from run to run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds: float
    phases: dict[str, float] = {}
    where: str = "here"


class CellEvents:
    """What an executor reports while it works; the default ignores it all (validate draws progress)."""

    def kept(self, cell: Cell) -> None: ...
    def started(self, cell: Cell, where: str) -> None: ...
    def step(self, cell: Cell) -> None: ...
    def finished(self, cell: Cell, measured: Measured) -> None: ...


class CellStore:
    """The finished cells of one run folder, and the folder where cells keep their logs."""

    def __init__(self, root: Path, logs: Path):
        self.root = make_dirs(root, what="cell folder")
        self.logs = Path(logs)
        sweep_partials(self.root)

    def folder(self, name: str) -> Path:
        return self.root / name

    def finished(self, cell: Cell) -> bool:
        try:
            record = CellRecord.model_validate_json((self.folder(cell.name) / CELL_FILE).read_bytes())
        except (OSError, ValueError):
            return False
        return record.name == cell.name and record.fingerprint == cell.fingerprint

    def keep(self, cell: Cell, fill: Callable[[Path], Measured]) -> Measured:
        """The cell's files, written by `fill` into a temp folder renamed into place with the cell's
        record and timing: a kill or an error leaves no half cell."""
        with atomic_directory(self.folder(cell.name)) as tmp:
            measured = fill(tmp)
            (tmp / TIMING_FILE).write_text(measured.model_dump_json(indent=2) + "\n")
            record = CellRecord(name=cell.name, fingerprint=cell.fingerprint)
            (tmp / CELL_FILE).write_text(record.model_dump_json(by_alias=True, indent=2) + "\n")
        return measured

    def timing(self, name: str) -> Measured | None:
        return read_timing(self.root, name)

    def link_into(self, names: Iterable[str], dest: Path) -> None:
        """Hard links of the named cells' files under dest/<cell>/ (copies where links cannot be made)."""
        for name in names:
            source = self.folder(name)
            for path in sorted(source.rglob("*")):
                if not path.is_file() or path.name in (OWNER_MARK, TIMING_FILE):
                    continue
                target = dest / name / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)


def read_timing(cells: Path, name: str) -> Measured | None:
    """How long the cell kept under `cells` took when it was measured; None if it is not kept."""
    try:
        return Measured.model_validate_json((Path(cells) / name / TIMING_FILE).read_bytes())
    except (OSError, ValueError):
        return None


class Executor(Protocol):
    def measure(self, store: CellStore, cells: list[Cell], events: CellEvents) -> dict[str, Measured]:
        """Measure the cells (each after the cells it reads) into the store; raise CellFailedError when one fails."""
        ...


class LocalExecutor:
    """One cell at a time in this process, in order; the first failure stops the study (the cells
    finished before it are kept)."""

    def measure(self, store: CellStore, cells: list[Cell], events: CellEvents) -> dict[str, Measured]:
        done = {}
        make_dirs(store.logs, what="log folder")
        for cell in cells:
            events.started(cell, "here")
            workspace = CellWorkspace(Path(), {name: store.folder(name) for name in cell.after}, store.logs,
                                      functools.partial(events.step, cell))

            def fill(tmp: Path, cell=cell, workspace=workspace) -> Measured:
                workspace.out, started = tmp, time.perf_counter()
                cell.measure(workspace)
                return Measured(seconds=time.perf_counter() - started, phases=workspace.seconds)

            done[cell.name] = store.keep(cell, fill)
            events.finished(cell, done[cell.name])
        return done


def run_cells(store: CellStore, cells: list[Cell], executor: Executor | None = None, *, remeasure: bool = False,
              events: CellEvents | None = None) -> dict[str, Measured]:
    """Measure every cell not finished with its fingerprint (with `remeasure`, every cell), a cell after
    those it reads; returns what this run measured."""
    events = events or CellEvents()
    todo = [cell for cell in cells if remeasure or not store.finished(cell)]
    for cell in cells:
        if cell not in todo:
            events.kept(cell)
    return (executor or LocalExecutor()).measure(store, todo, events) if todo else {}

