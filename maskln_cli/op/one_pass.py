"""The one-pass variance, E[x**2] - E[x]**2: a precision mistake, recognized by its rows.

Its error is rounding's (the cancellation of E[x**2] against E[x]**2 on rows whose mean is large
against their spread), so no float64 formula gives it: :func:`one_pass_match` asks whether a
result errs as one would, on the rows one would, by about as much, and by rescaling each row by
a factor of its own; on one or two rows, whether the kernel's own rows account for the error.
"""

from __future__ import annotations

import torch

from maskln_cli.op.mistake_records import Diagnosis, Mistake
from maskln_cli.op.reference import reference_masked_layer_norm

ONE_PASS = Mistake(
    "one_pass_variance",
    "one-pass variance E[x**2] - E[x]**2 (catastrophic cancellation on rows whose mean is large"
    " against their spread)",
    "subtract the mean first and average the squares of x - mean (two passes)",
    reference_masked_layer_norm,  # no formula: recognized by its rows, see one_pass_match
)


def _zeroed(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``y`` with the invalid rows' values 0."""
    return torch.where(valid.unsqueeze(-1), y, 0.0)


def _row_errors(result: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Each row's relative L2 distance ([rows], flattened leading axes); inf where the row is
    not finite in both, 0 for a row of zeros matched exactly."""
    channels = result.shape[-1]
    result, reference = result.reshape(-1, channels), reference.reshape(-1, channels)
    finite = (result.isfinite() & reference.isfinite()).all(dim=-1)
    difference = torch.where(finite.unsqueeze(1), result - reference, 0.0).norm(dim=-1)
    size = torch.where(finite.unsqueeze(1), reference, 0.0).norm(dim=-1)
    errors = difference / size
    errors = torch.where(size == 0, torch.where(difference == 0, 0.0, torch.inf), errors)
    return torch.where(finite, errors, torch.inf)


def one_pass_match(
    result: torch.Tensor,
    truth: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
) -> Diagnosis | None:
    """A one-pass variance in ``dtype`` errs far more than a two-pass one on some rows (those
    with a large mean against their spread). The result errs like it: wrongly on those rows and
    only on those, by about as much, and by rescaling each row's normalized values (a wrong
    variance) rather than anything else. Its error, not its exact value, is the signature: two
    one-pass kernels round differently."""
    if dtype == torch.float64 or not valid.any():
        return None
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    rows = _zeroed(x, valid).to(dtype).to(compute)
    mean = rows.mean(dim=-1, keepdim=True)
    one_pass = _one_pass_output(rows, valid, scale, bias, eps)
    centered = rows - mean  # a plain two-pass kernel in the same dtype, for comparison
    two_pass_xhat = centered / torch.sqrt(centered.square().mean(dim=-1, keepdim=True) + eps)
    two_pass = _zeroed(two_pass_xhat.double() * scale + bias, valid)
    keep = valid.reshape(-1)
    errors = {
        name: _row_errors(value, truth)[keep]
        for name, value in (("result", result), ("one", one_pass), ("two", two_pass))
    }
    floor = errors["two"].clamp_min(8 * torch.finfo(dtype).eps)
    wrong = errors["result"] >= 10 * floor
    if not wrong.any():
        return None
    if int((wrong & (errors["one"] < 3 * floor)).sum()) > 0.1 * int(wrong.sum()):
        return None  # the result errs where a one-pass variance would not
    ratio = float((errors["result"][wrong] / errors["one"][wrong]).median())
    if not 0.2 <= ratio <= 5 or not _rescaled_rows(result, truth, bias, valid, wrong):
        return None  # not by as much as a one-pass variance would, or not as it would
    # Too few rows to see the factors vary as rounding's do (a uniformly scaled output, out *
    # 1.001, matched 1 draw in 10 on one row): the one-pass kernel's own rows are asked for.
    if int(wrong.sum()) < 3 and not _replayed(result, truth, one_pass, keep, wrong, dtype):
        return None
    return Diagnosis(ONE_PASS.name, ONE_PASS.description, ONE_PASS.fix, abs(1 - ratio))


def _one_pass_output(
    rows: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """A one-pass kernel computing in ``rows``' dtype, its output as float64 values."""
    mean = rows.mean(dim=-1, keepdim=True)
    one_pass_var = (rows * rows).mean(dim=-1, keepdim=True) - mean * mean
    xhat = (rows - mean) / torch.sqrt(one_pass_var.clamp_min(0) + eps)
    return _zeroed(xhat.double() * scale + bias, valid)


def _replayed(
    result: torch.Tensor,
    truth: torch.Tensor,
    model: torch.Tensor,
    keep: torch.Tensor,
    wrong: torch.Tensor,
    dtype: torch.dtype,
) -> bool:
    """Does ``model`` (a one-pass kernel's own output) account for the result's error on every
    ``wrong`` valid row, to a hundredth of it (or to the result's own rounding)? The rounding
    of a row's E[x**2] and E[x]**2 is that row's own: another mistake lands on it by chance
    about once in a thousand rows, and a one-pass kernel summing in another order is not named
    (its error is another row's draw)."""
    off_model = _row_errors(result, model)[keep][wrong]
    off_truth = _row_errors(result, truth)[keep][wrong]
    return bool((off_model <= (0.01 * off_truth).clamp_min(4 * torch.finfo(dtype).eps)).all())


def _rescaled_rows(
    result: torch.Tensor,
    truth: torch.Tensor,
    bias: torch.Tensor,
    valid: torch.Tensor,
    wrong: torch.Tensor,
) -> bool:
    """On the ``wrong`` valid rows, is the result's error mostly a multiple of the row's
    ``xhat * scale``, as a wrong variance (a wrong 1 / std) makes it, by a factor that varies
    from row to row, as rounding makes it? (A formula mistake, such as an unbiased variance,
    rescales every row by about the same factor.)"""
    channels = truth.shape[-1]
    keep = valid.reshape(-1)
    shape = (-1, channels)
    error = (result - truth).reshape(shape)[keep][wrong]
    scaled = (truth - bias).reshape(shape)[keep][wrong]
    finite = (error.isfinite() & scaled.isfinite()).all(dim=-1)
    error, scaled = error[finite], scaled[finite]
    if not len(error):
        return False
    size = scaled.square().sum(dim=-1, keepdim=True)
    factor = torch.where(size > 0, (error * scaled).sum(dim=-1, keepdim=True) / size, 0.0)
    left = (error - factor * scaled).norm(dim=-1) / error.norm(dim=-1).clamp_min(1e-300)
    if float(left.median()) > 0.5:
        return False
    factors = factor.squeeze(1)
    return len(factors) < 3 or float(factors.std()) >= 0.3 * float(factors.abs().mean())
