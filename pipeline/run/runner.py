"""The stage runner: run stages in order, each into OUT/<stage>/, skipping what is already done.

Every stage writes into a temp folder that is renamed into place only when complete, with a
`manifest.json` that records what the output was made from (recipe sections, input hashes, tool
versions) and what it is (sha256 of each output file). A stage is skipped when its manifest's
fingerprint matches and its outputs still hash as recorded; otherwise it is redone. So a run killed
at any moment and started again finishes with the same artifacts.

"The same" means byte for byte, except the fields a schema declares volatile (`pipeline.run.artifacts.volatile_fields`):
when a stage ran and how long it took, and what a stage measured about itself (`Stage.run` may
return measurements such as peak memory; they go into the manifest, never into the outputs, so
they change no digest and redo no later stage).
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import ValidationError
from rich.console import Console

from pipeline.errors import BadInputError, ExternalError, MxspecError
from pipeline.recipe import Recipe
from pipeline.run.artifacts import StageManifest
from pipeline.run.atomic import OWNER_MARK, atomic_directory, atomic_write_text, is_disk_full, make_dirs, sweep_partials
from pipeline.run.hashing import HashCache, canonical_sha256, digest_of
from pipeline.run.layout import MANIFEST, RunLayout
from pipeline.run.stage_log import third_party_output_to, verbose
from pipeline.run.versions import tool_versions

__all__ = ["T", "StageContext", "Stage", "StageResult", "run_stages", "preview_last_stage", "read_manifest",
    "is_run_folder", "prepare_run_folder", "recipe_hash", "hold_run_folder"]

T = TypeVar("T")


@dataclass
class StageContext:
    """What a stage may read: the recipe, earlier stages' folders, the shared hash cache."""

    recipe: Recipe
    out: Path
    hashes: HashCache
    console: Console = field(default_factory=lambda: Console(stderr=True))
    force: frozenset[str] = frozenset()  # stages to redo from scratch (`--force`), not from what they kept

    @property
    def run(self) -> RunLayout:
        return RunLayout(self.out)

    def stage_dir(self, name: str) -> Path:
        return self.run.stage(name)


class Stage(Protocol):
    """One step of the pipeline. Implementations live one per module in `pipeline/`."""

    name: str
    version: int  # bump when the stage's outputs change for the same inputs
    sections: tuple[str, ...]  # recipe sections the outputs depend on
    requires: tuple[str, ...]  # earlier stages whose outputs are inputs: "stage", or "stage/file" for one file
    tools: tuple[str, ...]  # packages whose version changes the outputs
    # A stage may also set `always_run = True` to be redone on every run (publish: the remote can change).

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        """Files or folders outside OUT whose content the outputs depend on."""
        ...

    def run(self, ctx: StageContext, workdir: Path) -> dict[str, float] | None:
        """Write the stage's outputs into `workdir` (an empty folder); optionally return measurements
        of the work itself (seconds, peak memory), which the manifest records."""
        ...


@dataclass(frozen=True)
class StageResult:
    name: str
    skipped: bool
    path: Path
    manifest: StageManifest


def run_stages(
    recipe: Recipe,
    out: Path,
    stages: Sequence[Stage],
    *,
    force: Sequence[str] = (),
    must_be_done: Sequence[str] = (),
    console: Console | None = None,
) -> list[StageResult]:
    """Run `stages` in order into `out`, resuming: a stage whose manifest matches is skipped.

    Stages named in `must_be_done` are never run: if one is not up to date the call fails (so a
    publishing job cannot silently re-quantize a checkpoint), and `out` must already be a run folder."""
    with _open_run(recipe, out, console, force, create=not must_be_done, read_only=False) as ctx:
        return [_run_one(stage, ctx, force=stage.name in force, must_be_done=stage.name in must_be_done)
                for stage in stages]


def preview_last_stage(recipe: Recipe, out: Path, stages: Sequence[Stage], preview: Callable[[StageContext], T],
                       console: Console | None = None) -> T:
    """A dry run of `run_stages(recipe, out, stages, must_be_done=<every stage but the last>)`: the same
    checks in the same order, refused with the same lines (a folder that is no run, one locked by
    another run, a stage out of date), changing nothing; `preview(ctx)` stands in for the last stage."""
    with _open_run(recipe, out, console, (), create=False, read_only=True) as ctx:
        for stage in stages[:-1]:
            _run_one(stage, ctx, force=False, must_be_done=True)
        _input_hashes(stages[-1], ctx)
        return preview(ctx)


