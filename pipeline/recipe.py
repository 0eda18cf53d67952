"""Recipes: one TOML file names everything a run does, validated before any work starts.

A recipe is data (as in torchtune): the target and drafter, the quantization scheme and its
exclusions, calibration, the validation matrix, gate thresholds, the serving environment and the
publish target. Every problem is reported as one line naming the file, the key and the fix.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import RecipeError

__all__ = ["Scheme", "Workload", "Precision", "Method", "Backend", "PromptSource", "MAX_PROMPTS", "MAX_TOKENS",
    "SERVED_SUBSET", "repo_id_problem", "NO_MTP_HEAD_IN_MEMORY", "ModelRef", "Quantization", "Calibration",
    "Validation", "Gate", "Serving", "Plan", "Cluster", "Publish", "Recipe", "load_recipe"]

Scheme = Literal["mxfp4", "mxfp4_weight_only"]
Workload = Literal["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
Precision = Literal["bf16", "mxfp4"]
Method = Literal["ar", "mtp", "dflash"]
Backend = Literal["reference", "vllm"]
PromptSource = Literal["packaged", "hub"]

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
# A Hub repo id as the Hub accepts it: 'owner/name', each part letters, digits, '-', '_', '.', at most 96
# characters, not starting with '-' or '.', without '--' or '..', and not ending in '.git'.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_REPO_PART}/{_REPO_PART}$")
# Upper bounds a real study stays far below; past them a typo costs hours or memory, not a result.
MAX_PROMPTS = 10_000  # the largest offline prompt set (GSM8K) has 1,319
MAX_TOKENS = 262_144  # Qwen3.5's max_position_embeddings
# The quantize stage's rates as scripts/bench_quantize.py measured them on the project's 2-core machine
# (docs/benchmarks.md): a plain copy's bytes read + written per second, and the kernel's ns per weight.
STORAGE_GB_S = 0.6
ENCODE_NS_PER_WEIGHT = {"bf16": 1.0, "fp8": 1.0}
SERVED_SUBSET = ("workloads", "budgets", "num_prompts")  # [serving] keys that narrow [validation] for vLLM


def repo_id_problem(repo_id: str) -> str | None:
    """Why `repo_id` is not a Hub repo id, or None."""
    if not _REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return (f"{repo_id!r} is not a Hub repo id; use 'owner/name' with letters, digits, '-', '_' or '.' "
                "(no '--' or '..', at most 96 characters each)")
    return None


def _no_duplicates(values: list, key: str) -> list:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{key} lists {', '.join(repeated)} more than once; list each once")
    return values


# Why a quantized MTP head is quantized file to file: transformers builds Qwen3.5 without its MTP head, so
# Quark never sees it in memory (and its export restores the head as stored). `auto` mode, the recipe
# check and `recipe check`'s memory rows all say so with these words.
NO_MTP_HEAD_IN_MEMORY = "in memory there is no MTP head to quantize (transformers does not build it)"

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @classmethod
    def unfingerprinted(cls) -> set[str]:
        """Fields that choose how a result is made, never what it is (so no stage reruns for them)."""
        return {name for name, field in cls.model_fields.items()
                if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("fingerprinted") is False}


class ModelRef(_Section):
    """A model on the Hub (id + pinned revision) or in a local directory (path)."""

    id: str | None = Field(None, description="Hub repo id, e.g. 'Qwen/Qwen3.5-27B'")
    revision: str | None = Field(None, description="Hub revision; pin a 40-hex commit")
    path: Path | None = Field(None, description="local checkpoint directory (relative to the recipe)")
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="digest of all files (`mxspec` prints it); pins a local model's exact bytes"
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelRef:
        if (self.id is None) == (self.path is None):
            raise ValueError("give exactly one of 'id' (a Hub repo) or 'path' (a local directory)")
        if self.id is not None:
            if problem := repo_id_problem(self.id):
                raise ValueError(f"'id': {problem}")
            if not self.revision:
                raise ValueError("a Hub 'id' needs a pinned 'revision' (the 40-hex commit sha)")
        elif self.revision is not None:
            raise ValueError("'revision' only applies to a Hub 'id', not to a local 'path'")
        return self

    @property
    def pinned(self) -> bool:
        return self.path is not None or bool(self.revision and _HEX40.match(self.revision))

    def describe(self) -> str:
        return f"{self.id}@{self.revision}" if self.id else str(self.path)


class Quantization(_Section):
    scheme: Scheme = "mxfp4"
    exclude: list[str] | None = Field(
        None, description="fnmatch patterns kept in bf16; omit to use the model family's defaults"
    )
    quantize_mtp: bool = Field(False, description="quantize the MTP head (known to collapse MTP acceptance)")
    mode: Literal["auto", "in_memory", "file_to_file"] = "auto"
    template: str | None = Field(None, description="Quark LLMTemplate name; default: from model_type")
    encoder: Literal["auto", "quark", "kernel"] = Field(
        "auto", description="file_to_file mode's MXFP4 encoder: Quark's routine, or mxspec's kernel where it is "
        "proven bit-identical to it; auto: the proven kernel, else Quark (on an accelerator when torch sees one)",
        json_schema_extra={"fingerprinted": False})

    @model_validator(mode="after")
    def _mtp_quantized_file_to_file(self) -> Quantization:
        if self.quantize_mtp and self.mode == "in_memory":
            raise ValueError(f"quantize_mtp = true needs mode = 'file_to_file' (or 'auto'): {NO_MTP_HEAD_IN_MEMORY}")
        return self


class Calibration(_Section):
    dataset: Literal["shakespeare", "file"] = "shakespeare"
    path: Path | None = Field(None, description="text file, with dataset = 'file'")
    num_samples: Annotated[int, Field(ge=1)] = 32
    seq_len: Annotated[int, Field(ge=16)] = 512

    @model_validator(mode="after")
    def _path_iff_file(self) -> Calibration:
        if (self.dataset == "file") != (self.path is not None):
            raise ValueError("set 'path' exactly when dataset = 'file'")
        return self


class Validation(_Section):
    workloads: Annotated[list[Workload], Field(min_length=1)] = ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench"]
    budgets: Annotated[list[Annotated[int, Field(ge=2, le=64)]], Field(min_length=1)] = [4, 8, 16]
    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=4096)]], Field(min_length=1)] = [1, 32]
    precisions: Annotated[list[Precision], Field(min_length=1)] = ["bf16", "mxfp4"]
    methods: Annotated[list[Method], Field(min_length=1)] = ["ar", "mtp", "dflash"]
    backends: Annotated[list[Backend], Field(min_length=1)] = ["vllm"]
    num_prompts: Annotated[int, Field(ge=1, le=MAX_PROMPTS)] = 128
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)] = 4096
    warmup_requests: Annotated[int, Field(ge=0, le=1000)] = 2
    seed: int = 0
    prompt_source: PromptSource = Field(
        "packaged", description="'packaged': prompt copies shipped in registry packages (offline, the default); "
        "'hub': the Hub datasets the dflash benchmark client loads (MBPP differs: sanitized split)"
    )

    @property
    def replays_served_text(self) -> bool:
        """Whether the reference path replays along vLLM's served text: a study served by vLLM alone, at
        both precisions, with the AR servers whose greedy text it reads (validate's replay cells)."""
        return ("vllm" in self.backends and "reference" not in self.backends
                and {"bf16", "mxfp4"} <= set(self.precisions) and "ar" in self.methods)

    @model_validator(mode="after")
    def _measurable(self) -> Validation:
        for key in ("workloads", "budgets", "concurrency", "precisions", "methods", "backends"):
            _no_duplicates(getattr(self, key), key)
        if "dflash" not in self.methods:
            raise ValueError("methods: acceptance drift is measured for 'dflash'; add it")
        if "reference" not in self.backends and 1 not in self.concurrency:
            raise ValueError("the vLLM backend measures per-prompt acceptance at concurrency 1; add 1 to concurrency")
        return self


class Gate(_Section):
    max_acceptance_length_drop: Annotated[float, Field(ge=0)] = Field(
        0.25, description="largest tolerated drop of mean AL (bf16 minus MXFP4), per workload and budget"
    )
    max_position_gap: Annotated[float, Field(ge=0, le=1)] = 0.05
    max_same_text_drop: Annotated[float, Field(ge=0)] = Field(
        0.25, description="largest tolerated drop of mean AL when the MXFP4 target verifies bf16's own text "
        "(drafter/target alignment with the text held fixed)"
    )
    min_top1_agreement: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="smallest tolerated share of positions where MXFP4's greedy token is bf16's, on bf16's "
        "text (meaningless for near-flat distributions, e.g. random test models: use max_kl there)"
    )
    max_kl: Annotated[float, Field(ge=0)] | None = Field(
        0.25, description="largest tolerated mean KL(bf16 || MXFP4) per token on bf16's text, nats"
    )
    max_accuracy_drop: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="largest tolerated drop of GSM8K / MATH-500 accuracy (needs max_tokens long enough to finish)"
    )
    max_mtp_acceptance_drop: Annotated[float, Field(ge=0)] | None = Field(
        0.25, description="largest tolerated drop of served MTP mean AL (bf16 head vs the MXFP4 checkpoint's), per "
        "workload and step count")
    min_throughput_lift: float | None = Field(None, description="e.g. 0.05 = MXFP4 must be 5% faster")
    on_inconclusive: Literal["fail", "pass"] = "fail"


