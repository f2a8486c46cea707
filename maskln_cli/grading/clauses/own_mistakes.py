"""Mistakes the grader names beside the shared catalogue (:mod:`maskln_cli.op.mistakes`): formulas
of its own (:data:`GRADE_MISTAKES`, tried on a wrong output as the catalogue's are) and causes of
wrong gradients recognized from the gradients themselves (:func:`gradient_pattern`). Like every
cause the grader names, each is named only when a test confirms it (:mod:`maskln_cli.grading.
confirm`).
"""

from __future__ import annotations

import torch

from maskln_cli.op.mistakes import Diagnosis, Mistake


def _clean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), x, 0.0)


def _masked(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), y, 0.0)


def _variance_clamped(x, valid, scale, bias, eps):
    x = _clean(x, valid)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return _masked((x - mean) * torch.rsqrt(var.clamp(min=eps)) * scale + bias, valid)


def _std_clamped(x, valid, scale, bias, eps):
    x = _clean(x, valid)
    mean = x.mean(-1, keepdim=True)
    std = (x - mean).square().mean(-1, keepdim=True).sqrt()
    return _masked((x - mean) / std.clamp(min=eps) * scale + bias, valid)


def _channels_from_axis_one(x, valid, scale, bias, eps):
    count = x.shape[1] if x.dim() >= 2 else x.shape[-1]
    x = _clean(x, valid)
    mean = x.sum(-1, keepdim=True) / count
    var = (x - mean).square().sum(-1, keepdim=True) / count
    return _masked((x - mean) / torch.sqrt(var + eps) * scale + bias, valid)


def mean_detached_formula(x, valid, scale, bias, eps):
    """The op with its variance taken around ``mean.detach()``: right values and first
    derivatives, other second derivatives."""
    x = _clean(x, valid)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean.detach()).square().mean(-1, keepdim=True)
    return _masked((x - mean) / torch.sqrt(var + eps) * scale + bias, valid)


GRADE_MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "variance_clamped",
            "eps used as a floor of the variance, not added to it: rsqrt(var.clamp(min=eps)),"
            " max(var, eps)",
            "add eps to the variance: rsqrt(var + eps); clamp nothing",
            _variance_clamped,
        ),
        Mistake(
            "std_clamped",
            "eps used as a floor of the standard deviation, not added to the variance:"
            " (x - mean) / sqrt(var).clamp(min=eps)",
            "divide by sqrt(var + eps); clamp nothing",
            _std_clamped,
        ),
        Mistake(
            "channels_from_another_axis",
            "C read from another axis (x.size(1), x.shape[1]: the positions of x [B, N, C]),"
            " written for x [rows, C]: the mean and variance are divided by the wrong count",
            "take C from the last axis, x.shape[-1], or use x.mean(-1)",
            _channels_from_axis_one,
        ),
    )
}
"""The grader's own formula mistakes, tried with the catalogue's."""


def _diagnosis(name: str, description: str, fix: str) -> Diagnosis:
    return Diagnosis(name, description, fix, 0.0)


