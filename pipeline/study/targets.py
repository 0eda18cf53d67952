"""The target models the reference path runs, and the greedy text they write.

`load_target` gives the bf16 source (an FP8 source dequantized) or the MXFP4 export through Quark's
importer, on the accelerator when torch sees one (bf16) and on the CPU otherwise (float32: the CPU has
no fast bf16 matmul here). Scripts, tests and the reference backend all load targets through it, so
they measure the same model."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.checkpoints.tokenizer import chat_ids
from pipeline.quant.quark import decode_weights_once, import_quark
from pipeline.study.workloads import Prompt

__all__ = ["reference_device", "load_target", "greedy_continuations"]


def reference_device() -> str:
    """Where the reference path runs: the accelerator when torch sees one (CUDA or ROCm), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(path: Path, precision: str, device: str = "cpu"):
    """The target as a model the reference path runs: the source (bf16, or an FP8 source dequantized), or
    the MXFP4 export via Quark's importer (so W+A checkpoints quantize activations as they would when
    served). On the CPU in float32 (no native bf16 there); on an accelerator in bf16, a bf16 source
    spread over the node's GPUs by transformers' `device_map`."""
    from pipeline.checkpoints.folder import read_checkpoint
    from pipeline.checkpoints.fp8 import is_fp8_source
    from pipeline.checkpoints.reader import load_source

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if precision == "bf16":
        config = read_checkpoint(Path(path)).config if device != "cpu" else {}
        if device != "cpu" and not is_fp8_source(config):
            import transformers

            model_class = getattr(transformers, config["architectures"][0])
            return model_class.from_pretrained(path, dtype=dtype, device_map="auto").eval()
        return load_source(Path(path)).to(device=device, dtype=dtype).eval()

    model = import_quark().import_model_from_safetensors(None, str(path), device=device).to(dtype).eval()
    return decode_weights_once(model, dtype)


@torch.no_grad()
def greedy_continuations(target, tokenizer, prompts: list[Prompt], max_tokens: int, batch_size: int = 8) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation up to EOS or max_tokens, prompt length) per prompt, in order."""
    eos = tokenizer.eos_token_id
    encoded = [chat_ids(tokenizer, p.text) for p in prompts]
    results: list[tuple[list[int], int]] = [None] * len(prompts)  # type: ignore[list-item]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), eos, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[r, width - len(encoded[i]) :] = 1
        out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                              max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos).cpu()
        for r, i in enumerate(rows):
            generated = out[r, width:].tolist()
            if eos in generated:
                generated = generated[: generated.index(eos) + 1]
            results[i] = (encoded[i] + generated, len(encoded[i]))
    return results
