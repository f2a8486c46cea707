"""Kernels a user might write, correct and wrong, and the data that tells them apart.

``maskln verify`` is tested (tests/verify/test_verify_kernels.py) and calibrated
(benchmarks/verify_calibration.py) on these: each kernel takes the inputs as stored and runs
in a given dtype, returning ``out`` and, by autograd through its own ops, ``grad_x``,
``grad_scale`` and ``grad_bias`` for the upstream gradient, as a kernel's result file holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.jobs.generate import generate_inputs

Tensors = dict[str, torch.Tensor]
EPS = 1e-5


# --- data ------------------------------------------------------------------------------------


def offset_batch(
    offset: float, seed: int = 0, shape=(8, 128, 64), dtype="float32", std: float = 1.0
) -> Tensors:
    """A padded batch (``maskln generate --invalid 0.3 --poison --grad``) whose valid rows carry
    a common offset: x = offset + N(0, std), computed in float64 then stored in ``dtype``."""
    tensors = generate_inputs(shape, "float32", seed, invalid=0.3, poison=True, grad=True)
    valid = tensors["valid"][..., None]
    x = torch.where(valid, std * tensors["x"].double() + offset, tensors["x"].double())
    return _stored(dict(tensors, x=x), dtype)


def heavy_tailed_batch(seed: int = 0, shape=(8, 128, 64), dtype="float32") -> Tensors:
    """A padded batch whose valid rows are Student's t with 2 degrees of freedom (a few values
    far out in most rows, as activations have), with an upstream gradient likewise."""
    tensors = generate_inputs(shape, "float32", seed, invalid=0.3, poison=True, grad=True)
    generator = torch.Generator().manual_seed(2000 + seed)
    chi = torch.empty(shape, dtype=torch.float64).exponential_(0.5, generator=generator)
    rows = tensors["x"].double() / (chi / 2).sqrt()
    x = torch.where(tensors["valid"][..., None], rows, tensors["x"].double())
    return _stored(dict(tensors, x=x), dtype)


def spread_batch(seed: int = 0, shape=(8, 128, 64), dtype="float32") -> Tensors:
    """A padded batch whose valid rows have spreads from 1e-2 to 10 (log-uniform) about means
    drawn from N(0, 1): small spreads make eps matter, large means against small spreads make
    a one-pass variance cancel."""
    tensors = generate_inputs(shape, "float32", seed, invalid=0.3, poison=True, grad=True)
    generator = torch.Generator().manual_seed(1000 + seed)
    leading = shape[:-1]
    spread = 10 ** (3 * torch.rand(leading, generator=generator, dtype=torch.float64) - 2)
    mean = torch.randn(leading, generator=generator, dtype=torch.float64)
    rows = mean[..., None] + spread[..., None] * tensors["x"].double()
    x = torch.where(tensors["valid"][..., None], rows, tensors["x"].double())
    return _stored(dict(tensors, x=x), dtype)


def long_rows(seed: int = 0, rows: int = 4, channels: int = 2**20) -> Tensors:
    """A few float32 rows of 2**20 channels (no padding), with an upstream gradient."""
    return generate_inputs((rows, channels), "float32", seed, invalid=0.0, grad=True)


def _stored(tensors: Tensors, dtype: str) -> Tensors:
    target = getattr(torch, dtype)
    return {k: v if v.dtype == torch.bool else v.to(target) for k, v in tensors.items()}


# --- kernels ---------------------------------------------------------------------------------

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x, valid, scale, bias) -> out, in x's dtype, differentiable by autograd."""


def _rows_zeroed(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype))


def _masked(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid[..., None], y, torch.zeros((), dtype=y.dtype))


