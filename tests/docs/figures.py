"""When a line a page shows and the line a run printed differ only in figures that legitimately
vary by machine.

The pages are made on one CPU and checked on others (AVX-512, AVX2 only, Intel or AMD, the
portable kernels). Pinning torch's numerics (runner.NUMERIC_ENV) makes most outputs the same bits
everywhere, but not all: on an AVX2-only AMD EPYC, a float32 kernel written in torch ops printed
``max abs 4.834e-07 at [1, 63, 23]`` where the page, made on an AVX-512 Xeon, shows
``max abs 5.769e-07 at [1, 77, 30]``. So the last digits of a figure are never compared across
machines; the text, the verdicts, the counts and every figure beyond its rounding still are:

- text between figures: the same (runs of spaces count as one: a wider figure shifts a column);
- integers (counts, shapes, sizes, exit codes): the same, but in a rounding figure's row;
- a figure with a fraction or an exponent: the same to one unit in the last digit the page
  shows, or to :data:`RELATIVE` of its value (a JSON float prints 17 digits of a sum of float32
  terms);
- a *rounding figure* (:data:`ROUNDING_LABELS`, :data:`ROUNDING_KEYS`: the size of a correct
  result's rounding error, the ratio of two such, where the largest one is): within a factor of
  :data:`ROUNDING_FACTOR`, its position (integers in brackets) free. A real change of a budget or
  of a kernel's accuracy moves them by more; a wrong verdict changes the text.
"""

from __future__ import annotations

import math
import re

RELATIVE = 1e-5
"""How far a figure that is not a rounding figure may move, relative to its value."""
ROUNDING_FACTOR = 2.0
"""How far a rounding figure may move: up to this factor either way, the same sign."""

ROUNDING_LABELS = re.compile(
    r"^\s*(error|PyTorch \w+|vs PyTorch|worst (valid )?element|max (abs|rel) diff|rel L2 error)"
    r"\s{2,}"
)
"""Rows of verify's and compare's reports whose figures are rounding errors (and the row's
position of the largest)."""
ROUNDING_KEYS = re.compile(
    r'^\s*"(max_abs_diff|max_abs_index|max_rel_diff|max_rel_index|rel_l2|budget_ratio'
    r'|yardstick_max_abs_diff|yardstick_rel_l2|factor_needed|distance)":'
)
"""The same figures in JSON, and a diagnosis's distance (how far the evidence is from the
mistake's model: rounding, when the model fits)."""

NUMBER = re.compile(r"(?<![\w.])(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?)(?![\d.])")
"""A figure: not inside a word (``float32``), thousands separated by commas (``65,536``)."""
BRACKETS = re.compile(r"\[[^\[\]]*\]")


def same_figures(shown: str, real: str) -> bool:
    """Whether ``real`` is the ``shown`` line but for figures within what varies by machine."""
    shown_parts, real_parts = NUMBER.split(shown), NUMBER.split(real)
    if len(shown_parts) != len(real_parts) or len(shown_parts) == 1:
        return False
    texts = zip(shown_parts[::2], real_parts[::2], strict=True)
    if any(" ".join(a.split()) != " ".join(b.split()) for a, b in texts):
        return False
    rounding = bool(ROUNDING_LABELS.match(shown) or ROUNDING_KEYS.match(shown))
    free = _positions(shown) if rounding else set()
    figures = zip(NUMBER.finditer(shown), real_parts[1::2], strict=True)
    return all(
        found.start() in free or _close(found.group(), other, rounding) for found, other in figures
    )


def _positions(line: str) -> set[int]:
    """Where the integers in brackets start: a position (``at [1, 63, 23]``), not a figure."""
    return {
        bracket.start() + found.start()
        for bracket in BRACKETS.finditer(line)
        for found in NUMBER.finditer(bracket.group())
        if _integer(found.group())
    }


def _integer(text: str) -> bool:
    return not any(mark in text for mark in ".eE")


def _close(shown: str, real: str, rounding: bool) -> bool:
    a, b = float(shown.replace(",", "")), float(real.replace(",", ""))
    if rounding:  # "443x what its budget allows" is a rounding figure too, printed whole
        if a == 0 or b == 0 or (a < 0) != (b < 0):
            return a == b
        return 1 / ROUNDING_FACTOR <= b / a <= ROUNDING_FACTOR
    if _integer(shown) or _integer(real):
        return shown == real
    return abs(a - b) <= max(_last_digit(shown), RELATIVE * abs(a)) * (1 + 1e-9)  # 1e-10 in binary


def _last_digit(text: str) -> float:
    """One unit in the last digit a figure shows: ``4.834e-07`` -> 1e-10, ``0.1096`` -> 1e-4."""
    mantissa, _, exponent = text.replace(",", "").lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return math.pow(10, (int(exponent) if exponent else 0) - decimals)
