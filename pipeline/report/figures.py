"""A validate report as PNG figures: acceptance vs budget, per-position acceptance and, when vLLM
served the pair, speedup over AR and the MXFP4 throughput lift."""

from __future__ import annotations

from pathlib import Path

from pipeline.report.markdown import config_label, throughput_lifts
from pipeline.run.artifacts import ServedRow, ValidateReport

__all__ = ["ACCEPTANCE_FIGURES", "SERVING_FIGURES", "FIGURES", "STYLES", "write_figures"]

ACCEPTANCE_FIGURES = ("acceptance_vs_budget.png", "per_position_acceptance.png", "same_text_acceptance.png")
SERVING_FIGURES = ("speedup.png", "throughput_lift.png")
FIGURES = ACCEPTANCE_FIGURES + SERVING_FIGURES
STYLES = {"bf16": "-", "mxfp4": "--"}  # line style per precision


def write_figures(report: ValidateReport, folder: Path) -> None:
    """The figures the report has data for, into `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report.serving:
        _serving_figures(report.serving, folder, plt)
    if report.cells:
        _acceptance_figures(report, folder, plt)


def _acceptance_figures(report: ValidateReport, folder: Path, plt) -> None:
    cells = report.cells
    workloads = list(dict.fromkeys(c.workload for c in cells))
    colors = {w: plt.get_cmap("tab10")(i) for i, w in enumerate(workloads)}

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for w in workloads:
        for precision, style in STYLES.items():
            points = sorted((c.budget, c.mean_acceptance_length) for c in cells if c.workload == w and c.precision == precision)
            if points:
                ax.plot(*zip(*points), style, marker="o", color=colors[w], label=f"{w} {precision}")
    ax.set(xlabel="budget (DFlash block size)", ylabel="mean acceptance length", title="Acceptance vs budget")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / ACCEPTANCE_FIGURES[0], dpi=120)
    plt.close(fig)

    budget = max(c.budget for c in cells)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in cells:
        if c.budget == budget:
            positions = range(1, len(c.per_position_acceptance) + 1)
            ax.plot(positions, c.per_position_acceptance, STYLES[c.precision], color=colors[c.workload],
                    label=f"{c.workload} {c.precision}")
    ax.set(xlabel="draft position i", ylabel="P(accept >= i)", ylim=(0, 1),
           title=f"Per-position acceptance, block {budget} (solid bf16, dashed MXFP4)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / ACCEPTANCE_FIGURES[1], dpi=120)
    plt.close(fig)
    if report.same_text_cells:
        _same_text_figure(report, folder, plt)


def _same_text_figure(report: ValidateReport, folder: Path, plt) -> None:
    """Per budget, bars per workload: bf16 and MXFP4 on their own texts, MXFP4 on bf16's text; the
    MXFP4 target's top-1 agreement with bf16 printed under each workload."""
    own = {(c.workload, c.precision, c.budget): c.mean_acceptance_length for c in report.cells}
    same = {(c.workload, c.budget): c.mean_acceptance_length for c in report.same_text_cells}
    budgets = sorted({b for _, b in same})
    workloads = list(dict.fromkeys(w for w, _ in same))
    agreement = {f.workload: f.top1_agreement for f in report.fidelity}
    series = (("bf16, own text", lambda w, b: own.get((w, "bf16", b))), ("MXFP4, own text", lambda w, b: own.get((w, "mxfp4", b))),
              ("MXFP4, bf16's text", lambda w, b: same.get((w, b))))
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for k, (label, value) in enumerate(series):
            ax.bar([i + k * 0.27 for i in range(len(workloads))], [value(w, budget) or 0 for w in workloads], 0.27,
                   label=label, color=plt.get_cmap("tab10")(k), hatch="//" if k == 2 else None)
        ax.set_xticks([i + 0.27 for i in range(len(workloads))],
                      [f"{w}\ntop-1 {agreement[w]:.2f}" if w in agreement else w for w in workloads], fontsize=7)
        ax.set(ylabel="mean acceptance length", title=f"Block {budget}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Own text vs the same (bf16) text: text drift or drafter/target alignment", fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / ACCEPTANCE_FIGURES[2], dpi=120)
    plt.close(fig)


def _serving_figures(rows: list[ServedRow], folder: Path, plt) -> None:
    """Speedup bars per workload and config, one panel per concurrency (MXFP4 hatched); the MXFP4
    throughput lift over bf16."""
    concurrencies = sorted({r.concurrency for r in rows})
    configs = [c for c in dict.fromkeys(config_label(r) for r in rows) if c != "AR"]
    workloads = list(dict.fromkeys(r.workload for r in rows))
    precisions = list(dict.fromkeys(r.precision for r in rows))
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(6.5 * len(concurrencies), 4), squeeze=False)
    width = 0.8 / max(1, len(configs) * len(precisions))
    for ax, concurrency in zip(axes[0], concurrencies):
        for k, (config, precision) in enumerate((c, p) for c in configs for p in precisions):
            values = [next((r.speedup for r in rows if r.workload == w and config_label(r) == config
                            and r.precision == precision and r.concurrency == concurrency), 0) or 0 for w in workloads]
            ax.bar([i + k * width for i in range(len(workloads))], values, width, label=f"{config} {precision}",
                   color=plt.get_cmap("tab10")(configs.index(config)), hatch="//" if precision == "mxfp4" else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(configs) * len(precisions) - 1) / 2 for i in range(len(workloads))], workloads)
        ax.set(ylabel="speedup over AR", title=f"Concurrency {concurrency}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / SERVING_FIGURES[0], dpi=120)
    plt.close(fig)
    lifts = throughput_lifts(rows)
    if lifts:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        labels = [f"{x.workload}\n{x.config} c={x.concurrency}" for x in lifts]
        ax.bar(range(len(lifts)), [100 * x.lift for x in lifts], color="tab:orange")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(lifts)), labels, fontsize=6, rotation=45, ha="right")
        ax.set(ylabel="MXFP4 throughput lift over bf16 (%)", title="MXFP4 vs bf16 target, same drafter")
        fig.tight_layout()
        fig.savefig(folder / SERVING_FIGURES[1], dpi=120)
        plt.close(fig)
