"""Task answers that can be checked without running code: GSM8K's final number, MATH-500's boxed answer.

Both workloads ask for the final answer inside \\boxed{} (see `workloads`). A response is scored by
its last \\boxed{...} (balanced braces); a response without one, or one that did not finish within
the token budget, has no answer and counts as wrong. GSM8K compares numbers (commas, `$` and a
trailing `.` ignored); MATH-500 compares the answer strings after a light LaTeX normalisation
(spaces, `\\left`/`\\right`, `\\dfrac`/`\\tfrac`, `^\\circ`, `\\text{...}` units wrappers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CHECKABLE", "Answer", "last_boxed", "normalize_latex", "is_correct"]

CHECKABLE = ("gsm8k", "math500")


@dataclass(frozen=True)
class Answer:
    finished: bool  # the response ended (EOS) within max_tokens
    correct: bool


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text`, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unbalanced: the response was cut inside the box


def _number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").replace("\\!", "").strip().rstrip(".")
    found = _NUMBER.findall(cleaned)
    return float(found[-1]) if len(found) == 1 else None


def normalize_latex(answer: str) -> str:
    s = answer.strip().rstrip(".")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("^\\circ", ""), ("^{\\circ}", ""), ("\\!", ""), ("\\,", ""), ("$", "")):
        s = s.replace(old, new)
    return re.sub(r"\s+", "", s)


def is_correct(workload: str, response: str, gold: str) -> bool:
    """Whether `response` ends with the right boxed answer for `gold`."""
    boxed = last_boxed(response)
    if boxed is None:
        return False
    if workload == "gsm8k":
        got, want = _number(boxed), _number(gold)
        return got is not None and want is not None and abs(got - want) < 1e-6
    if workload == "math500":
        if normalize_latex(boxed) == normalize_latex(gold):
            return True
        got, want = _number(boxed), _number(gold)
        return got is not None and want is not None and _NUMBER.fullmatch(normalize_latex(gold)) is not None \
            and abs(got - want) < 1e-6
    raise ValueError(f"{workload!r} answers are not checkable here; checkable: {', '.join(CHECKABLE)}")
