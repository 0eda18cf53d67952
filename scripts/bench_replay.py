"""Replay vs online loop on the reference pair: same prompts, one run, time per measured token.

The online loop is the real greedy DFlash decode (draft, verify, commit, repeat). Replay generates the
target's greedy continuation once (batched), runs the target once over it and replays the drafter's
blocks; for greedy decoding both must give identical per-step acceptance. Prints both times per
measured token, the speed-up (target: replay at least 3x faster) and whether acceptance is identical.

Usage: python scripts/bench_replay.py [--prompts 8] [--block-size 8] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.dflash import DFlashDrafter
from pipeline.speculative import TargetHooks, generate_online, replay_acceptance, target_features
from pipeline.validate import chat_ids, greedy_continuations
from pipeline.workloads import load_prompts

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models/smollm2-135m-instruct")
    parser.add_argument("--drafter", type=Path, default=ROOT / "models/smollm2-135m-instruct-dflash")
    parser.add_argument("--workload", default="gsm8k")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = DFlashDrafter.from_pretrained(args.drafter)
    prompts = load_prompts(args.workload, args.prompts, seed=0)
    stop = {tokenizer.eos_token_id}

    started = time.perf_counter()
    online = [generate_online(target, drafter, chat_ids(tokenizer, p.text), args.block_size, args.max_tokens, stop)
              for p in prompts]
    online_seconds = time.perf_counter() - started

    started = time.perf_counter()
    replayed = []
    with torch.no_grad():
        for tokens, prompt_len in greedy_continuations(target, tokenizer, prompts, args.max_tokens):
            sequence = torch.tensor(tokens)
            hidden = target(sequence[None], output_hidden_states=True).hidden_states
            features = target_features(hidden, drafter.cfg.target_layer_ids)[0]
            replayed.append((tokens, replay_acceptance(drafter, TargetHooks.of(target), sequence, features,
                                                       prompt_len, args.block_size).acceptance_lengths))
    replay_seconds = time.perf_counter() - started

    online_tokens = sum(len(run.tokens) - run.prompt_len for run in online)
    replay_tokens = sum(len(tokens) - run.prompt_len for (tokens, _), run in zip(replayed, online))
    same_tokens = sum(run.tokens == tokens for run, (tokens, _) in zip(online, replayed))
    same_acceptance = sum(run.acceptance_lengths == lengths for run, (_, lengths) in zip(online, replayed))
    steps = sum(len(run.acceptance_lengths) for run in online)
    mean_al = sum(sum(run.acceptance_lengths) for run in online) / steps
    per_token_online = online_seconds / online_tokens
    per_token_replay = replay_seconds / replay_tokens
    print(f"{len(prompts)} {args.workload} prompts, block {args.block_size}, max {args.max_tokens} tokens, "
          f"mean acceptance length {mean_al:.3f} ({steps} steps)")
    print(f"online loop: {online_seconds:7.1f} s for {online_tokens} tokens = {per_token_online * 1000:6.1f} ms/token")
    print(f"replay:      {replay_seconds:7.1f} s for {replay_tokens} tokens = {per_token_replay * 1000:6.1f} ms/token")
    print(f"replay speed-up per measured token: {per_token_online / per_token_replay:.2f}x (target >= 3x)")
    print(f"identical continuation: {same_tokens}/{len(prompts)} prompts; "
          f"identical per-step acceptance: {same_acceptance}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
