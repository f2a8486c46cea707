"""Known mistakes of a backward pass, and of statistics kept in a half dtype.

A kernel author's backward is written by hand: ``dx = rstd * (wdy - xhat * c1 - c2)``, with
``wdy = scale * grad_out``, ``c1 = mean(xhat * wdy)`` and ``c2 = mean(wdy)``; ``grad_scale =
sum(grad_out * xhat)`` and ``grad_bias = sum(grad_out)`` over the valid rows. Its usual
mistakes leave the forward right: a term dropped (or, under autograd, the variance or the mean
detached from the graph), the variance recomputed unbiased in the backward only, the padding's
upstream gradient summed into grad_scale and grad_bias. Each is a :class:`Mistake` whose
``gradients`` are that backward in float64 (its ``formula``, the forward, is the correct one).

:data:`STATISTICS_OVERFLOW` is recognized by where a result is wrong (:func:`overflow_match`):
on the valid rows, and only those, whose statistics a half-precision kernel cannot hold (a sum
of squares beyond float16's 65,504), or a float32 kernel (beyond float32's 3.4e+38).
"""

from __future__ import annotations

import math

import torch

from maskln_cli.op.mistake_records import Diagnosis, Gradients, Mistake

__all__ = [
    "BACKWARD_MISTAKES",
    "STATISTICS_OVERFLOW",
    "STATISTICS_OVERFLOW_DTYPE",
    "backward_with_eps",
    "overflow_match",
    "overflowing_rows",
]


def _statistics(x: torch.Tensor, valid: torch.Tensor, eps: float, unbiased: bool = False):
    rows = torch.where(valid.unsqueeze(-1), x, 0.0)
    mean = rows.mean(dim=-1, keepdim=True)
    var = (rows - mean).square().mean(dim=-1, keepdim=True)
    if unbiased:
        channels = x.shape[-1]
        var = var * channels / (channels - 1) if channels > 1 else torch.full_like(var, torch.nan)
    rstd = (var + eps).rsqrt()
    return rows, (rows - mean) * rstd, rstd


def _correct(x, valid, scale, bias, eps):
    """The op's forward (float64): a backward mistake leaves it right."""
    _, xhat, _ = _statistics(x, valid, eps)
    return torch.where(valid.unsqueeze(-1), xhat * scale + bias, 0.0)


def _backward(xhat_term=True, mean_term=True, unbiased=False, padding=False, eps_used=None):
    """The hand-written backward (float64), with the given term or rule wrong (``eps_used``:
    another eps than the forward's)."""

    def gradients(x, valid, scale, bias, eps, grad_out):
        keep = valid.unsqueeze(-1)
        _, xhat, rstd = _statistics(x, valid, eps if eps_used is None else eps_used, unbiased)
        upstream = grad_out.nan_to_num(0.0, 0.0, 0.0)
        dy = torch.where(keep, upstream, 0.0)
        wdy = dy * scale
        dx = wdy
        if xhat_term:
            dx = dx - xhat * (xhat * wdy).mean(dim=-1, keepdim=True)
        if mean_term:
            dx = dx - wdy.mean(dim=-1, keepdim=True)
        grad_x = torch.where(keep, dx * rstd, 0.0)
        leading = tuple(range(x.dim() - 1))
        summed = upstream if padding else dy
        return grad_x, (summed * xhat).sum(leading), summed.sum(leading)

    return gradients


def backward_with_eps(eps_used: float) -> Gradients:
    """The correct backward with ``eps_used`` instead of the forward's eps (float64)."""
    return _backward(eps_used=eps_used)


BACKWARD_MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "backward_missing_xhat_term",
            "grad_x misses its xhat term, -xhat * mean(xhat * scale * grad_out): the variance's"
            " path dropped from a hand-written backward (or the variance detached from the"
            " graph)",
            "dx = rstd * (wdy - xhat * mean(xhat * wdy) - mean(wdy)), with wdy = scale *"
            " grad_out; keep the variance in the graph",
            _correct,
            _backward(xhat_term=False),
        ),
        Mistake(
            "backward_missing_mean_term",
            "grad_x misses its mean term, -mean(scale * grad_out): the mean's path dropped from"
            " a hand-written backward (or the mean detached from the graph)",
            "dx = rstd * (wdy - xhat * mean(xhat * wdy) - mean(wdy)), with wdy = scale *"
            " grad_out; keep the mean in the graph",
            _correct,
            _backward(mean_term=False),
        ),
        Mistake(
            "backward_unbiased_variance",
            "the backward recomputes the variance unbiased (x.var() divides by C - 1) while the"
            " forward uses the population variance",
            "use the forward's rstd in the backward (save it), or x.var(unbiased=False)",
            _correct,
            _backward(unbiased=True),
        ),
        Mistake(
            "padding_in_parameter_gradients",
            "a parameter gradient (grad_scale or grad_bias) sums the padding's grad_out too:"
            " the backward's sums over rows are not masked",
            "sum grad_out * xhat and grad_out over the valid rows only:"
            " torch.where(valid[..., None], grad_out, 0) first",
            _correct,
            _backward(padding=True),
        ),
    )
}
"""Mistakes of a backward pass whose forward is right (``diagnose_gradient`` tries them)."""