class Serving(_Section):
    """How vLLM serves the study, and what of [validation]'s matrix it serves: by default all of it; a
    subset (workloads, budgets, the first num_prompts prompts) keeps a CPU demo short while the
    reference backend measures the rest."""

    workloads: Annotated[list[Workload], Field(min_length=1)] | None = Field(
        None, description="the workloads vLLM serves; default: validation.workloads")
    budgets: Annotated[list[Annotated[int, Field(ge=2, le=64)]], Field(min_length=1)] | None = Field(
        None, description="the MTP and DFlash budgets vLLM serves; default: validation.budgets")
    num_prompts: Annotated[int, Field(ge=1, le=MAX_PROMPTS)] | None = Field(
        None, description="the first N of validation's prompts per workload; default: validation.num_prompts")
    enforce_eager: bool = Field(
        False, description="serve without torch.compile and graph capture: on a 2-core CPU a server starts in about "
        "30 s instead of 1-4 min and steps more slowly (a CPU demo's few prompts; never for a throughput study)")
    env: dict[str, str] = {}
    tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    extra_args: list[str] = []
    startup_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    peak_bandwidth_tb_s: Annotated[float, Field(gt=0)] | None = Field(
        None, description="the accelerator's memory bandwidth, TB/s (MI355X: 8.0): served rows report their share of it")
    request_timeout_s: Annotated[float, Field(gt=0)] = Field(600.0, description="one request; a hung server fails after this")


