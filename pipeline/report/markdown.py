"""A validate report as Markdown for people: the blog's acceptance and serving tables.

Torch-free, so the card (and anything else that renders a finished report) can use it without loading
the measuring code.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.run.artifacts import ServedRow, ValidateReport

__all__ = ["ThroughputLift", "config_label", "report_markdown", "acceptance_tables", "same_text_tables",
    "served_subset_line", "serving_tables", "speed_accounting_table", "throughput_lifts"]


@dataclass(frozen=True)
class ThroughputLift:
    """MXFP4 over bf16 throughput of one served configuration."""

    workload: str
    config: str
    concurrency: int
    bf16_tok_s: float
    mxfp4_tok_s: float

    @property
    def lift(self) -> float:
        return self.mxfp4_tok_s / self.bf16_tok_s - 1


def config_label(row: ServedRow) -> str:
    """"AR", or the speculative method with its block size, e.g. "DFLASH B=8"."""
    return row.method.upper() if row.method == "ar" else f"{row.method.upper()} B={row.budget}"


def report_markdown(report: ValidateReport) -> str:
    """report.md: what was measured, the acceptance tables with their intervals, the serving tables, versions."""
    s = report.settings
    lines = [f"# Validation report: {report.recipe}", "",
             (f"Backend `{report.backend}`; target `{report.target}`; drafter `{report.drafter}` (unchanged); "
             f"{s.num_prompts} prompts per workload, max {s.max_tokens} tokens, "
             "greedy. Mean acceptance length counts the bonus token."), "",
             f"Prompts ({s.prompt_source}):", "", *(f"- {w}: {where}" for w, where in s.prompt_sets.items()), "",
             *acceptance_tables(report)]
    if report.drift:
        lines += ["", "Measurements only: the gate (`gate/summary.md`) judges these intervals against the recipe's "
                  "thresholds.", "", "![acceptance vs budget](acceptance_vs_budget.png)", "",
                  "![per-position acceptance](per_position_acceptance.png)"]
        if report.same_text_cells:
            lines += ["", "![own text vs same text](same_text_acceptance.png)"]
    if report.serving:
        lines += ["", served_subset_line(report), *serving_tables(report.serving)]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(report.versions.items())), ""]
    return "\n".join(lines)


def acceptance_tables(report: ValidateReport) -> list[str]:
    """AL by budget, and bf16 vs MXFP4 with the delta, as Markdown lines."""
    cells = {(c.workload, c.precision, c.budget): c for c in report.cells}
    budgets = sorted({c.budget for c in report.cells})
    precisions = [p for p in ("bf16", "mxfp4") if any(c.precision == p for c in report.cells)]
    workloads = list(dict.fromkeys(c.workload for c in report.cells))
    lines = ["## Acceptance length by budget (DFlash)", "",
             "| Workload | " + " | ".join(f"{p} block={b}" for b in budgets for p in precisions) + " |",
             "|---|" + "---|" * (len(budgets) * len(precisions))]
    for w in workloads:
        row = [f"{cells[(w, p, b)].mean_acceptance_length:.3f}" if (w, p, b) in cells else "-"
               for b in budgets for p in precisions]
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    if report.drift:
        lines += ["", "## bf16 vs MXFP4 target (same drafter)", "",
                  "| Workload | Block | bf16 | MXFP4 | Δ | 95% CI | max per-position gap |",
                  "|---|---|---|---|---|---|---|"]
        for d in report.drift:
            base, quant = cells[(d.workload, "bf16", d.budget)], cells[(d.workload, "mxfp4", d.budget)]
            lines.append(
                f"| {d.workload} | {d.budget} | {base.mean_acceptance_length:.3f} | "
                f"{quant.mean_acceptance_length:.3f} | {d.delta:+.3f} | [{d.ci95[0]:+.3f}, {d.ci95[1]:+.3f}] | "
                f"{d.max_position_gap:.3f} |")
    return lines + same_text_tables(report)


def same_text_tables(report: ValidateReport) -> list[str]:
    """Own-text against same-text acceptance, the MXFP4 target's fidelity, and task accuracy."""
    lines = []
    cells = {(c.workload, c.precision, c.budget): c for c in report.cells}
    same = {(c.workload, c.budget): c for c in report.same_text_cells}
    if report.same_text_drift:
        lines += ["", "## Text drift or alignment: MXFP4 on bf16's own text", "",
                  ("Own text: each precision's drafter acceptance on its own greedy continuation (what a user gets). "
                   "Same text: the MXFP4 target verifies the drafter along bf16's continuation (teacher forced), so "
                   "a damaged target whose text became easier to draft cannot look better here."
                   + (" bf16's continuation is the text the bf16 AR server wrote; the reference path replayed "
                      "both targets along it." if report.reference_text == "served" else "")), "",
                  "| Workload | Block | bf16 own | MXFP4 own | MXFP4 on bf16 text | own Δ | same-text Δ | same-text 95% CI |",
                  "|---|---|---|---|---|---|---|---|"]
        own = {(d.workload, d.budget): d for d in report.drift}
        for d in report.same_text_drift:
            base, quant = cells[(d.workload, "bf16", d.budget)], cells.get((d.workload, "mxfp4", d.budget))
            own_delta = own.get((d.workload, d.budget))
            lines.append(
                f"| {d.workload} | {d.budget} | {base.mean_acceptance_length:.3f} | "
                f"{'-' if quant is None else f'{quant.mean_acceptance_length:.3f}'} | "
                f"{same[(d.workload, d.budget)].mean_acceptance_length:.3f} | "
                f"{'-' if own_delta is None else f'{own_delta.delta:+.3f}'} | {d.delta:+.3f} | "
                f"[{d.ci95[0]:+.3f}, {d.ci95[1]:+.3f}] |")
    if report.fidelity:
        lines += ["", "## MXFP4 target fidelity on bf16's text", "",
                  ("Both targets read bf16's greedy text, teacher forced. Measured by: `vllm` = the AR servers' own "
                   "kernels (prompt_logprobs of the bf16 and the MXFP4 server), `reference` = the reference path "
                   "(PyTorch; the MXFP4 checkpoint through Quark's importer)."), "",
                  "| Workload | measured by | prompts | positions | top-1 agreement | 95% CI | KL(bf16 ‖ MXFP4), nats | 95% CI | top-k |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for f in report.fidelity:
            lines.append(f"| {f.workload} | {f.measured_by} | {f.num_prompts} | {f.num_positions} | {f.top1_agreement:.3f} | "
                         f"[{f.top1_agreement_ci95[0]:.3f}, {f.top1_agreement_ci95[1]:.3f}] | {f.kl:.3f} | "
                         f"[{f.kl_ci95[0]:.3f}, {f.kl_ci95[1]:.3f}] | {f.kl_top_k} |")
        lines += ["", ("KL keeps bf16's top-k tokens (those the MXFP4 side also reports, through vLLM) and merges the "
                       "rest into one outcome: a lower bound of the full KL.")]
    if report.mtp_drift or report.mtp_same_text_drift:
        lines += ["", "## MTP head: bf16 vs the MXFP4 checkpoint's", "",
                  ("Served: each precision's MTP server at concurrency 1, on its own text. Same text: the MXFP4 "
                   "checkpoint's head (unquantized) replayed along bf16's text with the MXFP4 target verifying, "
                   "against bf16's head on its own."), "",
                  "| Workload | measured | steps + 1 | Δ mean AL | 95% CI | max per-position gap | prompts |",
                  "|---|---|---|---|---|---|---|"]
        for how, rows in (("served", report.mtp_drift), ("same text", report.mtp_same_text_drift)):
            for d in rows:
                lines.append(f"| {d.workload} | {how} | {d.budget} | {d.delta:+.3f} | [{d.ci95[0]:+.3f}, {d.ci95[1]:+.3f}] | "
                             f"{d.max_position_gap:.3f} | {d.num_prompts} |")
    batched = any(r.concurrency > 1 and r.method != "ar" for r in report.serving or [])
    if batched:
        lines += ["", "## Served acceptance above concurrency 1, paired by prompt", ""]
        if not report.per_request_acceptance:
            lines.append("This vLLM reports no per-request acceptance: above concurrency 1 served acceptance comes from "
                         "the server's counters, pooled over prompts, with no paired interval.")
        else:
            lines += ["From vLLM's per-request metrics (`metrics.speculative_decoding`), MXFP4 minus bf16.", "",
                      "| Workload | method | block | concurrency | Δ mean AL | 95% CI | max per-position gap | prompts |",
                      "|---|---|---|---|---|---|---|---|"]
            for d in report.served_drift:
                lines.append(f"| {d.workload} | {d.method} | {d.budget} | {d.concurrency} | {d.delta:+.3f} | "
                             f"[{d.ci95[0]:+.3f}, {d.ci95[1]:+.3f}] | {d.max_position_gap:.3f} | {d.num_prompts} |")
    if report.accuracy:
        lines += ["", "## Task accuracy (answers checked without running code)", "",
                  "| Workload | bf16 | MXFP4 | Δ | 95% CI (paired) | finished bf16 / MXFP4 | note |", "|---|---|---|---|---|---|---|"]
        for a in report.accuracy:
            delta = "-" if a.delta is None else f"{a.delta:+.3f}"
            ci = "-" if a.delta_ci95 is None else f"[{a.delta_ci95[0]:+.3f}, {a.delta_ci95[1]:+.3f}]"
            lines.append(f"| {a.workload} | {a.accuracy['bf16']:.3f} | {a.accuracy['mxfp4']:.3f} | {delta} | {ci} | "
                         f"{a.finished['bf16']} / {a.finished['mxfp4']} of {a.num_prompts} | {a.note} |")
    return lines


def served_subset_line(report: ValidateReport) -> str:
    """What vLLM served, and how: the serving tables may cover a subset of the acceptance tables."""
    s, rows = report.settings, report.serving
    workloads = list(dict.fromkeys(r.workload for r in rows))
    prompts = " or ".join(map(str, sorted({r.num_prompts for r in rows})))
    line = f"vLLM served {', '.join(workloads)}, " + (
        f"{prompts} prompts per workload." if prompts == str(s.num_prompts) else
        f"the first {prompts} of the {s.num_prompts} prompts per workload above.")
    if s.enforce_eager:
        line += (" Servers ran eager (`--enforce-eager`, no torch.compile): they start sooner and step more slowly "
                 "than compiled servers.")
    return line + "\n"


def serving_tables(rows: list[ServedRow]) -> list[str]:
    """Speedup over AR per workload and config (best in bold), served vs measured acceptance, and the
    MXFP4 throughput lift over bf16."""
    lines = []
    for precision in dict.fromkeys(r.precision for r in rows):
        for concurrency in sorted({r.concurrency for r in rows}):
            subset = [r for r in rows if r.precision == precision and r.concurrency == concurrency]
            configs = list(dict.fromkeys(config_label(r) for r in subset))
            lines += [f"## Throughput speedup over AR, {precision} target, concurrency {concurrency} (vLLM)", "",
                      "| Workload | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
            for workload in dict.fromkeys(r.workload for r in subset):
                by_config = {config_label(r): r for r in subset if r.workload == workload}
                best = max(((r.speedup or 0) for c, r in by_config.items() if c != "AR"), default=None)  # bold: fastest speculative
                cells = []
                for config in configs:
                    r = by_config.get(config)
                    text = "-" if r is None or r.speedup is None else f"{r.speedup:.2f}x ({r.throughput_tok_s:.1f} tok/s)"
                    cells.append(f"**{text}**" if r is not None and config != "AR" and r.speedup == best else text)
                lines.append(f"| {workload} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += speed_accounting_table(rows)
    served = [r for r in rows if r.method != "ar" and r.concurrency == min(x.concurrency for x in rows)]
    if served:
        lines += ["## Served vs measured acceptance length (same prompts)", "",
                  "| Workload | Target | Method | Block | served AL (vLLM /metrics) | measured AL (acceptance backend) "
                  "| greedy tokens = AR |", "|---|---|---|---|---|---|---|"]
        for r in served:
            measured = r.acceptance_length_measured
            same = "-" if r.identical_to_ar is None else f"{r.identical_to_ar:.0%}"
            served_al = "-" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.3f}"
            lines.append(f"| {r.workload} | {r.precision} | {r.method.upper()} | {r.budget} | {served_al} | "
                         f"{'-' if measured is None else f'{measured:.3f}'} | {same} |")
        lines += ["", ("Served AL can sit slightly above measured AL on the same text: vLLM counts a request's final "
                  "drafts accepted past `max_tokens` or the stop token, the acceptance backend counts only the tokens "
                  "kept. Where the texts differ (near-ties on a quantized target) the two measure different "
                  "continuations."), ""]
    lifts = throughput_lifts(rows)
    if lifts:
        lines += ["## MXFP4 throughput over bf16 (same drafter)", "",
                  "| Workload | Config | Concurrency | bf16 tok/s | MXFP4 tok/s | lift |", "|---|---|---|---|---|---|"]
        for lift in lifts:
            lines.append(f"| {lift.workload} | {lift.config} | {lift.concurrency} | {lift.bf16_tok_s:.1f} | "
                         f"{lift.mxfp4_tok_s:.1f} | {lift.lift:+.1%} |")
        lines.append("")
    return lines


def speed_accounting_table(rows: list[ServedRow]) -> list[str]:
    """Where the speed went: speedup / AL and the weight bandwidth each served row achieved."""
    accounted = [r for r in rows if r.weight_bandwidth_gb_s is not None]
    if not accounted:
        return []
    lines = ["## Where the speed went (vLLM)", "",
             "| Workload | Target | Config | Concurrency | speedup | served AL | speedup / AL | weights read, GB/s | of peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in accounted:
        def num(x, fmt):
            return "-" if x is None else format(x, fmt)
        lines.append(f"| {r.workload} | {r.precision} | {config_label(r)} | {r.concurrency} | {num(r.speedup, '.2f')} | "
                     f"{num(r.mean_acceptance_length, '.3f')} | {num(r.speedup_over_al, '.2f')} | "
                     f"{r.weight_bandwidth_gb_s:.1f} | {num(r.bandwidth_share, '.1%')} |")
    return lines + ["", ("speedup / AL is the share of accepted tokens turned into speed (1.0: a speculative step costs "
                         "an AR step). Weights read = checkpoint weight bytes x target steps per second, full batches "
                         "assumed; an MoE step reads only its routed experts."), ""]


def throughput_lifts(rows: list[ServedRow]) -> list[ThroughputLift]:
    """One per (workload, config, concurrency) served at both precisions."""
    by_key = {(r.workload, config_label(r), r.concurrency, r.precision): r.throughput_tok_s for r in rows}
    return [ThroughputLift(workload, config, concurrency, bf16, mxfp4)
            for (workload, config, concurrency, precision), mxfp4 in by_key.items()
            if precision == "mxfp4" and (bf16 := by_key.get((workload, config, concurrency, "bf16")))]
