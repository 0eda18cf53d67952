"""Hub publishing jobs: several (recipe, run folder) pairs published, or planned, in one invocation.

Each job runs the publish stage on a run whose earlier stages are done (nothing is recomputed); one
job's failure, even a bug, is recorded in its summary row and does not stop the jobs after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape

from pipeline.errors import BadInputError, MxspecError
from pipeline.recipe import Recipe
from pipeline.run.artifacts import PublishResult
from pipeline.run.layout import RunLayout
from pipeline.stages.publish import PublishStage

__all__ = ["JobOutcome", "publish_runs"]


@dataclass(frozen=True)
class JobOutcome:
    """One line of a publishing job's summary."""

    recipe: str
    repo_id: str
    result: str
    revision: str = ""
    files: str = ""
    error: str = ""
    exit_code: int = 0

    def row(self) -> tuple[str, ...]:
        return (self.recipe, self.repo_id, self.error or self.result, self.revision[:12], self.files)


def publish_runs(jobs: list[tuple[Recipe, Path]], *, dry_run: bool = False, force: bool = False, console=None) -> list[JobOutcome]:
    """A publishing job: publish (or plan) each (recipe, run folder); one failure does not stop the rest."""
    outcomes = []
    for recipe, out in jobs:
        repo = recipe.publish.repo_id or "-"
        try:
            outcomes.append(_plan_only(recipe, out, force, console) if dry_run else _publish_one(recipe, out, force, console))
        except MxspecError as exc:
            outcomes.append(_failed(recipe, repo, str(exc), exc.exit_code, console))
        except Exception as exc:  # noqa: BLE001 - a bug in one job must not stop the others; the summary names it
            outcomes.append(_failed(recipe, repo, f"internal error: {exc.__class__.__name__}: {exc}", 3, console))
    return outcomes


def _failed(recipe: Recipe, repo: str, message: str, exit_code: int, console) -> JobOutcome:
    if console:
        console.print(f"[red]error:[/] {escape(recipe.name)}: {escape(message)}")
    return JobOutcome(recipe.name, repo, "failed", error=message.splitlines()[0], exit_code=exit_code)


def _publish_one(recipe: Recipe, out: Path, force: bool, console) -> JobOutcome:
    from pipeline.entrypoints import run_pipeline  # every stage's module, torch among them

    if not recipe.publish.repo_id:
        raise BadInputError(f"{recipe.name}: [publish] repo_id is not set; add repo_id = 'owner/name' to the recipe")
    run_pipeline(recipe, out, until=PublishStage.name, only_last=True, publish_failed_gate=force, console=console)
    result = PublishResult.model_validate_json(RunLayout(Path(out)).publish_result.read_bytes())
    state = "new commit" if result.created_commit else "unchanged (no commit)"
    if result.pr_url:
        state += f", PR {result.pr_url}"
    return JobOutcome(recipe.name, result.repo_id, state, result.revision,
                      f"{result.verified} verified, {len(result.uploaded)} uploaded")


def _plan_only(recipe: Recipe, out: Path, force: bool, console) -> JobOutcome:
    from pipeline.entrypoints import preview_publish

    if not recipe.publish.repo_id:
        raise BadInputError(f"{recipe.name}: [publish] repo_id is not set; add repo_id = 'owner/name' to the recipe")
    plan = preview_publish(recipe, out, force=force, console=console)
    size = plan.total_bytes / 1e9
    where = f"{plan.endpoint}/{plan.repo_id}" + (" (PR)" if plan.create_pr else "") + (f", tag {plan.tag}" if plan.tag else "")
    return JobOutcome(recipe.name, plan.repo_id, f"would upload to {where}: {plan.commit_message}", "",
                      f"{len(plan.files)} files, {size:.2f} GB")
