"""Acceptance metrics: the one home of the formulas, shared by the reference backend and vLLM.

Per speculative step the acceptance length is accepted drafts + 1 (the bonus token counts), so it
lies in [1, B]. Over many steps:
  mean acceptance length            = 1 + accepted / drafts
  per-position acceptance rate i    = P(accepted >= i + 1) = accepted_at_position[i] / drafts
and therefore mean acceptance length = 1 + sum of the per-position rates. vLLM counts the same
things in `vllm:spec_decode_num_drafts`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos{position=i}`, and per request in a response's
`metrics.speculative_decoding.acceptance_histogram` (steps by accepted drafts).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["VLLM_DRAFTS", "VLLM_DRAFT_TOKENS", "VLLM_ACCEPTED", "VLLM_ACCEPTED_PER_POS", "AcceptanceStats"]

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class AcceptanceStats:
    """Counts over speculative steps with up to `num_speculative_tokens` drafts each."""

    num_speculative_tokens: int
    num_drafts: int  # speculative steps
    accepted_at_position: tuple[int, ...]  # [i] = steps that accepted at least i + 1 drafts

    @classmethod
    def from_lengths(cls, acceptance_lengths: Iterable[int], block_size: int) -> AcceptanceStats:
        """From per-step acceptance lengths (bonus counted), as the reference backend measures."""
        lengths = list(acceptance_lengths)
        if any(not 1 <= n <= block_size for n in lengths):
            raise ValueError(f"acceptance lengths must lie in [1, {block_size}]")
        at_position = tuple(sum(1 for n in lengths if n - 1 >= i + 1) for i in range(block_size - 1))
        return cls(block_size - 1, len(lengths), at_position)

    @classmethod
    def from_vllm_metrics(cls, before: dict, after: dict, num_speculative_tokens: int) -> AcceptanceStats:
        """From two /metrics snapshots (see serving.client.scrape_metrics) around a run."""

        def total(name: str, position: int | None = None) -> float:
            def pick(samples: dict) -> float:
                return sum(
                    value for (metric, labels), value in samples.items()
                    if metric == name and (position is None or ("position", str(position)) in labels)
                )

            return pick(after) - pick(before)

        drafts = int(round(total(VLLM_DRAFTS)))
        at_position = tuple(int(round(total(VLLM_ACCEPTED_PER_POS, i))) for i in range(num_speculative_tokens))
        return cls(num_speculative_tokens, drafts, at_position)

    @classmethod
    def from_vllm_request(cls, metrics: dict, num_speculative_tokens: int) -> AcceptanceStats:
        """From one response's `metrics.speculative_decoding` (vLLM's per-request metrics):
        `acceptance_histogram[j]` = steps that accepted exactly j drafts."""
        histogram = list(metrics["acceptance_histogram"])
        if len(histogram) != num_speculative_tokens + 1:
            raise ValueError(f"a histogram of {len(histogram)} bins for {num_speculative_tokens} speculative tokens")
        at_position = tuple(sum(histogram[i + 1 :]) for i in range(num_speculative_tokens))
        return cls(num_speculative_tokens, sum(histogram), at_position)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at_position)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(accept >= i + 1 drafts) for i = 0 .. num_speculative_tokens - 1; non-increasing."""
        if not self.num_drafts:
            return [float("nan")] * self.num_speculative_tokens
        return [count / self.num_drafts for count in self.accepted_at_position]

    @classmethod
    def pooled(cls, stats: Iterable[AcceptanceStats]) -> AcceptanceStats:
        """Counts of several runs (e.g. prompts) added up."""
        stats = list(stats)
        total = stats[0]
        for more in stats[1:]:
            total = total.merged(more)
        return total

    def merged(self, other: AcceptanceStats) -> AcceptanceStats:
        assert self.num_speculative_tokens == other.num_speculative_tokens
        return AcceptanceStats(
            self.num_speculative_tokens,
            self.num_drafts + other.num_drafts,
            tuple(a + b for a, b in zip(self.accepted_at_position, other.accepted_at_position, strict=True)),
        )
