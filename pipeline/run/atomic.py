"""Write-then-rename helpers: a crash or kill never leaves an artifact that looks complete.

mxspec only ever replaces what it wrote itself. Every folder `atomic_directory` creates carries an
ownership mark (`OWNER_MARK`); an existing folder without it, or a file, at an output path is
refused with one line (exit 2) instead of being moved aside and deleted.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import BadInputError

__all__ = ["TMP_MARK", "OLD_MARK", "OWNER_MARK", "atomic_write_bytes", "atomic_write_text", "check_output_file",
    "is_mxspec_folder", "check_replaceable", "make_dirs", "is_disk_full", "atomic_directory", "sweep_partials"]

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
OWNER_MARK = ".mxspec-output"  # an empty file: "mxspec wrote this folder and may replace it"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def check_output_file(path: Path, what: str) -> Path:
    """Refuse (exit 2) an output file path mxspec cannot write, before any work: a folder, a broken or
    looping symlink, or a parent that is not an existing folder."""
    path = Path(path)
    if path.is_dir():
        raise BadInputError(f"{path}: the {what} is a folder; pass a file path, e.g. {path / 'plan.json'}")
    if path.is_symlink() and not path.exists():
        raise BadInputError(f"{path}: the {what} is a broken or looping symlink; pick another path")
    if not path.parent.is_dir():
        raise BadInputError(f"{path}: the {what}'s folder {path.parent} does not exist; create it or pick another path")
    return path


def is_mxspec_folder(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / OWNER_MARK).is_file()


def check_replaceable(path: Path, what: str = "output folder") -> None:
    """Refuse (exit 2) when `path` holds something mxspec did not write: a file, or a non-empty folder
    without the ownership mark. An absent path or an empty folder is fine."""
    path = Path(path)
    try:
        if path.is_symlink() and not path.exists():
            raise BadInputError(f"{path}: the {what} is a broken or looping symlink; pick another path")
        if path.exists() and not path.is_dir():
            raise BadInputError(f"{path}: the {what} is an existing file; mxspec will not replace it, pick another path")
        if path.is_dir() and any(path.iterdir()) and not is_mxspec_folder(path):
            raise BadInputError(f"{path}: the {what} already exists and was not written by mxspec; "
                                "move it away or pick another path (mxspec never replaces what it did not write)")
    except OSError as exc:
        raise BadInputError(f"{path}: the {what} cannot be inspected ({_why(exc)}); pick another path") from exc


def make_dirs(path: Path, what: str = "output folder", shown: Path | None = None) -> Path:
    """mkdir -p with one clear line (naming `shown`, default `path`) for the ways a user-given path can
    be unusable."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".{TMP_MARK}probe-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise BadInputError(f"{shown or path}: cannot use it as the {what} ({_why(exc)}); pick a writable folder") from exc
    return path


def is_disk_full(exc: BaseException) -> bool:
    """The write failed for want of space (or quota): an OSError, or a library's wrapped "os error 28"."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "os error 28" in str(exc)


def _why(exc: OSError) -> str:
    reasons = {errno.ENOTDIR: "a part of the path is a file", errno.EEXIST: "a file is in the way",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "not permitted",
               errno.ELOOP: "symlink loop", errno.ENOENT: "it cannot be created there",
               errno.ENOSPC: "no space left on the device", errno.ENAMETOOLONG: "name too long"}
    return reasons.get(exc.errno, exc.strerror or exc.__class__.__name__)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty sibling temp dir (already marked as mxspec's); on success it replaces `final` in
    one rename.

    `final` must be absent, empty or an earlier mxspec output (`check_replaceable`). On any error (or a
    kill) the temp dir is left with a name `sweep_partials` removes, and `final` keeps its previous
    content or stays absent.
    """
    final = Path(os.path.abspath(final))
    if Path.cwd() == final or final in Path.cwd().parents:
        raise BadInputError(f"{final}: the output folder holds the current folder; pick a subfolder instead")
    check_replaceable(final)
    make_dirs(final.parent, shown=final)
    token = uuid.uuid4().hex[:8]
    tmp = final.with_name(f".{final.name}{TMP_MARK}{token}")
    try:
        tmp.mkdir()
        (tmp / OWNER_MARK).touch()
    except OSError as exc:
        raise BadInputError(f"{final}: cannot write the output folder ({_why(exc)}); pick a writable path") from exc
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}{OLD_MARK}{token}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def sweep_partials(folder: Path) -> list[Path]:
    """Remove temp and superseded leftovers of interrupted atomic writes in `folder`."""
    removed = []
    if not Path(folder).is_dir():
        return removed
    for entry in Path(folder).iterdir():
        if entry.name.startswith(".") and (TMP_MARK in entry.name or OLD_MARK in entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
