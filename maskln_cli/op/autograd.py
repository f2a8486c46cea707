"""The op's derivatives: two autograd.Functions over the kernels of :mod:`maskln_cli.op.backend`.

:class:`MaskedLayerNormFunction` is the op with its derivatives of both modes:

- ``backward`` (reverse mode) calls the backward kernel, directly when no graph is to be built
  (the common case), else through the registered backward op, whose own autograd is
  :class:`MaskedLayerNormBackwardFunction`;
- ``jvp`` (forward mode: ``torch.func.jvp``, ``jacfwd``, dual tensors) is the backward kernel
  again, since the Jacobian of xhat in x is symmetric: for a valid row,
  ``J = rstd * (I - 1/C - xhat xhat^T / C)``, so ``J t`` is the backward's dx for ``dy = t``
  and unit scale; then ``y' = scale * J x' + xhat * scale' + bias'``.

:class:`MaskedLayerNormBackwardFunction` is the backward kernel as a function of (dy, x, scale),
so that derivatives compose over it (``create_graph=True``, ``jacrev``, ``hessian``): its own
derivatives (second order) come from the float64 composite of :mod:`maskln_cli.op.functional`,
which recomputes the statistics from x and so carries the terms that flow through them.

Both are the autograd of the registered ops (:mod:`maskln_cli.op.library`), applied there at a
single level of torch.func's transforms (the ops' dispatcher kernels unwrap one level at a time;
vmap has the ops' own rules); the public function applies the first directly for plain tensors,
the cheapest way in. Inside, anything but plain tensors (fake, functional, wrapped by a
transform) goes through the ops again, so a traced graph holds the op as one node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad
from torch._functorch.utils import enable_single_level_autograd_function, unwrap_dead_wrappers

from maskln_cli.op import backend
from maskln_cli.op.checks import compute_dtype
from maskln_cli.op.functional import gradients

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
PLAIN = (torch.Tensor, torch.nn.Parameter)


def transformed() -> bool:
    """A torch.func transform, or forward-mode AD, is active."""
    return (
        torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0
    )


def legacy_batched(tensor: torch.Tensor) -> bool:
    """A batched gradient of ``autograd.grad(..., is_grads_batched=True)`` (as gradcheck's
    ``check_batched_grad`` makes), which torch's older vmap batches outside any transform."""
    return bool(torch._C._functorch.is_legacy_batchedtensor(tensor))


def traced(*tensors: torch.Tensor) -> bool:
    """Fake, meta or other tensor subclasses (tracing, export): the registered op's path."""
    return any(type(t) not in PLAIN or t.is_meta for t in tensors)


def observed() -> bool:
    """A TorchDispatchMode (a flop counter, a tracer) or the profiler is active: it sees ops
    of the dispatcher only, so the op must be one, not a direct call of the kernels."""
    return bool(torch._C._len_torch_dispatch_stack()) or torch._C._autograd._profiler_enabled()


def plain(*tensors: torch.Tensor) -> bool:
    """Tensors the kernels can take directly: no graph being traced, no transform active,
    nothing observing the dispatcher."""
    return not (
        traced(*tensors)
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or observed()
    )


