"""A checkpoint's tokenizer as the pairing and the reference path use it: which files make it (their
hashes must match between a drafter and its target) and how a prompt becomes token ids (the chat
template, as vLLM's chat endpoint applies it)."""

from __future__ import annotations

from pathlib import Path

from pipeline.run.hashing import sha256_file

__all__ = ["TOKENIZER_FILES", "tokenizer_hashes", "chat_ids"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json")


def tokenizer_hashes(folder: Path, hashed: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of each tokenizer file the checkpoint in `folder` has. `hashed`: the checkpoint's file hashes
    already read (a resolved model's), taken instead of reading the files again."""
    if hashed is not None:
        return {name: sha for name, sha in hashed.items() if name in TOKENIZER_FILES}
    return {name: sha256_file(folder / name) for name in TOKENIZER_FILES if (folder / name).is_file()}


def chat_ids(tokenizer, text: str) -> list[int]:
    """A user prompt as the token ids a chat model sees: the chat template with the generation prompt."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)
