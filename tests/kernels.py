"""Kernels a user might write, correct and wrong, and the data that tells them apart.

``maskln verify`` is tested (tests/verify/test_verify_kernels.py) and calibrated
(benchmarks/verify_calibration.py) on these: each kernel takes the inputs as stored and runs
in a given dtype, returning ``out`` and, by autograd through its own ops, ``grad_x``,
``grad_scale`` and ``grad_bias`` for the upstream gradient, as a kernel's result file holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.jobs.generate import generate_inputs

Tensors = dict[str, torch.Tensor]
EPS = 1e-5


# --- data ------------------------------------------------------------------------------------


def offset_batch(offset: float, seed: int = 0, shape=(8, 128, 64), dtype="float32") -> Tensors:
    """A padded batch (``maskln generate --invalid 0.3 --poison --grad``) whose valid rows carry
    a common offset: x = offset + N(0, 1), computed in float64 then stored in ``dtype``."""
    tensors = generate_inputs(shape, "float32", seed, invalid=0.3, poison=True, grad=True)
    valid = tensors["valid"][..., None]
    x = torch.where(valid, tensors["x"].double() + offset, tensors["x"].double())
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


def welford(x, valid, scale, bias):
    """One pass of Welford's running mean and sum of squared deviations, in x's dtype."""
    rows = _rows_zeroed(x, valid)
    mean = torch.zeros_like(rows[..., :1])
    squares = torch.zeros_like(mean)
    for channel in range(rows.shape[-1]):
        value = rows[..., channel : channel + 1]
        delta = value - mean
        mean = mean + delta / (channel + 1)
        squares = squares + delta * (value - mean)
    var = squares / rows.shape[-1]
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


def zero_padding(result: Tensors, valid: torch.Tensor) -> Tensors:
    """``out`` and ``grad_x`` set to +0.0 at the invalid rows (the padding zeroed, as a
    framework's kernel is then used: nn.LayerNorm's output masked afterwards)."""
    zeroed = dict(result)
    for key in ("out", "grad_x"):
        if key in zeroed:
            zeroed[key] = torch.where(valid[..., None], zeroed[key], 0.0).to(zeroed[key].dtype)
    return zeroed
