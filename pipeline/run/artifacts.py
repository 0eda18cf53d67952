"""Typed artifacts: every JSON file a stage writes, as its writer emits it and its readers read it
(stage manifests, the quantize report, the pair manifest, the validate report, the gate verdict).
Their JSON Schemas are exported to docs/schemas/ (`python scripts/export_schemas.py`).

No torch here: the gate, the card and the CLI's light commands read reports without it. A report is
checked twice on read: against its schema (types, no NaN or infinity, no unknown keys) and against
itself (every (workload, budget) the settings name has its cells and its drift row, and each drift
row agrees with the cells it summarises), so an edited or truncated report is refused, not gated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import BadInputError
from pipeline.recipe import Gate, PromptSource
from pipeline.run import layout
from pipeline.run.hashing import digest_of

__all__ = ["MANIFEST_SCHEMA", "QUANTIZE_SCHEMA", "PAIR_SCHEMA", "VALIDATE_SCHEMA", "GATE_SCHEMA",
    "PUBLISHED_LIST_SCHEMA", "Verdict", "CONSISTENCY_TOLERANCE", "Interval", "Rate", "VOLATILE", "volatile_fields",
    "StageManifest", "ArtifactT", "ReportSettings", "AcceptanceCell", "DriftRow", "MEASURED_BY", "FidelityRow",
    "AccuracyRow", "ServedRow", "ValidateReport", "ResolvedModel", "LogitAgreement", "ExportVerification",
    "QuantizeReport", "ModelRef", "QuantizedRef", "DrafterRef", "PairManifest", "GateCheck", "GateVerdict",
    "PublishedFiles", "PublishSkipped", "PublishResult", "read_artifact", "write_artifact", "read_validate_report",
    "ARTIFACTS", "json_schemas"]

MANIFEST_SCHEMA = 1
QUANTIZE_SCHEMA = "mxspec.quantize/1"
PAIR_SCHEMA = "mxspec.pair/1"
VALIDATE_SCHEMA = "mxspec.validate/4"
GATE_SCHEMA = "mxspec.gate/1"
PUBLISHED_LIST_SCHEMA = "mxspec.published-files/1"
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
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)


ArtifactT = TypeVar("ArtifactT", bound=BaseModel)


class ReportSettings(_Artifact):
    workloads: list[str]
    precisions: list[str]
    budgets: list[Annotated[int, Field(ge=2)]]
    num_prompts: Annotated[int, Field(ge=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    seed: int
    prompt_source: PromptSource
    prompt_sets: dict[str, str]  # workload -> where its prompts came from (dataset or package file, version)
    enforce_eager: bool = False  # vLLM served without torch.compile: slower steps than a compiled server


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
    concurrency: Annotated[int, Field(ge=1)] | None = None  # served rows at one concurrency (`served_drift`)


MEASURED_BY = {"vllm": "the served kernels", "reference": "the reference path"}  # FidelityRow.measured_by, in words


class FidelityRow(_Artifact):
    """The MXFP4 target against bf16 on one workload's bf16 continuations, teacher forced (`fidelity`):
    by the served kernels (vLLM's prompt_logprobs from both AR servers) or by the reference path
    (PyTorch, the MXFP4 checkpoint through Quark's importer)."""

    workload: str
    measured_by: Literal["reference", "vllm"]
    num_prompts: Annotated[int, Field(ge=1)]
    num_positions: Annotated[int, Field(ge=0)]
    top1_agreement: Rate  # share of positions where MXFP4's greedy token is bf16's
    top1_agreement_ci95: Interval
    kl: Annotated[float, Field(ge=0)]  # mean KL(bf16 || MXFP4) per position, nats
    kl_ci95: Interval
    kl_top_k: Annotated[int, Field(ge=1)]  # bf16 kept as its top-K tokens plus the rest: a lower bound of the full KL


class AccuracyRow(_Artifact):
    """Task accuracy of both precisions on one workload whose answers can be checked (`answers`)."""

    workload: str
    measured: bool
    note: str  # how it was scored, or why it was not
    num_prompts: Annotated[int, Field(ge=1)]
    finished: dict[str, int]  # precision -> responses that ended within max_tokens
    accuracy: dict[str, Rate]  # precision -> share of prompts answered correctly (unfinished counts as wrong)
    delta: float | None = None  # MXFP4 minus bf16
    delta_ci95: Interval | None = None  # paired over prompts


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
    # Where the speed went (`serving.benchmark.speed_accounting`)
    speedup_over_al: float | None = Field(None, json_schema_extra=VOLATILE)  # 1.0: a speculative step costs an AR step
    weight_bytes: int | None = None  # the served checkpoint's weight files
    weight_bandwidth_gb_s: float | None = Field(None, json_schema_extra=VOLATILE)  # weight_bytes x target steps per second
    bandwidth_share: float | None = Field(None, json_schema_extra=VOLATILE)  # of serving.peak_bandwidth_tb_s


class ValidateReport(_Artifact):
    """validate/report.json."""

    schema_: Literal["mxspec.validate/4"] = Field(VALIDATE_SCHEMA, alias="schema")
    recipe: str
    backend: Literal["reference", "vllm"]
    target: str
    drafter: str
    settings: ReportSettings
    versions: dict[str, str | None]
    cells: list[AcceptanceCell]
    drift: list[DriftRow]
    serving: list[ServedRow] | None = None
    # The text the reference path measured along: its own generation, vLLM's served AR text, or none ran
    reference_text: Literal["generated", "served"] | None = None
    # Same text (reference path): the drafter against the MXFP4 target along bf16's continuation.
    same_text_cells: list[AcceptanceCell] = []
    same_text_drift: list[DriftRow] = []  # MXFP4 on bf16's text minus bf16 on its own text, paired
    fidelity: list[FidelityRow] = []  # per workload, one row per way it was measured
    accuracy: list[AccuracyRow] = []
    mtp_drift: list[DriftRow] = []  # served MTP acceptance, MXFP4 minus bf16, paired by prompt at concurrency 1
    mtp_same_text_drift: list[DriftRow] = []  # the MXFP4 checkpoint's unquantized head on bf16's text, replayed
    # Served acceptance above concurrency 1, paired by prompt through vLLM's per-request metrics (DFlash and MTP)
    served_drift: list[DriftRow] = []
    per_request_acceptance: bool | None = None  # whether vLLM reported them; None: vLLM did not serve

    def same_text_row(self, workload: str, budget: int) -> DriftRow | None:
        return next((r for r in self.same_text_drift if (r.workload, r.budget) == (workload, budget)), None)

    def fidelity_rows(self, workload: str) -> list[FidelityRow]:
        return [r for r in self.fidelity if r.workload == workload]

    def accuracy_row(self, workload: str) -> AccuracyRow | None:
        return next((r for r in self.accuracy if r.workload == workload and r.measured), None)

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


class ResolvedModel(_Artifact):
    """resolve/<role>.json: a model of the recipe as a local folder, with the hashes of its files."""

    role: Literal["target", "drafter"]
    source: Literal["hub", "local"]
    ref: str  # what the recipe named: "owner/name@revision" or a path
    revision: str | None  # the commit the Hub resolved to; None for local folders
    path: str  # local folder holding the files
    files: dict[str, str]  # relative path -> sha256

    @property
    def digest(self) -> str:
        return digest_of(self.files)

    @property
    def config(self) -> dict:
        return json.loads((Path(self.path) / "config.json").read_text())


class LogitAgreement(_Artifact):
    """The reloaded export against the bf16 source on calibration windows (dense causal LMs)."""

    tokens: Annotated[int, Field(ge=1)]
    mean_abs_logit_error: Annotated[float, Field(ge=0)]
    kl_bf16_to_mxfp4: float
    top1_agreement: Rate


class ExportVerification(_Artifact):
    """What the quantize stage checked of Quark's export."""

    bit_exact_tensors: Annotated[int, Field(ge=1)]  # quantized tensors equal to pipeline.quant.mxfp4.encode of their source
    moe_experts_quantized: Annotated[int, Field(ge=0)]
    encoder: str
    source_format: Literal["bf16", "fp8"] = "bf16"
    # FP8 source weights kept unquantized, each equal to its dequantized value in the config's dtype
    dequantized_kept_tensors: Annotated[int, Field(ge=0)] = 0
    logits: LogitAgreement | None = None


class EncoderRecord(_Artifact):
    """Which MXFP4 encoder wrote the export's weights (`quant.encoder.EncoderChoice`)."""

    name: Literal["quark", "kernel"]
    device: str
    proof: str | None = Field(None, description="for the kernel: the inputs it was proven bit-identical to Quark on")
    reason: str


class QuantizeReport(_Artifact):
    """quantize/mxspec-quantize.json."""

    schema_: Literal["mxspec.quantize/1"] = Field(QUANTIZE_SCHEMA, alias="schema")
    target: str
    target_digest: str
    scheme: str
    mode: Literal["in_memory", "file_to_file"]
    template: str
    exclude: list[str]
    quantized_layers: Annotated[int, Field(ge=1)]
    excluded_layers: Annotated[int, Field(ge=0)]
    carried_over_tensors: Annotated[int, Field(ge=0)]
    verification: ExportVerification
    encoder: EncoderRecord | None = Field(None, description="absent where the report does not record it")
    versions: dict[str, str]


class ModelRef(_Artifact):
    """A model as resolved: its reference (Hub id@revision or path), revision and content digest."""

    ref: str
    revision: str | None
    digest: str


class QuantizedRef(_Artifact):
    path: str
    digest: str


class DrafterRef(ModelRef):
    files: dict[str, str]  # file -> sha256, checked unchanged against the recipe's pin


class PairManifest(_Artifact):
    """pair/pair.json: the bf16 target, its MXFP4 export and the unchanged drafter that serves both."""

    schema_: Literal["mxspec.pair/1"] = Field(PAIR_SCHEMA, alias="schema")
    target: ModelRef
    quantized_target: QuantizedRef
    drafter: DrafterRef
    block_size: Annotated[int, Field(ge=2)]
    launch_commands: dict[str, str]


class GateCheck(_Artifact):
    """One gated cell: a (workload, budget) drift row, or one throughput comparison."""

    name: str  # e.g. "gsm8k B=8" or "throughput gsm8k dflash B=8 c=1"
    workload: str
    kind: Literal["acceptance", "throughput"]
    verdict: Verdict
    reason: str
    measured: dict[str, int | float | list[float]] = Field(default_factory=dict)


class GateVerdict(_Artifact):
    """gate/verdict.json. `verdict` is before the inconclusive policy, `passed` after it."""

    schema_: Literal["mxspec.gate/1"] = Field(GATE_SCHEMA, alias="schema")
    verdict: Verdict
    passed: bool
    exit_code: Literal[0, 1]
    thresholds: Gate
    report: str
    report_sha256: str
    checks: list[GateCheck]


class PublishedFiles(_Artifact):
    """mxspec/files.json in a published repo: the files this publish owns there (path -> sha256)."""

    schema_: Literal["mxspec.published-files/1"] = Field(PUBLISHED_LIST_SCHEMA, alias="schema")
    files: dict[str, str]


class PublishSkipped(_Artifact):
    """publish/publish.json of a recipe that names no repo: nothing was uploaded, and why."""

    published: Literal[False] = False
    reason: str


class PublishResult(_Artifact):
    """publish/publish.json after an upload. The Hub's commit id and what this attempt sent are declared
    volatile: a publish resumed after a kill finds its commit already made and records that instead."""

    published: Literal[True] = True
    repo_id: str
    endpoint: str
    revision: str = Field(json_schema_extra=VOLATILE)  # the commit that holds the files (its id includes its time)
    created_commit: bool = Field(json_schema_extra=VOLATILE)  # False when the Hub already had exactly these files
    uploaded: list[str] = Field(json_schema_extra=VOLATILE)  # files sent in the commit (empty when nothing changed)
    deleted: list[str] = Field(default_factory=list, json_schema_extra=VOLATILE)  # stale files the commit removed
    verified: int  # files whose remote size and sha256 matched the local bytes
    pr_url: str | None = None
    tag: str | None = None
    gate_verdict: str = ""
    forced: bool = False
    files: dict[str, str] = Field(default_factory=dict)  # path in repo -> sha256


def read_artifact(path: Path, model: type[ArtifactT], remedy: str) -> ArtifactT:
    """An artifact a stage wrote, checked against its model, or one line (exit 2) saying why it cannot
    be used and `remedy` (how to make it again)."""
    path = Path(path)
    try:
        return model.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise BadInputError(f"{path}: not found; {remedy}") from None
    except (IsADirectoryError, NotADirectoryError):
        raise BadInputError(f"{path}: not a file; {remedy}") from None
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read it ({exc.strerror}); {remedy}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise BadInputError(f"{path}: '{key}' {first['msg'].lower()}; {remedy}") from exc


def write_artifact(artifact: BaseModel, path: Path) -> None:
    """An artifact as its readers read it: JSON in the model's field order, the schema key by its name."""
    path.write_text(artifact.model_dump_json(by_alias=True, indent=2) + "\n")


def read_validate_report(path: Path) -> ValidateReport:
    """A validate report that holds together, or one line (exit 2) saying why it cannot be used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInputError(f"{path}: report not found; pass OUT/validate/report.json of a validate run") from None
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError, NotADirectoryError) as exc:
        raise BadInputError(f"{path}: not a JSON report ({exc.__class__.__name__}); pass OUT/validate/report.json") from exc
    except OSError as exc:
        raise BadInputError(f"{path}: cannot read the report ({exc.strerror}); pass a readable file") from exc
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
                            "regenerate it with `mxspec validate`") from exc
    problems = report.consistency_problems()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BadInputError(f"{path}: inconsistent report: {problems[0]}{more}; regenerate it with `mxspec validate`")
    return report


# Every JSON file mxspec writes: schema name -> (where it lives, see `layout`, and its model).
ARTIFACTS: dict[str, tuple[str, Any]] = {
    "manifest": (f"OUT/<stage>/{layout.MANIFEST}", StageManifest),
    "resolved": (f"OUT/resolve/{layout.resolved_file('<role>')}", ResolvedModel),
    "quantize": (f"OUT/quantize/{layout.QUANTIZE_REPORT}", QuantizeReport),
    "pair": (f"OUT/pair/{layout.PAIR_FILE}", PairManifest),
    "validate": (f"OUT/validate/{layout.REPORT_FILE}", ValidateReport),
    "gate": (f"OUT/gate/{layout.VERDICT_FILE}", GateVerdict),
    "publish": (f"OUT/publish/{layout.PUBLISH_FILE}", PublishResult | PublishSkipped),
    "published-files": (f"{layout.PUBLISHED_LIST} in the published Hub repo", PublishedFiles),
}


def json_schemas() -> dict[str, dict]:
    """The JSON Schema of every artifact, by the file name docs/schemas/ gives it."""
    from pydantic import TypeAdapter

    return {f"{name}.schema.json": {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": place,
                                    **TypeAdapter(model).json_schema(by_alias=True)}
            for name, (place, model) in ARTIFACTS.items()}