class Plan(_Section):
    """Rates for `mxspec plan`'s estimates: assumptions, not measurements of this study. The serving defaults are
    Qwen3.5-27B on one MI355X at concurrency 1 as AMD's ROCm blog reports it (AR about 80 tok/s, MTP
    about 245, DFlash about 400; MXFP4 about 15% faster); the reference defaults are what the reference
    pair measured on a 2-core CPU (docs/benchmarks.md); the replay and prefill defaults are guesses for
a 27B-class target on one accelerator, to be replaced by measured rates; the quantize defaults are what
scripts/bench_quantize.py measured on the project's 2-core machine (docs/benchmarks.md, Quantization)."""

    tok_s: dict[Method, Annotated[float, Field(gt=0)]] = Field(
        {"ar": 80.0, "mtp": 245.0, "dflash": 400.0}, description="one request's output tokens/s per method, bf16 target")
    mxfp4_speedup: Annotated[float, Field(gt=0)] = 1.15
    batch_gain: Annotated[float, Field(ge=1)] = Field(
        8.0, description="aggregate throughput at concurrency c = one request's x min(c, batch_gain)")
    output_tokens_per_prompt: Annotated[int, Field(ge=1)] | None = Field(
        None, description="expected tokens per response; default validation.max_tokens (an upper bound)")
    server_start_s: Annotated[float, Field(ge=0)] = Field(300.0, description="loading and warming one vLLM server")
    replay_tok_s: dict[Precision, Annotated[float, Field(gt=0)]] = Field(
        {"bf16": 4000.0, "mxfp4": 2000.0}, description="reference path along vLLM's served text (a vLLM-only study), "
        "text tokens/s per precision on the node's accelerator; MXFP4 includes its pass over bf16's text")
    prefill_tok_s: Annotated[float, Field(gt=0)] = Field(
        20000.0, description="a server's prompt_logprobs prefill, tokens/s: the AR servers score text for fidelity")
    reference_tok_s: dict[Precision, Annotated[float, Field(gt=0)]] = Field(
        {"bf16": 18.0, "mxfp4": 8.7}, description="reference backend, tokens/s per precision (MXFP4 includes the same-text pass)")
    storage_gb_s: Annotated[float, Field(gt=0)] = Field(
        STORAGE_GB_S, description="quantize: bytes read plus bytes written per second (1e9) by a plain file copy")
    encode_ns_per_weight: dict[Literal["bf16", "fp8"], Annotated[float, Field(gt=0)]] = Field(
        ENCODE_NS_PER_WEIGHT, description="quantize: the MXFP4 kernel's time per weight on one CPU core, by source "
        "format (FP8: dequantized as it encodes)")
    quantize_cpus: Annotated[int, Field(ge=1)] = Field(2, description="quantize: CPU cores that encode")