STATISTICS_OVERFLOW = Mistake(
    "statistics_overflow",
    "the row statistics overflow float16: a row's sum of squares beyond 65,504 (values of a"
    " few hundred) becomes inf, and the row NaN, inf, or what a zero rstd leaves (LayerNorm's"
    " bias, RMSNorm's 0)",
    "accumulate the statistics in float32 (as torch's half-precision kernels do), whatever the"
    " dtype of the values",
    _correct,  # recognized by where the result is wrong, not by a formula
)
STATISTICS_OVERFLOW_FLOAT32 = Mistake(
    "statistics_overflow",
    "the row statistics overflow float32: a row's sum of squares beyond 3.4e+38 (values beyond"
    " about 1e19) becomes inf, and the row NaN, inf, or what a zero rstd leaves (LayerNorm's"
    " bias, RMSNorm's 0)",
    "keep the row's sum of squares in float64, or divide the row by its largest |x| before"
    " squaring it",
    _correct,  # recognized by where the result is wrong, not by a formula
)
"""The same mistake in a float32 kernel's own statistics (its rows' values beyond ~1e19)."""
STATISTICS_OVERFLOW_FLOAT64 = Mistake(
    "statistics_overflow",
    "the row statistics overflow float64: a row's sum of squares beyond 1.8e+308 (values beyond"
    " about 1e154) becomes inf, and the row NaN, inf, or what a zero rstd leaves (LayerNorm's"
    " bias, RMSNorm's 0)",
    "divide the row by its largest |x| before squaring it (or square the deviations scaled)",
    _correct,  # recognized by where the result is wrong, not by a formula
)
"""The same mistake in a float64 kernel's own statistics (its rows' values beyond ~1e154)."""
OVERFLOWING = {
    torch.float16: STATISTICS_OVERFLOW,
    torch.float32: STATISTICS_OVERFLOW_FLOAT32,
    torch.float64: STATISTICS_OVERFLOW_FLOAT64,
}
"""Dtypes whose range a row's statistics outgrow, and the words for it: a float32 kernel's rows
of 1e29 overflow float16's range too, but it is float32's that its sums outgrew."""
RANGE_OF = {torch.bfloat16: torch.float32}
"""Dtypes whose statistics overflow in another's range: bfloat16 has float32's (and a bfloat16
kernel keeps float32 statistics, as torch's do)."""
STATISTICS_OVERFLOW_DTYPE = torch.float16
"""The dtype a kernel's statistics overflow in, whatever it stores (float32 accumulators
of float16 sums overflow as a float16 kernel does)."""