GRADIENTS_IN_FLOAT32 = _diagnosis(
    "gradients_in_float32",
    "the gradients of float64 inputs carry float32's rounding (the outputs are right): a"
    " float32 constant or buffer in the backward, torch.tensor(1 / C) or torch.zeros(C) made"
    " in the default dtype",
    "make every tensor of the backward in x's dtype: torch.tensor(v, dtype=x.dtype),"
    " x.new_zeros(...), or divide by C as a Python number",
)
PADDING_IN_GRAD_BIAS = _diagnosis(
    "padding_in_grad_bias",
    "grad_bias sums the upstream gradient of the invalid rows too: the padding's outputs are"
    " constant zeros, so their gradient must not reach bias (a hand-written backward summing"
    " grad_out over every row)",
    "sum grad_out over the valid rows only: torch.where(valid[..., None], grad_out, 0) first",
)
GRAD_X_IN_PADDING = _diagnosis(
    "grad_x_in_padding",
    "grad_x is not zero in the invalid rows: a hand-written backward that computes every row's"
    " gradient from grad_out and never masks the padding's (whose outputs are constant zeros)",
    "zero the invalid rows of grad_x: torch.where(valid[..., None], grad_x, 0.0)",
)
NAN_MADE_IN_PADDING = _diagnosis(
    "nan_made_in_padding",
    "NaN made in the invalid rows by the function itself (masked_fill with NaN, nanmean, a"
    " division of a padded row by zero) reaches a gradient, through 0 * NaN: masking the output"
    " afterwards does not stop it",
    "zero the padding, torch.where(valid[..., None], x, 0.0), and compute every row as a"
    " valid one: no NaN in any row, then select the output with torch.where",
)
MEAN_DETACHED_IN_VARIANCE = _diagnosis(
    "mean_detached_in_variance",
    "the variance taken around mean.detach() (or a mean computed without grad): its first"
    " derivative is right, the mean's term cancels there, but not its second derivative",
    "compute the variance around the mean itself, in the graph: ((x - mean)**2).mean(-1)",
)
RESULT_FROM_EARLIER_CALL = _diagnosis(
    "result_from_earlier_call",
    "a wrong result that depends on earlier calls: the same inputs, given again as new tensors,"
    " give the right one (statistics or results cached by id(x), data_ptr() or shape, in a"
    " global or a default argument)",
    "compute every call from its own inputs; cache nothing between calls",
)
OWN_CAUSES = (
    GRADIENTS_IN_FLOAT32,
    PADDING_IN_GRAD_BIAS,
    GRAD_X_IN_PADDING,
    NAN_MADE_IN_PADDING,
    MEAN_DETACHED_IN_VARIANCE,
    RESULT_FROM_EARLIER_CALL,
)
"""The grader's own causes that are not formulas."""


FLOAT32_GRADIENT_ERROR = (1e-13, 2e-6)
"""The relative RMS error of a float64 gradient computed with float32 somewhere in it: above
float64's rounding of a correct backward, at most a few hundred float32 ulps."""


def gradient_pattern(
    name: str,
    actual: torch.Tensor,
    reference: torch.Tensor,
    valid: torch.Tensor,
    grad_out: torch.Tensor | None,
    right: bool,
    dtype: torch.dtype,
) -> Diagnosis | None:
    """A cause read from a wrong gradient ``name`` (``grad_x``, ``grad_bias``, ...) whose output
    is ``right``: float32's rounding in a float64 backward; the padding's upstream gradient in
    grad_bias; grad_x not zeroed in the padding. None: no such pattern."""
    if tuple(actual.shape) != tuple(reference.shape) or not bool(actual.isfinite().all()):
        return None
    error = actual.double() - reference
    size = float(reference.norm())
    relative = float(error.norm()) / size if size else float("inf")
    low, high = FLOAT32_GRADIENT_ERROR
    if right and dtype == torch.float64 and low < relative <= high:
        return GRADIENTS_IN_FLOAT32
    if grad_out is None or not valid.dim() or bool(valid.all()):
        return None
    keep = valid.unsqueeze(-1)
    tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    scale = tolerance * max(1.0, float(reference.abs().max()) if reference.numel() else 1.0)
    if name == "grad_x" and tuple(actual.shape) == tuple(keep.expand(actual.shape).shape):
        in_valid = (error.abs() * keep).amax() if error.numel() else 0.0
        in_padding = (actual.double().abs() * ~keep).amax() if error.numel() else 0.0
        if float(in_valid) <= scale < float(in_padding):
            return GRAD_X_IN_PADDING
    if name == "grad_bias":
        padding = torch.where(keep, 0.0, grad_out.double()).reshape(-1, actual.shape[-1]).sum(0)
        if float(padding.abs().max()) > scale and float((error - padding).abs().max()) <= scale:
            return PADDING_IN_GRAD_BIAS
    return None
