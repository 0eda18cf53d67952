"""Making a Hub repo equal to a publish plan, in one commit, and proving it arrived.

One commit carries the checkpoint, the card (README.md), the figures and mxspec's own reports
(`mxspec/`). Before committing, the remote tree is compared with the local files (size plus sha256
for LFS files, git blob id for small ones), so publishing the same artifacts again makes no commit,
and a publish killed half-way resumes: LFS objects already on the Hub are not sent again (the LFS
batch API says so) and the commit is only created once everything is uploaded. After the commit the
remote tree is listed again and compared with the plan as a whole: every planned file with its local
bytes, and no other file (so after a re-sharded export no old shard or index is left behind).

mxspec lists what it published in `mxspec/files.json`; a later publish deletes, in the same commit, the
files that list names and the new plan does not (old shards, an old index). A file mxspec never
published (one added by hand on the Hub) is not deleted: publishing into such a repo is refused until
it is removed or another repo_id is chosen. The Hub's own `.gitattributes` is left alone.

A commit is the one step that is not idempotent: after a failed or unanswered commit the branch is read
again, and the commit is retried only if no commit holding exactly these files has landed; a commit
that landed while its answer was lost is taken as ours. The commit names its parent, so even a retry
that races a landed commit cannot make a second one."""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BadInputError, HubError
from pipeline.hub.http import ATTEMPTS, hub_errors, retried, retryable, wait_s
from pipeline.run.artifacts import PublishedFiles, PublishResult
from pipeline.run.layout import PUBLISHED_LIST

__all__ = ["HUB_MANAGED", "UploadFile", "PublishPlan", "publish_plan", "stale_files", "verify_upload", "git_blob_sha1"]

HUB_MANAGED = frozenset({".gitattributes"})  # created by the Hub with the repo; never planned, never deleted


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


def publish_plan(plan: PublishPlan, token: str) -> PublishResult:
    """Create the repo if needed, commit what differs from the remote (stale files deleted), tag, verify.
    Idempotent."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=plan.endpoint, token=token)
    with hub_errors(plan.endpoint, plan.repo_id, token):
        retried(lambda: api.create_repo(plan.repo_id, private=plan.private, exist_ok=True))
        head = retried(lambda: _head_commit(api, plan.repo_id))
        remote = retried(lambda: _remote_files(api, plan.repo_id, head)) if head else {}
        stale = retried(lambda: stale_files(api, plan, remote, head))
        changed = [f for f in plan.files if not _same(f, remote.get(f.path_in_repo))]
        revision, pr_url = (_commit(api, plan, changed, stale, head) if changed or stale else (head, None))
        if plan.tag and not plan.create_pr:
            retried(lambda: _ensure_tag(api, plan.repo_id, plan.tag, revision))
        verified = retried(lambda: verify_upload(api, plan, revision))
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
    retried(lambda: api.preupload_lfs_files(plan.repo_id, additions=additions, create_pr=plan.create_pr))
    open_prs = retried(lambda: _pull_requests(api, plan.repo_id)) if plan.create_pr else set()
    for attempt in range(ATTEMPTS):
        try:
            info = api.create_commit(plan.repo_id, operations=operations, commit_message=plan.commit_message,
                                     create_pr=plan.create_pr, parent_commit=head)
            return info.oid, info.pr_url
        except Exception as exc:
            if not retryable(exc):
                raise
            landed = retried(lambda: _landed_commit(api, plan, head, open_prs))
            if landed is not None:  # the commit went through, its answer did not
                return landed
            if attempt == ATTEMPTS - 1:
                raise
            time.sleep(wait_s(exc, attempt))
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
