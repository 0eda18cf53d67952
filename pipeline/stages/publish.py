"""Publish stage: upload the validated MXFP4 checkpoint with its model card, then prove it arrived.

One commit carries the checkpoint, the card (README.md), the figures and mxspec's own reports
(`mxspec/`). Before committing, the remote tree is compared with the local files (size plus sha256
for LFS files, git blob id for small ones), so publishing the same artifacts again makes no commit,
and a publish killed half-way resumes: LFS objects already on the Hub are not sent again (the LFS
batch API says so) and the commit is only created once everything is uploaded. After the commit the
remote tree is listed again and compared with the plan as a whole: every planned file with its local
bytes, and no other file (so after a re-sharded export no old shard or index is left behind).

The remote repo is made equal to the plan. mxspec lists what it published in `mxspec/files.json`; a
later publish deletes, in the same commit, the files that list names and the new plan does not (old
shards, an old index). A file mxspec never published (one added by hand on the Hub) is not deleted:
publishing into such a repo is refused until it is removed or another repo_id is chosen. The Hub's
own `.gitattributes` is left alone.

Faults: every request has a time limit (MXSPEC_HUB_TIMEOUT_S, default 300 s per read or write). Reads,
`create_repo(exist_ok)`, tags and LFS uploads are retried on 408/429/5xx and dropped connections,
waiting as long as a 429's Retry-After asks. A commit is the one step that is not idempotent: after a
failed or unanswered commit the branch is read again, and the commit is retried only if no commit
holding exactly these files has landed; a commit that landed while its answer was lost is taken as
ours. The commit names its parent, so even a retry that races a landed commit cannot make a second one.

Guards: a gate that did not pass refuses the upload unless forced, and the drafter is never uploaded
or touched (it is only named, with its revision and hashes, in the card). The Hub token comes from
the environment or the Hub's own login and never appears in output, reports, the card or errors.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BadInputError, GateFailedError, HubError
from pipeline.recipe import Recipe
from pipeline.report.card import RunArtifacts, render_model_card
from pipeline.run.artifacts import (
    PublishedFiles,
    PublishResult,
    PublishSkipped,
    write_artifact,
)
from pipeline.run.atomic import OWNER_MARK
from pipeline.run.hashing import HashCache, list_files
from pipeline.run.layout import (
    CARD_FILE,
    PUBLISH_FILE,
    PUBLISHED_LIST,
    REPO_FIGURES,
    REPO_REPORTS,
)
from pipeline.run.runner import StageContext

HUB_MANAGED = frozenset({".gitattributes"})  # created by the Hub with the repo; never planned, never deleted
DEFAULT_ENDPOINT = "https://huggingface.co"
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
ATTEMPTS = 5  # per step: the first try and four retries
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")  # drafter files that must never be uploaded (a shared
# tokenizer file may legitimately have the same bytes in both repos)


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
    gate_verdict: str  # the gate's verdict the plan was made under
    forced: bool  # publishing although the gate did not pass

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


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
    return PublishPlan(publish.repo_id, hub_endpoint(recipe), publish.private, publish.create_pr, publish.tag, message, files,
                       gate_verdict=verdict.verdict, forced=not verdict.passed)


def published_list(files: list[UploadFile], folder: Path) -> UploadFile:
    """Write mxspec/files.json (the planned files, itself excepted) into `folder`, as a file to upload."""
    local = folder / Path(PUBLISHED_LIST).name
    listing = PublishedFiles(files={f.path_in_repo: f.sha256 for f in files})
    write_artifact(listing, local)
    return UploadFile(PUBLISHED_LIST, local, local.stat().st_size, hashlib.sha256(local.read_bytes()).hexdigest())


def publish_plan(plan: PublishPlan, token: str) -> PublishResult:
    """Create the repo if needed, commit what differs from the remote (stale files deleted), tag, verify.
    Idempotent."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=plan.endpoint, token=token)
    with _hub_errors(plan, token):
        _retried(lambda: api.create_repo(plan.repo_id, private=plan.private, exist_ok=True))
        head = _retried(lambda: _head_commit(api, plan.repo_id))
        remote = _retried(lambda: _remote_files(api, plan.repo_id, head)) if head else {}
        stale = _retried(lambda: stale_files(api, plan, remote, head))
        changed = [f for f in plan.files if not _same(f, remote.get(f.path_in_repo))]
        revision, pr_url = (_commit(api, plan, changed, stale, head) if changed or stale else (head, None))
        if plan.tag and not plan.create_pr:
            _retried(lambda: _ensure_tag(api, plan.repo_id, plan.tag, revision))
        verified = _retried(lambda: verify_upload(api, plan, revision))
    return PublishResult(repo_id=plan.repo_id, endpoint=plan.endpoint, revision=revision,
                         created_commit=bool(changed or stale), uploaded=[f.path_in_repo for f in changed],
                         deleted=stale, verified=verified, pr_url=pr_url,
                         tag=plan.tag if not plan.create_pr else None, gate_verdict=plan.gate_verdict, forced=plan.forced,
                         files={f.path_in_repo: f.sha256 for f in plan.files})


