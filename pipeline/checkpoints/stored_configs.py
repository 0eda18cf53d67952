"""The real Qwen3.5 and DFlash configs stored as data (`pipeline/checkpoints/configs/<name>.json`), without
torch: each file is the model's config.json plus a `source` entry (Hub repo, pinned revision, how it was
obtained, published totals). `pipeline.architectures` builds them on the meta device; `pipeline.quant.memory`
sizes them for recipes that name their Hub repo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DATA_DIR", "stored_for_repo"]

DATA_DIR = Path(__file__).with_name("configs")


def stored_for_repo(repo_id: str) -> dict[str, Any] | None:
    """The stored config.json (with its `source`) of the Hub repo `repo_id`, or None."""
    for path in sorted(DATA_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("source", {}).get("repo") == repo_id:
            return data
    return None
