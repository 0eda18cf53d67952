"""Checkable answers: the last balanced \\boxed{}, GSM8K numbers, MATH-500 strings after normalisation."""

from __future__ import annotations

import pytest

from pipeline.study.answers import is_correct, last_boxed, normalize_latex


def test_the_last_box_counts_with_nested_braces():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("no box here") is None
    assert last_boxed("cut off \\boxed{\\frac{1}{") is None  # a response cut inside the box has no answer


@pytest.mark.parametrize("response, gold, correct", [
    ("so she makes \\boxed{18} dollars", "18", True),
    ("\\boxed{$1,800}", "1800", True),
    ("\\boxed{18.0}.", "18", True),
    ("\\boxed{17}", "18", False),
    ("the answer is 18", "18", False),  # unboxed: the prompt asks for a box
    ("\\boxed{18 or 19}", "18", False),  # two numbers: not an answer
])
def test_gsm8k_compares_numbers(response, gold, correct):
    assert is_correct("gsm8k", response, gold) is correct


@pytest.mark.parametrize("response, gold, correct", [
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", True),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{\\text{Evelyn}}", "Evelyn", True),
    ("\\boxed{3\\sqrt{13}}", "3\\sqrt{13}", True),
    ("\\boxed{2\\sqrt{13}}", "3\\sqrt{13}", False),
    ("\\boxed{5.0}", "5", True),
])
def test_math500_compares_normalised_latex(response, gold, correct):
    assert is_correct("math500", response, gold) is correct


def test_normalisation_keeps_what_changes_the_value():
    assert normalize_latex("\\frac{1}{2}") != normalize_latex("\\frac{2}{1}")


def test_other_workloads_are_not_checkable_here():
    with pytest.raises(ValueError, match="not checkable"):
        is_correct("humaneval", "\\boxed{1}", "1")
