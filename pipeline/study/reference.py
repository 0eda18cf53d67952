"""The reference backend: DFlash (and MTP) acceptance replayed in plain PyTorch over the HF target.

For each workload and precision (bf16 / MXFP4) the target runs once over prompt + continuation for its
hidden states, and `speculative.replay.replay_pass` walks the steps a greedy speculative run takes at
every budget (identical to the online loop, which the tests keep as the cross-check). The continuation
is either the target's own greedy text, generated here (reference cells), or, in a study that serves
with vLLM alone, the greedy text the AR servers wrote (replay cells): then this path never generates,
it runs one target pass per text, on the accelerator when there is one. The MXFP4 cell also replays
along bf16's texts (same-text acceptance) and compares next-token distributions (fidelity)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from pipeline.recipe import Recipe
from pipeline.run.artifacts import read_artifact, write_artifact
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
    fingerprint,
    reference_cell_specs,
    run_cells,
)
from pipeline.study.fidelity import PromptFidelity, ReferenceDistribution, compare
from pipeline.study.targets import greedy_continuations, load_target, reference_device
from pipeline.study.workloads import Prompt

__all__ = ["ReferenceMeasurements", "ReferenceCellResult", "REFERENCE_CELL_VERSION", "TEXTS_FILE", "Text",
    "reference_cells", "measure_reference", "score_answer"]


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


def _served_texts(folder: Path, workload: str) -> list[Text]:
    from pipeline.study.served import ServingCellResult, served_texts

    cell = read_artifact(folder / RESULT_FILE, ServingCellResult, "run validate again")
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
    replays_mtp_head = "mtp" in v.methods and "vllm" in v.backends

    def mtp_head(precision: str):
        if not replays_mtp_head:
            return None
        if precision not in loaded:
            head = load_mtp_head(paths[precision])
            loaded[precision] = head.to(device) if head is not None else None
        return loaded[precision]

    common = {"version": REFERENCE_CELL_VERSION, "drafter": digests["drafter"], "budgets": list(v.budgets),
              "mtp": replays_mtp_head,
              "num_prompts": v.num_prompts, "max_tokens": v.max_tokens, "seed": v.seed, "source": v.prompt_source,
              "tools": {name: package_version(name) for name in ("torch", "transformers", "amd-quark")}}
    cells, prints = [], {}
    for spec in reference_cell_specs(v.precisions, prompts, along_served_text=served is not None):
        prints[spec.name] = fingerprint(cell=spec.name, target=digests[spec.precision], after=prints.get(spec.bf16_cell),
                                        text=served[spec.precision] if served else None, **common)
        items = prompts[spec.workload]

        def measure(work: CellWorkspace, spec=spec, items=items) -> None:
            drafter, tokenizer = tools()
            target = targets.get(paths[spec.precision], spec.precision, device)
            if spec.text_cell:
                texts = _served_texts(work.inputs[spec.text_cell], spec.workload)
            else:
                with work.timed(f"{spec.precision} own text"):
                    texts = greedy_continuations(target, tokenizer, items, v.max_tokens)
            bf16_texts = _read_texts(work.inputs[spec.bf16_cell]) if spec.bf16_cell else None
            result = _measure_reference_cell(_CellModels(target, drafter, mtp_head(spec.precision), tokenizer),
                                             spec.precision, spec.workload, items, texts, v, bf16_texts, work)
            write_artifact(result, work.out / RESULT_FILE)

        cells.append(Cell(spec.name, prints[spec.name], measure, after=spec.after, steps=len(items)))
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
