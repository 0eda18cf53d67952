"""The pipeline's stages in order, and the one call that runs them.

Each stage lives in its own module with one public entry point; this file only orders them.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from pipeline.errors import BadInputError
from pipeline.hub.upload import PublishPlan
from pipeline.recipe import Recipe
from pipeline.run.runner import Stage, StageResult, preview_last_stage, run_stages
from pipeline.stages.gate import GateStage
from pipeline.stages.pair import PairStage
from pipeline.stages.preflight import preflight
from pipeline.stages.publish import PublishStage, plan_publish
from pipeline.stages.quantize import QuantizeStage
from pipeline.stages.resolve import ResolveStage
from pipeline.stages.validate import ValidateStage

__all__ = ["PIPELINE", "run_pipeline", "preview_publish"]

PIPELINE: tuple[Stage, ...] = (ResolveStage(), QuantizeStage(), PairStage(), ValidateStage(), GateStage(), PublishStage())


def run_pipeline(
    recipe: Recipe,
    out: Path,
    *,
    until: str | None = None,
    force: tuple[str, ...] = (),
    only_last: bool = False,
    publish_failed_gate: bool = False,
    console: Console | None = None,
) -> list[StageResult]:
    """Run every stage up to and including `until` (default: all), resuming what is done.

    With `only_last`, the stages before `until` must already be up to date (nothing is recomputed).
    `publish_failed_gate` lets the publish stage upload a run whose gate did not pass (recorded)."""
    names = [stage.name for stage in PIPELINE]
    unknown = [name for name in (*force, *([until] if until else [])) if name not in names]
    if unknown:
        raise BadInputError(f"unknown stage {unknown[0]!r}; stages are: {', '.join(names)}")
    pipeline = (*PIPELINE[:-1], PublishStage(force=publish_failed_gate))
    stages = pipeline[: names.index(until) + 1] if until else pipeline
    must_be_done = tuple(stage.name for stage in stages[:-1]) if only_last else ()
    preflight(recipe, out)
    return run_stages(recipe, out, stages, force=force, must_be_done=must_be_done, console=console)


def preview_publish(recipe: Recipe, out: Path, *, force: bool = False, console: Console | None = None) -> PublishPlan:
    """`mxspec publish --dry-run`: what `run_pipeline(recipe, out, until="publish", only_last=True)` would
    upload, decided by the same checks (preflight, the run folder, its lock, every stage up to date,
    the gate) and refused with the same lines; nothing is written or uploaded."""
    import tempfile

    preflight(recipe, out)

    def plan(ctx) -> PublishPlan:
        with tempfile.TemporaryDirectory(prefix="mxspec-card-") as card_dir:
            return plan_publish(recipe, ctx.out, Path(card_dir), ctx.hashes, force=force)

    return preview_last_stage(recipe, out, (*PIPELINE[:-1], PublishStage(force=force)), plan, console)
