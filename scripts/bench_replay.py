"""Replay vs online loop on the reference pair: same prompts, one run, time per measured token.

The online loop is the real greedy DFlash decode (draft, verify, commit, repeat), run once per block
size. Replay, as the validate stage uses it, generates the target's greedy continuation once (batched),
runs the target once over it and replays the drafter's blocks for every block size; for greedy
decoding both must give identical per-step acceptance. A measured token is one continuation token at
one block size, so both sides measure the same thing. Prints both times per measured token, the
speed-up (target: replay at least 3x faster) and whether continuations and acceptance are identical.

With --replay-only it skips the online loop and prints only the mean acceptance length per block
size (the reference pair's acceptance bar: block 8 >= 2.5 on GSM8K).

Usage: python scripts/bench_replay.py [--prompts 8] [--block-sizes 4 8 16] [--max-tokens 96] [--replay-only]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.speculative.dflash import DFlashDrafter
from pipeline.speculative.replay import generate_online, replay_sequence
from pipeline.study.targets import greedy_continuations
from pipeline.study.workloads import load_prompts

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def replay(target, tokenizer, drafter, prompts, block_sizes, max_tokens) -> tuple[list[list[int]], dict[int, list[list[int]]]]:
    """Greedy continuations (batched), one target pass over each, and the drafter's per-step
    acceptance lengths replayed at every block size."""
    continuations, replayed = [], {b: [] for b in block_sizes}
    for tokens, prompt_len in greedy_continuations(target, tokenizer, prompts, max_tokens):
        continuations.append(tokens)
        for b, run in replay_sequence(target, drafter, tokens, prompt_len, block_sizes).items():
            replayed[b].append(run.acceptance_lengths)
    return continuations, replayed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models/smollm2-135m-instruct")
    parser.add_argument("--drafter", type=Path, default=ROOT / "models/smollm2-135m-instruct-dflash")
    parser.add_argument("--workload", default="gsm8k")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--replay-only", action="store_true", help="acceptance by replay only, no online loop")
    args = parser.parse_args()

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = DFlashDrafter.from_pretrained(args.drafter)
    prompts = load_prompts(args.workload, args.prompts, seed=0)
    stop = {tokenizer.eos_token_id}

    if args.replay_only:
        _, replayed = replay(target, tokenizer, drafter, prompts, args.block_sizes, args.max_tokens)
        print(f"{len(prompts)} {args.workload} prompts, max {args.max_tokens} tokens, replay")
        for b in args.block_sizes:
            print(f"  block {b:2d}: mean acceptance length {sum(map(sum, replayed[b])) / sum(map(len, replayed[b])):.3f} "
                  f"({sum(map(len, replayed[b]))} steps)")
        return

    started = time.perf_counter()
    online = {b: [generate_online(target, drafter, chat_ids(tokenizer, p.text), b, args.max_tokens, stop) for p in prompts]
              for b in args.block_sizes}
    online_seconds = time.perf_counter() - started

    started = time.perf_counter()
    continuations, replayed = replay(target, tokenizer, drafter, prompts, args.block_sizes, args.max_tokens)
    replay_seconds = time.perf_counter() - started

    online_tokens = sum(len(run.tokens) - run.prompt_len for runs in online.values() for run in runs)
    replay_tokens = len(args.block_sizes) * sum(len(t) - run.prompt_len for t, run in zip(continuations, online[args.block_sizes[0]]))
    runs = len(prompts) * len(args.block_sizes)
    same_tokens = sum(run.tokens == t for b in args.block_sizes for run, t in zip(online[b], continuations))
    same_acceptance = sum(run.acceptance_lengths == lengths for b in args.block_sizes
                          for run, lengths in zip(online[b], replayed[b]))
    print(f"{len(prompts)} {args.workload} prompts, max {args.max_tokens} tokens, block sizes {args.block_sizes}")
    for b in args.block_sizes:
        steps = sum(len(run.acceptance_lengths) for run in online[b])
        mean_al = sum(sum(run.acceptance_lengths) for run in online[b]) / steps
        print(f"  block {b:2d}: mean acceptance length {mean_al:.3f} ({steps} steps)")
    per_token_online = online_seconds / online_tokens
    per_token_replay = replay_seconds / replay_tokens
    print(f"online loop: {online_seconds:7.1f} s for {online_tokens} measured tokens = {per_token_online * 1000:6.1f} ms/token")
    print(f"replay:      {replay_seconds:7.1f} s for {replay_tokens} measured tokens = {per_token_replay * 1000:6.1f} ms/token")
    print(f"replay speed-up per measured token: {per_token_online / per_token_replay:.2f}x (target >= 3x)")
    print(f"identical continuation: {same_tokens}/{runs} runs; identical per-step acceptance: {same_acceptance}/{runs} runs")


if __name__ == "__main__":
    main()