def stale_files(api, plan: PublishPlan, remote: dict, head: str | None) -> list[str]:
    """Remote files an earlier mxspec publish put there that the plan no longer has; refuses (exit 2)
    when the repo holds files mxspec never published, since deleting them is not mxspec's call."""
    planned = {f.path_in_repo for f in plan.files}
    extra = sorted(set(remote) - planned - HUB_MANAGED)
    if not extra:
        return []
    owned = set(_published_before(api, plan.repo_id, head) if PUBLISHED_LIST in remote else ()) | {PUBLISHED_LIST}
    foreign = [path for path in extra if path not in owned]
    if foreign:
        raise BadInputError(f"{plan.repo_id} holds {len(foreign)} file(s) mxspec did not publish ({', '.join(foreign[:3])}"
                            f"{' ...' if len(foreign) > 3 else ''}); remove them on the Hub or set another [publish] repo_id")
    return extra


def _published_before(api, repo_id: str, revision: str) -> list[str]:
    """The paths listed in the repo's mxspec/files.json at `revision` (a broken listing owns nothing)."""
    from pydantic import ValidationError

    with tempfile.TemporaryDirectory() as tmp:
        local = api.hf_hub_download(repo_id, PUBLISHED_LIST, revision=revision, local_dir=tmp)
        try:
            return list(PublishedFiles.model_validate_json(Path(local).read_text()).files)
        except (ValidationError, UnicodeDecodeError):
            return []


def _commit(api, plan: PublishPlan, changed: list[UploadFile], stale: list[str], head: str | None) -> tuple[str, str | None]:
    """Upload the LFS objects (idempotent, retried), then commit once, additions and deletions together:
    (revision, PR url)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    additions = [CommitOperationAdd(f.path_in_repo, str(f.local)) for f in changed]
    operations = [*additions, *(CommitOperationDelete(path) for path in stale)]
    _retried(lambda: api.preupload_lfs_files(plan.repo_id, additions=additions, create_pr=plan.create_pr))
    open_prs = _retried(lambda: _pull_requests(api, plan.repo_id)) if plan.create_pr else set()
    for attempt in range(ATTEMPTS):
        try:
            info = api.create_commit(plan.repo_id, operations=operations, commit_message=plan.commit_message,
                                     create_pr=plan.create_pr, parent_commit=head)
            return info.oid, info.pr_url
        except Exception as exc:
            if not _retryable(exc):
                raise
            landed = _retried(lambda: _landed_commit(api, plan, head, open_prs))
            if landed is not None:  # the commit went through, its answer did not
                return landed
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(_wait_s(exc, attempt))
    raise AssertionError("unreachable")


def _pull_requests(api, repo_id: str) -> set[str]:
    return {ref.ref for ref in api.list_repo_refs(repo_id, include_pull_requests=True).pull_requests or []}


def _landed_commit(api, plan: PublishPlan, head: str | None, open_prs: set[str]) -> tuple[str, str | None] | None:
    """A commit made since `head` whose files are exactly the planned ones (an earlier try of ours), or None.

    On main: the branch moved and its tree holds our files. For a pull request: a PR opened since
    `open_prs` holds them. Main moving to something else means someone else committed: refuse rather
    than commit on top of it."""
    refs = api.list_repo_refs(plan.repo_id, include_pull_requests=plan.create_pr)
    if plan.create_pr:
        candidates = [(ref.target_commit, f"{plan.endpoint}/{plan.repo_id}/discussions/{ref.ref.rsplit('/', 1)[-1]}")
                      for ref in (refs.pull_requests or []) if ref.ref not in open_prs]
    else:
        main = next((b.target_commit for b in refs.branches if b.name == "main"), None)
        candidates = [(main, None)] if main and main != head else []
    for revision, pr_url in candidates:
        remote = _remote_files(api, plan.repo_id, revision)
        if not _tree_problems(plan, remote):
            return revision, pr_url
    if candidates and not plan.create_pr:
        raise HubError(f"{plan.repo_id}: main moved to {candidates[0][0][:12]} while publishing (someone else "
                       "committed); run `mxspec publish` again to publish on top of it", repo_id=plan.repo_id)
    return None


def _retryable(exc: BaseException) -> bool:
    """A fault worth another try: 408/429/5xx, or the connection failed or timed out."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        return exc.response is not None and exc.response.status_code in RETRY_STATUSES
    return isinstance(exc, _transport_errors())