@contextmanager
def _open_run(recipe: Recipe, out: Path, console: Console | None, force: Sequence[str], *, create: bool,
              read_only: bool) -> Iterator[StageContext]:
    """The run folder checked, locked (only probed, `read_only`) and swept of partial outputs, as a context.
    A run refused or failed (an `MxspecError`) before any stage finished leaves no trace in a folder
    that was absent or empty: what this call created there is removed."""
    existed = Path(out).exists()
    fresh = not existed or (Path(out).is_dir() and not any(Path(out).iterdir()))
    out = prepare_run_folder(out, create=create)
    try:
        with _locked(recipe, out, console, force, read_only) as ctx:
            yield ctx
    except MxspecError:
        if fresh and not read_only and not any(out.glob(f"*/{MANIFEST}")):
            _remove_created(out, existed)
        raise


def _remove_created(out: Path, existed: bool) -> None:
    """Undo a refused run in a folder it found absent or empty: everything there is this run's."""
    if not existed:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in out.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() else child.unlink(missing_ok=True)


@contextmanager
def _locked(recipe: Recipe, out: Path, console: Console | None, force: Sequence[str],
            read_only: bool) -> Iterator[StageContext]:
    with hold_run_folder(out, probe=read_only):
        if not read_only:
            sweep_partials(out)
        hashes = HashCache(RunLayout(out).hash_cache)
        ctx = StageContext(recipe=recipe, out=out, hashes=hashes, console=console or Console(stderr=True),
                           force=frozenset(force))
        try:
            yield ctx
        finally:
            if not read_only:
                try:
                    hashes.save()
                except OSError:
                    pass  # a cache of file hashes only (a full disk, say): the next run hashes again


def _run_one(stage: Stage, ctx: StageContext, *, force: bool, must_be_done: bool = False) -> StageResult:
    final = ctx.stage_dir(stage.name)
    inputs = _input_hashes(stage, ctx)
    fingerprint = _fingerprint(stage, ctx.recipe, inputs)
    previous = read_manifest(final)
    reusable = not force and not getattr(stage, "always_run", False)
    if reusable and previous and previous.fingerprint == fingerprint and _outputs_intact(final, previous, ctx):
        ctx.console.print(f"[green]✓[/] {stage.name}: up to date (skipped)")
        return StageResult(stage.name, True, final, previous)
    if must_be_done:
        raise BadInputError(f"stage '{stage.name}' in {ctx.out} is missing or out of date for this recipe; "
                            f"run `mxspec run RECIPE --out {ctx.out}` first")

    log = ctx.run.stage_log(stage.name)
    ctx.console.print(f"[bold]→ {stage.name}[/]" + ("" if verbose() else f"  [dim](other tools' output: {log})[/]"),
                      soft_wrap=True)
    if previous and previous.stage == stage.name and not (final / OWNER_MARK).exists():
        (final / OWNER_MARK).touch()  # a stage folder of an mxspec from before ownership marks: ours to replace
    started = time.time()
    with atomic_directory(final) as workdir, _disk_full_is_external(stage, ctx):
        with third_party_output_to(log, ctx.console):
            measured = stage.run(ctx, workdir) or {}
        outputs = ctx.hashes.tree(workdir)
        outputs.pop(MANIFEST, None)
        outputs.pop(OWNER_MARK, None)
        manifest = StageManifest(
            stage=stage.name,
            stage_version=stage.version,
            fingerprint=fingerprint,
            recipe_name=ctx.recipe.name,
            recipe_sha256=recipe_hash(ctx.recipe),
            config_sha256=recipe_hash(ctx.recipe, *stage.sections),
            inputs=inputs,
            versions=tool_versions(),
            outputs=outputs,
            started_at=_iso(started),
            finished_at=_iso(time.time()),
            duration_s=round(time.time() - started, 3),
            measured=measured,
        )
        atomic_write_text(workdir / MANIFEST, json.dumps(manifest.model_dump(by_alias=True), indent=2, sort_keys=True) + "\n")
    ctx.console.print(f"[green]✓[/] {stage.name}: done in {manifest.duration_s:.1f} s")
    return StageResult(stage.name, False, final, manifest)


