"""Known mistakes in implementing masked layer normalization, and which one a result matches.

``maskln verify`` (a kernel's output file) and ``maskln grade`` (a function) both ask the same
question once a result is wrong: is it one of the usual mistakes? Each :class:`Mistake` is the
op written wrongly in one way, evaluated on the same inputs; :func:`diagnose_output` says which
of them a result is close to. :func:`diagnose_nan_gradient` explains NaN gradients that come
from unsanitized padding.

Formula mistakes are evaluated in float64, so a match does not depend on the result's dtype;
precision mistakes (a one-pass variance, :mod:`maskln_cli.op.one_pass`) are evaluated in the
result's dtype and recognized by the size of their error rather than its exact value, since two
one-pass kernels round differently. Dtype mistakes (:func:`diagnose_precision`: an output in
another dtype than x's, or computed in a lower precision) are recognized by the result's dtype
and by every value of it being a number of the lower precision. :data:`MORE_MISTAKES` holds
formulas the grader also tries (``diagnose_output(..., mistakes=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from maskln_cli.op.backward_mistakes import (
    BACKWARD_MISTAKES,
    RANGE_OF,
    STATISTICS_OVERFLOW,
    STATISTICS_OVERFLOW_DTYPE,
    overflow_match,
)
from maskln_cli.op.mistake_records import Catalogue, Diagnosis, Mistake, padding_mistakes
from maskln_cli.op.one_pass import ONE_PASS, one_pass_match
from maskln_cli.op.rms_mistakes import RMS_BACKWARD_MISTAKES, RMS_MISTAKES, rms_correct

__all__ = [
    "BACKWARD_MISTAKES",
    "CATALOGUES",
    "LOWER_PRECISION",
    "MISTAKES",
    "MORE_MISTAKES",
    "NEGATIVE_ZERO",
    "ONE_PASS",
    "PRECISION_MISTAKES",
    "RANGE_OF",
    "STATISTICS_OVERFLOW",
    "STATISTICS_OVERFLOW_DTYPE",
    "Diagnosis",
    "Mistake",
    "diagnose_gradient",
    "diagnose_nan_gradient",
    "diagnose_output",
    "diagnose_precision",
    "distances",
    "overflow_match",
    "relative_distance",
]

# --- the formulas --------------------------------------------------------------------------------


def _clean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), x, 0.0)


def _statistics(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(dim=dim, keepdim=True)
    return mean, (x - mean).square().mean(dim=dim, keepdim=True)


def _masked(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), y, 0.0)


def correct(x, valid, scale, bias, eps):
    """The op as specified (float64)."""
    x = _clean(x, valid)
    mean, var = _statistics(x)
    return _masked((x - mean) / torch.sqrt(var + eps) * scale + bias, valid)


def _with_xhat(
    make_xhat: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
):
    """A formula that differs from the correct one in how x is normalized only."""

    def formula(x, valid, scale, bias, eps):
        x = _clean(x, valid)
        mean, var = _statistics(x)
        return _masked(make_xhat(x, mean, var, eps) * scale + bias, valid)

    return formula


def _unbiased(x, mean, var, eps):
    channels = x.shape[-1]
    unbiased = var * channels / (channels - 1) if channels > 1 else torch.full_like(var, torch.nan)
    return (x - mean) / torch.sqrt(unbiased + eps)


def _with_affine(apply: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
    """A formula that normalizes correctly and applies scale and bias wrongly."""

    def formula(x, valid, scale, bias, eps):
        x = _clean(x, valid)
        mean, var = _statistics(x)
        return _masked(apply((x - mean) / torch.sqrt(var + eps), scale, bias), valid)

    return formula


def _wrong_axis(x, valid, scale, bias, eps):
    if x.dim() < 2:
        return torch.full_like(x, torch.nan)
    x = _clean(x, valid)
    mean, var = _statistics(x, dim=-2)
    return _masked((x - mean) / torch.sqrt(var + eps) * scale + bias, valid)


def _padding_returns_bias(x, valid, scale, bias, eps):
    return torch.where(valid.unsqueeze(-1), correct(x, valid, scale, bias, eps), bias)


def _padding_not_masked(x, valid, scale, bias, eps):
    mean, var = _statistics(x)
    return (x - mean) / torch.sqrt(var + eps) * scale + bias


def _rms_norm(x, valid, scale, bias, eps):
    x = _clean(x, valid)
    return _masked(
        x / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps) * scale + bias, valid
    )


MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "unbiased_variance",
            "unbiased variance (divides by C - 1)",
            "use the population variance: mean((x - mean)**2), or var(unbiased=False)",
            _with_xhat(_unbiased),
        ),
        Mistake(
            "eps_outside_sqrt",
            "eps added outside the square root: (x - mean) / (sqrt(var) + eps)",
            "add eps inside: (x - mean) / sqrt(var + eps)",
            _with_xhat(lambda x, mean, var, eps: (x - mean) / (torch.sqrt(var) + eps)),
        ),
        Mistake(
            "eps_missing",
            # An eps far below the rows' variance (BERT's 1e-12) gives the same rows.
            "eps missing (or far smaller than the reference's): (x - mean) / sqrt(var)",
            "add the reference's eps inside the square root: (x - mean) / sqrt(var + eps)",
            _with_xhat(lambda x, mean, var, eps: (x - mean) / torch.sqrt(var)),
        ),
        Mistake(
            "sqrt_missing",
            "no square root: (x - mean) / (var + eps)",
            "divide by the square root: (x - mean) / sqrt(var + eps)",
            _with_xhat(lambda x, mean, var, eps: (x - mean) / (var + eps)),
        ),
        Mistake(
            "scale_missing",
            "scale not applied: xhat + bias",
            "multiply by scale before adding bias: xhat * scale + bias",
            _with_affine(lambda xhat, scale, bias: xhat + bias),
        ),
        Mistake(
            "bias_missing",
            "bias not added: xhat * scale",
            "add bias after scaling: xhat * scale + bias",
            _with_affine(lambda xhat, scale, bias: xhat * scale),
        ),
        Mistake(
            "bias_before_scale",
            "bias added before scaling: (xhat + bias) * scale",
            "scale first, then add bias: xhat * scale + bias",
            _with_affine(lambda xhat, scale, bias: (xhat + bias) * scale),
        ),
        Mistake(
            "scale_bias_swapped",
            "scale and bias swapped: xhat * bias + scale",
            "xhat * scale + bias",
            _with_affine(lambda xhat, scale, bias: xhat * bias + scale),
        ),
        Mistake(
            "wrong_axis",
            "normalized over the positions axis (-2) instead of the channels (-1)",
            "take mean and variance over the last axis: dim=-1",
            _wrong_axis,
        ),
        Mistake(
            "rms_norm",
            "mean not subtracted (RMS normalization): x / sqrt(mean(x**2) + eps)",
            "subtract the row mean before dividing: (x - mean) / sqrt(var + eps)",
            _rms_norm,
        ),
        Mistake(
            "padding_returns_bias",
            "invalid rows return bias (the padding is normalized to 0, then bias added)",
            "zero every invalid output after adding bias: torch.where(valid[..., None], y, 0)",
            _padding_returns_bias,
        ),
        *padding_mistakes(_padding_not_masked, correct),
    )
}


CATALOGUES: dict[str, Catalogue] = {
    "layer": Catalogue(correct, MISTAKES, BACKWARD_MISTAKES, fitted=True),
    "rms": Catalogue(rms_correct, RMS_MISTAKES, RMS_BACKWARD_MISTAKES, fitted=False),
}
"""Each norm's catalogue, by the norm's name: one matching code for both (``norm=``)."""


def _affine_reset(x, valid, scale, bias, eps):
    return correct(x, valid, torch.ones_like(scale), torch.zeros_like(bias), eps)


def _unbiased_rescaled(x, valid, scale, bias, eps):
    """Right but for C = 1, where every valid output is NaN (0 * NaN)."""
    out = correct(x, valid, scale, bias, eps)
    if x.shape[-1] == 1:
        out = torch.where(valid.unsqueeze(-1), torch.nan, out)
    return out


def _eps_float32(x, valid, scale, bias, eps):
    return correct(x, valid, scale, bias, float(torch.tensor(eps, dtype=torch.float32)))


def _statistics_with_count(x, valid, scale, bias, eps, count):
    x = _clean(x, valid)
    mean = x.sum(dim=-1, keepdim=True) / count
    var = (x - mean).square().sum(dim=-1, keepdim=True) / count
    return _masked((x - mean) / torch.sqrt(var + eps) * scale + bias, valid)


def _over_valid_rows(x, valid, scale, bias, eps):
    count = valid.sum().clamp_min(1).to(x.dtype)
    return _statistics_with_count(x, valid, scale, bias, eps, count)


def _whole_tensor(x, valid, scale, bias, eps, padding_too=False):
    clean = _clean(x, valid)
    keep = valid.unsqueeze(-1).expand(x.shape)
    values = clean.reshape(-1) if padding_too else clean[keep]
    if values.numel() == 0:
        return torch.zeros_like(clean)
    mean = values.mean()
    var = (values - mean).square().mean()
    return _masked((clean - mean) / torch.sqrt(var + eps) * scale + bias, valid)


MORE_MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "parameters_reinitialized",
            "scale and bias replaced by ones and zeros (nn.init.ones_/zeros_ on them, or a"
            " fresh nn.LayerNorm's own parameters)",
            "use scale and bias as given: never create, reset or re-initialize them in the op",
            _affine_reset,
        ),
        Mistake(
            "eps_squared",
            "eps squared: (x - mean) / sqrt(var + eps**2), eps read as a standard deviation",
            "add eps itself to the variance: (x - mean) / sqrt(var + eps)",
            lambda x, valid, scale, bias, eps: correct(x, valid, scale, bias, eps**2),
        ),
        Mistake(
            "eps_float32",
            "eps held as a float32 tensor (torch.tensor(eps) in the default dtype): float64"
            " results lose precision where eps matters",
            "keep eps a Python float, or make it torch.tensor(eps, dtype=x.dtype)",
            _eps_float32,
        ),
        Mistake(
            "unbiased_rescaled",
            "the unbiased variance rescaled by (C - 1) / C: right for C > 1, but at C = 1"
            " x.var() divides by C - 1 = 0, and 0 * NaN is NaN",
            "compute the population variance directly: ((x - mean)**2).mean(-1), or"
            " x.var(-1, unbiased=False)",
            _unbiased_rescaled,
        ),
        Mistake(
            "statistics_over_valid_rows",
            "mean and variance divided by the number of valid positions instead of C (a masked"
            " mean over the sequence, not over the channels)",
            "average over the C channels of each row: x.mean(-1) and ((x - mean)**2).mean(-1);"
            " the mask only says which rows are zeroed",
            _over_valid_rows,
        ),
        Mistake(
            "statistics_over_whole_tensor",
            "one mean and one variance for the whole tensor (every valid element), as batch"
            " norm has, instead of one per row",
            "reduce over the last axis only, keepdim=True: x.mean(-1, keepdim=True)",
            _whole_tensor,
        ),
        Mistake(
            "statistics_over_whole_tensor_padded",
            "one mean and one variance for the whole tensor, padding's zeros included, instead"
            " of one per row",
            "reduce over the last axis only, keepdim=True: x.mean(-1, keepdim=True)",
            lambda x, valid, scale, bias, eps: _whole_tensor(x, valid, scale, bias, eps, True),
        ),
    )
}
"""Formulas the grader tries besides :data:`MISTAKES` (``diagnose_output(..., mistakes=...)``):
a function has no reason to give a plain layer norm's output, a kernel's output file may."""

NEGATIVE_ZERO = Mistake(
    "negative_zero",
    "invalid rows zeroed by multiplying by the mask: bias * 0 is -0.0 where bias is negative",
    "select instead of multiplying: torch.where(valid[..., None], y, 0.0) or"
    " y.masked_fill(~valid[..., None], 0.0) write +0.0",
    correct,  # recognized by the sign of its zeros, not by a formula
)

PRECISION_MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "output_float32",
            "the output is float32 for float64 inputs (a dtype hard-coded, or the result never"
            " cast back)",
            "return x's dtype: allocate with torch.empty_like(x) or finish with .to(x.dtype);"
            " never dtype=torch.float32",
            correct,
        ),
        Mistake(
            "output_lower_precision",
            "the output is in a lower precision than x (a dtype hard-coded, or the result never"
            " cast back)",
            "return x's dtype: allocate with torch.empty_like(x) or finish with .to(x.dtype)",
            correct,
        ),
        Mistake(
            "float64_not_cast_back",
            "computed in float64 and never cast back: the output is float64 for lower-precision"
            " inputs",
            "cast the result back to x's dtype: .to(x.dtype)",
            correct,
        ),
        Mistake(
            "computed_in_float32",
            "float64 inputs computed in float32 (every output value is a float32 number)",
            "compute float64 inputs in float64: no .float() or dtype=torch.float32 inside",
            correct,
        ),
        Mistake(
            "computed_in_float16",
            "computed in float16 (every output value is a float16 number): float16 arithmetic"
            " errs by about 1e-3",
            "compute in x's dtype (float32 at least); for speed, keep float32 accumulation",
            correct,
        ),
        Mistake(
            "computed_in_bfloat16",
            "computed in bfloat16 (every output value is a bfloat16 number): bfloat16 arithmetic"
            " errs by about 1e-2",
            "compute in x's dtype (float32 at least); for speed, keep float32 accumulation",
            correct,
        ),
    )
}
"""Dtype and precision mistakes, recognized by :func:`diagnose_precision` (their ``formula`` is
a placeholder)."""

LOWER_PRECISION: dict[str, torch.dtype | None] = {
    "output_float32": torch.float32,
    "output_lower_precision": None,  # the output's own dtype
    "float64_not_cast_back": torch.float64,
    "computed_in_float32": torch.float32,
    "computed_in_float16": torch.float16,
    "computed_in_bfloat16": torch.bfloat16,
}
"""The precision each dtype mistake computes or returns in (None: the result's own dtype)."""

# --- matching ------------------------------------------------------------------------------------

MATCH_DISTANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""A result matches a formula mistake within this relative L2 distance, for the result's dtype
(a few times that dtype's rounding of a normalized output)."""


PADDING_MISTAKES = ("padding_not_masked", "mask_inverted")
"""Mistakes told by what the padding holds: with every row valid, nothing tells them (an
inverted mask zeroes every row, as a gain of 0 does)."""


def diagnose_output(
    actual: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dtype: torch.dtype | None = None,
    *,
    noise: float | None = None,
    mistakes: dict[str, Mistake] | None = None,
    norm: str = "layer",
) -> list[Diagnosis]:
    """The known mistakes ``actual`` (an output of the op on these inputs) matches, best first.

    ``dtype`` is the dtype the result was computed in (default: ``actual``'s). A mistake matches
    when the result is within :data:`MATCH_DISTANCE` of its output and ten times closer to it
    than to the correct output. ``noise``, when given, is the relative L2 error a correct
    implementation in ``dtype`` makes on these rows (PyTorch's, say): on rows with a large
    offset it is well above :data:`MATCH_DISTANCE`, and a mistake then matches within three
    times it, when three times closer to it than to the correct output. An empty list: the
    result is wrong in no known way (or right). ``mistakes``: the formulas tried (default
    :data:`MISTAKES`, or the ``norm``'s catalogue of :data:`CATALOGUES`).

    Example:
        >>> x = torch.tensor([[1.0, 3.0, 4.0], [5.0, 5.0, 9.0]], dtype=torch.float64)
        >>> valid, scale, bias = torch.tensor([True, True]), torch.ones(3), torch.zeros(3)
        >>> wrong = (x - x.mean(-1, True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)
        >>> [d.mistake for d in diagnose_output(wrong, x, valid, scale, bias, 1e-5)]
        ['unbiased_variance']
    """
    dtype = dtype or actual.dtype
    catalogue = CATALOGUES[norm]
    x64, scale64, bias64 = x.double(), scale.double(), bias.double()
    result = actual.double()
    truth = catalogue.correct(x64, valid, scale64, bias64, eps)
    to_truth = _distance(result, truth)
    if to_truth == 0.0:
        return []

    def output(mistake: Mistake) -> torch.Tensor:
        with torch.no_grad():
            return mistake.formula(x64, valid, scale64, bias64, eps)

    def own_noise(mistake: Mistake, exact: torch.Tensor) -> float:
        """How far the mistake's formula computed in float32 is from its float64 value: a
        kernel making it errs by about that, not by a correct kernel's ``noise`` (rows with
        a large offset: centering loses digits that RMS normalization does not)."""
        with torch.no_grad():
            rounded = mistake.formula(x.float(), valid, scale.float(), bias.float(), eps)
        return _distance(rounded.double(), exact)

    tried = catalogue.mistakes if mistakes is None else mistakes
    if bool(valid.all()):  # no padding: no evidence of a padding mistake (zeros match one)
        tried = {name: m for name, m in tried.items() if name not in PADDING_MISTAKES}
    own = own_noise if dtype == torch.float32 else None
    found = _matching(result, truth, tried.values(), output, dtype, noise, own)
    if catalogue.fitted:  # a one-pass variance's model is of centered rows
        one_pass = one_pass_match(result, truth, x64, valid, scale64, bias64, eps, dtype)
        if one_pass is not None:
            found.append(one_pass)
    return sorted(found, key=lambda d: d.distance)


def diagnose_precision(
    actual: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    norm: str = "layer",
) -> list[Diagnosis]:
    """The dtype mistake ``actual`` (an output of the op on these inputs) shows, if any: its
    dtype is not x's, or every finite value of it is a number of a lower precision (float32 for
    a float64 x; float16 or bfloat16) while the truth, in x's dtype, is not.

    Example:
        >>> x = torch.randn(4, 16, dtype=torch.float64)
        >>> valid, scale, bias = torch.ones(4, dtype=torch.bool), torch.ones(16), torch.zeros(16)
        >>> low = correct(x.float(), valid, scale, bias, 1e-5).double()
        >>> [d.mistake for d in diagnose_precision(low, x, valid, scale, bias, 1e-5)]
        ['computed_in_float32']
    """
    if not (actual.is_floating_point() and x.is_floating_point()):
        return []
    name = None
    if actual.dtype != x.dtype:
        if actual.dtype == torch.float64:
            name = "float64_not_cast_back"
        elif x.dtype == torch.float64 and actual.dtype == torch.float32:
            name = "output_float32"
        elif actual.dtype.itemsize < x.dtype.itemsize:
            name = "output_lower_precision"
    else:
        with torch.no_grad():
            args = (x.double(), valid, scale.double(), bias.double(), eps)
            truth = CATALOGUES[norm].correct(*args).to(x.dtype)
        for lower in (torch.bfloat16, torch.float16, torch.float32):
            if lower.itemsize >= x.dtype.itemsize or lower == x.dtype:
                continue
            if _all_representable(actual, lower) and not _mostly_representable(truth, lower):
                name = f"computed_in_{str(lower).removeprefix('torch.')}"
                break
    if name is None:
        return []
    mistake = PRECISION_MISTAKES[name]
    return [Diagnosis(mistake.name, mistake.description, mistake.fix, 0.0)]


def _representable(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Which finite, nonzero elements of ``t`` are numbers of ``dtype`` (bool, those only)."""
    t = t.detach()
    keep = t.isfinite() & (t != 0)
    values = t[keep]
    return values.to(dtype).to(values.dtype) == values


def _all_representable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    exact = _representable(t, dtype)
    return exact.numel() >= 4 and bool(exact.all())


def _mostly_representable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    exact = _representable(t, dtype)
    return exact.numel() < 4 or float(exact.double().mean()) > 0.5


def relative_distance(result: torch.Tensor, reference: torch.Tensor) -> float:
    """``||result - reference|| / ||reference||`` over the elements finite in both (how far a
    result is from the truth, as :func:`diagnose_output`'s ``noise`` wants it).

    Example:
        >>> relative_distance(torch.tensor([3.0, float("nan")]), torch.tensor([4.0, 1.0]))
        0.25
    """
    both = result.isfinite() & reference.isfinite()
    size = reference[both].double().norm()
    difference = (result[both].double() - reference[both].double()).norm()
    if size == 0:
        return 0.0 if difference == 0 else float("inf")
    return float(difference / size)


def _distance(result: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative L2 distance over finite values; NaN or inf in different places (or different
    infinities) make it infinite."""
    difference = (result - reference).norm()
    size = reference.norm()
    if not (difference.isfinite() and size.isfinite()):  # else every value is finite in both
        finite = reference.isfinite()
        if not torch.equal(result.isfinite(), finite):
            return float("inf")
        if not torch.equal(result[~finite].nan_to_num(0.0), reference[~finite].nan_to_num(0.0)):
            return float("inf")
        difference = (result[finite] - reference[finite]).norm()
        size = reference[finite].norm()
    if size == 0:
        return 0.0 if difference == 0 else float("inf")
    return float(difference / size)


def _limit(dtype: torch.dtype, noise: float | None) -> tuple[float, float]:
    """How close a result must be to a mistake's output, and how many times closer to it than
    to the truth. With rounding noise n, a result that is the mistake plus noise is about n
    from the mistake: it matches within 3n, when the mistake stands three times above it."""
    limit = MATCH_DISTANCE.get(dtype, 1e-4)
    if noise is None or not noise < float("inf") or 3 * noise <= limit:
        return limit, 10.0
    return 3 * noise, 3.0


def _matching(
    result: torch.Tensor,
    truth: torch.Tensor,
    mistakes: Iterable[Mistake],
    result_of: Callable[[Mistake], torch.Tensor],
    dtype: torch.dtype,
    noise: float | None,
    own_noise: Callable[[Mistake, torch.Tensor], float] | None = None,
) -> list[Diagnosis]:
    """The mistakes ``result`` matches (unsorted), by the rule of :func:`diagnose_output`:
    ``result_of(mistake)`` is what that mistake gives (an output, or a gradient), and
    ``truth`` the correct one. A mistake that gives the truth here (bias missing where bias
    is 0; a backward term dropped, for grad_scale) cannot be told from it, nor one within
    ``closer`` times the dtype's rounding (or ``noise``) of it: it is not tried. With
    ``own_noise(mistake, its float64 value)``, a mistake matches within ten times its own
    formula's rounding at most."""
    limit, closer = _limit(dtype, noise)
    to_truth = _distance(result, truth)
    finite_noise = noise if noise is not None and noise < float("inf") else 0.0
    resolution = closer * max(torch.finfo(dtype).eps / 2, finite_noise)
    found = []
    for mistake in mistakes:
        value = result_of(mistake)
        distance = _distance(result, value)
        told = _distance(value, truth) > resolution  # the mistake is not the truth here
        fits = distance <= limit and distance * closer <= to_truth and told
        if fits and own_noise is not None:
            fits = distance <= max(MATCH_DISTANCE.get(dtype, 1e-4), 10 * own_noise(mistake, value))
        if fits:
            found.append(Diagnosis(mistake.name, mistake.description, mistake.fix, distance))
    return found


GRADIENTS = ("grad_x", "grad_scale", "grad_bias")


def diagnose_gradient(
    actual: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    grad_out: torch.Tensor,
    eps: float,
    dtype: torch.dtype | None = None,
    *,
    noise: float | None = None,
    mistakes: dict[str, Mistake] | None = None,
    name: str = "grad_x",
    norm: str = "layer",
) -> list[Diagnosis]:
    """The known mistakes a gradient ``actual`` (``name``: w.r.t. x, or grad_scale or
    grad_bias) matches, best first: for each formula of :data:`MISTAKES` the gradient of
    ``sum(mistake(x) * grad_out)`` (a backward pass written from the same wrong formula), and
    for each of :data:`BACKWARD_MISTAKES` its own backward (or those of ``mistakes``), by the
    rule of :func:`diagnose_output`.

    Example:
        >>> x = torch.tensor([[1.0, 3.0, 4.0], [5.0, 5.0, 9.0]], dtype=torch.float64)
        >>> valid, scale, bias = torch.tensor([True, True]), torch.ones(3), torch.zeros(3)
        >>> dy = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], dtype=torch.float64)
        >>> leaf = x.clone().requires_grad_()
        >>> wrong = (leaf - leaf.mean(-1, True)) / torch.sqrt(leaf.var(-1, keepdim=True) + 1e-5)
        >>> (dx,) = torch.autograd.grad(wrong, leaf, dy)
        >>> [d.mistake for d in diagnose_gradient(dx, x, valid, scale, bias, dy, 1e-5)]
        ['unbiased_variance']
    """
    dtype = dtype or actual.dtype
    catalogue = CATALOGUES[norm]
    x64, scale64, bias64 = x.double(), scale.double(), bias.double()
    upstream = torch.where(valid.unsqueeze(-1), grad_out.double(), 0.0)
    upstream = upstream.nan_to_num(0.0, 0.0, 0.0)
    result = actual.double()
    which = GRADIENTS.index(name)

    def gradient(mistake: Mistake) -> torch.Tensor:
        if mistake.gradients is not None:
            return mistake.gradients(x64, valid, scale64, bias64, eps, grad_out.double())[which]
        leaves = [t.detach().requires_grad_() for t in (x64, scale64, bias64)]
        with torch.enable_grad():
            out = mistake.formula(leaves[0], valid, leaves[1], leaves[2], eps)
            grad = torch.autograd.grad(out, leaves[which], upstream, allow_unused=True)[0]
        return torch.zeros_like(leaves[which]) if grad is None else grad

    truth = gradient(Mistake("", "", "", catalogue.correct))
    if _distance(result, truth) == 0.0:
        return []
    tried = {**catalogue.mistakes, **catalogue.backward} if mistakes is None else mistakes
    found = _matching(result, truth, tried.values(), gradient, dtype, noise)
    return sorted(found, key=lambda d: d.distance)


def distances(
    actual: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mistake: Mistake,
    grad_out: torch.Tensor | None = None,
    norm: str = "layer",
) -> tuple[float, float]:
    """How far ``actual`` (out, or grad_x given ``grad_out``) is from what ``mistake`` gives,
    and from the truth: relative L2 distances (:func:`relative_distance`), in float64."""
    catalogue = CATALOGUES[norm]
    x64, scale64, bias64 = x.double(), scale.double(), bias.double()

    def value(formula: Callable[..., torch.Tensor]) -> torch.Tensor:
        leaf = x64.detach().requires_grad_(grad_out is not None)
        with torch.enable_grad():
            out = formula(leaf, valid, scale64, bias64, eps)
            if grad_out is None:
                return out.detach()
            upstream = torch.where(valid.unsqueeze(-1), grad_out.double(), 0.0).nan_to_num(0.0)
            (grad,) = torch.autograd.grad(out, leaf, upstream, allow_unused=True)
        return torch.zeros_like(leaf) if grad is None else grad

    result = actual.double()
    return (
        relative_distance(result, value(mistake.formula)),
        relative_distance(result, value(catalogue.correct)),
    )


def diagnose_nan_gradient(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    grad_out: torch.Tensor | None = None,
    eps: float | None = None,
) -> Diagnosis | None:
    """When gradient ``name`` holds NaN (or inf) where the reference is finite and the padding
    holds NaN or inf, say so and why: 0 * NaN is NaN. Not where a clean padding row gives NaN
    too in ``actual``'s dtype (given ``eps``: a zero row's rstd, ``1 / sqrt(eps)``, beyond its
    largest value, as float16's is at eps 1e-12): the padding is then no confirmed cause.

    Example:
        >>> x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0]])
        >>> valid = torch.tensor([True, False])
        >>> d = diagnose_nan_gradient("grad_scale", torch.tensor([float("nan"), 1.0]),
        ...                           torch.tensor([1.0, 1.0]), x, valid)
        >>> d.mistake
        'nan_from_padding'
    """
    leaked = ~actual.isfinite() & reference.isfinite()
    if not leaked.any():
        return None
    # A clean (zero) padding row overflows alike: 1 / sqrt(eps) beyond the dtype's largest.
    overflows = eps is not None and (eps <= 0 or 1 / math.sqrt(eps) > _largest(actual.dtype))
    if overflows:
        return None
    invalid = ~valid.unsqueeze(-1).expand(x.shape)
    poisoned_x = bool((~x.isfinite() & invalid).any())
    poisoned_dy = grad_out is not None and bool((~grad_out.isfinite() & invalid).any())
    if not (poisoned_x or poisoned_dy):
        return None
    source = "x" if poisoned_x else "grad_out"
    return Diagnosis(
        "nan_from_padding",
        f"NaN or inf from the padding of {source} reaches {name} (0 * NaN is NaN: masking the"
        " output or multiplying by the mask does not stop it)",
        "sanitize x before the reductions, torch.where(valid[..., None], x, 0), and select"
        " with torch.where rather than multiplying by the mask",
        0.0,
    )


def _largest(dtype: torch.dtype) -> float:
    """A floating dtype's largest finite value (inf for any other)."""
    return torch.finfo(dtype).max if dtype.is_floating_point else math.inf
