"""Whether a result's errors have a coarser dtype's granularity: the evidence a precision cause
needs before it is named.

Errors of the size a float16 kernel makes are not enough to say "float16 rounding": a formula
mistake (the mean divided by C - 1, a term of the backward divided by C - 1) errs by as much.
What rounding to a dtype leaves, and no formula does, is its grid: a row sum accumulated in
float16 is a float16 number, and so is every value rounded to it on the way. So each valid row
of the sample gives back what the kernel computed from it, by least squares
(:func:`recovered`): for out, the mean and variance it normalized with (``(out - bias) / scale
= r * (x - m)``); for grad_x, the two means of its backward (``grad_x / rstd - wdy = -c1 *
xhat - c2``); and for out, element by element, ``(out - bias) / scale`` itself (xhat rounded on
the way). A quantity (or C times it, a sum) lies on the dtype's grid when it is within three
standard errors of its fit of a number of that dtype; the result has the dtype's granularity
when, of the rows (or elements) where the grid is at least :data:`RESOLVED` standard errors
wide (where a value off the grid would rarely land on it by chance), at least
:data:`ON_GRID` of them lie on it, at grid points that chance puts them at less than
:data:`CHANCE` of the time (one statistic every row shares lands them all on one number, which
counts once), and there are :data:`MIN_RESOLVED` or more.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from maskln_cli.verify.sample import Sample

RESOLVED = 30.0
"""A value's grid is resolved where its spacing is this many standard errors of the value
(three either side of a grid point then covers a fifth of it at most)."""
ON_GRID = 0.8
"""The share of resolved values that must lie on the grid."""
MIN_RESOLVED = 8
"""Resolved values needed for a verdict (rows, or elements)."""
CHANCE = 0.2**4
"""How likely the values on the grid may be there by chance, at most: each distinct grid point
they stand on counts once, as likely as six of its best value's standard errors are of the
spacing (a fifth at the resolution's limit), so four points at that limit do. A formula mistake
giving every row one statistic (out times 1.01 at eps 1: each row's variance times C recovered
as about -5) lands all its rows on one number, near a grid point one time in five; a statistic
stored in bfloat16 (every row's mean 1000 exactly) lands there to far finer errors."""


def coarsest(
    name: str, sample: Sample, truth: torch.Tensor, dtypes: list[torch.dtype]
) -> torch.dtype | None:
    """The dtype of ``dtypes`` whose granularity ``sample``'s result for ``name`` (out or
    grad_x) has (see the module's docstring; ``truth`` is the sample's float64 truth); of two,
    the one whose grid is the coarser on those values (a bfloat16 number is a float16 one too,
    and a float16 subnormal a bfloat16 one), where they lie on it beyond the chance of a point
    of the finer grid (:func:`on_grid`'s ``finer``). None: it has none's, or either's."""
    import torch

    candidates = recovered(name, sample, truth)
    if not candidates:
        return None
    # The truth's own values, judged with the result's error bars: where they too lie on a
    # grid, the data put them there, not a kernel (rows about 1e4 have means near 10,000, a
    # float16 number, and a wrong kernel's wide error bars reach it).
    truths = recovered(name, sample, truth, actual=truth) or [None] * len(candidates)

    def coarseness(dtype: torch.dtype, finer: torch.dtype | None) -> float | None:
        """The coarsest grid of ``dtype`` some candidate lies on (None: none does)."""
        found = None
        for (value, error), truth_candidate in zip(candidates, truths, strict=True):
            relative = on_grid(value, error, dtype, finer)
            if relative is None or (found is not None and relative <= found):
                continue
            if (
                truth_candidate is not None
                and on_grid(truth_candidate[0], error, dtype) is not None
            ):
                continue
            found = relative
        return found

    best, coarsest_seen = None, -math.inf
    for dtype in dtypes:
        relative = coarseness(dtype, None)
        if relative is not None and relative > coarsest_seen:
            best, coarsest_seen = dtype, relative
    # Values on the coarser grid lie on the finer one too: the coarser is named only where
    # they are on it beyond what a point of the finer grid is by chance; else either may be.
    # The result's own dtype is a finer grid too (a float16 kernel's means of 1000.0, stored
    # in its own dtype, are bfloat16 numbers as one float16 number in eight there is).
    if best is None:
        return None
    own = sample.actual.dtype
    finer = [d for d in {*dtypes, own} if torch.finfo(d).eps < torch.finfo(best).eps]
    if finer and coarseness(best, max(finer, key=lambda d: torch.finfo(d).eps)) is None:
        return None
    return best


def on_grid(
    value: torch.Tensor,
    error: torch.Tensor,
    dtype: torch.dtype,
    finer: torch.dtype | None = None,
) -> float | None:
    """Whether the values (with their standard errors) lie on ``dtype``'s grid, as
    :func:`coarsest` asks: if they do, the grid's mean spacing relative to them (log2), else
    None.

    Example:
        >>> import torch
        >>> values = torch.linspace(1, 2, 50, dtype=torch.float64)
        >>> noise = torch.full_like(values, 1e-9)
        >>> round(on_grid(values.half().double() + 1e-10, noise, torch.float16), 1)
        -10.5
        >>> on_grid(values, noise, torch.float16) is None
        True
    """

    finite = value.isfinite() & error.isfinite() & (value != 0)
    value, error = value[finite], error[finite]
    spacing = grid_spacing(value, dtype)
    resolved = spacing >= RESOLVED * error
    if int(resolved.sum()) < MIN_RESOLVED:
        return None
    value, error, spacing = value[resolved], error[resolved], spacing[resolved]
    near = (value - value.to(dtype).double()).abs() <= 3 * error + 1e-300
    if float(near.double().mean()) < ON_GRID:
        return None
    import torch

    # Each distinct point by chance: 6 error / spacing of its best-resolved value; or, where
    # a ``finer`` dtype's grid holds it too, as often as a point of that grid is one of this
    # (a float16 kernel's means of 3.0 are bfloat16 numbers too: one in eight is).
    points, which = value[near].to(dtype).unique(return_inverse=True)
    odds = 6 * error[near] / spacing[near]
    if finer is not None:
        odds = torch.maximum(odds, grid_spacing(value[near], finer) / spacing[near])
    odds = odds.clamp(max=1.0)
    best = torch.ones(len(points), dtype=torch.float64).scatter_reduce(0, which, odds, "amin")
    if float(best.log().sum()) > math.log(CHANCE):
        return None
    return float((spacing / value.abs()).log2().mean())


def grid_spacing(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype``'s spacing of numbers at each of ``value`` (its subnormals' below its normal
    range; its largest binade's beyond it).

    Example:
        >>> import torch
        >>> values = torch.tensor([1.0, 3.0, 1e-7], dtype=torch.float64)
        >>> grid_spacing(values, torch.float16).tolist()
        [0.0009765625, 0.001953125, 5.960464477539063e-08]
    """
    import torch

    info = torch.finfo(dtype)
    magnitude = value.abs().clamp(min=info.tiny, max=info.max)
    spacing = torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps
    return spacing.clamp(min=info.tiny * info.eps)  # subnormals


def recovered(
    name: str, sample: Sample, truth: torch.Tensor, actual: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the kernel computed, recovered from its result row by row, with standard errors:
    (values, errors) pairs, each a candidate to lie on a grid. ``actual``: another result of
    the sample's shape to recover them from (the truth); None: the sample's own."""

    problem = sample.problem
    channels = problem.channels
    valid = sample.valid.reshape(-1)
    actual = (sample.actual if actual is None else actual).reshape(-1, channels)[valid].double()
    x = sample.x.reshape(-1, channels)[valid].double()
    if not len(actual) or channels < 3 or not bool(actual.isfinite().all()):
        return []
    mean = x.mean(dim=1, keepdim=True)
    centered = x - mean
    rstd = (centered.square().mean(dim=1, keepdim=True) + problem.eps).rsqrt()
    found = []
    if name == "out":
        scale, bias = problem.scale, problem.bias
        usable = scale.abs() > 1e-3 * float(scale.abs().max())
        y = ((actual - bias) / scale)[:, usable]
        # y = r * (x - m): slope r and intercept -r * m by least squares on each row.
        slope, intercept, residual = _line(x[:, usable], y)
        spread = _spread(x[:, usable])
        count = int(usable.sum())
        slope_error = residual / spread
        m = -intercept / slope
        m_error = residual / (math.sqrt(count) * slope.abs())
        var = slope.square().reciprocal() - problem.eps
        var_error = 2 * slope_error / slope.abs() ** 3
        found += [(m, m_error), (m * channels, m_error * channels)]
        found += [(var, var_error), (var * channels, var_error * channels)]
        # Element by element: xhat rounded on the way (its float32 rounding as the error).
        element_error = (y.abs() + (bias / scale)[usable].abs()) * 2**-24
        found.append((y.reshape(-1), element_error.reshape(-1)))
    elif sample.grad_out is not None:
        dy = sample.grad_out.reshape(-1, channels)[valid].double()
        wdy = dy * problem.scale
        xhat = centered * rstd
        z = actual / rstd - wdy  # = -c1 * xhat - c2
        slope, intercept, residual = _line(xhat, z)
        c1, c2 = -slope, -intercept
        c1_error = residual / _spread(xhat)
        c2_error = residual / math.sqrt(channels)
        found += [(c1, c1_error), (c1 * channels, c1_error * channels)]
        found += [(c2, c2_error), (c2 * channels, c2_error * channels)]
    return found


def _line(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's least-squares line ``y = slope * x + intercept``, and the rms of its
    residual (the standard error of one value)."""
    x_mean, y_mean = x.mean(dim=1, keepdim=True), y.mean(dim=1, keepdim=True)
    dx, dy = x - x_mean, y - y_mean
    slope = (dx * dy).sum(dim=1, keepdim=True) / dx.square().sum(dim=1, keepdim=True)
    intercept = y_mean - slope * x_mean
    fitted = slope * x + intercept
    freedom = max(x.shape[1] - 2, 1)
    residual = ((y - fitted).square().sum(dim=1, keepdim=True) / freedom).sqrt()
    return slope.squeeze(1), intercept.squeeze(1), residual.squeeze(1)


def _spread(x: torch.Tensor) -> torch.Tensor:
    """Each row's ``sqrt(sum((x - mean)**2))``: how well it determines a slope."""
    return (x - x.mean(dim=1, keepdim=True)).square().sum(dim=1).sqrt()
