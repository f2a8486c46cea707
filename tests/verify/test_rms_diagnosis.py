"""verify's diagnosis of wrong RMSNorm kernels (issue 39): each is FAILed with its own cause
named or with none, never another's; correct ones pass with no cause.

The kernels are those of :mod:`tests.verify.test_rms_budget` (hand-written forward and backward,
one mistake each) and a few of the padding's; the inputs three families (its hard rows, a
padded batch whose padding holds NaN and inf, rows with a few huge channels as LLaMA's
activations have), each with a row of small magnitude where eps matters. The truth is verify's
own float64 reference, checked against an independent float64 one here.
"""

from __future__ import annotations

import pytest
import torch

from maskln_cli.testing import verify
from tests.verify.test_rms_budget import CORRECT, DTYPES, hard_rows, kernel, truth_of

EPS = 1e-6
CAUSES = {
    "mean subtracted": "mean_subtracted",
    "eps outside the sqrt": "eps_outside_sqrt",
    "1 + scale": "gain_plus_one",
    "scale for 1 + scale": "gain_minus_one",
    "variance over C-1": "squares_over_c_minus_1",
    "padding not zeroed": "padding_not_masked",
    "mask inverted": "mask_inverted",
    # named where its sums overflow float16; its rounding has no RMSNorm model yet: unnamed
    "half accumulation": "statistics_overflow",
    "grad_x without its xhat term": "backward_missing_xhat_term",
    # mistakes RMSNorm's catalogue does not hold: no cause may be named
    "out x (1 + 1e-4)": None,
    "last channel wrong": None,
}
"""Each wrong kernel and the one cause it may be given (None: none)."""
HALF = ("mean subtracted", "1 + scale", "half accumulation")
"""The mistakes tried in float16 and bfloat16 too."""


def hard(dtype, seed=0):
    return hard_rows(dtype, 1024, seed)


def batch(dtype, seed=0):
    """[2, 24, 256] of N(0, 3), lengths 24 and 13, the padding NaN and inf; one row small."""
    generator = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(2, 24, 256, generator=generator, dtype=torch.float64)
    x[0, 5] *= 3e-4
    valid = torch.arange(24) < torch.tensor([[24], [13]])
    x[1, 13:, ::2], x[1, 13:, 1::2] = float("nan"), float("inf")
    return x.to(dtype).double(), valid


def outliers(dtype, seed=0):
    """[16, 512] of N(0, 1) with channels 5 and 77 fifty times larger; the last 3 rows
    padding; one row small."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 512, generator=generator, dtype=torch.float64)
    x[:, [5, 77]] *= 50
    x[2] *= 1e-3
    valid = torch.arange(16) < 13
    return x.to(dtype).double(), valid


FAMILIES = {"hard rows": hard, "batch": batch, "outliers": outliers}


def _uncatalogued(kind):
    """A kernel whose mistake is none of the catalogue's, or is in its backward (float32)."""
    right = kernel("pairwise float32")

    def run(x, valid, w, eps, dy):
        out, grad_x, grad_scale = right(x, valid, w, eps, dy)
        if kind == "out x (1 + 1e-4)":
            out = out * (1 + 1e-4)
        elif kind == "last channel wrong":
            out = torch.cat([out[:, :-1], out[:, -1:] * 1.01], dim=-1)
        else:  # grad_x = rstd * w * dy: the term of rstd's own gradient dropped
            rows = torch.where(valid[:, None], x, 0)
            rstd = torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps)
            grad_x = torch.where(valid[:, None], rstd * w * dy, 0)
        return out, grad_x, grad_scale

    return run


def wrong_kernel(kind):
    """``(x, valid, w, eps, dy)`` -> (out, grad_x, grad_scale) with mistake ``kind`` (for
    "scale for 1 + scale" the problem's offset is 1: the kernel's gain misses it)."""
    if CAUSES[kind] is None or kind == "grad_x without its xhat term":
        return _uncatalogued(kind)
    if kind in ("scale for 1 + scale", "padding not zeroed", "mask inverted"):
        right = kernel("pairwise float32")
        if kind == "scale for 1 + scale":
            return right
        if kind == "mask inverted":
            return lambda x, valid, w, eps, dy: right(x, ~valid, w, eps, dy)

        def unmasked(x, valid, w, eps, dy):
            everything = torch.ones_like(valid)
            return right(x, everything, w, eps, dy)

        return unmasked
    return kernel(kind)


