"""Publish stage: upload the validated MXFP4 checkpoint with its model card, then prove it arrived.

One commit carries the checkpoint, the card (README.md), the figures and mxspec's own reports
(`mxspec/`). Before committing, the remote tree is compared with the local files (size plus sha256
for LFS files, git blob id for small ones), so publishing the same artifacts again makes no commit,
and a publish killed half-way resumes: LFS objects already on the Hub are not sent again (the LFS
batch API says so) and the commit is only created once everything is uploaded. After the commit the
remote tree is listed again and every file is compared with its local bytes.

Guards: a gate that did not pass refuses the upload unless forced, and the drafter is never uploaded
or touched (it is only named, with its revision and hashes, in the card). The Hub token comes from
the environment or the Hub's own login and never appears in output, reports, the card or errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.card import RunArtifacts, render_model_card
from pipeline.errors import BadInputError, ExternalError, GateFailedError
from pipeline.gate import read_verdict
from pipeline.hashing import HashCache, list_files
from pipeline.recipe import Recipe
from pipeline.runner import StageContext

PUBLISH_FILE = "publish.json"
CARD_FILE = "README.md"
REPORTS = (("quantize", "mxspec-quantize.json"), ("pair", "pair.json"), ("validate", "report.json"),
           ("validate", "report.md"), ("gate", "verdict.json"), ("gate", "summary.md"))
DEFAULT_ENDPOINT = "https://huggingface.co"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # drafter files that must never be uploaded (a shared
# tokenizer file may legitimately have the same bytes in both repos)


class HubError(ExternalError):
    """The Hub refused a request or could not be reached."""


@dataclass(frozen=True)
class UploadFile:
    path_in_repo: str
    local: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class PublishPlan:
    repo_id: str
    endpoint: str
    private: bool
    create_pr: bool
    tag: str | None
    commit_message: str
    files: list[UploadFile]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class PublishResult:
    repo_id: str
    endpoint: str
    revision: str  # the commit that holds the files
    created_commit: bool  # False when the Hub already had exactly these files
    uploaded: list[str]  # files sent in the commit (empty when nothing changed)
    verified: int  # files whose remote size and sha256 matched the local bytes
    pr_url: str | None = None
    tag: str | None = None
    gate_verdict: str = ""
    forced: bool = False
    files: dict[str, str] = field(default_factory=dict)  # path in repo -> sha256


def hub_endpoint(recipe: Recipe) -> str:
    return (recipe.publish.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_token() -> str:
    """The token from HF_TOKEN or `hf auth login`; one line on how to provide it when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise BadInputError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or stop before publishing "
                            "with `mxspec run RECIPE --until gate`)")
    return token


def plan_publish(recipe: Recipe, out: Path, card_dir: Path, hashes: HashCache, *, force: bool = False) -> PublishPlan:
    """What would be uploaded for the run in `out`; writes the card into `card_dir`. Checks every guard."""
    publish = recipe.publish
    if not publish.repo_id:
        raise BadInputError("[publish] repo_id is not set in the recipe; add repo_id = 'owner/name' to publish")
    run = RunArtifacts(Path(out))
    for stage in ("quantize", "pair", "validate", "gate"):
        if not (run.out / stage / "manifest.json").is_file():
            raise BadInputError(f"{run.out}: stage '{stage}' has not run; run `mxspec run RECIPE --out {run.out}` first")
    verdict = read_verdict(run.out / "gate")
    if not verdict["passed"] and not force:
        raise GateFailedError(f"refusing to publish: the gate verdict is {verdict['verdict']} (see "
                              f"{run.out / 'gate' / 'summary.md'}); fix the checkpoint, or pass --force to publish anyway")
    card = Path(card_dir) / CARD_FILE
    card.write_text(render_model_card(recipe, run, publish.repo_id))

    sources: dict[str, Path] = {}
    for rel in list_files(run.checkpoint):
        sources[rel] = run.checkpoint / rel
    sources[CARD_FILE] = card  # the card replaces any README copied from the base model
    for figure in run.figures():
        sources[f"figures/{figure.name}"] = figure
    for stage, name in REPORTS:
        if (run.out / stage / name).is_file():
            sources[f"mxspec/{name}"] = run.out / stage / name
    drafter_weights = {sha for name, sha in run.pair["drafter"]["files"].items() if name.endswith(WEIGHT_SUFFIXES)}
    files = []
    for path_in_repo, local in sorted(sources.items()):
        sha = hashes.file(local)
        if sha in drafter_weights:
            raise BadInputError(f"{local} has the same bytes as the drafter's weights; the drafter is never uploaded")
        files.append(UploadFile(path_in_repo, local, local.stat().st_size, sha))
    message = (f"mxspec: {recipe.name}, {run.quantize['scheme']} with AMD Quark, gate {verdict['verdict']}"
               + (" (forced)" if not verdict["passed"] else ""))
    return PublishPlan(publish.repo_id, hub_endpoint(recipe), publish.private, publish.create_pr, publish.tag, message, files)


