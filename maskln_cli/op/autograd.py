"""How the op meets PyTorch: its autograd, the torch.library custom ops, and the dispatch tests.

One op, three ways in, chosen by :func:`maskln_cli.op.api.masked_layer_normalization`:

- eager (the default): the blocked, in-place kernels of :mod:`maskln_cli.op.blocked`, through
  an autograd.Function;
- under torch.compile and torch.export, and for fake and meta tensors: the same kernels as the
  torch.library custom op ``maskln::masked_layer_norm``, with a fake implementation, autograd
  (its backward the custom op ``maskln::masked_layer_norm_backward``) and a vmap rule, so that
  a graph holds one opaque node;
- under torch.func transforms (grad, vmap, jvp, jacrev, jacfwd, hessian) and forward-mode AD:
  the purely functional composite of :mod:`maskln_cli.op.functional`, which they see through.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad

from maskln_cli.op.blocked import backward_in_place, forward
from maskln_cli.op.functional import gradients


def transformed() -> bool:
    """A torch.func transform, or forward-mode AD, is active: the composite path."""
    return (
        torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0
    )


def legacy_batched(tensor: torch.Tensor) -> bool:
    """A batched gradient of ``autograd.grad(..., is_grads_batched=True)`` (as gradcheck's
    ``check_batched_grad`` makes), which torch's older vmap batches outside any transform."""
    return bool(torch._C._functorch.is_legacy_batchedtensor(tensor))


def traced(*tensors: torch.Tensor) -> bool:
    """Fake, meta or other tensor subclasses (tracing, export): the custom op's path."""
    return any(
        type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta"
        for t in tensors
    )


class autocast_off:
    """``torch.autocast(device, enabled=False)`` when autocast is on for ``device``, else
    nothing (entering an autocast context costs microseconds on every call)."""

    def __init__(self, device_type: str) -> None:
        self._context = None
        if device_type in ("cpu", "cuda", "xpu") and torch.is_autocast_enabled(device_type):
            self._context = torch.autocast(device_type, enabled=False)

    def __enter__(self) -> None:
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


# --- autograd: one setup_context and one backward, for the eager Function and the custom op ----


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    x, valid, scale, _, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, valid, scale, mean, rstd)
    ctx.eps = eps


def _backward(
    ctx: Any, dy: torch.Tensor, _dmean: object = None, _drstd: object = None
) -> tuple[torch.Tensor | None, ...]:
    x, valid, scale, mean, rstd = ctx.saved_tensors
    need_dx, _, need_dscale, need_dbias, _ = ctx.needs_input_grad
    needs = (need_dx, need_dscale, need_dbias)
    if torch.is_grad_enabled() or transformed() or legacy_batched(dy):
        # create_graph (or a batched backward under vmap): the saved statistics carry no graph,
        # so the differentiable formula recomputes them from x, for the second-order terms that
        # flow through mean and rstd. In float64, so that its intermediate values are exact.
        grads = gradients(dy.double(), x.double(), valid, scale.double(), ctx.eps, needs)
        dx, dscale, dbias = (None if g is None else g.to(x.dtype) for g in grads)
    elif traced(dy, x, valid, scale):
        computed = iter(
            torch.ops.maskln.masked_layer_norm_backward(
                dy, x, valid, scale, mean, rstd, ctx.eps, list(needs)
            )
        )
        dx, dscale, dbias = (next(computed) if need else None for need in needs)
    else:
        dx, dscale, dbias = backward_in_place(dy, x, valid, scale, mean, rstd, ctx.eps, *needs)
    return dx, None, dscale, dbias, None


class MaskedLayerNormFunction(torch.autograd.Function):
    """The eager op: the blocked kernels, with no dispatcher in between (the custom op below
    costs about 20 microseconds a call more, which small inputs would notice)."""

    @staticmethod
    def forward(x, valid, scale, bias, eps):  # type: ignore[override]
        return forward(x, valid, scale, bias, eps)

    setup_context = staticmethod(_setup_context)  # type: ignore[assignment]
    backward = staticmethod(_backward)  # type: ignore[assignment]


# --- the torch.library custom ops: what torch.compile, torch.export and fake tensors see -------


@torch.library.custom_op("maskln::masked_layer_norm", mutates_args=())
def masked_layer_norm_op(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` from checked inputs of one compute dtype: the blocked forward."""
    return forward(x, valid, scale, bias, eps)  # type: ignore[return-value]


@masked_layer_norm_op.register_fake
def _(x, valid, scale, bias, eps):
    statistics = x.new_empty((*x.shape[:-1], 1))
    return torch.empty_like(x), statistics, torch.empty_like(statistics)


masked_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("maskln::masked_layer_norm_backward", mutates_args=())
def masked_layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    output_mask: list[bool],
) -> list[torch.Tensor]:
    """The gradients that ``output_mask`` asks for, of (dx, dscale, dbias), in that order."""
    grads = backward_in_place(dy, x, valid, scale, mean, rstd, eps, *output_mask)
    return [g for g in grads if g is not None]


@masked_layer_norm_backward_op.register_fake
def _(dy, x, valid, scale, mean, rstd, eps, output_mask):
    shapes = (x.shape, scale.shape, scale.shape)
    return [x.new_empty(shape) for shape, need in zip(shapes, output_mask, strict=True) if need]


@masked_layer_norm_op.register_vmap
def _(info, in_dims, x, valid, scale, bias, eps):
    """Under vmap, the batch axis becomes one more leading axis of x; batched scale and bias
    apply to the normalized rows, which the op computes with unit scale and zero bias."""
    size = info.batch_size
    x = _batch_first(x, in_dims[0], size)
    valid = _batch_first(valid, in_dims[1], size)
    batched_params = in_dims[2] is not None or in_dims[3] is not None
    if not batched_params:
        return masked_layer_norm_op(x, valid, scale, bias, eps), (0, 0, 0)
    channels = x.shape[-1]
    y, mean, rstd = masked_layer_norm_op(x, valid, x.new_ones(channels), x.new_zeros(channels), eps)
    view = (size,) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    scale = _batch_first(scale, in_dims[2], size).reshape(view)
    bias = _batch_first(bias, in_dims[3], size).reshape(view)
    return (torch.where(valid.unsqueeze(-1), y * scale + bias, 0.0), mean, rstd), (0, 0, 0)


def _batch_first(tensor: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    if dim is None:
        return tensor.unsqueeze(0).expand(size, *tensor.shape)
    return tensor.movedim(dim, 0)