def judged(kind, family, dtype, correct=False, seed=0, upstream=1.0):
    """The kernel's report (``upstream``: grad_out's scale), after checking verify's truth
    against :func:`truth_of`."""
    x64, valid = FAMILIES[family](dtype, seed)
    channels = x64.shape[-1]
    generator = torch.Generator().manual_seed(1)
    weight = (0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)).to(dtype)
    offset = 1.0 if kind == "scale for 1 + scale" else 0.0
    if not offset:
        weight = (weight.double() + 1).to(dtype)
    dy = upstream * torch.randn(x64.shape, generator=generator, dtype=torch.float64)
    dy = dy.to(dtype)
    x = x64.to(dtype)
    run = kernel(kind) if correct else wrong_kernel(kind)
    flat = (x.reshape(-1, channels), valid.reshape(-1), weight, EPS, dy.reshape(-1, channels))
    out, grad_x, grad_scale = (t.reshape(x.shape) if t.dim() == 2 else t for t in run(*flat))
    report = verify(
        out, x, valid, weight, None, EPS, grad_out=dy, grad_x=grad_x, grad_scale=grad_scale,
        norm="rms", offset=offset,
    )  # fmt: skip
    # verify's float64 truth is RMSNorm's: the independent one's distance to it is tiny
    truth = truth_of(
        torch.where(valid.reshape(-1)[:, None], x64.reshape(-1, channels), 0.0),
        valid.reshape(-1), weight.double() + offset, EPS, dy.double().reshape(-1, channels),
    )[0]  # fmt: skip
    right = verify(
        truth.reshape(x.shape).to(dtype), x, valid, weight, None, EPS, norm="rms", offset=offset
    )
    assert right.passed, right.tensors[0].problems
    return report


def causes_of(report):
    return {t.name: [d["mistake"] for d in t.diagnosis] for t in report.tensors if t.diagnosis}


def _cases():
    for kind in CAUSES:
        for family in FAMILIES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                if dtype == torch.float32 and kind == "half accumulation":
                    continue  # accumulating in float32 is not a mistake
                if dtype != torch.float32 and kind not in HALF:
                    continue
                yield pytest.param(kind, family, dtype, id=f"{kind}-{family}-{dtype}")


@pytest.mark.parametrize(("kind", "family", "dtype"), list(_cases()))
def test_wrong_rms_kernels_fail_with_their_own_cause_or_none(kind, family, dtype):
    report = judged(kind, family, dtype)
    assert not report.passed
    own = CAUSES[kind]
    for name, causes in causes_of(report).items():
        assert own is not None and causes == [own], (name, causes, own)


FORMULAS = [kind for kind, cause in CAUSES.items() if cause and kind != "half accumulation"]


@pytest.mark.parametrize("kind", FORMULAS)
def test_formula_mistakes_are_named_in_float32(kind):
    """On the hard rows in float32 each formula mistake shows in out (the backward's in grad_x,
    out right), and is named there."""
    report = judged(kind, "hard rows", torch.float32)
    backward = kind == "grad_x without its xhat term"
    tensor = report.tensors[1 if backward else 0]
    assert tensor.name == ("grad_x" if backward else "out") and not tensor.passed
    assert report.tensors[0].passed == backward
    assert [d["mistake"] for d in tensor.diagnosis] == [CAUSES[kind]], tensor.problems


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["batch", "outliers"])
@pytest.mark.parametrize("kind", CORRECT)
def test_correct_rms_kernels_pass_with_no_cause(kind, family, dtype):
    report = judged(kind, family, dtype, correct=True)
    assert report.passed, [t.problems for t in report.tensors]
    assert not causes_of(report)
