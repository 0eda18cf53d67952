"""How far the MXFP4 target's next-token distribution moved from bf16's, on the same text.

Measured at every continuation position of the bf16 target's greedy text, teacher forced (both
targets read the same tokens): top-1 agreement (the MXFP4 target's greedy token equals bf16's) and
KL(bf16 || MXFP4) in nats. The bf16 distribution is kept as its top-K tokens plus one bucket for all
the others, so a long run never holds vocabulary-sized rows; the KL over that partition is a lower
bound of the full KL (merging outcomes never increases KL) and equals it when K covers the vocabulary.

Through vLLM (`compare_served`) both targets score the same text with `prompt_logprobs`, which returns
each server's own top-k (plus the token actually there). The partition is then bf16's top-k tokens
whose MXFP4 log-probability the MXFP4 server returned, plus one bucket for all the others: again a
lower bound of the full KL, measured by the kernels that serve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

__all__ = ["TOP_K", "SERVED_TOP_K", "ReferenceDistribution", "PromptFidelity", "compare", "kl_per_position",
    "compare_served"]

if TYPE_CHECKING:
    import torch

TOP_K = 64
SERVED_TOP_K = 20  # vLLM's default --max-logprobs: the most a server returns per position unless raised
_TINY = 1e-12


@dataclass(frozen=True)
class ReferenceDistribution:
    """The bf16 target's next-token distribution at each position, as its top-K tokens."""

    ids: torch.Tensor  # [positions, K], most likely first
    logprobs: torch.Tensor  # [positions, K]

    @classmethod
    def of(cls, logprobs: torch.Tensor, k: int = TOP_K) -> ReferenceDistribution:
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        return cls(top.indices, top.values.float())


@dataclass(frozen=True)
class PromptFidelity:
    """One prompt's sums, so prompts pool by their token counts."""

    positions: int
    agreements: int
    kl_sum: float


def compare(reference: ReferenceDistribution, logprobs: torch.Tensor) -> PromptFidelity:
    """The MXFP4 target's log-probabilities [positions, vocab] at the same positions against bf16's."""
    if logprobs.shape[0] != reference.ids.shape[0]:
        raise ValueError(f"{logprobs.shape[0]} positions against a reference of {reference.ids.shape[0]}")
    agreements = int((logprobs.argmax(-1) == reference.ids[:, 0]).sum())
    return PromptFidelity(logprobs.shape[0], agreements, float(kl_per_position(reference, logprobs).sum()))


def kl_per_position(reference: ReferenceDistribution, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(bf16 || MXFP4) over {each of bf16's top-K tokens, every other token}, per position."""
    import torch

    p_top = reference.logprobs.exp()
    q_top_logprobs = logprobs.float().gather(-1, reference.ids)
    top = (p_top * (reference.logprobs - q_top_logprobs)).sum(-1)
    p_rest = (1 - p_top.sum(-1)).clamp_min(0)
    q_rest = (1 - q_top_logprobs.exp().sum(-1)).clamp_min(_TINY)
    rest = torch.where(p_rest > _TINY, p_rest * (p_rest.clamp_min(_TINY).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (top + rest).clamp_min(0)


def compare_served(reference: list[dict[int, float]], observed: list[dict[int, float]]) -> PromptFidelity:
    """One prompt through vLLM: per continuation position, bf16's top-k log-probabilities (`reference`)
    and the MXFP4 server's (`observed`), each as token id -> logprob, both scoring bf16's text."""
    if len(reference) != len(observed):
        raise ValueError(f"{len(observed)} positions against a reference of {len(reference)}")
    agreements, kl_sum = 0, 0.0
    for p, q in zip(reference, observed, strict=True):
        agreements += max(p, key=p.__getitem__) == max(q, key=q.__getitem__)
        kl_sum += _partition_kl(p, q)
    return PromptFidelity(len(reference), agreements, kl_sum)


def _partition_kl(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) over {each token both know, every other token}; p and q as token id -> logprob."""
    known = [t for t in p if t in q]
    top = sum(math.exp(p[t]) * (p[t] - q[t]) for t in known)
    p_rest = max(1.0 - sum(math.exp(p[t]) for t in known), 0.0)
    q_rest = max(1.0 - sum(math.exp(q[t]) for t in known), _TINY)
    rest = p_rest * (math.log(max(p_rest, _TINY)) - math.log(q_rest)) if p_rest > _TINY else 0.0
    return max(top + rest, 0.0)