class Cluster(_Section):
    """Where validate's cells run (`pipeline.study.cells`): one at a time in this process, or as Ray tasks.

    Not part of any fingerprint: a cell measures the same wherever it runs."""

    executor: Literal["local", "ray"] = "local"
    address: str | None = Field(
        None, description="Ray cluster to join, e.g. 'auto' or 'ray://head:10001'; default RAY_ADDRESS, else a local one")
    device: Literal["auto", "gpu", "cpu"] = Field(
        "auto", description="what a cell reserves: its server's tensor_parallel_size GPUs, or cpus_per_cell CPUs; "
        "auto: GPUs when the cluster has any")
    cpus_per_cell: Annotated[int, Field(ge=1)] = 1
    max_retries: Annotated[int, Field(ge=0, le=10)] = Field(
        2, description="times Ray runs a cell again whose worker or node died")


class Publish(_Section):
    repo_id: str | None = Field(None, description="target Hub repo 'owner/name'; unset = do not publish")
    private: bool = True
    create_pr: bool = False
    tag: str | None = None
    endpoint: str | None = Field(None, description="Hub endpoint; default: HF_ENDPOINT or huggingface.co")
    base_model: str | None = Field(None, description="Hub id of the base model for the card; default: target.id")

    @model_validator(mode="after")
    def _valid_repo(self) -> Publish:
        if self.repo_id is not None and (problem := repo_id_problem(self.repo_id)):
            raise ValueError(f"repo_id: {problem}")
        if self.endpoint is not None and not re.match(r"^https?://[^\s/]+", self.endpoint):
            raise ValueError(f"endpoint: {self.endpoint!r} is not an http(s) URL; e.g. 'https://huggingface.co'")
        return self


class Recipe(_Section):
    name: Annotated[str, Field(min_length=1)]
    description: str = ""
    target: ModelRef
    drafter: ModelRef
    quantization: Quantization = Quantization()
    calibration: Calibration = Calibration()
    validation: Validation = Validation()
    gate: Gate = Gate()
    serving: Serving = Serving()
    plan: Plan = Plan()
    cluster: Cluster = Cluster()
    publish: Publish = Publish()

    @model_validator(mode="after")
    def _never_the_drafter(self) -> Recipe:
        repo, drafter = self.publish.repo_id, self.drafter.id
        if repo and drafter and repo.lower() == drafter.lower():
            raise ValueError(f"publish.repo_id {repo!r} is the drafter's repo; mxspec never modifies the drafter, "
                             "publish the quantized target to its own repo")
        return self

    @model_validator(mode="after")
    def _plan_has_every_rate(self) -> Recipe:
        v = self.validation
        missing = [f"plan.tok_s.{m}" for m in v.methods if "vllm" in v.backends and m not in self.plan.tok_s]
        missing += [f"plan.reference_tok_s.{p}" for p in v.precisions
                    if "reference" in v.backends and p not in self.plan.reference_tok_s]
        missing += [f"plan.replay_tok_s.{p}" for p in v.precisions
                    if v.replays_served_text and p not in self.plan.replay_tok_s]
        if missing:
            raise ValueError(f"{', '.join(missing)}: no rate to estimate with; add it to [plan] or drop the key to use the defaults")
        return self

    @model_validator(mode="after")
    def _serves_a_subset(self) -> Recipe:
        v, s = self.validation, self.serving
        narrowed = [key for key in SERVED_SUBSET if getattr(s, key) is not None]
        if not narrowed:
            return self
        key = f"serving.{narrowed[0]}"
        if "vllm" not in v.backends:  # like the rest of [serving], unused without vLLM
            return self
        if "reference" not in v.backends:
            raise ValueError(f"{key} serves a subset of the study, and without the reference backend nothing measures "
                             f"the rest; add 'reference' to validation.backends, or set validation.{narrowed[0]} instead")
        for name in ("workloads", "budgets"):
            chosen = getattr(s, name) or []
            _no_duplicates(chosen, f"serving.{name}")
            if extra := [str(x) for x in chosen if x not in getattr(v, name)]:
                raise ValueError(f"serving.{name} lists {', '.join(extra)}, which validation.{name} does not measure; "
                                 f"serve a subset of validation.{name} {getattr(v, name)}")
        if s.num_prompts is not None and s.num_prompts > v.num_prompts:
            raise ValueError(f"serving.num_prompts = {s.num_prompts} is more than validation.num_prompts = "
                             f"{v.num_prompts}; serve at most the prompts the reference backend measures")
        return self

    @property
    def served(self) -> Validation:
        """The matrix the vLLM backend serves: [validation], narrowed by [serving]'s subset keys."""
        return self.validation.model_copy(update={key: value for key in SERVED_SUBSET
                                                  if (value := getattr(self.serving, key)) is not None})


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe; local paths in it are resolved against the recipe's folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe not found; pass the path of a .toml file (see recipes/)", path=path) from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: the recipe is not UTF-8 text; pass a UTF-8 .toml file", path=path) from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc.strerror or exc.__class__.__name__}); "
                          "pass a readable .toml file", path=path) from exc
    if not text.strip():
        raise RecipeError(f"{path}: the recipe is empty; start from one in recipes/ (e.g. recipes/reference-cpu.toml)",
                          path=path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}", path=path) from exc
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_explain(path, text, exc), path=path) from exc
    return _resolve_paths(recipe, path.parent.resolve())