@contextmanager
def _disk_full_is_external(stage: Stage, ctx: StageContext) -> Iterator[None]:
    """A full disk is the machine's problem, not a bug: one line (exit 3); the stage's temp folder goes."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        raise ExternalError(f"{ctx.out}: no space left on the device while writing stage '{stage.name}'; "
                            f"free space there or choose another --out, then run again (earlier stages are kept)") from exc


def read_manifest(stage_dir: Path) -> StageManifest | None:
    """The stage's manifest, or None when it is missing or not a valid manifest (the stage is redone)."""
    try:
        return StageManifest.model_validate_json((Path(stage_dir) / MANIFEST).read_bytes())
    except (FileNotFoundError, NotADirectoryError, ValidationError):
        return None


def is_run_folder(path: Path) -> bool:
    return RunLayout(Path(path)).state.is_dir()


def prepare_run_folder(out: Path, create: bool = True) -> Path:
    """The run folder, created if absent (with `create`; else it must already be one); refused (exit 2)
    when it is a file, unwritable, or a folder of someone else's files (a run folder is one that holds
    mxspec's state folder)."""
    out = Path(out)
    try:
        out = out.resolve()
    except (OSError, RuntimeError):
        raise BadInputError(f"{out}: the run folder (--out) is a symlink loop; pick another path") from None
    if out.exists() and not out.is_dir():
        raise BadInputError(f"{out}: the run folder (--out) is an existing file; pick a folder path")
    if out.is_dir() and not is_run_folder(out) and any(out.iterdir()):
        raise BadInputError(f"{out}: the run folder (--out) holds files not written by mxspec; "
                            "pick a new or empty folder (mxspec never writes into someone else's folder)")
    if not create:
        if not is_run_folder(out):
            raise BadInputError(f"{out} holds no mxspec run; run `mxspec run RECIPE --out {out}` first")
        return out
    return make_dirs(out, "run folder (--out)")


def _input_hashes(stage: Stage, ctx: StageContext) -> dict[str, str]:
    inputs: dict[str, str] = {}
    for requirement in stage.requires:
        name, _, file = requirement.partition("/")
        manifest = read_manifest(ctx.stage_dir(name))
        if manifest is None or (file and file not in manifest.outputs):
            raise BadInputError(f"stage '{stage.name}' needs the outputs of '{name}' in {ctx.out}; run it first")
        outputs = {file: manifest.outputs[file]} if file else manifest.outputs
        inputs[f"stage:{requirement}"] = digest_of(outputs)
    for name, path in stage.external_inputs(ctx).items():
        path = Path(path)
        if path.is_dir():
            inputs[name] = digest_of(ctx.hashes.tree(path))
        elif path.is_file():
            inputs[name] = ctx.hashes.file(path)
        else:
            raise BadInputError(f"stage '{stage.name}': input '{name}' not found at {path}")
    return inputs


def _fingerprint(stage: Stage, recipe: Recipe, inputs: dict[str, str]) -> str:
    versions = tool_versions()
    key = {
        "stage": stage.name,
        "stage_version": stage.version,
        "mxspec": versions["mxspec"],
        "config": recipe_hash(recipe, *stage.sections),
        "inputs": inputs,
        "tools": {name: versions.get(name) for name in stage.tools},
    }
    return canonical_sha256(key)


def recipe_hash(recipe: Recipe, *sections: str) -> str:
    """sha256 of the named sections of the recipe (all of it without names): what a stage's output depends on.
    A section's unfingerprinted fields (e.g. [quantization] encoder, proven not to change a byte) are left out."""
    dumped = recipe.model_dump(mode="json", include=set(sections) if sections else None)
    for name, value in dumped.items():
        section = getattr(recipe, name)
        if isinstance(value, dict) and hasattr(section, "unfingerprinted"):
            for field in section.unfingerprinted():
                value.pop(field, None)
    return canonical_sha256(dumped)


def _outputs_intact(stage_dir: Path, manifest: StageManifest, ctx: StageContext) -> bool:
    for name, sha in manifest.outputs.items():
        path = stage_dir / name
        if not path.is_file() or ctx.hashes.file(path) != sha:
            ctx.console.print(f"[yellow]![/] {manifest.stage}: {name} changed or missing; redoing the stage")
            return False
    return True


@contextmanager
def hold_run_folder(out: Path, *, probe: bool = False) -> Iterator[None]:
    """One run per output folder at a time; the lock dies with the process, so a kill never wedges it.
    `probe`: only check that no other run holds it, creating nothing (a dry run)."""
    lock = RunLayout(out).lock
    if probe and not lock.exists():
        yield  # no run ever locked it
        return
    if not probe:
        lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "r" if probe else "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInputError(f"{out} is in use by another mxspec run; wait for it or pick another --out") from None
        yield


def _iso(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))
