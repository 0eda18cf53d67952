"""Acceptance drift between the bf16 and the MXFP4 target, with a bootstrap confidence interval.

The unit of resampling is the prompt: both precisions ran the same prompts, so each bootstrap draw
picks prompts with replacement and recomputes both mean acceptance lengths from the pooled counts
(a paired ratio estimator). The same draws give an interval for the drop of each per-position
acceptance rate (bf16 minus MXFP4). This module measures; only the gate holds thresholds, and
`decide` is the one rule it uses to turn the interval of a drop into a verdict:
  pass          the whole interval of the drop lies at or below the threshold (within tolerance);
  fail          the whole interval lies above the threshold (the drop is significantly too large);
  inconclusive  the interval straddles the threshold (more prompts are needed to decide).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.speculative.acceptance import AcceptanceStats

__all__ = ["BOOTSTRAP_SAMPLES", "Drift", "drop_interval", "decide", "acceptance_drift", "prompt_bootstrap_ci",
    "pooled_ratio_ci", "paired_difference_ci"]

BOOTSTRAP_SAMPLES = 2000


@dataclass(frozen=True)
class Drift:
    delta: float  # mean AL (MXFP4) - mean AL (bf16)
    ci95: tuple[float, float]
    per_position_gap: list[float]  # |P_mxfp4(i) - P_bf16(i)|
    max_position_gap: float
    mean_position_gap: float
    position_drop_ci95: list[tuple[float, float]]  # interval of P_bf16(i) - P_mxfp4(i), per position
    num_prompts: int


def drop_interval(delta_ci95: tuple[float, float]) -> tuple[float, float]:
    """The interval of a drop (bf16 minus MXFP4) from the interval of a delta (MXFP4 minus bf16)."""
    low, high = delta_ci95
    return -high, -low


def decide(drop_ci95: tuple[float, float], threshold: float) -> str:
    """Verdict for a quantity whose increase is bad (a drop), from its 95% interval and its threshold."""
    low, high = drop_ci95
    if high <= threshold:
        return "pass"
    if low > threshold:
        return "fail"
    return "inconclusive"


def _pooled_al(drafts: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """AcceptanceStats.mean_acceptance_length, vectorised over bootstrap draws."""
    return 1.0 + accepted.sum(-1) / np.maximum(drafts.sum(-1), 1)


def acceptance_drift(bf16: list[AcceptanceStats], mxfp4: list[AcceptanceStats], seed: int = 0) -> Drift:
    """Drift from per-prompt stats (same prompts, same order, in both lists)."""
    if len(bf16) != len(mxfp4) or not bf16:
        raise ValueError("drift needs the same non-empty list of prompts for both precisions")
    base_drafts, base_at = _counts(bf16)
    quant_drafts, quant_at = _counts(mxfp4)
    delta = float(_pooled_al(quant_drafts, quant_at.sum(-1)) - _pooled_al(base_drafts, base_at.sum(-1)))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(bf16), size=(BOOTSTRAP_SAMPLES, len(bf16)))
    deltas = _pooled_al(quant_drafts[picks], quant_at[picks].sum(-1)) - _pooled_al(base_drafts[picks], base_at[picks].sum(-1))
    low, high = (float(x) for x in np.percentile(deltas, [2.5, 97.5]))
    position_drops = _pooled_rates(base_drafts[picks], base_at[picks]) - _pooled_rates(quant_drafts[picks], quant_at[picks])
    drop_lows, drop_highs = np.percentile(position_drops, [2.5, 97.5], axis=0)
    pooled_bf16, pooled_mxfp4 = AcceptanceStats.pooled(bf16), AcceptanceStats.pooled(mxfp4)
    gaps = [abs(a - b) for a, b in zip(pooled_mxfp4.per_position_acceptance, pooled_bf16.per_position_acceptance)]
    return Drift(delta, (low, high), gaps, max(gaps), float(np.mean(gaps)),
                 [(float(a), float(b)) for a, b in zip(drop_lows, drop_highs)], len(bf16))


def _counts(stats: list[AcceptanceStats]) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: drafts (n,) and accepted-at-position counts (n, positions)."""
    return (np.array([s.num_drafts for s in stats], dtype=float),
            np.array([s.accepted_at_position for s in stats], dtype=float))


def _pooled_rates(drafts: np.ndarray, accepted_at: np.ndarray) -> np.ndarray:
    """AcceptanceStats.per_position_acceptance, vectorised over bootstrap draws."""
    return accepted_at.sum(-2) / np.maximum(drafts.sum(-1), 1)[..., None]


def prompt_bootstrap_ci(stats: list[AcceptanceStats], seed: int = 0) -> tuple[float, float]:
    """95% interval of one precision's mean AL over prompts."""
    drafts = np.array([s.num_drafts for s in stats], dtype=float)
    accepted = np.array([s.accepted for s in stats], dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(stats), size=(BOOTSTRAP_SAMPLES, len(stats)))
    low, high = np.percentile(_pooled_al(drafts[picks], accepted[picks]), [2.5, 97.5])
    return float(low), float(high)


def pooled_ratio_ci(numerators: list[float], denominators: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval over prompts of sum(numerators) / sum(denominators) (e.g. agreements per token)."""
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(num), size=(BOOTSTRAP_SAMPLES, len(num)))
    low, high = np.percentile(num[picks].sum(-1) / np.maximum(den[picks].sum(-1), 1e-12), [2.5, 97.5])
    return float(low), float(high)


def paired_difference_ci(base: list[float], other: list[float], seed: int = 0) -> tuple[float, float]:
    """95% interval over prompts of mean(other) - mean(base), the prompts drawn together for both."""
    if len(base) != len(other) or not base:
        raise ValueError("a paired difference needs the same non-empty list of prompts on both sides")
    diff = np.asarray(other, dtype=float) - np.asarray(base, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(diff), size=(BOOTSTRAP_SAMPLES, len(diff)))
    low, high = np.percentile(diff[picks].mean(-1), [2.5, 97.5])
    return float(low), float(high)
