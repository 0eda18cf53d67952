"""The study as cells, each with an estimated cost, and its wall time on 1 GPU, one node and a cluster.

A cell is a unit of validate's work that measures and nothing else (`pipeline.study.cells`):
  serving cell    one vLLM server of the matrix (precision x method x budget), serving every workload
                  at every concurrency; it holds `serving.tensor_parallel_size` GPUs;
  score cell      `score-mxfp4`: an MXFP4 AR server that scores the bf16 AR server's text (served
                  fidelity), after that server; as many GPUs;
  reference cell  one (precision, workload) of the reference backend; the MXFP4 cell needs the bf16
                  cell of its workload (it verifies bf16's text), so it starts after it; one GPU.
  replay cell     the same along vLLM's served AR text (a vLLM-only study): after its precision's AR
                  server, one target pass per text (MXFP4: two, its own and bf16's); one GPU.

The cost model is arithmetic over the recipe's `[plan]` rates, which are estimates, not measurements:
  serving    start-up + sum over the served workloads (`Recipe.served`) and concurrencies of
             num_prompts x output_tokens_per_prompt / (tok_s[method] x mxfp4_speedup? x min(c, batch_gain))
  reference  num_prompts x max_tokens / reference_tok_s[precision]
  replay     num_prompts x output_tokens_per_prompt / replay_tok_s[precision]
  scoring   the bf16 AR server and the score-mxfp4 cell (an MXFP4 AR server, after it) each prefill bf16's
             text once: workloads x num_prompts x output_tokens / prefill_tok_s (+ server_start_s for score-mxfp4)
The quantize stage, before the study (file-to-file with the MXFP4 kernel, `pipeline.quant.file_to_file`):
  (source bytes + export bytes) / storage_gb_s + encoded weights x encode_ns_per_weight[format] / quantize_cpus,
  no overlap counted (the stage overlaps them, so this bounds it from above).
A schedule places cells longest first, each on the GPUs of one node that free up earliest (after the
cells it depends on), which is what a Ray cluster with one task per cell and GPU reservations does.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline.quant.memory import MemoryPlan
from pipeline.recipe import Plan, Recipe
from pipeline.study.cells import SCORE_CELL, ar_cell_name, reference_cell_specs, serving_cell_name
from pipeline.study.served import measures_served_fidelity, server_matrix

__all__ = ["PlannedCell", "Placement", "Schedule", "QuantizeEstimate", "StudyPlan", "study_cells", "schedule",
    "quantize_estimate", "plan_study"]


class PlannedCell(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    kind: str  # serving | reference | replay
    gpus: int
    output_tokens: int  # tokens the cell generates, at most
    estimate_s: float
    after: tuple[str, ...] = ()  # cells that must finish first


class Placement(BaseModel):
    model_config = ConfigDict(frozen=True)

    cell: str
    node: int
    gpus: tuple[int, ...]
    start_s: float
    end_s: float


class Schedule(BaseModel):
    model_config = ConfigDict(frozen=True)

    nodes: int
    gpus_per_node: int
    wall_s: float
    placements: list[Placement]


class QuantizeEstimate(BaseModel):
    model_config = ConfigDict(frozen=True)

    source_format: str  # bf16 | fp8
    source_bytes: int
    export_bytes: int
    encoded_weights: int
    io_s: float
    encode_s: float
    estimate_s: float


class StudyPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    recipe: str
    quantize: QuantizeEstimate | None = None  # None: the target's sizes are not known here
    cells: list[PlannedCell]  # longest first
    schedules: list[Schedule]  # one GPU, one node, the cluster

    @property
    def total_s(self) -> float:
        return sum(cell.estimate_s for cell in self.cells)


def study_cells(recipe: Recipe) -> list[PlannedCell]:
    """Every cell of the recipe's study with its estimated cost, longest first."""
    v, rates = recipe.validation, recipe.plan
    cells = []
    if "vllm" in v.backends:
        served = recipe.served
        out_tokens = rates.output_tokens_per_prompt or v.max_tokens
        scoring_s = len(served.workloads) * served.num_prompts * out_tokens / rates.prefill_tok_s
        for server in server_matrix(recipe):
            single = rates.tok_s[server.method] * (rates.mxfp4_speedup if server.precision == "mxfp4" else 1.0)
            serving = sum(served.num_prompts * out_tokens / (single * min(c, rates.batch_gain)) for c in v.concurrency)
            name = serving_cell_name(server.label)
            scoring = scoring_s if name == ar_cell_name("bf16") and measures_served_fidelity(recipe) else 0.0
            cells.append(PlannedCell(
                name=name, kind="serving", gpus=recipe.serving.tensor_parallel_size,
                output_tokens=len(served.workloads) * len(v.concurrency) * served.num_prompts * out_tokens,
                estimate_s=rates.server_start_s + len(served.workloads) * serving + scoring))
        if measures_served_fidelity(recipe):
            cells.append(PlannedCell(name=SCORE_CELL, kind="serving", gpus=recipe.serving.tensor_parallel_size,
                                     output_tokens=0, after=(ar_cell_name("bf16"),),
                                     estimate_s=rates.server_start_s + scoring_s))
    if v.replays_served_text:
        out_tokens = rates.output_tokens_per_prompt or v.max_tokens
        for spec in reference_cell_specs(v.precisions, v.workloads, along_served_text=True):
            cells.append(PlannedCell(name=spec.name, kind="replay", gpus=1, output_tokens=0, after=spec.after,
                                     estimate_s=v.num_prompts * out_tokens / rates.replay_tok_s[spec.precision]))
    if "reference" in v.backends:
        for spec in reference_cell_specs(v.precisions, v.workloads, along_served_text=False):
            cells.append(PlannedCell(
                name=spec.name, kind="reference", gpus=1, output_tokens=v.num_prompts * v.max_tokens, after=spec.after,
                estimate_s=v.num_prompts * v.max_tokens / rates.reference_tok_s[spec.precision]))
    return sorted(cells, key=lambda cell: -cell.estimate_s)


