"""The families of data the clauses draw from, beside random rows: the inputs real mistakes live
in, which random data never makes (issue 32). Each case names its family at the start of its
label (``[constant rows] x [2, 5, 8] float64, ...``), so that a failing clause says which family
failed.

:data:`FAMILIES` is the catalogue, in words; the builders make each family's float64 rows
(:func:`constant_rows`, :func:`zero_holding_rows`, :func:`eps_rows`), the eps range
(:data:`EPS_RANGE`), the channel counts (:data:`PRIME_CHANNELS`), the upstream gradients'
layouts (:data:`UPSTREAM_LAYOUTS`), and :func:`family_cases`, the cases most clauses add to their
own: constant rows, exact zeros, C = 1 and a prime C.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from maskln_cli.grading.clauses import draws
from maskln_cli.grading.clauses.cases import RANDOM, Case, describe_inputs, make_case

CONSTANT = "constant rows"
ZEROS = "exact zeros"
EPS = "eps range"
ONE_CHANNEL = "C = 1"
PRIME = "prime C"
UPSTREAM = "strided upstream"
POISONED = "poisoned padding"
WIDE = "wide rows"
OFFSET = "offset rows"
LAYOUT = "strided inputs"
WORKED = "worked example"
TIES = "exact ties"
IDENTITY = "identity affine"
HUGE = "huge magnitudes"
TINY = "tiny magnitudes"
HEAVY = "heavy tails"
ZERO_ROWS = "rows of zeros"

FAMILIES: dict[str, str] = {
    RANDOM: "random rows: mean within twice the spread, row variances from 1e-8 to 4",
    CONSTANT: "valid rows that are constant (zero variance): the output is bias, and the"
    " gradient w.r.t. x is (dy * scale - its mean) / sqrt(eps), large, not 0",
    ZEROS: "valid rows holding exact zeros (as after a ReLU), one of them all zeros: zeros are"
    " values, not padding",
    EPS: "eps 1e-12, 1e-8, 1e-5, 0.1, 3 and 10, each on rows whose variance is 0.01, 1 and 100"
    " times eps (where eps decides the result)",
    ONE_CHANNEL: "C = 1: every valid row is constant, its output bias, its gradient w.r.t. x 0",
    PRIME: "a prime number of channels (7, 13, 31, 2,039): no vector width or block divides it",
    UPSTREAM: "upstream gradients (3-D) transposed, channels-transposed, stepped, expanded"
    " (stride 0) and a scalar's (out.sum().backward())",
    POISONED: "NaN, ±inf and 1e30 in invalid rows",
    WIDE: "wide or many rows (C up to 8,192, thousands of rows)",
    OFFSET: "float32 rows far from zero against their spread (1e4 ± 0.1)",
    LAYOUT: "inputs of any strides: permuted, stepped, expanded, channels-strided",
    WORKED: "the specification's worked example",
    TIES: "valid rows holding exact ties: elements equal to the row's mean, equal elements,"
    " zero deviations in a row that is not constant (where |x - mean|, sign(x - mean) and"
    " branches on x == mean have no derivative, or the wrong one)",
    IDENTITY: "scale all ones and bias all zeros, as a module initializes them (where a function"
    " that skips the identity affine gives scale and bias no gradient)",
    HUGE: "RMSNorm: rows of magnitude 1e12 (float32) and 1e100 (float64), whose squares are"
    " far beyond float16's range (and rstd**3, in the backward, near the bottom of the dtype's)",
    TINY: "RMSNorm: rows of magnitude 1e-9 (float32) and 1e-75 (float64), with eps 0.01, 1 and"
    " 100 times their mean square: where eps decides, far below float16's range",
    HEAVY: "RMSNorm: heavy-tailed rows (log-normal magnitudes, a few entries 1,000 times"
    " larger): one entry decides the mean square",
    ZERO_ROWS: "RMSNorm: valid rows all zeros, where mean(x**2) = 0: rstd is 1 / sqrt(eps),"
    " the output 0 and the gradient w.r.t. x dy * scale / sqrt(eps), large, not NaN",
}
"""Every family a case can belong to, and what it holds."""

EPS_RANGE = (1e-12, 1e-8, 1e-5, 0.1, 3.0, 10.0)
EPS_SPREADS = (0.1, 1.0, 10.0)
"""Row spreads of the eps family, times sqrt(eps): variances 0.01, 1 and 100 times eps."""
PRIME_CHANNELS = (7, 13, 31)
CONSTANT_VALUES = (-1.5, 0.375, 2.0, -0.25, 1.0, 0.625)
"""Constants of the constant rows: binary fractions, so that any way of summing C of them and
dividing by C gives them back (a correct float32 kernel's x - mean is exactly 0). Rows of
zeros are the exact-zeros family's."""


def family_of(label: str) -> str | None:
    """The family a case's label names, or None.

    Example:
        >>> family_of("[C = 1] x [2, 5, 1] float32, eps 1e-05, contiguous")
        'C = 1'
    """
    if label.startswith("["):
        name, close, _ = label[1:].partition("] ")
        if close and name in FAMILIES:
            return name
    return None


ZERO_VARIANCE_EPS = 0.1
"""eps of rows of zero variance (constant rows, C = 1) in float32: a correct kernel's mean of
such a row may round (a product with 1 / C, a fused Welford), and its x - mean of about 6e-8
times x is divided by sqrt(var + eps); at eps 1e-5 that is 2e-5 times x, the size of the float32
tolerance itself."""


def eps_for(family: str, dtype: torch.dtype, eps: float = 1e-5) -> float:
    """The eps a case of ``family`` in ``dtype`` uses: :data:`ZERO_VARIANCE_EPS` for rows of
    zero variance in a precision below float64, else ``eps``.

    Example:
        >>> eps_for(ONE_CHANNEL, torch.float32), eps_for(ONE_CHANNEL, torch.float64)
        (0.1, 1e-05)
    """
    if family in (CONSTANT, ONE_CHANNEL) and dtype != torch.float64:
        return max(eps, ZERO_VARIANCE_EPS)
    return eps


def constant_rows(g: torch.Generator, leading: Sequence[int], channels: int) -> torch.Tensor:
    """Random rows (:func:`draws.rows`) of which every other one is constant."""
    x = draws.rows(g, leading, channels).reshape(-1, channels)
    values = torch.tensor(CONSTANT_VALUES, dtype=torch.float64)
    for index in range(0, x.shape[0], 2):
        x[index] = values[(index // 2) % len(values)]
    return x.reshape(*leading, channels)


def mask_for(
    family: str, x: torch.Tensor, g: torch.Generator, leading: Sequence[int]
) -> torch.Tensor:
    """A random mask for rows ``x`` of ``family`` (:func:`draws.mask`): for constant rows, with
    a constant row among the valid ones (:func:`with_a_valid_constant_row`)."""
    valid = draws.mask(g, leading)
    return with_a_valid_constant_row(x, valid) if family == CONSTANT else valid


def with_a_valid_constant_row(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``valid`` with a constant row of ``x`` among its valid rows: where the mask left every
    constant row out, the first one trades places with a valid row (as many rows stay valid),
    or is made valid where no row was (a single row). Data of the constant-rows family with no
    valid constant row test nothing of it: a probe confirming a cause there confirmed nothing
    (8 of 3,000 salts), and a clause's case, drawn with another seed, would check nothing."""
    flat = valid.reshape(-1)
    rows = x.reshape(flat.numel(), -1)
    constant = (rows == rows[:, :1]).all(-1)
    if bool((constant & flat).any()) or not bool(constant.any()):
        return valid
    swapped = flat.clone()
    if bool(flat.any()):
        swapped[int(flat.nonzero()[0])] = False
    swapped[int(constant.nonzero()[0])] = True
    return swapped.reshape(valid.shape)


def zero_holding_rows(g: torch.Generator, leading: Sequence[int], channels: int) -> torch.Tensor:
    """Rows as after a ReLU (about half their entries exactly 0), and one row all zeros."""
    x = draws.rows(g, leading, channels).clamp_min(0.0).reshape(-1, channels)
    if x.shape[0] > 1:
        x[1] = 0.0
    return x.reshape(*leading, channels)


TIE_DEVIATIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)
"""Deviations from the mean in rows of exact ties: binary fractions, so that every sum of a row
is exact, in float32 too, and its mean is exactly its middle value."""


def tie_rows(g: torch.Generator, leading: Sequence[int], channels: int) -> torch.Tensor:
    """Rows (C >= 3) whose elements are ``mean + d``: one or two deviations exactly 0 (elements
    equal to the mean), the others in pairs ``+a, -a``, the first pair twice (equal elements);
    means from :data:`CONSTANT_VALUES`, in random order."""
    rows = math.prod(leading)
    zeros = 1 if channels % 2 else 2
    x = torch.empty(rows, channels, dtype=torch.float64)
    for index in range(rows):
        picks = torch.randint(len(TIE_DEVIATIONS), ((channels - zeros) // 2,), generator=g)
        sizes = [TIE_DEVIATIONS[int(i)] for i in picks]
        sizes[-1] = sizes[0]  # a pair twice: equal elements
        deviations = [0.0] * zeros + [v for a in sizes for v in (a, -a)]
        order = torch.randperm(channels, generator=g)
        mean = CONSTANT_VALUES[index % len(CONSTANT_VALUES)]
        x[index] = mean + torch.tensor(deviations, dtype=torch.float64)[order]
    return x.reshape(*leading, channels)


def eps_rows(g: torch.Generator, leading: Sequence[int], channels: int, eps: float) -> torch.Tensor:
    """Rows whose variances are 0.01, 1 and 100 times eps (well conditioned)."""
    root = math.sqrt(eps)
    return draws.rows(g, leading, channels, spreads=[root * s for s in EPS_SPREADS], offset=2.0)


UPSTREAM_LAYOUTS: tuple[tuple[str, str, tuple[tuple[Any, ...], ...]], ...] = (
    ("transposed", "swap01", (("permute", (1, 0, 2)),)),
    ("channels-transposed", "swap12", (("permute", (0, 2, 1)),)),
    ("a stepped slice", "step1", (("step", 1, 2),)),
    ("expanded over the batch (stride 0)", "batch1", ()),
    ("a scalar's, out.sum().backward() (all strides 0)", "scalar", ()),
)
"""(words, how the base is shaped, views) of each upstream gradient layout, for x [B, N, C]."""


def upstream_case(
    g: torch.Generator,
    shape: tuple[int, int, int],
    layout: tuple[str, str, tuple[tuple[Any, ...], ...]],
    dtype: torch.dtype,
    eps: float = 1e-5,
) -> Case:
    """A random 3-D case whose upstream gradient has one of :data:`UPSTREAM_LAYOUTS`."""
    words, base_kind, views = layout
    b, n, c = shape
    x = draws.rows(g, (b, n), c)
    label = f"{describe_inputs(x, dtype, eps)}, the upstream gradient {words}"
    case = make_case(
        label, x, draws.mask(g, (b, n)), draws.params(g, c), eps, dtype, family=UPSTREAM
    )
    base_shape = {
        "swap01": (n, b, c),
        "swap12": (b, c, n),
        "step1": (b, 2 * n, c),
        "batch1": (1, n, c),
        "scalar": (),
    }[base_kind]
    base = torch.randn(base_shape, generator=g, dtype=torch.float64)
    if base_kind == "scalar":
        base = torch.tensor(1.0, dtype=torch.float64)
    case.grad_out = base.to(dtype)
    if base_kind in ("batch1", "scalar"):
        views = (("expand", (b, n, c)),)
    case.views = {"grad_out": views}
    return case


def family_cases(
    g: torch.Generator,
    leading: Sequence[int] = (2, 5),
    grad: bool = False,
    families: Sequence[str] = (CONSTANT, ZEROS, ONE_CHANNEL, PRIME),
    dtypes: Sequence[torch.dtype] = (torch.float64, torch.float32),
) -> list[Case]:
    """The cases a clause adds to its own, of each of ``families`` and ``dtypes``: constant
    rows, exact zeros, C = 1 and a prime C (7; 13 in float32); eps 1e-5 (:func:`eps_for`: 0.1
    for rows of zero variance in float32)."""
    cases = []
    for family in families:
        for dtype in dtypes:
            single = dtype == torch.float32
            eps = eps_for(family, dtype)
            channels = {ONE_CHANNEL: 1, PRIME: 13 if single else 7}.get(family, 8)
            if family == CONSTANT:
                x = constant_rows(g, leading, channels)
            elif family == ZEROS:
                x = zero_holding_rows(g, leading, channels)
            elif family == TIES:
                x = tie_rows(g, leading, channels)
            else:
                x = draws.rows(g, leading, channels)
            label = describe_inputs(x, dtype, eps)
            valid = mask_for(family, x, g, leading)
            params = draws.params(g, channels)
            if family == IDENTITY:
                params = (torch.ones(channels, dtype=torch.float64),
                          torch.zeros(channels, dtype=torch.float64))  # fmt: skip
            cases.append(make_case(label, x, valid, params, eps, dtype, g, grad, family=family))
    return cases


RMS_FAMILIES = (HUGE, TINY, HEAVY, ZERO_ROWS)
"""The RMSNorm exercise's own families (:func:`rms_cases`), beside those both exercises share
(constant rows, exact zeros, C = 1, a prime C, the eps range)."""
MAGNITUDES = {torch.float64: (1e100, 1e-75), torch.float32: (1e12, 1e-9)}
"""(huge, tiny) row magnitudes by dtype: as large and as small as a plain x.pow(2).mean() in
the input's dtype, forward and backward (whose rstd**3 is 1e-300 and 1e225, 1e-36 and 1e27),
gets right; torch's own F.rms_norm overflows in its backward beyond them (rows of 1e-150 and
eps 1e-302 in float64). A float16 mean square overflows or underflows on every one."""


def rms_rows(g: torch.Generator, family: str, leading: Sequence[int], channels: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, list[float]]:  # fmt: skip
    """float64 rows of an RMSNorm ``family`` for ``dtype``, and the eps of each case."""
    huge, tiny = MAGNITUDES[dtype]
    noise = torch.randn(*leading, channels, generator=g, dtype=torch.float64)
    if family == HUGE:
        return noise * huge, [1e-6]
    if family == TINY:
        return noise * tiny, [tiny * tiny * ratio for ratio in (0.01, 1.0, 100.0)]
    if family == HEAVY:
        spread = torch.exp(1.5 * torch.randn(noise.shape, generator=g, dtype=torch.float64))
        outliers = torch.rand(noise.shape, generator=g, dtype=torch.float64) < 0.05
        return noise * spread * torch.where(outliers, 1e3, 1.0), [1e-6]
    rows = noise.reshape(-1, channels)
    rows[::2] = 0.0  # every other row all zeros, valid or not
    return rows.reshape(noise.shape), [1e-6]


def rms_cases(
    g: torch.Generator,
    leading: Sequence[int] = (2, 5),
    grad: bool = False,
    dtypes: Sequence[torch.dtype] = (torch.float64, torch.float32),
) -> list[Case]:
    """The RMSNorm exercise's family cases (:data:`RMS_FAMILIES`), C = 16, in each dtype."""
    cases = []
    for family in RMS_FAMILIES:
        for dtype in dtypes:
            x, epsilons = rms_rows(g, family, leading, 16, dtype)
            for eps in epsilons:
                label = describe_inputs(x, dtype, eps)
                valid = draws.mask(g, leading)
                params = draws.params(g, 16)
                cases.append(make_case(label, x, valid, params, eps, dtype, g, grad,
                                       family=family))  # fmt: skip
    return cases
