"""The acceptance formulas, and their invariants: 1 <= AL <= B, non-increasing curve, AL = 1 + sum."""

from __future__ import annotations

import random

import pytest

from pipeline.speculative.acceptance import VLLM_ACCEPTED_PER_POS, VLLM_DRAFTS, AcceptanceStats


def test_from_lengths_counts_the_bonus_token():
    stats = AcceptanceStats.from_lengths([1, 4, 2, 4], block_size=4)
    assert stats.num_drafts == 4 and stats.accepted == 0 + 3 + 1 + 3
    assert stats.mean_acceptance_length == pytest.approx(11 / 4)
    assert stats.per_position_acceptance == [3 / 4, 2 / 4, 2 / 4]


@pytest.mark.parametrize("seed", range(5))
def test_invariants_hold_for_any_run(seed):
    rng = random.Random(seed)
    block = rng.choice([4, 8, 16])
    stats = AcceptanceStats.from_lengths([rng.randint(1, block) for _ in range(200)], block)
    curve = stats.per_position_acceptance
    assert 1 <= stats.mean_acceptance_length <= block
    assert all(a >= b for a, b in zip(curve, curve[1:]))
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(curve))


def test_lengths_outside_the_block_are_rejected():
    with pytest.raises(ValueError):
        AcceptanceStats.from_lengths([5], block_size=4)
    with pytest.raises(ValueError):
        AcceptanceStats.from_lengths([0], block_size=4)


def test_from_vllm_counter_deltas():
    before = {(VLLM_DRAFTS, (("engine", "0"),)): 10.0}
    after = {(VLLM_DRAFTS, (("engine", "0"),)): 14.0}
    for pos, (b, a) in enumerate([(8, 12), (5, 7), (1, 2)]):
        before[(VLLM_ACCEPTED_PER_POS, (("engine", "0"), ("position", str(pos))))] = b
        after[(VLLM_ACCEPTED_PER_POS, (("engine", "0"), ("position", str(pos))))] = a
    stats = AcceptanceStats.from_vllm_metrics(before, after, num_speculative_tokens=3)
    assert stats.num_drafts == 4 and stats.accepted_at_position == (4, 2, 1)
    assert stats.mean_acceptance_length == pytest.approx(1 + 7 / 4)


def test_a_per_request_histogram_counts_as_the_same_steps_would():
    """vLLM's `acceptance_histogram[j]` = steps that accepted exactly j drafts: lengths 1, 4, 2, 4 at B=4."""
    metrics = {"acceptance_histogram": [1, 1, 0, 2], "num_spec_steps": 4, "num_accepted_draft_tokens": 7}
    assert AcceptanceStats.from_vllm_request(metrics, 3) == AcceptanceStats.from_lengths([1, 4, 2, 4], 4)
    with pytest.raises(ValueError, match="4 bins for 7 speculative tokens"):
        AcceptanceStats.from_vllm_request(metrics, 7)


def test_merge_adds_counts():
    a = AcceptanceStats.from_lengths([2, 3], 4)
    b = AcceptanceStats.from_lengths([1], 4)
    assert a.merged(b) == AcceptanceStats.from_lengths([2, 3, 1], 4)