def _resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    def fix(section: BaseModel) -> BaseModel:
        p = getattr(section, "path", None)
        if p is None or p.is_absolute():
            return section
        return section.model_copy(update={"path": (base / p).resolve()})

    return recipe.model_copy(
        update={name: fix(getattr(recipe, name)) for name in ("target", "drafter", "calibration")}
    )


def _explain(path: Path, text: str, exc: ValidationError) -> str:
    """One line per problem: where it is, what is wrong, how to fix it."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"] if not isinstance(part, int)]
        key = ".".join(loc) or "(top level)"
        where = f"{path}{_line_of(text, loc)}"
        kind = err["type"]
        if kind == "extra_forbidden":
            section_model = _model_at(loc[:-1])
            known = list(section_model.model_fields) if section_model else []
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
            lines.append(f"{where}: unknown key '{key}'; {hint}")
        elif kind == "missing":
            lines.append(f"{where}: missing required key '{key}'; add it to the recipe")
        elif kind == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            lines.append(f"{where}: '{key}' = {err['input']!r} is not supported; use one of {expected}")
        elif kind == "value_error":
            message = err["msg"].removeprefix("Value error, ")
            if not loc and (named := _NAMED_KEY.match(message)):  # a check across sections names its key
                where = f"{path}{_line_of(text, list(named.groups()))}"
            section = f"[{key}] " if loc else ""
            lines.append(f"{where}: {section}{message}")
        else:
            lines.append(f"{where}: '{key}' = {err['input']!r}: {err['msg'].lower()}; fix its value")
    return "\n".join(lines)


_NAMED_KEY = re.compile(r"^([a-z_]+)\.([a-z_]+)\b")


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _line_of(text: str, loc: list[str]) -> str:
    """Best-effort ':LINE' of a key in the TOML text, to point an editor at it."""
    if not loc:
        return ""
    section, key = loc[:-1], loc[-1]
    lines = text.splitlines()
    header = re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(map(re.escape, loc)) + r"\s*\]")
    found = next((i for i, line in enumerate(lines) if header.match(line)), None)
    if found is not None:  # the error is about a whole section: point at its header
        return f":{found + 1}"
    start = 0
    if section:
        header = re.compile(r"^\s*\[\s*" + r"\s*\.\s*".join(map(re.escape, section)) + r"\s*\]")
        found = next((i for i, line in enumerate(lines) if header.match(line)), None)
        if found is None:
            return ""
        start = found + 1
    key_re = re.compile(r"^\s*" + re.escape(key) + r"\s*=")
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        if key_re.match(lines[i]):
            return f":{i + 1}"
    return f":{start}" if section else ""
