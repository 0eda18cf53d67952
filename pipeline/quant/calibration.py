"""Calibration text: fixed token windows for Quark and for the quantize stage's verification."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.errors import BadInputError
from pipeline.recipe import Calibration

__all__ = ["SHIPPED", "calibration_text", "calibration_windows"]

SHIPPED = Path(__file__).resolve().parents[2] / "calibration" / "shakespeare"


def calibration_text(spec: Calibration) -> str:
    if spec.dataset == "file":
        try:
            return spec.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInputError(f"calibration.path: cannot read {spec.path} ({exc.__class__.__name__})") from exc
    files = sorted(SHIPPED.glob("*.txt"))
    if not files:
        raise BadInputError(f"calibration text missing in {SHIPPED}; restore the repository's calibration/ folder")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def calibration_windows(spec: Calibration, tokenizer) -> torch.Tensor:
    """[num_samples, seq_len] token ids: consecutive, non-overlapping windows from the start."""
    ids = tokenizer(calibration_text(spec), add_special_tokens=False)["input_ids"]
    needed = spec.num_samples * spec.seq_len
    if len(ids) < needed:
        raise BadInputError(
            f"calibration text has {len(ids)} tokens, fewer than num_samples x seq_len = {needed}; "
            "lower them or give a longer text"
        )
    return torch.tensor(ids[:needed]).view(spec.num_samples, spec.seq_len)