def _statistics(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = rows.mean(-1, keepdim=True)
    return mean, (rows - mean).square().mean(-1, keepdim=True)


def torch_layer_norm(x, valid, scale, bias):
    """F.layer_norm (nn.LayerNorm's kernel) with the padding zeroed before and after."""
    out = F.layer_norm(_rows_zeroed(x, valid), (x.shape[-1],), scale, bias, EPS)
    return _masked(out, valid)


def two_pass(x, valid, scale, bias):
    """The formula written plainly: mean, then the mean of squared deviations."""
    rows = _rows_zeroed(x, valid)
    mean, var = _statistics(rows)
    return _masked((rows - mean) * torch.rsqrt(var + EPS) * scale + bias, valid)


def _sequential_sum(rows: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(rows[..., :1])
    for channel in range(rows.shape[-1]):  # one element at a time, as a naive loop adds
        total = total + rows[..., channel : channel + 1]
    return total


def _two_passes(x, valid, scale, bias, row_sum: Callable[[torch.Tensor], torch.Tensor]):
    """Mean, then the variance around it, each summed over a row by ``row_sum``."""
    rows = _rows_zeroed(x, valid)
    channels = x.shape[-1]
    mean = row_sum(rows) / channels
    var = row_sum((rows - mean).square()) / channels
    return _masked((rows - mean) * torch.rsqrt(var + EPS) * scale + bias, valid)


def sequential(x, valid, scale, bias):
    """Two passes, each sum accumulated element by element in x's dtype (a naive GPU thread
    per row): correct, and less accurate than torch's pairwise sums."""
    return _two_passes(x, valid, scale, bias, _sequential_sum)


def maskln(x, valid, scale, bias):
    """maskln's own op, in x's dtype."""
    return masked_layer_normalization(x, valid, scale, bias, EPS)


def one_pass(x, valid, scale, bias):
    """WRONG: variance as E[x**2] - E[x]**2."""
    rows = _rows_zeroed(x, valid)
    mean = rows.mean(-1, keepdim=True)
    var = (rows * rows).mean(-1, keepdim=True) - mean * mean
    return _masked((rows - mean) / torch.sqrt(var.clamp_min(0) + EPS) * scale + bias, valid)


def eps_outside(x, valid, scale, bias):
    """WRONG: (x - mean) / (sqrt(var) + eps)."""
    rows = _rows_zeroed(x, valid)
    mean, var = _statistics(rows)
    var = torch.where(valid[..., None], var, 1.0)  # sqrt's gradient at 0 is not the mistake
    return _masked((rows - mean) / (torch.sqrt(var) + EPS) * scale + bias, valid)


def unbiased(x, valid, scale, bias):
    """WRONG: the variance divided by C - 1."""
    rows = _rows_zeroed(x, valid)
    mean = rows.mean(-1, keepdim=True)
    var = rows.var(-1, keepdim=True, unbiased=True)
    return _masked((rows - mean) / torch.sqrt(var + EPS) * scale + bias, valid)


def padding_returns_bias(x, valid, scale, bias):
    """WRONG: invalid rows normalized as zeros, so they come out as bias."""
    out = F.layer_norm(_rows_zeroed(x, valid), (x.shape[-1],), scale, bias, EPS)
    return torch.where(valid[..., None], out, bias)


def nan_leak(x, valid, scale, bias):
    """WRONG: the one-liner, ``F.layer_norm(x, ...).masked_fill(~valid[..., None], 0)``: right
    values, but NaN in the padding reaches the gradients (0 * NaN is NaN)."""
    return F.layer_norm(x, (x.shape[-1],), scale, bias, EPS).masked_fill(~valid[..., None], 0)


def _kahan_sum(rows: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(rows[..., :1])
    carry = torch.zeros_like(total)
    for channel in range(rows.shape[-1]):  # compensated summation, element by element
        term = rows[..., channel : channel + 1] - carry
        step = total + term
        carry = (step - total) - term
        total = step
    return total


def kahan(x, valid, scale, bias):
    """Two passes, each sum compensated (Kahan) element by element in x's dtype."""
    return _two_passes(x, valid, scale, bias, _kahan_sum)


def welford_statistics(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's mean and population variance by Welford's running update, in rows' dtype."""
    mean = torch.zeros_like(rows[..., :1])
    squares = torch.zeros_like(mean)
    for channel in range(rows.shape[-1]):
        value = rows[..., channel : channel + 1]
        delta = value - mean
        mean = mean + delta / (channel + 1)
        squares = squares + delta * (value - mean)
    return mean, squares / rows.shape[-1]


def welford(x, valid, scale, bias):
    """One pass of Welford's running mean and sum of squared deviations, in x's dtype."""
    rows = _rows_zeroed(x, valid)
    mean, var = welford_statistics(rows)
    return _masked((rows - mean) * torch.rsqrt(var + EPS) * scale + bias, valid)


def with_eps(eps: float) -> Kernel:
    """WRONG (unless eps is the run's): a correct two-pass kernel with another eps."""

    def kernel(x, valid, scale, bias):
        rows = _rows_zeroed(x, valid)
        mean, var = _statistics(rows)
        return _masked((rows - mean) * torch.rsqrt(var + eps) * scale + bias, valid)

    kernel.__doc__ = f"two-pass with eps {eps:g}"
    return kernel


def _sequential_sum_in(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A row sum accumulated element by element in ``dtype`` (a half accumulator), returned in
    the rows' own dtype."""

    def row_sum(rows: torch.Tensor) -> torch.Tensor:
        return _sequential_sum(rows.to(dtype)).to(rows.dtype)

    return row_sum


def accumulate_in(dtype: torch.dtype) -> Kernel:
    """WRONG: two passes whose row sums (mean, variance) are accumulated in ``dtype`` element
    by element, the rest in x's dtype: a half accumulator."""

    def kernel(x, valid, scale, bias):
        return _two_passes(x, valid, scale, bias, _sequential_sum_in(dtype))

    kernel.__doc__ = f"row sums accumulated in {dtype}"
    return kernel


def backward_of(forward: Kernel, backward: Kernel) -> Kernel:
    """``forward``'s values with ``backward``'s gradients: a kernel whose backward pass is
    written apart from its forward (wrong when they disagree)."""

    def kernel(x, valid, scale, bias):
        wrong = backward(x, valid, scale, bias)
        return forward(x, valid, scale, bias).detach() + (wrong - wrong.detach())

    return kernel


def scaled_output(x, valid, scale, bias):
    """WRONG: F.layer_norm's output times (1 + 1e-5)."""
    return torch_layer_norm(x, valid, scale, bias) * (1 + 1e-5)


CORRECT: dict[str, Kernel] = {
    "F.layer_norm": torch_layer_norm,
    "two-pass": two_pass,
    "sequential": sequential,
    "maskln": maskln,
}
SYSTEMATIC_CORRECT: dict[str, Kernel] = {
    "F.layer_norm": torch_layer_norm,
    "pairwise (two-pass)": two_pass,
    "sequential": sequential,
    "Welford": welford,
    "Kahan": kahan,
    "blocked (maskln)": maskln,
}
"""Correct kernels whose errors are rounding only: never systematic (issue 23, 5)."""
SYSTEMATIC_WRONG: dict[str, Kernel] = {
    "eps 1e-6 for 1e-5": with_eps(1e-6),
    "out x (1 + 1e-5)": scaled_output,
    "eps 3e-5 for 1e-5": with_eps(3e-5),
}
"""Mistakes that hide in the budget at wide rows, and that their structure shows."""
WRONG: dict[str, Kernel] = {
    "one-pass variance": one_pass,
    "eps outside sqrt": eps_outside,
    "unbiased variance": unbiased,
    "padding returns bias": padding_returns_bias,
    "NaN-leaking one-liner": nan_leak,
}


def run(kernel: Kernel, inputs: Tensors, dtype: torch.dtype | None = None) -> Tensors:
    """``kernel`` on ``inputs`` (as stored) in ``dtype`` (default: x's): out, and with a
    ``grad_out`` the three gradients of ``sum(out * grad_out)``, each in ``dtype``."""
    dtype = dtype or inputs["x"].dtype
    x, scale, bias = (inputs[k].detach().to(dtype).requires_grad_() for k in ("x", "scale", "bias"))
    out = kernel(x, inputs["valid"], scale, bias)
    result = {"out": out.detach()}
    if "grad_out" in inputs:
        grads = torch.autograd.grad(out, (x, scale, bias), inputs["grad_out"].to(dtype))
        result.update(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True))
    return result


def verified(
    kernel: Callable[..., torch.Tensor],
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    grad_out: torch.Tensor,
):
    """``maskln_cli.testing.verify``'s report of ``kernel(x, valid, scale, bias, eps)``: its out
    and the three gradients of ``sum(out * grad_out)`` by autograd (zeros for an input it does
    not use), its warnings silenced."""
    import warnings

    from maskln_cli.testing import verify

    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = kernel(leaves[0], valid, leaves[1], leaves[2], eps)
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        grads = [
            torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)
        ]
        return verify(
            out.detach(), x, valid, scale, bias, eps, grad_out=grad_out, grad_x=grads[0],
            grad_scale=grads[1], grad_bias=grads[2],
        )  # fmt: skip


def zero_padding(result: Tensors, valid: torch.Tensor) -> Tensors:
    """``out`` and ``grad_x`` set to +0.0 at the invalid rows (the padding zeroed, as a
    framework's kernel is then used: nn.LayerNorm's output masked afterwards)."""
    zeroed = dict(result)
    for key in ("out", "grad_x"):
        if key in zeroed:
            zeroed[key] = torch.where(valid[..., None], zeroed[key], 0.0).to(zeroed[key].dtype)
    return zeroed


# --- hand-written kernels: forward and backward side by side -----------------------------------
#
# A kernel author writes the backward pass by hand (Triton's layer-norm tutorial, a CUDA kernel):
# dx = rstd * (wdy - xhat * c1 - c2), with wdy = scale * dy, c1 = mean(xhat * wdy) and
# c2 = mean(wdy); grad_scale = sum(dy * xhat) and grad_bias = sum(dy) over the valid rows.
# ``written`` is that kernel, correct or with one mistake in its backward; its sums are torch's
# (pairwise) or a loop's (a GPU thread per row), and its dx the formula above or torch's own
# CPU form (``ds_db``: sums of wdy * x and wdy, then dx = rstd * wdy + b * x + c, which
# loses digits at large offsets as torch's does).

BACKWARD_MISTAKES = (
    "no_xhat_term",  # dx = rstd * (wdy - c2): the variance's path dropped (or detached)
    "no_mean_term",  # dx = rstd * (wdy - xhat * c1): the mean's path dropped (or detached)
    "unbiased_in_backward",  # the backward recomputes rstd from x.var() (unbiased by default)
    "padding_in_sums",  # grad_scale and grad_bias sum the padding's grad_out too
    "c1_over_c_minus_1",  # c1 = sum(xhat * wdy) / (C - 1)
    "mean_term_sign",  # dx = rstd * (wdy - xhat * c1 + c2)
    "grad_scale_without_xhat",  # grad_scale = sum(dy), a copy of grad_bias
    "no_rstd",  # dx = wdy - xhat * c1 - c2: rstd forgotten
    "half_backward_sums",  # c1 and c2 accumulated in float16
)
"""The one mistake each wrong ``written`` kernel makes in its backward (its forward is right)."""


def _row_mean(t: torch.Tensor, sequential: bool) -> torch.Tensor:
    return _sequential_sum(t) / t.shape[-1] if sequential else t.mean(-1, keepdim=True)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Written(torch.autograd.Function):
    """Masked layer normalization with a hand-written backward (see :func:`written`)."""

    @staticmethod
    def forward(ctx, x, valid, scale, bias, mistake, sequential, form):
        compute = _compute_dtype(x.dtype)
        keep = valid[..., None]
        rows = torch.where(keep, x, torch.zeros((), dtype=x.dtype)).to(compute)
        mean = _row_mean(rows, sequential)
        var = _row_mean((rows - mean).square(), sequential)
        rstd = torch.rsqrt(var + EPS)
        xhat = (rows - mean) * rstd
        out = torch.where(keep, xhat * scale.to(compute) + bias.to(compute), 0.0)
        ctx.save_for_backward(x, valid, scale, mean, rstd)
        ctx.settings = mistake, sequential, form
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, valid, scale, mean, rstd = ctx.saved_tensors
        mistake, sequential, form = ctx.settings
        compute = _compute_dtype(x.dtype)
        keep = valid[..., None]
        channels = x.shape[-1]
        rows = torch.where(keep, x, torch.zeros((), dtype=x.dtype)).to(compute)
        upstream = dy.to(compute)
        dy_valid = torch.where(keep, upstream, 0.0)
        if mistake == "unbiased_in_backward":
            rstd = torch.rsqrt(rows.var(-1, keepdim=True) + EPS)
        xhat = (rows - mean) * rstd
        wdy = dy_valid * scale.to(compute)
        if mistake == "half_backward_sums":
            half = _sequential_sum_in(torch.float16)
            c1, c2 = half(xhat * wdy) / channels, half(wdy) / channels
        else:
            c1, c2 = _row_mean(xhat * wdy, sequential), _row_mean(wdy, sequential)
        if form == "ds_db":  # torch's CPU backward: sums of wdy * x and wdy
            ds = _row_mean(wdy * rows, sequential) * channels
            db = c2 * channels
            b = (db * mean - ds) * rstd**3 / channels
            c = -b * mean - db * rstd / channels
            dx = rstd * wdy + b * rows + c
        elif mistake == "no_xhat_term":
            dx = rstd * (wdy - c2)
        elif mistake == "no_mean_term":
            dx = rstd * (wdy - xhat * c1)
        elif mistake == "c1_over_c_minus_1":
            dx = rstd * (wdy - xhat * c1 * channels / (channels - 1) - c2)
        elif mistake == "mean_term_sign":
            dx = rstd * (wdy - xhat * c1 + c2)
        elif mistake == "no_rstd":
            dx = wdy - xhat * c1 - c2
        else:
            dx = rstd * (wdy - xhat * c1 - c2)
        dx = torch.where(keep, dx, 0.0)
        leading = tuple(range(x.dim() - 1))
        summed = upstream if mistake == "padding_in_sums" else dy_valid
        grad_bias = summed.sum(leading)
        grad_scale = grad_bias if mistake == "grad_scale_without_xhat" else (
            summed * xhat).sum(leading)  # fmt: skip
        cast = scale.dtype
        return dx.to(x.dtype), None, grad_scale.to(cast), grad_bias.to(cast), None, None, None


def written(mistake: str | None = None, sums: str = "pairwise", form: str = "xhat") -> Kernel:
    """A kernel with a hand-written backward: right (``mistake`` None) or with one of
    :data:`BACKWARD_MISTAKES`; its row sums ``pairwise`` (torch's) or ``sequential`` (a loop),
    its dx the tutorial's formula (``xhat``) or torch's CPU form (``ds_db``)."""
    assert mistake is None or mistake in BACKWARD_MISTAKES, mistake
    sequential = sums == "sequential"

    def kernel(x, valid, scale, bias):
        return _Written.apply(x, valid, scale, bias, mistake, sequential, form)

    kernel.__doc__ = f"hand-written backward ({sums} sums, {form})" + (
        f", WRONG: {mistake}" if mistake else "")  # fmt: skip
    return kernel


BACKWARD_CORRECT: dict[str, Kernel] = {
    "written": written(),
    "written, sequential sums": written(sums="sequential"),
    "written, torch's form": written(form="ds_db"),
    "written, torch's form, sequential sums": written(sums="sequential", form="ds_db"),
}
"""Correct kernels with a hand-written backward: the forms a kernel author writes."""


# --- more forward mistakes, one each ----------------------------------------------------------


def _normalized(x, valid, scale, bias, make_xhat, affine=None):
    """A two-pass kernel in x's compute dtype whose xhat is ``make_xhat(rows, mean, var)``
    (and whose affine step is ``affine(xhat, scale, bias)``); autograd differentiates it."""
    compute = _compute_dtype(x.dtype)
    rows = _rows_zeroed(x, valid).to(compute)
    mean, var = _statistics(rows)
    xhat = make_xhat(rows, mean, var)
    s, b = scale.to(compute), bias.to(compute)
    out = affine(xhat, s, b) if affine else xhat * s + b
    return _masked(out, valid).to(x.dtype)


def mean_over_c_minus_1(x, valid, scale, bias):
    """WRONG: the mean divided by C - 1 (the variance then around it)."""
    channels = x.shape[-1]

    def xhat(rows, mean, var):
        wrong = rows.sum(-1, keepdim=True) / (channels - 1)
        spread = (rows - wrong).square().mean(-1, keepdim=True)
        return (rows - wrong) * torch.rsqrt(spread + EPS)

    return _normalized(x, valid, scale, bias, xhat)


def mean_over_c_plus_1(x, valid, scale, bias):
    """WRONG: the mean divided by C + 1 (64/65 of it subtracted: on offset rows close to RMS
    normalization, which it is not)."""
    channels = x.shape[-1]

    def xhat(rows, mean, var):
        wrong = rows.sum(-1, keepdim=True) / (channels + 1)
        spread = (rows - wrong).square().mean(-1, keepdim=True)
        return (rows - wrong) * torch.rsqrt(spread + EPS)

    return _normalized(x, valid, scale, bias, xhat)


def welford_squares_of_d(x, valid, scale, bias):
    """WRONG: Welford's M2 summing d * d (d = x - the old mean) for d * (x - the new mean):
    the first element's square, x[0]**2 / C, joins every row's variance."""

    def xhat(rows, mean, var):
        running = torch.zeros_like(rows[..., :1])
        m2 = torch.zeros_like(running)
        for i in range(rows.shape[-1]):
            d = rows[..., i : i + 1] - running
            running = running + d / (i + 1)
            m2 = m2 + d * d
        return (rows - running) * torch.rsqrt(m2 / rows.shape[-1] + EPS)

    return _normalized(x, valid, scale, bias, xhat)


def first_valid_row_zeroed(x, valid, scale, bias):
    """WRONG on one row: the first valid row zeroed (a loop starting at 1), the rest right."""
    right = torch_layer_norm(x, valid, scale, bias)
    flat = valid.reshape(-1).clone()
    first = torch.zeros_like(flat)
    first[int(flat.nonzero().min())] = True
    return right.masked_fill(first.reshape(valid.shape)[..., None], 0.0)


def scale_plus_one(x, valid, scale, bias):
    """WRONG: scale applied as 1 + scale (a Gemma-style parametrization where it is not one)."""
    return _normalized(
        x, valid, scale, bias, lambda rows, mean, var: (rows - mean) * torch.rsqrt(var + EPS),
        lambda xhat, s, b: xhat * (1 + s) + b,
    )  # fmt: skip


def bias_before_scale(x, valid, scale, bias):
    """WRONG: (xhat + bias) * scale."""
    return _normalized(
        x, valid, scale, bias, lambda rows, mean, var: (rows - mean) * torch.rsqrt(var + EPS),
        lambda xhat, s, b: (xhat + b) * s,
    )  # fmt: skip


def mean_not_subtracted(x, valid, scale, bias):
    """WRONG: x / sqrt(mean(x**2) + eps) (an RMS norm where a layer norm is asked)."""
    return _normalized(
        x, valid, scale, bias,
        lambda rows, mean, var: rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + EPS),
    )  # fmt: skip


def variance_clamped(x, valid, scale, bias):
    """WRONG: sqrt(max(var, eps)) instead of sqrt(var + eps) ("for stability")."""
    return _normalized(
        x, valid, scale, bias,
        lambda rows, mean, var: (rows - mean) * torch.rsqrt(var.clamp_min(EPS)),
    )  # fmt: skip


def xhat_in_bfloat16(x, valid, scale, bias):
    """WRONG: xhat rounded to bfloat16 on the way (a bfloat16 scratch buffer), the rest in
    x's dtype: bfloat16 rounding, element by element."""
    return _normalized(
        x, valid, scale, bias,
        lambda rows, mean, var: ((rows - mean) * torch.rsqrt(var + EPS)).bfloat16().to(rows.dtype),
    )  # fmt: skip


def statistics_in_half(x, valid, scale, bias):
    """WRONG for large values: a half-precision kernel whose row statistics are kept in x's own
    half dtype: the variance (a mean of squares) overflows float16 once squares pass 65,504."""
    rows = _rows_zeroed(x, valid)
    mean = rows.mean(-1, keepdim=True)  # stored in x's dtype
    var = (rows - mean).square().mean(-1, keepdim=True)  # squares and their mean in x's dtype
    xhat = (rows - mean).float() * torch.rsqrt(var.float() + EPS)
    return _masked(xhat * scale.float() + bias.float(), valid).to(x.dtype)


def all_in_half(x, valid, scale, bias):
    """WRONG in a half dtype: every step in x's own dtype, autograd's backward too. On rows
    that float16 stores as constant (1e4 + N(0, 0.1) is 10,000 to within its spacing of 8),
    the backward of rsqrt(var + eps) takes rstd**3 = eps**-1.5 = 3e7, past float16's 65,504:
    grad_x is NaN on those valid rows (inf * 0), the padding's rows of grad_x right."""
    rows = _rows_zeroed(x, valid)
    mean = rows.mean(-1, keepdim=True)
    var = (rows - mean).square().mean(-1, keepdim=True)
    return _masked((rows - mean) * torch.rsqrt(var + EPS) * scale + bias, valid)


def last_row_wrong(mistake: Kernel) -> Kernel:
    """WRONG on one row: a kernel right on every row but the last valid one, where ``mistake``
    computes it (a vectorized loop's tail, a grid's last block)."""

    def kernel(x, valid, scale, bias):
        right = torch_layer_norm(x, valid, scale, bias)
        wrong = mistake(x, valid, scale, bias)
        flat = valid.reshape(-1)
        last = torch.zeros_like(flat)
        last[int(flat.nonzero().max())] = True
        return torch.where(last.reshape(valid.shape)[..., None], wrong, right)

    kernel.__doc__ = f"right but on the last valid row: {mistake.__doc__}"
    return kernel


def channel_tail_wrong(x, valid, scale, bias):
    """WRONG: the last channel (a vector loop's remainder) normalized with the statistics of
    the others only."""
    channels = x.shape[-1]
    compute = _compute_dtype(x.dtype)
    rows = _rows_zeroed(x, valid).to(compute)
    mean, var = _statistics(rows)
    head_mean, head_var = _statistics(rows[..., : channels - 1])
    right = (rows - mean) * torch.rsqrt(var + EPS)
    tail = (rows - head_mean) * torch.rsqrt(head_var + EPS)
    xhat = torch.cat([right[..., :-1], tail[..., -1:]], dim=-1)
    return _masked(xhat * scale.to(compute) + bias.to(compute), valid).to(x.dtype)


# --- the catalogue of wrong kernels the diagnosis is measured on -------------------------------


@dataclass(frozen=True)
class Wrong:
    """A wrong kernel and the causes a diagnosis of it may name: its own mistake (a name of
    maskln's catalogue, or of a coarser dtype's rounding); none for a mistake the catalogue
    does not hold, which must then go unnamed."""

    kernel: Kernel
    causes: frozenset[str] = frozenset()
    dtypes: tuple[str, ...] = ("float32",)  # the dtypes it is run in


def _wrong(kernel: Kernel, *causes: str, dtypes: tuple[str, ...] = ("float32",)) -> Wrong:
    return Wrong(kernel, frozenset(causes), dtypes)


HALF = ("float16", "bfloat16")
CATALOGUE: dict[str, Wrong] = {
    # forward mistakes, the backward autograd's of the same formula
    "one-pass variance": _wrong(one_pass, "one_pass_variance"),
    "eps outside sqrt": _wrong(eps_outside, "eps_outside_sqrt"),
    "unbiased variance": _wrong(unbiased, "unbiased_variance"),
    "eps 1e-6 for 1e-5": _wrong(with_eps(1e-6), "eps_mismatch"),
    "eps 3e-5 for 1e-5": _wrong(with_eps(3e-5), "eps_mismatch"),
    "bias before scale": _wrong(bias_before_scale, "bias_before_scale"),
    "mean not subtracted": _wrong(mean_not_subtracted, "rms_norm"),
    # sqrt(max(var, eps)) is sqrt(var) wherever var > eps: eps missing, or RESULT's eps at
    # most a small bound, there
    "variance clamped at eps": _wrong(variance_clamped, "eps_missing", "eps_mismatch"),
    "padding returns bias": _wrong(padding_returns_bias, "padding_returns_bias"),
    "NaN-leaking one-liner": _wrong(nan_leak, "nan_from_padding"),
    "mean over C - 1": _wrong(mean_over_c_minus_1),
    # a hunt's wrong causes (issue 37): 'RMS normalization', 'RESULT's eps ≈ 1.6e+06', 'the
    # mask read the other way round'; eps squared (1e-10) is eps missing where var >> 1e-10
    "mean over C + 1": _wrong(mean_over_c_plus_1),
    "Welford summing d * d": _wrong(welford_squares_of_d),
    "first valid row zeroed": _wrong(first_valid_row_zeroed),
    "eps squared": _wrong(with_eps(1e-10), "eps_mismatch", "eps_missing"),
    "scale applied as 1 + scale": _wrong(scale_plus_one),
    "out x (1 + 1e-5)": _wrong(scaled_output),
    "last channel wrong": _wrong(channel_tail_wrong),
    "last row: eps outside sqrt": _wrong(last_row_wrong(eps_outside), "eps_outside_sqrt"),
    "last row: unbiased variance": _wrong(last_row_wrong(unbiased), "unbiased_variance"),
    # precision mistakes
    # float16 sums also overflow (at offsets from 1e3: 64 values of 1e4 sum past 65,504)
    "row sums in float16": _wrong(
        accumulate_in(torch.float16), "rounding_float16", "statistics_overflow"
    ),
    "xhat rounded to bfloat16": _wrong(xhat_in_bfloat16, "rounding_bfloat16"),
    "statistics in the half dtype": _wrong(
        statistics_in_half,
        "statistics_overflow",
        "rounding_float16",
        "rounding_bfloat16",
        dtypes=HALF,
    ),
    # backward mistakes, the forward right
    "grad_x without its xhat term": _wrong(written("no_xhat_term"), "backward_missing_xhat_term"),
    "grad_x without its mean term": _wrong(written("no_mean_term"), "backward_missing_mean_term"),
    "unbiased variance in the backward": _wrong(
        written("unbiased_in_backward"), "backward_unbiased_variance"
    ),
    "padding's grad_out in grad_scale, grad_bias": _wrong(
        written("padding_in_sums"), "padding_in_parameter_gradients"
    ),
    "c1 over C - 1": _wrong(written("c1_over_c_minus_1")),
    "mean term's sign flipped": _wrong(written("mean_term_sign")),
    "grad_scale without xhat": _wrong(written("grad_scale_without_xhat")),
    "grad_x without rstd": _wrong(written("no_rstd")),
    "backward sums in float16": _wrong(written("half_backward_sums"), "rounding_float16"),
}
"""Wrong kernels, one subtle mistake each, forward or backward (tests/verify/
test_verify_diagnosis.py and benchmarks/verify_diagnosis.py judge them)."""

DATA_FAMILIES: dict[str, Callable[..., Tensors]] = {
    "N(0, 1)": lambda seed, dtype="float32": offset_batch(0.0, seed, dtype=dtype),
    "spread 1e-2..10": lambda seed, dtype="float32": spread_batch(seed, dtype=dtype),
    "offset 1e3": lambda seed, dtype="float32": offset_batch(1e3, seed, dtype=dtype),
    "1e4 + N(0, 0.1)": lambda seed, dtype="float32": offset_batch(1e4, seed, dtype=dtype, std=0.1),
    "heavy tails": lambda seed, dtype="float32": heavy_tailed_batch(seed, dtype=dtype),
    "N(0, 300)": lambda seed, dtype="float32": offset_batch(0.0, seed, dtype=dtype, std=300.0),
    "C = 768, N(0, 1)": lambda seed, dtype="float32": offset_batch(
        0.0, seed, shape=(2, 64, 768), dtype=dtype
    ),
    "C = 768, 1e4 + N(0, 0.1)": lambda seed, dtype="float32": offset_batch(
        1e4, seed, shape=(2, 64, 768), dtype=dtype, std=0.1
    ),
}
"""The data the catalogue is judged on (``family(seed, dtype)``): the usual, the spreads that
make eps matter, offsets that make float32 lose digits, heavy tails, values whose squares
overflow float16, and BERT's width."""

CORRECT_EVERYWHERE: dict[str, tuple[Kernel, tuple[str, ...]]] = {
    "F.layer_norm": (torch_layer_norm, ("float32", "float16", "bfloat16", "float64")),
    "maskln": (maskln, ("float32", "float16", "bfloat16", "float64")),
    **{
        name: (kernel, ("float32", "float16", "bfloat16", "float64"))
        for name, kernel in BACKWARD_CORRECT.items()
    },
    "two-pass": (two_pass, ("float32", "float64")),
    "sequential": (sequential, ("float32", "float64")),
    "Welford": (welford, ("float32", "float64")),
    "Kahan": (kahan, ("float32", "float64")),
}
"""Correct kernels and the dtypes each is correct in (those computing in x's own dtype are a
half dtype's arithmetic there, not a correct half kernel): every one must pass on every data
family (benchmarks/verify_diagnosis.py --correct, tests/verify/test_verify_diagnosis.py)."""
