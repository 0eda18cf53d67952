"""Fidelity of the MXFP4 target on bf16's text: top-1 agreement, and KL kept as bf16's top-K plus the rest."""

from __future__ import annotations

import pytest
import torch

from pipeline.study.fidelity import ReferenceDistribution, compare, kl_per_position


def logprobs(seed: int, positions: int = 12, vocab: int = 50, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(positions, vocab, generator=generator), dim=-1)


def test_a_target_compared_with_itself_agrees_everywhere_with_zero_kl():
    bf16 = logprobs(0)
    result = compare(ReferenceDistribution.of(bf16, k=8), bf16)
    assert result.positions == 12 and result.agreements == 12
    assert result.kl_sum == pytest.approx(0, abs=1e-5)


def test_with_k_covering_the_vocabulary_the_kl_is_the_full_kl():
    bf16, mxfp4 = logprobs(0), logprobs(1)
    full = (bf16.exp() * (bf16 - mxfp4)).sum(-1)
    assert torch.allclose(kl_per_position(ReferenceDistribution.of(bf16, k=50), mxfp4), full, atol=1e-5)


def test_a_smaller_k_gives_a_lower_bound_that_tightens_as_k_grows():
    bf16, mxfp4 = logprobs(0), logprobs(1)
    full = (bf16.exp() * (bf16 - mxfp4)).sum(-1)
    bounds = [kl_per_position(ReferenceDistribution.of(bf16, k=k), mxfp4) for k in (1, 4, 16, 50)]
    assert all((b <= full + 1e-5).all() for b in bounds)
    assert bounds[0].sum() <= bounds[1].sum() + 1e-5 <= bounds[2].sum() + 2e-5 <= bounds[3].sum() + 3e-5


def test_agreement_counts_positions_where_the_greedy_tokens_match():
    bf16 = logprobs(0)
    other = bf16.clone()
    flipped = [1, 5, 7]
    for i in flipped:  # make another token the most likely one at three positions
        other[i, (bf16[i].argmax() + 1) % 50] = bf16[i].max() + 1
    assert compare(ReferenceDistribution.of(bf16), other).agreements == 12 - len(flipped)


def test_positions_must_line_up():
    with pytest.raises(ValueError, match="positions"):
        compare(ReferenceDistribution.of(logprobs(0)), logprobs(1, positions=11))


def test_served_fidelity_is_the_reference_formula_when_the_mxfp4_server_returns_every_token():
    """`compare_served` over dicts (vLLM's prompt_logprobs) equals `compare` over tensors when the MXFP4
    side is known for all of bf16's top-k; with only the MXFP4 server's own top-k it is a lower bound."""
    from pipeline.study.fidelity import compare_served

    generator = torch.Generator().manual_seed(3)
    p = torch.log_softmax(torch.randn(12, 30, generator=generator) * 2, -1)
    q = torch.log_softmax(p + torch.randn(12, 30, generator=generator), -1)
    reference = ReferenceDistribution.of(p, k=20)
    as_dicts = [{int(t): float(v) for t, v in zip(ids, lps)} for ids, lps in zip(reference.ids, reference.logprobs)]
    full = [{t: float(v) for t, v in enumerate(row)} for row in q]
    exact, served = compare(reference, q), compare_served(as_dicts, full)
    assert served.agreements == exact.agreements and served.positions == 12
    assert served.kl_sum == pytest.approx(exact.kl_sum, rel=1e-5)
    top = [{int(t): float(row[t]) for t in row.topk(20).indices} for row in q]
    assert compare_served(as_dicts, top).kl_sum <= exact.kl_sum + 1e-6
    assert compare_served(as_dicts, top).agreements == exact.agreements
