"""Quantize stage: the resolved target -> OUT/quantize/checkpoint, an MXFP4 export with AMD Quark that vLLM
loads (quant_method quark), verified bit for bit (`quant.export`, `quant.verify`), and
mxspec-quantize.json beside it: the mode, what was kept unquantized, the verification and the versions.
"""

from __future__ import annotations

import resource
from dataclasses import asdict
from pathlib import Path

from pipeline.run.artifacts import QuantizeReport, write_artifact
from pipeline.run.layout import CHECKPOINT, QUANTIZE_REPORT
from pipeline.run.runner import StageContext

__all__ = ["QuantizeStage"]


class QuantizeStage:
    name = "quantize"
    version = 5  # bump when the export's bytes change for the same inputs
    sections = ("quantization", "calibration")
    requires = ("resolve/target.json",)  # the target only: a drafter change never re-quantizes
    tools = ("amd-quark", "torch", "transformers", "safetensors")

    def external_inputs(self, ctx: StageContext) -> dict[str, Path]:
        return {}

    def run(self, ctx: StageContext, workdir: Path) -> dict[str, float]:
        from pipeline.quant.export import quantize_checkpoint  # torch and Quark: only once the stage runs
        from pipeline.run.versions import tool_versions
        from pipeline.stages.resolve import read_resolved

        target = read_resolved(ctx.stage_dir("resolve"))["target"]
        ctx.console.print(f"  quantizing {target.ref} to {ctx.recipe.quantization.scheme} with AMD Quark")
        summary = quantize_checkpoint(
            Path(target.path), workdir / CHECKPOINT, ctx.recipe.quantization, ctx.recipe.calibration, ctx.recipe.cluster,
            say=ctx.console.print,
        )
        report = QuantizeReport(target=target.ref, target_digest=target.digest, versions=tool_versions(),
                                **asdict(summary))
        write_artifact(report, workdir / QUANTIZE_REPORT)
        logits = report.verification.logits
        ctx.console.print(
            f"  {summary.quantized_layers} layers MXFP4 ({summary.mode}, {report.encoder.name} encoder on "
            f"{report.encoder.device}), {summary.excluded_layers} kept bf16; "
            f"bit-exact vs the OCP MX encoder"
            + (f"; top-1 agreement {logits.top1_agreement:.3f}, KL {logits.kl_bf16_to_mxfp4:.4f}" if logits else "")
        )
        # The process's peak so far: quantize is the run's first heavy stage, so this is its peak.
        return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
