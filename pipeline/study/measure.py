"""The validation study measured cell by cell: the reference backend, vLLM's serving matrix, or both,
with replays along the served text when vLLM serves alone; then the report assembled from the cells.

Cells are kept in the run folder's cell store, so a killed study resumes with its finished cells
untouched, and run on the executor the recipe's [cluster] names (here, or as Ray tasks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pipeline.recipe import Cluster, Recipe
from pipeline.run.artifacts import ValidateReport
from pipeline.study.assembly import build_report, report_settings, served_rows
from pipeline.study.cells import CellStore, Executor, LocalExecutor, Measured, ar_cell_name, reference_cell_specs
from pipeline.study.progress import CellProgress
from pipeline.study.reference import measure_reference
from pipeline.study.workloads import load_prompts

__all__ = ["Validated", "CellRun", "measure_study", "executor_for"]


class Validated(NamedTuple):
    report: ValidateReport
    seconds: dict[str, float]  # wall time of each phase within the cells (replays, scoring): the manifest's, as it differs run to run
    cells: list[str]  # the cells the report was assembled from
    measured: dict[str, Measured]  # the cells this run measured (not those kept from earlier runs)


@dataclass(frozen=True)
class CellRun:
    """Where validate keeps its cells, the digests of what they read, whether to measure all again, and
    what measures them."""

    store: CellStore
    digests: dict[str, str]  # bf16 | mxfp4 | drafter -> digest of that model's files
    remeasure: bool = False
    executor: Executor | None = None  # default: one cell at a time in this process


def measure_study(recipe: Recipe, target_path: Path, quantized_path: Path, drafter_path: Path, logs: Path,
             console=None, cells: CellRun | None = None) -> Validated:
    """The validate stage's work, cell by cell: acceptance (reference backend, or vLLM's served counters
    per prompt) and, with the vLLM backend, the serving study. Without `cells`, every cell is measured
    into a scratch folder, in this process."""
    import tempfile

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pipeline.run.versions import tool_versions

    v = recipe.validation  # its matrix was checked by the recipe model and `preflight`
    prompts = {w: load_prompts(w, v.num_prompts, v.seed, v.prompt_source) for w in v.workloads}
    paths = {"bf16": Path(target_path), "mxfp4": Path(quantized_path)}
    per_prompt, serving, reference = {}, None, None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with tempfile.TemporaryDirectory(prefix="mxspec-cells-") as scratch, \
            Progress(*columns, console=console, transient=False) as progress:
        cells = cells or CellRun(CellStore(Path(scratch), logs), {"bf16": "", "mxfp4": "", "drafter": ""})
        replays = v.replays_served_text
        references = reference_cell_specs(v.precisions, v.workloads, along_served_text=replays)
        steps = len(references) * v.num_prompts if "reference" in v.backends or replays else 0
        if "vllm" in v.backends:
            from pipeline.study.served import measures_served_fidelity, serve_matrix, server_matrix

            steps += len(server_matrix(recipe)) * len(recipe.served.workloads) * len(v.concurrency)
            steps += len(recipe.served.workloads) if measures_served_fidelity(recipe) else 0
        events = CellProgress(progress, steps)
        run = {"remeasure": cells.remeasure, "events": events, "executor": cells.executor}
        if "reference" in v.backends:
            reference = measure_reference(recipe, paths, drafter_path, prompts, cells.store, cells.digests, **run)
            per_prompt = reference.own_text
        if "vllm" in v.backends:
            serving = serve_matrix(recipe, paths, drafter_path, prompts, cells.store, cells.digests, **run)
            if "reference" not in v.backends:
                per_prompt = serving.per_prompt
        if replays:  # the reference path along the AR servers' text: same text and fidelity without generating
            served = {p: serving.fingerprints[ar_cell_name(p)] for p in v.precisions}
            reference = measure_reference(recipe, paths, drafter_path, prompts, cells.store, cells.digests,
                                          served=served, **run)
    meta = {"recipe": recipe.name, "backend": "reference" if "reference" in v.backends else "vllm",
            "target": str(target_path), "drafter": str(drafter_path), "settings": report_settings(recipe),
            "versions": tool_versions(),
            "reference_text": "served" if replays else "generated" if "reference" in v.backends else None}
    report = build_report(recipe, per_prompt, meta, reference=reference,
                          served_fidelity=serving.fidelity if serving else None,
                          mtp_per_prompt=serving.mtp_per_prompt if serving else None,
                          per_request=serving.per_request if serving else None)
    if serving is not None:
        report = report.model_copy(update={"serving": served_rows(serving, reference)})
    names = (reference.cells if reference is not None else []) + (serving.cells if serving is not None else [])
    measured = (reference.measured if reference is not None else {}) | (serving.measured if serving is not None else {})
    phases: dict[str, float] = {}
    for done in measured.values():
        for phase, seconds in done.phases.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return Validated(report, phases, names, measured)


def executor_for(cluster: Cluster) -> Executor:
    """The executor a recipe's [cluster] section names."""
    if cluster.executor == "ray":
        from pipeline.study.ray_executor import RayExecutor

        return RayExecutor(cluster)
    return LocalExecutor()
