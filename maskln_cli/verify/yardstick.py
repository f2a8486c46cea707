"""PyTorch's own result on rows of verify's input, in the judged dtype: the yardstick a
budget is checked against (``F.layer_norm``, or ``F.rms_norm``, and their autograd gradients),
whose error raises an element's budget where PyTorch errs more than the model
(:func:`maskln_cli.verify.budget.unit`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Yardstick", "rms_yardstick", "yardstick"]


@dataclass
class Yardstick:
    """PyTorch's result on a chunk of rows, in the kernel's dtype: ``out`` and ``grad_x``
    ``[R, C]`` and this chunk's shares of ``grad_scale`` and ``grad_bias`` ``[C]``."""

    out: torch.Tensor
    grad_x: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None


def yardstick(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    grad_out: torch.Tensor | None = None,
    centered: bool = True,
) -> Yardstick:
    """``F.layer_norm`` in ``dtype`` on rows ``x`` ``[R, C]`` with the padding zeroed first (the
    one-liner without its NaN leak), and with ``grad_out`` its autograd gradients;
    ``centered=False``: ``F.rms_norm`` (``scale`` its whole gain; :func:`rms_yardstick`).

    Example:
        >>> x = torch.tensor([[1.0, 3.0], [float("nan"), 0.0]])
        >>> valid, one, zero = torch.tensor([True, False]), torch.ones(2), torch.zeros(2)
        >>> y = yardstick(x, valid, one, zero, 1e-5, torch.float32)
        >>> y.out
        tensor([[-1.0000,  1.0000],
                [ 0.0000,  0.0000]])
    """
    if not centered:
        return rms_yardstick(x, valid, scale, eps, dtype, grad_out)
    weight, shift = scale.to(dtype), bias.to(dtype)
    channels = x.shape[-1]
    # The padding set to +0.0 by index, before and after: what torch.where(keep, ..., 0)
    # gives, at a third of the cost of a broadcast mask (and nothing when every row is valid).
    invalid = (~valid).nonzero().squeeze(1)

    def padded(values: torch.Tensor) -> torch.Tensor:
        if not invalid.numel():
            return values.to(dtype)
        return values.to(dtype, copy=True).index_fill_(0, invalid, 0.0)

    if grad_out is None:
        with torch.no_grad():
            out = F.layer_norm(padded(x), (channels,), weight, shift, eps)
            return Yardstick(out.index_fill_(0, invalid, 0.0) if invalid.numel() else out)
    rows, upstream, power = padded(x), padded(grad_out), 1.0
    # Finite when its least and greatest values are (NaN carried into both): one pass.
    if not all(math.isfinite(float(v)) for v in torch.aminmax(upstream)):
        upstream, power = _upstream_in_range(grad_out, valid.unsqueeze(1), dtype)
    # The kernels autograd runs for F.layer_norm and its backward, called directly: the same
    # bits (the backward of torch.where passes the upstream gradient, already 0 on the
    # padding), without autograd's graph and its first call's imports (sympy, a second or two).
    with torch.no_grad():
        normalized, mean, rstd = torch.native_layer_norm(rows, (channels,), weight, shift, eps)
        grads = torch.ops.aten.native_layer_norm_backward(
            upstream, rows, (channels,), mean, rstd, weight, shift, (True, True, True)
        )
    if invalid.numel():
        normalized.index_fill_(0, invalid, 0.0)
    return Yardstick(normalized, *(_times(g, power) for g in grads))


def rms_yardstick(
    x: torch.Tensor,
    valid: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    grad_out: torch.Tensor | None = None,
) -> Yardstick:
    """``F.rms_norm`` in ``dtype`` on rows ``x`` ``[R, C]``, the padding zeroed first, and with
    ``grad_out`` its autograd gradients (grad_bias: the upstream gradient's sum, a zero bias's).

    Example:
        >>> x = torch.tensor([[3.0, 4.0], [float("nan"), 0.0]])
        >>> y = rms_yardstick(x, torch.tensor([True, False]), torch.ones(2), 0.0, torch.float32)
        >>> y.out
        tensor([[0.8485, 1.1314],
                [0.0000, 0.0000]])
    """
    keep = valid.unsqueeze(1)
    zero = torch.zeros((), dtype=dtype)
    rows = torch.where(keep, x.to(dtype), zero)
    weight = gain.to(dtype)
    shape = (x.shape[-1],)
    if grad_out is None:
        with torch.no_grad():
            return Yardstick(torch.where(keep, F.rms_norm(rows, shape, weight, eps), zero))
    upstream, power = _upstream_in_range(grad_out, keep, dtype)
    with torch.enable_grad():
        leaves = (rows.detach().requires_grad_(), weight.detach().requires_grad_())
        out = F.rms_norm(leaves[0], shape, leaves[1], eps)
        grad_x, grad_scale = torch.autograd.grad(out, leaves, upstream)
    grads = (_times(g, power) for g in (grad_x, grad_scale, upstream.sum(dim=0)))
    return Yardstick(torch.where(keep, out.detach(), zero), *grads)


RANGE_HEADROOM = 2.0**8
"""How far below its dtype's largest value grad_out is brought when it is beyond it."""


def _upstream_in_range(
    grad_out: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """grad_out on the valid rows, in ``dtype``, and 1; or, where a finite value of it is beyond
    ``dtype``'s range (inf once cast), divided by the power of two that brings its largest
    :data:`RANGE_HEADROOM` below that range's end, and that power: a gradient is linear in
    grad_out, so PyTorch's gradients times it are its gradients of grad_out itself (the
    yardstick's figure was NaN, or 0 when its error was taken as none)."""
    zero = torch.zeros((), dtype=dtype)
    upstream = torch.where(keep, grad_out.to(dtype), zero)
    if math.isfinite(float(upstream.abs().amax())):
        return upstream, 1.0
    finite = torch.where(keep & grad_out.isfinite(), grad_out.double(), 0.0)
    largest = float(finite.abs().amax())
    ceiling = torch.finfo(dtype).max / RANGE_HEADROOM
    if largest <= ceiling:  # inf in grad_out itself: nothing to bring into range
        return upstream, 1.0
    power = 2.0 ** math.ceil(math.log2(largest / ceiling))
    return torch.where(keep, (grad_out.double() / power).to(dtype), zero), power


def _times(grad: torch.Tensor, power: float) -> torch.Tensor:
    """``grad`` times ``power`` (a power of two: exact), in its dtype (inf where the product
    is beyond it, as PyTorch's own gradient would be)."""
    return grad if power == 1.0 else (grad.double() * power).to(grad.dtype)