def publish_plan(plan: PublishPlan, token: str, *, gate_verdict: str = "", forced: bool = False) -> PublishResult:
    """Create the repo if needed, commit what differs from the remote, tag, verify. Idempotent."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=plan.endpoint, token=token)
    with _hub_errors(plan, token):
        api.create_repo(plan.repo_id, private=plan.private, exist_ok=True)
        head = _head_commit(api, plan.repo_id)
        remote = _remote_files(api, plan.repo_id, head) if head else {}
        changed = [f for f in plan.files if not _same(f, remote.get(f.path_in_repo))]
        pr_url = None
        if changed:
            info = api.create_commit(
                plan.repo_id,
                operations=[CommitOperationAdd(f.path_in_repo, str(f.local)) for f in changed],
                commit_message=plan.commit_message,
                create_pr=plan.create_pr,
                parent_commit=head,
            )
            revision, pr_url = info.oid, info.pr_url
        else:
            revision = head
        if plan.tag and not plan.create_pr:
            _ensure_tag(api, plan.repo_id, plan.tag, revision)
        verified = verify_upload(api, plan, revision)
    return PublishResult(plan.repo_id, plan.endpoint, revision, bool(changed), [f.path_in_repo for f in changed],
                         verified, pr_url, plan.tag if not plan.create_pr else None, gate_verdict, forced,
                         {f.path_in_repo: f.sha256 for f in plan.files})


def verify_upload(api, plan: PublishPlan, revision: str) -> int:
    """List the remote tree at `revision` and compare every planned file's size and content hash."""
    remote = _remote_files(api, plan.repo_id, revision)
    problems = []
    for f in plan.files:
        entry = remote.get(f.path_in_repo)
        if entry is None:
            problems.append(f"{f.path_in_repo} is missing")
        elif not _same(f, entry, download=lambda path: _download_sha256(api, plan.repo_id, path, revision)):
            problems.append(f"{f.path_in_repo} differs (remote size {entry.size}, local {f.size})")
    if problems:
        raise HubError(f"{plan.repo_id}@{revision[:12]}: upload verification failed: {'; '.join(problems[:5])}")
    return len(plan.files)


def _head_commit(api, repo_id: str) -> str | None:
    """sha of main, or None for a repo without commits."""
    refs = api.list_repo_refs(repo_id)
    main = next((b for b in refs.branches if b.name == "main"), None)
    return main.target_commit if main else None


def _remote_files(api, repo_id: str, revision: str) -> dict:
    from huggingface_hub.hf_api import RepoFile

    return {entry.path: entry for entry in api.list_repo_tree(repo_id, revision=revision, recursive=True)
            if isinstance(entry, RepoFile)}


def git_blob_sha1(path: Path) -> str:
    """The id git (and the Hub's tree listing) gives a regular file's content."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _same(local: UploadFile, remote, download=None) -> bool:
    """Remote entry holds exactly the local bytes: LFS by sha256, regular files by git blob id (or bytes)."""
    if remote is None or remote.size != local.size:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == local.sha256
    if download is not None:  # verification: read the bytes back and hash them
        return download(local.path_in_repo) == local.sha256
    return remote.blob_id == git_blob_sha1(local.local)


def _download_sha256(api, repo_id: str, path: str, revision: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        local = api.hf_hub_download(repo_id, path, revision=revision, local_dir=tmp)
        return hashlib.sha256(Path(local).read_bytes()).hexdigest()


def _ensure_tag(api, repo_id: str, tag: str, revision: str) -> None:
    """Tags are immutable: create it, accept it if it already names `revision`, refuse otherwise."""
    existing = next((t for t in api.list_repo_refs(repo_id).tags if t.name == tag), None)
    if existing is None:
        api.create_tag(repo_id, tag=tag, revision=revision, tag_message="mxspec publish")
    elif existing.target_commit != revision:
        raise BadInputError(f"[publish] tag {tag!r} already names commit {existing.target_commit[:12]} in {repo_id}; "
                            "pick a new tag")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client errors huggingface_hub may raise: httpx's, or httpx2's (huggingface_hub >= 2.4)."""
    import importlib

    found = []
    for module in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(module).HTTPError)
        except ImportError:
            continue
    return tuple(found)