def differentiable(*tensors: torch.Tensor) -> bool:
    """A derivative of the op's result may be taken: reverse mode (grad enabled, an input
    requiring it) or forward mode (a dual level active, forward gradients enabled)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return torch.autograd.forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled()


def second_order(*tensors: torch.Tensor) -> bool:
    """Under torch.func, whether the derivative being computed from ``tensors`` (a Function's
    saved tensors and incoming derivative) will itself be differentiated: by an enclosing grad
    or jvp transform (their tensors wrap another level that tracks derivatives: ``hessian``,
    ``grad(grad(f))``), or by autograd outside the transforms (they require grad beneath)."""
    functorch = torch._C._functorch
    own = max(
        (functorch.maybe_get_level(t) for t in tensors if functorch.is_gradtrackingtensor(t)),
        default=None,
    )
    for tensor in tensors:
        while functorch.is_functorch_wrapped_tensor(tensor):
            if functorch.is_gradtrackingtensor(tensor) and functorch.maybe_get_level(tensor) != own:
                return True
            tensor = functorch.get_unwrapped(tensor)
        if tensor.requires_grad:
            return True
    return False


def apply_one_level(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function`` applied at the current level of torch.func's transforms only, as from a
    dispatcher kernel, where the transforms have already unwrapped the levels above (plain
    ``apply`` would route through all of them again)."""
    with enable_single_level_autograd_function():
        return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def apply_eager(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` for plain tensors outside torch.func's transforms, every
    argument given: ``Function.apply`` binds default arguments through ``inspect.signature``
    on every call, which costs more than the whole op on a small tensor."""
    args = unwrap_dead_wrappers(args)  # as Function.apply does
    return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def run_forward(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)``: the kernels for plain tensors, else the registered op."""
    if plain(x, valid, scale, bias):
        return backend.forward(x, valid, scale, bias, eps)  # type: ignore[return-value]
    return tuple(torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, eps))  # type: ignore[return-value]


def run_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool, bool],
) -> Grads:
    """``(dx, dscale, dbias)``, None where ``needs`` says so: the kernels for plain tensors,
    else the registered backward op."""
    if plain(dy, x, valid, scale, mean, rstd):
        return backend.backward(dy, x, valid, scale, mean, rstd, eps, needs)
    computed = iter(
        torch.ops.maskln.masked_layer_norm_backward(
            dy, x, valid, scale, mean, rstd, eps, list(needs)
        )
    )
    return tuple(next(computed) if need else None for need in needs)  # type: ignore[return-value]


class MaskedLayerNormFunction(torch.autograd.Function):
    """``(y, mean, rstd)`` of checked inputs, differentiable in x, scale and bias (mean and rstd
    are not); see the module docstring."""

    @staticmethod
    def forward(x, valid, scale, bias, eps):  # type: ignore[override]
        return run_forward(x, valid, scale, bias, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, valid, scale, bias, eps = inputs
        _, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.save_for_backward(x, valid, scale, mean, rstd)
        ctx.save_for_forward(x, valid, scale, mean, rstd)
        ctx.eps = eps
        ctx.bias_dtype = bias.dtype

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: object, _drstd: object) -> tuple[Any, ...]:
        x, valid, scale, mean, rstd = ctx.saved_tensors
        need_dx, _, need_dscale, need_dbias, _ = ctx.needs_input_grad
        needs = (need_dx, need_dscale, need_dbias)
        if legacy_batched(dy) or (
            torch._C._are_functorch_transforms_active() and second_order(dy, x, scale)
        ):
            # The float64 composite, differentiable by every transform: second derivatives
            # under torch.func (which cannot nest its own transforms inside the backward op's
            # derivatives), and torch's older vmap (gradcheck's batched gradients).
            dx, dscale, dbias = gradients(dy.double(), x.double(), valid, scale.double(),
                                          ctx.eps, needs)  # fmt: skip
            dx = None if dx is None else dx.to(x.dtype)
            dscale = None if dscale is None else dscale.to(scale.dtype)
        elif torch.is_grad_enabled() or transformed():  # a graph of the gradients is built
            computed = iter(
                torch.ops.maskln.masked_layer_norm_backward(
                    dy, x, valid, scale, mean, rstd, ctx.eps, list(needs)
                )
            )
            dx, dscale, dbias = (next(computed) if need else None for need in needs)
        else:
            dx, dscale, dbias = run_backward(dy, x, valid, scale, mean, rstd, ctx.eps, needs)
        if dbias is not None and dbias.dtype != ctx.bias_dtype:  # bias may be x's dtype
            dbias = dbias.to(ctx.bias_dtype)
        return dx, None, dscale, dbias, None

    @staticmethod
    def jvp(
        ctx: Any, tx: Any, _tvalid: Any, tscale: Any, tbias: Any, _teps: Any
    ) -> tuple[Any, ...]:
        x, valid, scale, mean, rstd = ctx.saved_tensors
        ones = torch.ones_like(scale)
        ty = None
        if tx is not None and (
            legacy_batched(tx)
            or (torch._C._are_functorch_transforms_active() and second_order(tx, x, scale))
        ):  # the composite, as in backward
            needs = (True, False, False)
            jx = gradients(tx.double(), x.double(), valid, ones.double(), ctx.eps, needs)[0]
            ty = jx.to(tx.dtype) * scale  # type: ignore[union-attr]
        elif tx is not None:  # scale * J tx, J symmetric: the backward kernel, unit scale
            (jx,) = torch.ops.maskln.masked_layer_norm_backward(
                tx, x, valid, ones, mean, rstd, ctx.eps, [True, False, False]
            )
            ty = jx * scale
        if tscale is not None:
            compute = compute_dtype(x.dtype)
            unit = torch.ones_like(scale, dtype=compute)
            xhat, _, _ = torch.ops.maskln.masked_layer_norm(
                x.to(compute), valid, unit, torch.zeros_like(unit), ctx.eps
            )
            ty = xhat * tscale if ty is None else ty + xhat * tscale
        if tbias is not None:
            ty = tbias.expand(x.shape) if ty is None else ty + tbias
        assert ty is not None  # forward AD asks only when some input has a tangent
        return ty.masked_fill(~valid.unsqueeze(-1), 0.0).to(x.dtype), None, None


class MaskedLayerNormBackwardFunction(torch.autograd.Function):
    """``(dx, dscale, dbias)`` (None where not needed) from the backward kernel, differentiable
    in dy, x and scale through the float64 composite (see the module docstring)."""

    @staticmethod
    def forward(dy, x, valid, scale, mean, rstd, eps, needs):  # type: ignore[override]
        return run_backward(dy, x, valid, scale, mean, rstd, eps, needs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        dy, x, valid, scale, _, _, eps, needs = inputs
        ctx.save_for_backward(dy, x, valid, scale)
        ctx.save_for_forward(dy, x, valid, scale)
        ctx.eps, ctx.needs = eps, needs

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        dy, x, valid, scale = ctx.saved_tensors
        function, wanted = _composite(ctx, valid)
        _, vjp = torch.func.vjp(function, dy, x, scale)
        reference = (x, scale, scale)
        given = tuple(
            torch.zeros_like(reference[i]) if cotangents[i] is None else cotangents[i]
            for i in wanted
        )
        ddy, ddx, dscale = vjp(given)
        return ddy, ddx, None, dscale, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, tdy: Any, tx: Any, _tvalid: Any, tscale: Any, *_rest: Any) -> tuple[Any, ...]:
        dy, x, valid, scale = ctx.saved_tensors
        function, wanted = _composite(ctx, valid)
        tangents = tuple(
            torch.zeros_like(primal) if tangent is None else tangent
            for primal, tangent in ((dy, tdy), (x, tx), (scale, tscale))
        )
        # J t by two vjps (u -> J^T u is linear, its vjp is J): a jvp would nest forward-mode
        # levels, which torch does not support inside forward-mode AD.
        outputs, vjp = torch.func.vjp(function, dy, x, scale)
        _, vjp_of_vjp = torch.func.vjp(vjp, tuple(torch.zeros_like(o) for o in outputs))
        (out,) = vjp_of_vjp(tangents)
        computed = iter(out)
        return tuple(next(computed) if i in wanted else None for i in range(3))


def _composite(ctx: Any, valid: torch.Tensor) -> tuple[Callable[..., Any], list[int]]:
    """The backward as the composite function of (dy, x, scale) whose derivatives are the
    second-order terms, in the dtypes of x and scale; and the indices of the gradients it
    returns (those the backward computed)."""
    wanted = [i for i, need in enumerate(ctx.needs) if need]

    def function(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> tuple[Any, ...]:
        grads = gradients(dy.double(), x.double(), valid, scale.double(), ctx.eps, ctx.needs)
        dtypes = (x.dtype, scale.dtype, scale.dtype)
        return tuple(grads[i].to(dtypes[i]) for i in wanted)  # type: ignore[union-attr]

    return function, wanted
