"""Resolve stage: turn the recipe's target and drafter into local folders with content hashes.

A Hub model goes through `huggingface_hub.snapshot_download` at its pinned revision (so the Hub's
cache, token and `HF_HUB_OFFLINE` work as everywhere else); a local model is used where it is.
The hashes recorded here are what later stages (and the pair check) compare against.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import BadInputError, ExternalError, ModelNotAvailableError
from pipeline.hub.env import hub_offline
from pipeline.recipe import ModelRef
from pipeline.run.artifacts import ResolvedModel, read_artifact, write_artifact
from pipeline.run.hashing import HashCache
from pipeline.run.layout import resolved_file
from pipeline.run.runner import StageContext

__all__ = ["ROLES", "resolve_model", "read_resolved", "ResolveStage"]

ROLES = ("target", "drafter")


def _download(ref: ModelRef, role: str) -> tuple[Path, str]:
    """snapshot_download at the pinned revision; returns (folder, commit). Errors carry no token."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = hub_offline()
    try:
        folder = Path(snapshot_download(repo_id=ref.id, revision=ref.revision, local_files_only=offline))
    except GatedRepoError:
        raise ExternalError(
            f"{role} {ref.describe()}: the repo is gated; accept its terms on the Hub and log in "
            "(`hf auth login`) or set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise BadInputError(f"{role}.revision: {ref.revision!r} does not exist in {ref.id}; fix the revision") from None
    except RepositoryNotFoundError:
        raise BadInputError(
            f"{role}.id: {ref.id!r} not found on the Hub (or private without a token); fix the id or log in"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise ModelNotAvailableError(
            f"{role} {ref.describe()} is not in the local Hub cache and {why}; download it on a connected "
            f"machine (`hf download {ref.id} --revision {ref.revision}`) or set {role}.path to a local copy",
            role=role, repo_id=ref.id, revision=ref.revision,
        ) from None
    except OSError as exc:
        raise ExternalError(f"{role} {ref.describe()}: download failed: {exc.__class__.__name__}") from None
    # Snapshot folders are named after the commit they hold.
    return folder, folder.name


def resolve_model(ref: ModelRef, role: str, hashes: HashCache | None = None) -> ResolvedModel:
    """Find the model's files locally (downloading a Hub model if needed) and hash them."""
    hashes = hashes or HashCache()
    if ref.path is not None:
        folder, source, revision = Path(ref.path), "local", None
        if not folder.is_dir():
            raise BadInputError(f"{role}.path: {folder} is not a folder; point it at a checkpoint directory")
    else:
        (folder, revision), source = _download(ref, role), "hub"
    if not (folder / "config.json").is_file():
        raise BadInputError(f"{role}: {folder} has no config.json; point {role} at a Hugging Face checkpoint")
    files = hashes.tree(folder)
    return ResolvedModel(role=role, source=source, ref=ref.describe(), revision=revision, path=str(folder.resolve()),
                         files=files)


def read_resolved(resolve_dir: Path) -> dict[str, ResolvedModel]:
    """The resolve stage's output, as {'target': ..., 'drafter': ...}."""
    return {role: read_artifact(Path(resolve_dir) / resolved_file(role), ResolvedModel,
                                "run `mxspec run RECIPE` again to resolve the models") for role in ROLES}


class ResolveStage:
    name = "resolve"
    version = 2
    sections = ("target", "drafter")
    requires = ()
    tools = ("huggingface-hub",)

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        # Local folders are hashed so an edited checkpoint redoes everything downstream; Hub
        # snapshots are pinned by revision, which is part of the recipe sections above.
        return {role: ref.path for role in ROLES if (ref := getattr(ctx.recipe, role)).path}

    def run(self, ctx: StageContext, workdir: Path) -> None:
        for role in ROLES:
            model = resolve_model(getattr(ctx.recipe, role), role, ctx.hashes)
            ctx.console.print(f"  {model.role}: {model.ref} -> {len(model.files)} files, digest {model.digest[:12]}")
            write_artifact(model, workdir / resolved_file(role))