def _wait_s(exc: BaseException, attempt: int) -> float:
    """A 429's Retry-After (seconds), else exponential backoff."""
    response = getattr(exc, "response", None)
    value = response.headers.get("Retry-After", "") if response is not None else ""
    return float(value) if value.strip().isdigit() else BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]


def _retried(call):
    """`call()`, tried again on a retryable fault; only for steps that are safe to repeat."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except Exception as exc:
            if attempt == ATTEMPTS - 1 or not _retryable(exc):
                raise
            time.sleep(_wait_s(exc, attempt))
    raise AssertionError("unreachable")


def configure_hub_client() -> None:
    """Give huggingface_hub's shared HTTP client time limits (its default waits forever on a silent server)."""
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory

    limit_s = hub_timeout_s()

    def factory():
        client = default_client_factory()
        client.timeout = httpx2.Timeout(limit_s, connect=min(limit_s, 30.0))
        return client

    set_client_factory(factory)


def hub_timeout_s() -> float:
    raw = os.environ.get("MXSPEC_HUB_TIMEOUT_S", "300")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise BadInputError(f"MXSPEC_HUB_TIMEOUT_S={raw!r} is not a positive number of seconds; unset it or set e.g. 300")
    return value


def verify_upload(api, plan: PublishPlan, revision: str) -> int:
    """List the remote tree at `revision`: every planned file with its local size and content hash
    (small files read back), and no file the plan does not have."""
    remote = _remote_files(api, plan.repo_id, revision)
    problems = _tree_problems(plan, remote, download=lambda path: _download_sha256(api, plan.repo_id, path, revision))
    if problems:
        raise HubError(f"{plan.repo_id}@{revision[:12]}: upload verification failed: {'; '.join(problems[:5])}",
                       repo_id=plan.repo_id)
    return len(plan.files)


def _tree_problems(plan: PublishPlan, remote: dict, download=None) -> list[str]:
    """How the remote tree differs from the plan (the Hub's own files aside); empty when it is equal."""
    problems = []
    for f in plan.files:
        entry = remote.get(f.path_in_repo)
        if entry is None:
            problems.append(f"{f.path_in_repo} is missing")
        elif not _same(f, entry, download=download):
            problems.append(f"{f.path_in_repo} differs (remote size {entry.size}, local {f.size})")
    planned = {f.path_in_repo for f in plan.files}
    problems += [f"{path} is not in the plan" for path in sorted(set(remote) - planned - HUB_MANAGED)]
    return problems


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
            status = exc.response.status_code if exc.response is not None else None
            first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            if status in (401, 403):
                message = f"the Hub at {self.plan.endpoint} refused the token ({status}); check HF_TOKEN's write access to {self.plan.repo_id}"
            else:
                message = f"the Hub at {self.plan.endpoint} answered {status or '?'}: {first}"
            raise HubError(message.replace(self.token, "***"), repo_id=self.plan.repo_id, status=status) from None
        if "Timeout" in exc.__class__.__name__:
            message = (f"the Hub at {self.plan.endpoint} did not answer within {hub_timeout_s():g} s, "
                       f"{ATTEMPTS} times; try again later, or raise MXSPEC_HUB_TIMEOUT_S")
        elif isinstance(exc, (*_transport_errors(), OSError)):
            message = f"cannot reach the Hub at {self.plan.endpoint} ({exc.__class__.__name__}); check the network or HF_ENDPOINT"
        else:
            return False
        raise HubError(message.replace(self.token, "***"), repo_id=self.plan.repo_id) from None


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