def overflowing_rows(x: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Which rows (flattened leading axes) a kernel keeping its statistics in ``dtype`` cannot
    hold: valid rows of finite values whose sum of squares exceeds the dtype's largest.

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [300.0, -300.0]], dtype=torch.float64)
        >>> overflowing_rows(x, torch.tensor([True, True]), torch.float16).tolist()
        [False, True]
    """
    channels = x.shape[-1]
    rows = x.reshape(-1, channels).double()
    keep = valid.reshape(-1) & rows.isfinite().all(dim=1)
    dtype = RANGE_OF.get(dtype, dtype)
    if dtype not in OVERFLOWING:
        return torch.zeros_like(keep)
    squares = torch.where(keep.unsqueeze(1), rows, 0.0).square().sum(dim=1)
    return keep & (squares > torch.finfo(dtype).max)


def overflow_match(
    actual: torch.Tensor,
    truth: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    guessed: bool = False,
) -> Diagnosis | None:
    """:data:`STATISTICS_OVERFLOW` when ``actual`` (out, given ``bias``, or grad_x: of rows
    ``x``, whose statistics a kernel keeps in ``dtype``) is wrong on the valid rows whose
    statistics overflow ``dtype`` and on no other, as an overflow leaves a row: NaN or inf
    (an infinite mean), or what a zero rstd gives (an infinite variance): out's bias, a
    grad_x of zeros; on at least half of those rows, and on every row whose mean square too
    is beyond ``dtype`` (which no kernel's statistics hold). Its ``distance``: the result's
    from what the overflow leaves (the truth on other rows); 0 where every wrong row's mean
    square is beyond ``dtype`` and the kernel's statistics are known to be in it (not
    ``guessed``): a formula's float64 output says nothing of such a kernel there, whose
    every statistic overflows, so no formula can be closer.

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [300.0, -300.0]], dtype=torch.float64)
        >>> truth = torch.tensor([[-1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        >>> actual = torch.tensor([[-1.0, 1.0], [float("nan"), 0.0]], dtype=torch.float64)
        >>> overflow_match(actual, truth, x, torch.tensor([True, True]), torch.float16).mistake
        'statistics_overflow'
    """
    channels = truth.shape[-1]
    over = overflowing_rows(x, valid, dtype)
    if not bool(over.any()):
        return None
    result = actual.reshape(-1, channels).double()
    reference = truth.reshape(-1, channels).double()
    finite = result.isfinite().all(dim=1)
    # A row whose values are all one in ``dtype`` (rows of 1e4 + N(0, 0.1) in float16) is
    # left as a zero rstd leaves it by its spread rounded away, which explains it as well:
    # only NaN or inf there (an infinite sum) is evidence of an overflow.
    low, high = x.reshape(-1, channels).to(dtype).aminmax(dim=1)
    over &= ~((low == high) & low.isfinite() & finite)
    # A row of one value in x as given is no evidence either way: NaN there is as much a 0/0
    # (its variance 0, and no eps) as an overflow's (float16 rows of 1e4 + N(0, 0.5)).
    low, high = x.reshape(-1, channels).aminmax(dim=1)
    over &= low != high
    if not bool(over.any()):
        return None
    zero_rstd = torch.zeros(channels, dtype=torch.float64) if bias is None else bias.double()
    # A zero rstd gives bias itself (grad_x: zeros), to the result's rounding: a variance far
    # too large but finite (a Welford kernel's, 1.6e6 for 0.01) leaves the rows near it only.
    near = 4 * torch.finfo(actual.dtype).eps * zero_rstd.abs().amax() + 1e-30
    collapsed = (result - zero_rstd).abs().amax(dim=1) <= near
    # Rows wrong beyond the result's own rounding (a bfloat16 row is never the float64 truth's
    # bits): 16 of its ulps of the row's largest value, far below what an overflow leaves.
    tolerance = 16 * torch.finfo(actual.dtype).eps
    size = reference.abs().amax(dim=1, keepdim=True) * tolerance
    close = torch.isclose(result, reference, rtol=tolerance, atol=0.0)
    off = ~(close | ((result - reference).abs() <= size))  # NaN: off
    wrong = off.any(dim=1) & valid.reshape(-1)
    if not bool(wrong.any()) or bool((wrong & ~over).any()):
        return None
    # Rows whose mean square too is beyond the dtype overflow whatever a kernel keeps (a sum
    # or a mean of squares): each is wrong if the statistics overflow (NaN on a row's own
    # 0/0 may stand on most rows, but not on these alone).
    surely = over & overflowing_rows(x.double() / math.sqrt(channels), valid, dtype)
    if bool((surely & ~wrong).any()):
        return None
    shaped = wrong & (~finite | collapsed)
    if 2 * int(shaped.sum()) < int(over.sum()) or not bool(shaped[wrong].all()):
        return None
    mistake = OVERFLOWING[RANGE_OF.get(dtype, dtype)]
    if guessed or bool((wrong & ~surely).any()):
        # Its rows of NaN or inf are what it leaves; its finite wrong rows, a zero rstd's.
        rows = ~(wrong & ~finite)
        left = torch.where(wrong.unsqueeze(1), zero_rstd, reference)[rows]
        size = float(reference[rows].norm())
        distance = float((result[rows] - left).norm()) / size if size > 0 else 0.0
    else:
        distance = 0.0
    return Diagnosis(mistake.name, mistake.description, mistake.fix, distance)