def schedule(cells: list[PlannedCell], nodes: int, gpus_per_node: int) -> Schedule:
    """Longest ready cell first, on the node whose GPUs free up earliest; a cell wider than a node is
    refused by the caller (`plan_study`)."""
    free = [[0.0] * gpus_per_node for _ in range(nodes)]  # when each GPU is next free
    done: dict[str, float] = {}
    placements = []
    waiting = sorted(cells, key=lambda c: -c.estimate_s)
    while waiting:
        cell = next(c for c in waiting if all(dep in done for dep in c.after))
        waiting.remove(cell)
        ready = max((done[dep] for dep in cell.after), default=0.0)
        best = None
        for node, gpu_free in enumerate(free):
            gpus = sorted(range(gpus_per_node), key=lambda g: gpu_free[g])[: cell.gpus]
            start = max(ready, *(gpu_free[g] for g in gpus))
            if best is None or start < best[0]:
                best = (start, node, gpus)
        start, node, gpus = best
        end = start + cell.estimate_s
        for g in gpus:
            free[node][g] = end
        done[cell.name] = end
        placements.append(Placement(cell=cell.name, node=node, gpus=tuple(sorted(gpus)), start_s=start, end_s=end))
    return Schedule(nodes=nodes, gpus_per_node=gpus_per_node, wall_s=max(done.values(), default=0.0),
                    placements=sorted(placements, key=lambda p: (p.node, p.gpus, p.start_s)))


def quantize_estimate(memory: MemoryPlan, rates: Plan) -> QuantizeEstimate:
    """The quantize stage's time from the target's sizes (`quant.memory`) and the [plan] rates."""
    io_s = (memory.source_bytes + memory.mxfp4_bytes) / (rates.storage_gb_s * 1e9)
    encode_s = memory.encoded_elements * rates.encode_ns_per_weight[memory.source_format] * 1e-9 / rates.quantize_cpus
    return QuantizeEstimate(source_format=memory.source_format, source_bytes=memory.source_bytes,
                            export_bytes=memory.mxfp4_bytes, encoded_weights=memory.encoded_elements,
                            io_s=io_s, encode_s=encode_s, estimate_s=io_s + encode_s)


def plan_study(recipe: Recipe, gpus_per_node: int = 8, nodes: int = 1, memory: MemoryPlan | None = None) -> StudyPlan:
    """The cells and their schedule on one GPU, on one node of `gpus_per_node`, and on `nodes` such nodes;
    with the target's `memory` plan, the quantize stage's estimate too."""
    from pipeline.errors import BadInputError

    cells = study_cells(recipe)
    widest = max((cell.gpus for cell in cells), default=1)
    if widest > gpus_per_node:
        raise BadInputError(f"a server needs {widest} GPUs (serving.tensor_parallel_size) but a node has "
                            f"{gpus_per_node}; pass --gpus {widest} or more")
    layouts = [(1, widest), (1, gpus_per_node), (nodes, gpus_per_node)]
    return StudyPlan(recipe=recipe.name, cells=cells,
                     quantize=quantize_estimate(memory, recipe.plan) if memory is not None else None,
                     schedules=[schedule(cells, n, g) for n, g in dict.fromkeys(layouts)])
