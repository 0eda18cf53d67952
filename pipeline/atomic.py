"""Write-then-rename helpers: a crash or kill never leaves an artifact that looks complete."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


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


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty sibling temp dir; on success it replaces `final` in one rename.

    On any error (or a kill) the temp dir is left with a name `sweep_partials` removes, and
    `final` keeps its previous content or stays absent.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    tmp = final.with_name(f".{final.name}{TMP_MARK}{token}")
    tmp.mkdir()
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
