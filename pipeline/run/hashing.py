"""Content hashes of files and folders, with a stat-keyed cache so a 50 GB checkpoint is read once.

The cache is keyed by (device, inode) and checked against (size, mtime_ns), as git's index does:
rewriting a file changes its mtime, so a changed file is always re-read, and a renamed file (a stage
folder moved into place) keeps its entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from pipeline.run.atomic import atomic_write_text

__all__ = ["IGNORED_NAMES", "sha256_file", "canonical_sha256", "sha256_bytes", "list_files", "digest_of", "HashCache"]

_CHUNK = 8 << 20
IGNORED_NAMES = {".git", ".cache", "__pycache__", ".DS_Store"}


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return digest.hexdigest()


def canonical_sha256(data) -> str:
    """sha256 of `data` serialised canonically (JSON with sorted keys; anything else by its str): the one
    way fingerprints, recipe hashes and cell keys are made, so equal inputs always hash equal."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def list_files(root: Path) -> list[str]:
    """Relative POSIX paths of the regular files under root (symlinks followed), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_NAMES)
        for name in filenames:
            if name in IGNORED_NAMES:
                continue
            full = Path(dirpath) / name
            found.append(full.relative_to(root).as_posix())
    return sorted(found)


def digest_of(files: dict[str, str]) -> str:
    """One hash for a set of (relative path, sha256) pairs."""
    lines = "".join(f"{name}\0{sha}\n" for name, sha in sorted(files.items()))
    return sha256_bytes(lines.encode())


class HashCache:
    """Remembers file hashes by stat signature; saved as JSON next to the run's outputs."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._entries: dict[str, list] = {}
        if path and path.exists():
            try:
                self._entries = json.loads(path.read_text())
            except (json.JSONDecodeError, OSError):
                self._entries = {}

    def file(self, path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
        stat = Path(path).stat()
        key, signature = f"{stat.st_dev}:{stat.st_ino}", [stat.st_size, stat.st_mtime_ns]
        cached = self._entries.get(key)
        if cached and cached[:2] == signature:
            if on_bytes:
                on_bytes(stat.st_size)
            return cached[2]
        sha = sha256_file(path, on_bytes)
        self._entries[key] = [*signature, sha]
        return sha

    def tree(self, root: Path, on_bytes: Callable[[int], None] | None = None) -> dict[str, str]:
        """sha256 of every file under root, keyed by relative path."""
        return {name: self.file(root / name, on_bytes) for name in list_files(root)}

    def save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self._entries))
