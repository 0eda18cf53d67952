"""Acceptance drift between the bf16 and the MXFP4 target, with a bootstrap confidence interval.

The unit of resampling is the prompt: both precisions ran the same prompts, so each bootstrap draw
picks prompts with replacement and recomputes both mean acceptance lengths from the pooled counts
(a paired ratio estimator). The verdict compares the interval with the tolerated drop:
  pass          the whole interval lies above -threshold (any drop is within tolerance);
  fail          the whole interval lies below -threshold (the drop is significantly too large);
  inconclusive  the interval straddles -threshold (more prompts are needed to decide).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.acceptance import AcceptanceStats

BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Drift:
    delta: float  # mean AL (MXFP4) - mean AL (bf16)
    ci95: tuple[float, float]
    per_position_gap: list[float]  # |P_mxfp4(i) - P_bf16(i)|
    max_position_gap: float
    mean_position_gap: float
    num_prompts: int
    verdict: str  # pass | fail | inconclusive


def _pooled_al(drafts: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """AcceptanceStats.mean_acceptance_length, vectorised over bootstrap draws."""
    return 1.0 + accepted.sum(-1) / np.maximum(drafts.sum(-1), 1)


def acceptance_drift(
    bf16: list[AcceptanceStats], mxfp4: list[AcceptanceStats], max_drop: float, seed: int = 0
) -> Drift:
    """Drift from per-prompt stats (same prompts, same order, in both lists)."""
    if len(bf16) != len(mxfp4) or not bf16:
        raise ValueError("drift needs the same non-empty list of prompts for both precisions")
    base_drafts = np.array([s.num_drafts for s in bf16], dtype=float)
    base_accepted = np.array([s.accepted for s in bf16], dtype=float)
    quant_drafts = np.array([s.num_drafts for s in mxfp4], dtype=float)
    quant_accepted = np.array([s.accepted for s in mxfp4], dtype=float)
    delta = float(_pooled_al(quant_drafts, quant_accepted) - _pooled_al(base_drafts, base_accepted))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(bf16), size=(BOOTSTRAP_SAMPLES, len(bf16)))
    deltas = _pooled_al(quant_drafts[picks], quant_accepted[picks]) - _pooled_al(base_drafts[picks], base_accepted[picks])
    low, high = (float(x) for x in np.percentile(deltas, [2.5, 97.5]))
    pooled_bf16, pooled_mxfp4 = AcceptanceStats.pooled(bf16), AcceptanceStats.pooled(mxfp4)
    gaps = [abs(a - b) for a, b in zip(pooled_mxfp4.per_position_acceptance, pooled_bf16.per_position_acceptance)]
    if low >= -max_drop:
        verdict = "pass"
    elif high < -max_drop:
        verdict = "fail"
    else:
        verdict = "inconclusive"
    return Drift(delta, (low, high), gaps, max(gaps), float(np.mean(gaps)), len(bf16), verdict)


def prompt_bootstrap_ci(stats: list[AcceptanceStats], seed: int = 0) -> tuple[float, float]:
    """95% interval of one precision's mean AL over prompts."""
    drafts = np.array([s.num_drafts for s in stats], dtype=float)
    accepted = np.array([s.accepted for s in stats], dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(stats), size=(BOOTSTRAP_SAMPLES, len(stats)))
    low, high = np.percentile(_pooled_al(drafts[picks], accepted[picks]), [2.5, 97.5])
    return float(low), float(high)
