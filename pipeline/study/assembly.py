"""The validate report assembled from what the cells measured: acceptance cells and drift rows with
their intervals, same-text and fidelity rows, accuracy, served rows. Measurements only: the gate
judges them."""

from __future__ import annotations

from dataclasses import asdict

from pipeline.recipe import Recipe
from pipeline.run.artifacts import (
    AcceptanceCell,
    AccuracyRow,
    DriftRow,
    FidelityRow,
    ReportSettings,
    ServedRow,
    ValidateReport,
)
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.study.drift import acceptance_drift, paired_difference_ci, pooled_ratio_ci, prompt_bootstrap_ci
from pipeline.study.fidelity import SERVED_TOP_K, TOP_K, PromptFidelity
from pipeline.study.reference import ReferenceMeasurements
from pipeline.study.workloads import describe_source

__all__ = ["report_settings", "build_report", "served_rows"]


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


def served_rows(serving, reference: ReferenceMeasurements | None) -> list[ServedRow]:
    """Serving rows, each DFlash or MTP row with the reference path's AL on the same prompts beside it
    (the first `num_prompts` of them, when vLLM serves a subset)."""
    def measured(row: ServedRow) -> float | None:
        if reference is None:
            return None
        source = {"dflash": reference.own_text, "mtp": reference.mtp_own_text}.get(row.method, {})
        stats = source.get((row.workload, row.precision, row.budget), [])[: row.num_prompts]
        return AcceptanceStats.pooled(stats).mean_acceptance_length if stats else None

    return [row.model_copy(update={"acceptance_length_measured": measured(row)}) for row in serving.rows]