class _hub_errors:
    """Turn client and HTTP failures into one-line HubErrors that never contain the token."""

    def __init__(self, plan: PublishPlan, token: str):
        self.plan, self.token = plan, token

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (BadInputError, GateFailedError, HubError)):
            return False
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(exc, HfHubHTTPError):
            status = exc.response.status_code if exc.response is not None else "?"
            first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            if status in (401, 403):
                message = f"the Hub at {self.plan.endpoint} refused the token ({status}); check HF_TOKEN's write access to {self.plan.repo_id}"
            else:
                message = f"the Hub at {self.plan.endpoint} answered {status}: {first}"
        elif isinstance(exc, (*_transport_errors(), OSError)):
            message = f"cannot reach the Hub at {self.plan.endpoint} ({exc.__class__.__name__}); check the network or HF_ENDPOINT"
        else:
            return False
        raise HubError(message.replace(self.token, "***")) from None


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
            (workdir / PUBLISH_FILE).write_text(json.dumps({"published": False, "reason": "no [publish] repo_id"}) + "\n")
            ctx.console.print("  publish: no [publish] repo_id in the recipe; nothing uploaded")
            return
        plan = plan_publish(recipe, ctx.out, workdir, ctx.hashes, force=self.force)  # refuses a failed gate first
        token = hub_token()
        gate = read_verdict(ctx.stage_dir("gate"))
        result = publish_plan(plan, token, gate_verdict=gate["verdict"], forced=not gate["passed"])
        write_result(result, workdir)
        ctx.console.print(f"  publish: {result.repo_id}@{result.revision[:12]} "
                          f"({'new commit, ' + str(len(result.uploaded)) + ' files' if result.created_commit else 'unchanged, no commit'}; "
                          f"{result.verified} files verified)")


def write_result(result: PublishResult, folder: Path) -> None:
    (folder / PUBLISH_FILE).write_text(json.dumps({"published": True, **asdict(result)}, indent=2) + "\n")


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
    from pipeline.errors import MxspecError

    outcomes = []
    for recipe, out in jobs:
        repo = recipe.publish.repo_id or "-"
        try:
            outcomes.append(_plan_only(recipe, out, force) if dry_run else _publish_one(recipe, out, force, console))
        except MxspecError as exc:
            outcomes.append(_failed(recipe, repo, str(exc), exc.exit_code, console))
        except Exception as exc:  # a bug in one job must not stop the others; the summary names it
            outcomes.append(_failed(recipe, repo, f"internal error: {exc.__class__.__name__}: {exc}", 3, console))
    return outcomes


def _failed(recipe: Recipe, repo: str, message: str, exit_code: int, console) -> JobOutcome:
    from rich.markup import escape

    if console:
        console.print(f"[red]error:[/] {escape(recipe.name)}: {escape(message)}")
    return JobOutcome(recipe.name, repo, "failed", error=message.splitlines()[0], exit_code=exit_code)


def _publish_one(recipe: Recipe, out: Path, force: bool, console) -> JobOutcome:
    from pipeline.runner import run_stages
    from pipeline.stages import PIPELINE

    if not recipe.publish.repo_id:
        raise BadInputError(f"{recipe.name}: [publish] repo_id is not set; add repo_id = 'owner/name' to the recipe")
    earlier = tuple(stage for stage in PIPELINE if stage.name != PublishStage.name)
    run_stages(recipe, out, (*earlier, PublishStage(force=force)), must_be_done=[s.name for s in earlier], console=console)
    result = json.loads((Path(out) / "publish" / PUBLISH_FILE).read_text())
    state = "new commit" if result["created_commit"] else "unchanged (no commit)"
    if result.get("pr_url"):
        state += f", PR {result['pr_url']}"
    return JobOutcome(recipe.name, result["repo_id"], state, result["revision"],
                      f"{result['verified']} verified, {len(result['uploaded'])} uploaded")


def _plan_only(recipe: Recipe, out: Path, force: bool) -> JobOutcome:
    with tempfile.TemporaryDirectory() as card_dir:
        hashes = HashCache(Path(out) / ".mxspec" / "hash-cache.json")
        plan = plan_publish(recipe, out, Path(card_dir), hashes, force=force)
    size = plan.total_bytes / 1e9
    where = f"{plan.endpoint}/{plan.repo_id}" + (" (PR)" if plan.create_pr else "") + (f", tag {plan.tag}" if plan.tag else "")
    return JobOutcome(recipe.name, plan.repo_id, f"would upload to {where}: {plan.commit_message}", "",
                      f"{len(plan.files)} files, {size:.2f} GB")
