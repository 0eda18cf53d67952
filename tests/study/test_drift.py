"""Drift statistics: the delta, its bootstrap interval over prompts, and the three-way rule the gate applies."""

from __future__ import annotations

import random

import pytest

from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.study.drift import acceptance_drift, decide, drop_interval


def prompts(mean_accept: float, n: int, seed: int, block: int = 8, steps: int = 40) -> list[AcceptanceStats]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lengths = [min(block, 1 + sum(rng.random() < mean_accept for _ in range(block - 1))) for _ in range(steps)]
        out.append(AcceptanceStats.from_lengths(lengths, block))
    return out


def test_identical_runs_pass_with_a_zero_interval():
    same = prompts(0.5, 20, seed=1)
    drift = acceptance_drift(same, same)
    assert drift.delta == 0 and drift.ci95 == (0.0, 0.0) and decide(drop_interval(drift.ci95), 0.2) == "pass"
    assert drift.max_position_gap == 0


def test_a_large_drop_on_many_prompts_fails():
    drift = acceptance_drift(prompts(0.7, 60, seed=1), prompts(0.3, 60, seed=2))
    assert drift.delta < -1 and drift.ci95[1] < -0.2 and decide(drop_interval(drift.ci95), 0.2) == "fail"
    assert drift.max_position_gap > 0.2


def test_few_noisy_prompts_near_the_threshold_are_inconclusive():
    drift = acceptance_drift(prompts(0.55, 4, seed=3, steps=5), prompts(0.5, 4, seed=40, steps=5))
    assert drift.ci95[0] < -0.1 < drift.ci95[1] and decide(drop_interval(drift.ci95), 0.1) == "inconclusive"


def test_the_interval_contains_the_estimate_and_is_seeded():
    a, b = prompts(0.6, 30, seed=5), prompts(0.55, 30, seed=6)
    first, second = acceptance_drift(a, b, seed=0), acceptance_drift(a, b, seed=0)
    assert first == second and first.ci95[0] <= first.delta <= first.ci95[1]


def test_lists_must_pair_up():
    with pytest.raises(ValueError):
        acceptance_drift(prompts(0.5, 3, 1), prompts(0.5, 2, 1))


def test_decide_compares_the_interval_of_a_drop_with_its_threshold():
    assert decide((-0.3, 0.1), 0.2) == "pass"
    assert decide((0.25, 0.4), 0.2) == "fail"
    assert decide((0.1, 0.3), 0.2) == "inconclusive"
    assert drop_interval((-0.4, 0.1)) == (-0.1, 0.4)


def test_per_position_drop_intervals_cover_the_observed_drop():
    base, quant = prompts(0.7, 40, seed=1), prompts(0.4, 40, seed=2)
    drift = acceptance_drift(base, quant)
    observed = [a - b for a, b in zip(AcceptanceStats.pooled(base).per_position_acceptance,
                                      AcceptanceStats.pooled(quant).per_position_acceptance)]
    assert len(drift.position_drop_ci95) == 7
    for (low, high), drop in zip(drift.position_drop_ci95, observed):
        assert low <= drop <= high
    largest = max(range(7), key=lambda i: observed[i])
    assert observed[largest] > 0.2 and drift.position_drop_ci95[largest][0] > 0.1  # significant on 40 prompts
    same = acceptance_drift(base, base)
    assert all(ci == (0.0, 0.0) for ci in same.position_drop_ci95)


def test_pooled_ratio_interval_weights_prompts_by_their_tokens():
    from pipeline.study.drift import pooled_ratio_ci

    low, high = pooled_ratio_ci([9, 1, 50], [10, 10, 50], seed=0)  # pooled 60/70
    assert low <= 60 / 70 <= high and 0 < low and high <= 1
    assert pooled_ratio_ci([5, 5], [10, 10]) == (0.5, 0.5)


def test_paired_difference_interval_is_zero_for_identical_sides_and_shifts_with_them():
    from pipeline.study.drift import paired_difference_ci

    assert paired_difference_ci([1, 0, 1, 1], [1, 0, 1, 1]) == (0.0, 0.0)
    low, high = paired_difference_ci([1] * 20, [0] * 5 + [1] * 15)
    assert high <= 0 and low < high
    with pytest.raises(ValueError):
        paired_difference_ci([1, 0], [1])
