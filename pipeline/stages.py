"""The pipeline's stages in order, and the one call that runs them.

Each stage lives in its own module with one public entry point; this file only orders them.
Stages not listed here have not landed yet, and their CLI commands say which issue tracks them.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from pipeline.errors import BadInputError
from pipeline.pair import PairStage
from pipeline.quantize import QuantizeStage
from pipeline.recipe import Recipe
from pipeline.resolve import ResolveStage
from pipeline.runner import Stage, StageResult, run_stages
from pipeline.validate import ValidateStage

# Planned order: resolve -> quantize -> pair -> validate -> gate -> publish.
PIPELINE: tuple[Stage, ...] = (ResolveStage(), QuantizeStage(), PairStage(), ValidateStage())

# Stages whose bodies have not landed, with the issue that builds them.
PENDING = {"gate": 7, "publish": 7}


def run_pipeline(
    recipe: Recipe,
    out: Path,
    *,
    until: str | None = None,
    force: tuple[str, ...] = (),
    console: Console | None = None,
) -> list[StageResult]:
    """Run every stage up to and including `until` (default: all), resuming what is done."""
    names = [stage.name for stage in PIPELINE]
    unknown = [name for name in (*force, *([until] if until else [])) if name not in names]
    if unknown:
        raise BadInputError(f"unknown stage {unknown[0]!r}; stages are: {', '.join(names)}")
    stages = PIPELINE[: names.index(until) + 1] if until else PIPELINE
    return run_stages(recipe, out, stages, force=force, console=console)
