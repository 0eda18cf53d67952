"""Write the JSON Schema of every artifact mxspec writes into docs/schemas/ (run after changing a model
in pipeline/run/artifacts.py; tests/run/test_artifacts.py fails while the files are stale)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.run.artifacts import json_schemas

SCHEMAS = Path(__file__).resolve().parent.parent / "docs" / "schemas"


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main() -> None:
    SCHEMAS.mkdir(parents=True, exist_ok=True)
    current = json_schemas()
    for stale in set(p.name for p in SCHEMAS.glob("*.schema.json")) - set(current):
        (SCHEMAS / stale).unlink()
    for name, schema in sorted(current.items()):
        (SCHEMAS / name).write_text(render(schema))
        print(f"wrote {SCHEMAS / name}")


if __name__ == "__main__":
    main()
