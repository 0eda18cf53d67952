"""Publish stage: upload the validated MXFP4 checkpoint with its model card, then prove it arrived.

The stage plans what a run publishes (the checkpoint, README.md rendered from the run, the figures and
mxspec's reports) and hands the plan to `hub.upload`, which makes the repo equal to it in one commit and
verifies the result (`hub.http` holds the time limits and retries).

Guards: a gate that did not pass refuses the upload unless forced, and the drafter is never uploaded
or touched (it is only named, with its revision and hashes, in the card). The Hub token comes from
the environment or the Hub's own login and never appears in output, reports, the card or errors.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.errors import BadInputError, GateFailedError
from pipeline.hub.env import hub_endpoint, hub_token
from pipeline.hub.http import configure_hub_client
from pipeline.hub.upload import PublishPlan, UploadFile, publish_plan
from pipeline.recipe import Recipe
from pipeline.report.card import RunArtifacts, render_model_card
from pipeline.run.artifacts import PublishedFiles, PublishSkipped, write_artifact
from pipeline.run.atomic import OWNER_MARK
from pipeline.run.hashing import HashCache, list_files
from pipeline.run.layout import CARD_FILE, PUBLISH_FILE, PUBLISHED_LIST, REPO_FIGURES, REPO_REPORTS
from pipeline.run.runner import StageContext

__all__ = ["WEIGHT_SUFFIXES", "plan_publish", "published_list", "PublishStage"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # drafter files that must never be uploaded (a shared
# tokenizer file may legitimately have the same bytes in both repos)


def plan_publish(recipe: Recipe, out: Path, card_dir: Path, hashes: HashCache, *, force: bool = False) -> PublishPlan:
    """What would be uploaded for the run in `out`; writes the card into `card_dir`. Checks every guard."""
    publish = recipe.publish
    if not publish.repo_id:
        raise BadInputError("[publish] repo_id is not set in the recipe; add repo_id = 'owner/name' to publish")
    run = RunArtifacts(Path(out))
    for stage in PublishStage.requires:
        if not run.layout.manifest(stage).is_file():
            raise BadInputError(f"{run.out}: stage '{stage}' has not run; run `mxspec run RECIPE --out {run.out}` first")
    verdict = run.gate
    if not verdict.passed and not force:
        raise GateFailedError(f"refusing to publish: the gate verdict is {verdict.verdict} (see "
                              f"{run.layout.summary}); fix the checkpoint, or pass --force to publish anyway",
                              verdict=run.layout.verdict)
    card = Path(card_dir) / CARD_FILE
    card.write_text(render_model_card(recipe, run, publish.repo_id))

    sources: dict[str, Path] = {}
    for rel in list_files(run.checkpoint):
        if Path(rel).name != OWNER_MARK:  # Quark's export copies the source folder's side files, a mark included
            sources[rel] = run.checkpoint / rel
    sources[CARD_FILE] = card  # the card replaces any README copied from the base model
    for figure in run.figures():
        sources[f"{REPO_FIGURES}/{figure.name}"] = figure
    for report in run.layout.reports():
        if report.is_file():
            sources[f"{REPO_REPORTS}/{report.name}"] = report
    drafter_weights = {sha for name, sha in run.pair.drafter.files.items() if name.endswith(WEIGHT_SUFFIXES)}
    files = []
    for path_in_repo, local in sorted(sources.items()):
        sha = hashes.file(local)
        if sha in drafter_weights:
            raise BadInputError(f"{local} has the same bytes as the drafter's weights; the drafter is never uploaded")
        files.append(UploadFile(path_in_repo, local, local.stat().st_size, sha))
    files.append(published_list(files, Path(card_dir)))
    message = (f"mxspec: {recipe.name}, {run.quantize.scheme} with AMD Quark, gate {verdict.verdict}"
               + (" (forced)" if not verdict.passed else ""))
    return PublishPlan(publish.repo_id, hub_endpoint(publish.endpoint), publish.private, publish.create_pr, publish.tag, message, files,
                       gate_verdict=verdict.verdict, forced=not verdict.passed)


def published_list(files: list[UploadFile], folder: Path) -> UploadFile:
    """Write mxspec/files.json (the planned files, itself excepted) into `folder`, as a file to upload."""
    local = folder / Path(PUBLISHED_LIST).name
    listing = PublishedFiles(files={f.path_in_repo: f.sha256 for f in files})
    write_artifact(listing, local)
    return UploadFile(PUBLISHED_LIST, local, local.stat().st_size, hashlib.sha256(local.read_bytes()).hexdigest())


class PublishStage:
    """Runs every time (it only re-verifies when nothing changed): the remote can change between runs.

    `force` publishes even though the gate did not pass (recorded in publish.json and the commit message)."""

    name = "publish"
    version = 1
    sections = ("publish",)
    requires = ("quantize", "pair", "validate", "gate")
    tools = ("huggingface-hub",)
    always_run = True

    def __init__(self, force: bool = False):
        self.force = force

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> None:
        recipe = ctx.recipe
        if not recipe.publish.repo_id:
            write_artifact(PublishSkipped(reason="no [publish] repo_id"), workdir / PUBLISH_FILE)
            ctx.console.print("  publish: no \\[publish] repo_id in the recipe; nothing uploaded")
            return
        plan = plan_publish(recipe, ctx.out, workdir, ctx.hashes, force=self.force)  # refuses a failed gate first
        token = hub_token()
        configure_hub_client()
        result = publish_plan(plan, token)
        write_artifact(result, workdir / PUBLISH_FILE)
        ctx.console.print(f"  publish: {result.repo_id}@{result.revision[:12]} "
                          f"({'new commit, ' + str(len(result.uploaded)) + ' files' if result.created_commit else 'unchanged, no commit'}; "
                          f"{result.verified} files verified)")
