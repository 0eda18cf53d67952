"""Typed artifacts: stage manifests, and the validate report as its writer emits it and its readers
(the gate) check it.

No torch here: the gate, the card and the CLI's light commands read reports without it. A report is
checked twice on read: against its schema (types, no NaN or infinity, no unknown keys) and against
itself (every (workload, budget) the settings name has its cells and its drift row, and each drift
row agrees with the cells it summarises), so an edited or truncated report is refused, not gated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import BadInputError
from pipeline.recipe import Gate

MANIFEST_SCHEMA = 1
VALIDATE_SCHEMA = "mxspec.validate/2"
Verdict = Literal["pass", "fail", "inconclusive"]
# How far a drift row's figures may sit from the same figures recomputed from its cells (float noise).
CONSISTENCY_TOLERANCE = 1e-6

Interval = tuple[float, float]
Rate = Annotated[float, Field(ge=0, le=1)]


VOLATILE: dict[str, Any] = {"volatile": True}  # json_schema_extra of a field that differs between identical runs


def volatile_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of an artifact model declared volatile (timings, measurements): left out when two
    runs' artifacts are compared."""
    return frozenset(name for name, info in model.model_fields.items()
                     if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("volatile"))


class StageManifest(BaseModel):
    """OUT/<stage>/manifest.json: what a stage's outputs were made from, and what they are."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal[1] = Field(MANIFEST_SCHEMA, alias="schema")
    stage: str
    stage_version: int
    fingerprint: str
    recipe_name: str
    recipe_sha256: str
    config_sha256: str
    inputs: dict[str, str]  # "stage:NAME" or "external:NAME" -> digest
    versions: dict[str, str]
    outputs: dict[str, str]  # file under the stage folder -> sha256
    started_at: str = Field(json_schema_extra=VOLATILE)
    finished_at: str = Field(json_schema_extra=VOLATILE)
    duration_s: float = Field(json_schema_extra=VOLATILE)
    measured: dict[str, float] = Field(default_factory=dict, json_schema_extra=VOLATILE)


class _Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ReportSettings(_Artifact):
    workloads: list[str]
    precisions: list[str]
    budgets: list[Annotated[int, Field(ge=2)]]
    num_prompts: Annotated[int, Field(ge=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    seed: int


class AcceptanceCell(_Artifact):
    """Mean acceptance of the drafter on one precision of the target, for one workload and budget."""

    workload: str
    precision: str
    method: str
    budget: Annotated[int, Field(ge=2)]
    mean_acceptance_length: Annotated[float, Field(ge=1)]
    per_position_acceptance: list[Rate]
    num_prompts: Annotated[int, Field(ge=1)]
    num_steps: Annotated[int, Field(ge=0)]
    ci95: Interval


class DriftRow(_Artifact):
    """bf16 vs MXFP4 for one (workload, budget): the paired difference and its bootstrap intervals."""

    workload: str
    method: str
    budget: Annotated[int, Field(ge=2)]
    delta: float  # mean AL (MXFP4) - mean AL (bf16)
    ci95: Interval
    per_position_gap: list[Rate]
    max_position_gap: Rate
    mean_position_gap: Rate
    position_drop_ci95: list[Interval]
    num_prompts: Annotated[int, Field(ge=1)]
    verdict: Verdict


class ServedRow(_Artifact):
    """One vLLM server serving one workload at one concurrency."""

    workload: str
    precision: str
    method: str
    budget: int | None
    concurrency: Annotated[int, Field(ge=1)]
    num_prompts: int
    output_tokens: int
    wall_s: float = Field(json_schema_extra=VOLATILE)
    throughput_tok_s: float = Field(json_schema_extra=VOLATILE)
    latency_p50_s: float = Field(json_schema_extra=VOLATILE)
    latency_max_s: float = Field(json_schema_extra=VOLATILE)
    mean_acceptance_length: float | None
    per_position_acceptance: list[float] | None
    num_drafts: int
    speedup: float | None = Field(None, json_schema_extra=VOLATILE)
    identical_to_ar: float | None = None
    acceptance_length_measured: float | None = None


class ValidateReport(_Artifact):
    """validate/report.json."""

    schema_: Literal["mxspec.validate/2"] = Field(VALIDATE_SCHEMA, alias="schema")
    recipe: str
    backend: Literal["reference", "vllm"]
    target: str
    drafter: str
    settings: ReportSettings
    gate: Gate  # the recipe's thresholds at validate time; `mxspec gate` uses them unless given a recipe
    versions: dict[str, str | None]
    cells: list[AcceptanceCell]
    drift: list[DriftRow]
    verdict: Literal["pass", "fail", "inconclusive", "not measured"]
    serving: list[ServedRow] | None = None

    model_config = ConfigDict(populate_by_name=True)

    def cell(self, workload: str, precision: str, budget: int) -> AcceptanceCell | None:
        return next((c for c in self.cells if (c.workload, c.precision, c.budget) == (workload, precision, budget)), None)

    def consistency_problems(self) -> list[str]:
        """What in the report contradicts itself or is missing for a bf16-vs-MXFP4 verdict."""
        s = self.settings
        problems = []
        compared = "bf16" in s.precisions and "mxfp4" in s.precisions
        rows = {}
        for row in self.drift:
            key = (row.workload, row.budget)
            if key in rows:
                problems.append(f"drift row {row.workload} B={row.budget} appears twice")
            rows[key] = row
        for workload in s.workloads:
            for budget in s.budgets:
                where = f"{workload} B={budget}"
                cells = {p: self.cell(workload, p, budget) for p in s.precisions}
                problems += [f"no {p} cell for {where}" for p, c in cells.items() if c is None]
                problems += [f"{p} cell {where} has {c.num_prompts} prompts, settings say {s.num_prompts}"
                             for p, c in cells.items() if c is not None and c.num_prompts != s.num_prompts]
                problems += [f"{p} cell {where} has {len(c.per_position_acceptance)} positions, expected {budget - 1}"
                             for p, c in cells.items() if c is not None and len(c.per_position_acceptance) != budget - 1]
                if compared and (workload, budget) not in rows:
                    problems.append(f"no drift row for {where}")
                elif compared and cells.get("bf16") and cells.get("mxfp4"):
                    problems += _drift_disagrees(rows[(workload, budget)], cells["bf16"], cells["mxfp4"])
        extra = set(rows) - {(w, b) for w in s.workloads for b in s.budgets}
        problems += [f"drift row {w} B={b} is not in the settings' workloads and budgets" for w, b in sorted(extra)]
        return problems


def _drift_disagrees(row: DriftRow, bf16: AcceptanceCell, mxfp4: AcceptanceCell) -> list[str]:
    where = f"drift row {row.workload} B={row.budget}"
    problems = []
    delta = mxfp4.mean_acceptance_length - bf16.mean_acceptance_length
    if not math.isclose(row.delta, delta, abs_tol=CONSISTENCY_TOLERANCE):
        problems.append(f"{where}: delta {row.delta:+.4f} but its cells differ by {delta:+.4f}")
    gaps = [abs(a - b) for a, b in zip(mxfp4.per_position_acceptance, bf16.per_position_acceptance)]
    if len(row.per_position_gap) != len(gaps) or any(
            not math.isclose(a, b, abs_tol=CONSISTENCY_TOLERANCE) for a, b in zip(row.per_position_gap, gaps)):
        problems.append(f"{where}: per-position gaps disagree with its cells")
    elif gaps and not math.isclose(row.max_position_gap, max(gaps), abs_tol=CONSISTENCY_TOLERANCE):
        problems.append(f"{where}: max_position_gap {row.max_position_gap:.4f} but its cells give {max(gaps):.4f}")
    if len(row.position_drop_ci95) != row.budget - 1:
        problems.append(f"{where}: {len(row.position_drop_ci95)} per-position intervals, expected {row.budget - 1}")
    if row.num_prompts != bf16.num_prompts or row.num_prompts != mxfp4.num_prompts:
        problems.append(f"{where}: {row.num_prompts} prompts, its cells have {bf16.num_prompts} and {mxfp4.num_prompts}")
    for low, high in [row.ci95, *row.position_drop_ci95]:
        if low > high:
            problems.append(f"{where}: interval [{low}, {high}] is reversed")
            break
    return problems


def read_validate_report(path: Path) -> ValidateReport:
    """A validate report that holds together, or one line (exit 2) saying why it cannot be used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInputError(f"{path}: report not found; pass OUT/validate/report.json of a validate run") from None
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError, NotADirectoryError) as exc:
        raise BadInputError(f"{path}: not a JSON report ({exc.__class__.__name__}); pass OUT/validate/report.json") from None
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read the report ({exc.strerror}); pass a readable file") from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != VALIDATE_SCHEMA:
        raise BadInputError(f"{path}: schema {schema!r} is not {VALIDATE_SCHEMA!r}; regenerate it with `mxspec validate`")
    try:
        report = ValidateReport.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "(top level)"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise BadInputError(f"{path}: '{key}' {first['msg'].lower()}{more}; the report was edited or truncated, "
                            "regenerate it with `mxspec validate`") from None
    problems = report.consistency_problems()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BadInputError(f"{path}: inconsistent report: {problems[0]}{more}; regenerate it with `mxspec validate`")
    return report
