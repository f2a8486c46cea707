"""The op's derivatives, for both norms: autograd.Functions over the kernels, and the rule that
picks a way.

:class:`MaskedLayerNormFunction` (and :class:`MaskedRMSNormFunction`, the same for RMSNorm) is
the op with its derivatives of both modes:

- ``backward`` (reverse mode) is the backward kernel, or, when the gradient is itself to be
  differentiated, :class:`MaskedLayerNormBackwardFunction` (:class:`MaskedRMSNormBackwardFunction`),
  which is differentiable in turn;
- ``jvp`` (forward mode: ``torch.func.jvp``, ``jacfwd``, dual tensors) is the backward again,
  since the Jacobian of xhat in x is symmetric: for a valid row,
  ``J = rstd * (I - 1/C - xhat xhat^T / C)`` (RMSNorm's without the ``1/C``), so ``J t`` is
  the backward's dx for ``dy = t`` and unit gain; then ``y' = g * J x' + xhat * scale' +
  bias'``, with the gain ``g`` scale (LayerNorm) or offset + scale (RMSNorm);
- ``vmap`` folds the batch axis into the rows: one kernel call for the whole batch.

The backward Functions are the backward kernel as a function of (dy, x, scale): their own
derivatives (second order and beyond) come from the float64 composite of
:mod:`maskln_cli.op.functional`, which recomputes the statistics from x and so carries the
terms that flow through them.

Each Function is a thin class with its norm's own signature; what they compute is written once,
for both norms, in the inner calling convention of :mod:`maskln_cli.op.norms` (bias, mean and
dbias None for RMSNorm), with the norm as a parameter.

Under torch.func the public functions apply the Function with ``Function.apply``, torch's
own route for autograd.Functions through its transforms: each grad or jvp level gets a node
whose forward runs the levels below it with derivatives on, so a transform outside sees the
op's output as a function of its inputs. (A Function applied at a single level, from a
dispatcher kernel, runs its forward with derivatives off: an outer transform then took the
output for a constant.) Whatever the Functions compute from a transform's tensors goes through
a Function or plain torch ops, never a kernel directly, so that every level can differentiate
and batch it. Two cases take the float64 composite of :mod:`maskln_cli.op.functional`, which
every transform sees through natively: two forward-mode transforms at once (torch runs a
Function's ``jvp`` with forward-mode AD off, so the outer one would see a constant), and the
registered op differentiated under torch.func (inside the dispatcher, ``Function.apply``
cannot reach the levels below).

Which way each call takes is one table per direction (:data:`FORWARD_WAYS`,
:data:`BACKWARD_WAYS`), the same for both norms, read top to bottom: the first row whose
condition holds; ``tests/op/test_ways.py`` enumerates the contexts that reach each row.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad
from torch._C._functorch import unwrap_if_dead

from maskln_cli.op import backend
from maskln_cli.op.batching import batched_backward, batched_forward, normalized
from maskln_cli.op.checks import compute_dtype
from maskln_cli.op.functional import gradients, with_statistics
from maskln_cli.op.norms import LAYER, RMS, Norm

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Statistics = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
Needs = tuple[bool, bool, bool]
PLAIN = (torch.Tensor, torch.nn.Parameter)


# --- the conditions ---------------------------------------------------------------------------


def traced(*tensors: torch.Tensor | None) -> bool:
    """Fake, meta or other tensor subclasses (tracing, export): the registered op's path. None
    (RMSNorm's bias) is no tensor."""
    for t in tensors:  # noqa: SIM110 (a loop, not any(): this runs on every eager call)
        if t is not None and (type(t) not in PLAIN or t.is_meta):
            return True
    return False


def observed() -> bool:
    """A TorchDispatchMode (a flop counter, a tracer) or the profiler is active: it sees ops
    of the dispatcher only, so the op must be one, not a direct call of the kernels."""
    return bool(torch._C._len_torch_dispatch_stack()) or torch._C._autograd._profiler_enabled()


def graph_made(*tensors: torch.Tensor | None) -> bool:
    """A graph is being made (torch.compile, torch.jit.trace, fake or meta tensors, export) or
    the dispatcher is watched: the op must appear as the registered op, one node."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or traced(*tensors) or observed()


def transformed() -> bool:
    """A torch.func transform, or forward-mode AD, is active."""
    return (
        torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0
    )


def nested_forward_mode() -> bool:
    """Two forward-mode transforms of torch.func are active (``jvp`` of ``jvp``, ``jacfwd`` of
    ``jacfwd``, ``jvp`` of ``jacfwd``...).

    torch runs an autograd.Function's ``jvp`` rule with forward-mode AD off (torch 2.13, any
    Function), so a forward-mode transform outside the one the rule serves takes the rule's
    tangent for a constant: ``jvp(jvp(f))`` comes out 0 where it is not. Under two such
    transforms the op is the composite instead, which every transform differentiates natively;
    under one, the Function's rule is right (reverse-mode transforms outside it still see its
    operations, which run with gradients on).
    """
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    levels = retrieve_all_functorch_interpreters()
    return sum(level.key() == TransformType.Jvp for level in levels) >= 2


def differentiable(*tensors: torch.Tensor | None) -> bool:
    """A derivative of the op's result may be taken: reverse mode (grad enabled, an input
    requiring it) or forward mode (a dual level active, forward gradients enabled). None
    (RMSNorm's bias) is no tensor."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(): this runs on every eager call
            if t is not None and t.requires_grad:
                return True
    return torch.autograd.forward_ad._current_level >= 0 and torch._C._is_fwd_grad_enabled()


def legacy_batched(tensor: torch.Tensor | None) -> bool:
    """A batched gradient of ``autograd.grad(..., is_grads_batched=True)`` (as gradcheck's
    ``check_batched_grad`` makes), which torch's older vmap batches outside any transform."""
    return tensor is not None and bool(torch._C._functorch.is_legacy_batchedtensor(tensor))


def gradients_differentiated() -> bool:
    """The gradient being computed may itself be differentiated: a graph of the backward is
    being built (``create_graph=True``), or torch.func's transforms are active (a transform
    outside may differentiate or batch what the backward computes)."""
    return torch.is_grad_enabled() or transformed()


def plain(*tensors: torch.Tensor | None) -> bool:
    """Tensors the kernels can take directly: no graph being made, no transform active."""
    return not (graph_made(*tensors) or torch._C._are_functorch_transforms_active())


# --- the ways, and the rule -------------------------------------------------------------------


class Way(enum.Enum):
    """How a call reaches the kernels."""

    OP = "the registered op: one node of the graph being made or watched"
    COMPOSITE = "the float64 composite of plain torch ops, which every transform sees through"
    FUNCTION = "Function.apply: torch.func's route through its transforms"
    AUTOGRAD = "the Function's C apply: eager autograd, the least overhead"
    KERNELS = "the kernels directly"
    DIFFERENTIABLE = "the backward Function: a gradient differentiable in turn"


Condition = Callable[..., bool]
FORWARD_WAYS: tuple[tuple[str, Condition, Way], ...] = (
    ("a graph is made or ops are watched", graph_made, Way.OP),
    ("two forward-mode transforms", lambda x, v, s, b: nested_forward_mode(), Way.COMPOSITE),
    ("torch.func or forward-mode AD", lambda x, v, s, b: transformed(), Way.FUNCTION),
    ("grad needed", lambda x, v, s, b: differentiable(x, s, b), Way.AUTOGRAD),
    ("otherwise", lambda x, v, s, b: True, Way.KERNELS),
)
"""The public functions' way in, by (x, valid, scale, bias); RMSNorm's bias is None."""
BACKWARD_WAYS: tuple[tuple[str, Condition, Way], ...] = (
    ("older vmap's batched gradients", lambda g: legacy_batched(g), Way.COMPOSITE),
    ("a differentiable gradient", lambda g: gradients_differentiated(), Way.DIFFERENTIABLE),
    ("otherwise", lambda g: True, Way.KERNELS),
)
"""The Functions' way to a derivative, by the incoming gradient (backward) or tangent (jvp)."""


def forward_way(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> Way:
    for _, holds, way in FORWARD_WAYS:  # a loop, not next(genexpr): every eager call runs it
        if holds(x, valid, scale, bias):
            return way
    raise AssertionError("FORWARD_WAYS ends with a row that always holds")


def backward_way(incoming: torch.Tensor | None) -> Way:
    for _, holds, way in BACKWARD_WAYS:
        if holds(incoming):
            return way
    raise AssertionError("BACKWARD_WAYS ends with a row that always holds")


def apply_eager(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` for plain tensors outside torch.func's transforms, every
    argument given: ``Function.apply`` binds default arguments through ``inspect.signature``
    on every call, which costs more than the whole op on a small tensor."""
    # dead torch.func wrappers unwrapped, as Function.apply does (unwrap_dead_wrappers, inline)
    args = tuple([unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])
    return super(torch.autograd.Function, function).apply(*args)  # type: ignore[misc]


def apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function`` applied as autograd needs here: through torch.func's levels when a transform
    is active (``Function.apply``), else the cheapest way."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return apply_eager(function, *args)


# --- each norm's Functions and ops, in the inner calling convention ---------------------------


def forward_function(
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
) -> tuple[type[torch.autograd.Function], tuple[Any, ...]]:
    """The norm's forward Function and its arguments (its output's first entry is y)."""
    if norm.centered:
        return MaskedLayerNormFunction, (x, valid, scale, bias, eps)
    return MaskedRMSNormFunction, (x, valid, scale, eps, offset)


def apply_forward(norm: Norm, *inner: Any, eager: bool = False) -> Statistics:
    """``(y, mean, rstd)`` from the norm's forward Function, applied as :func:`apply` does
    (``eager``: as :func:`apply_eager`)."""
    function, args = forward_function(norm, *inner)
    outputs = (apply_eager if eager else apply)(function, *args)
    return outputs if norm.centered else (outputs[0], None, outputs[1])


def apply_backward(
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
    eager: bool = False,
) -> Grads:
    """``(dx, dscale, dbias)`` from the norm's backward Function (differentiable in turn)."""
    how = apply_eager if eager else apply
    if norm.centered:
        return how(MaskedLayerNormBackwardFunction, dy, x, valid, scale, mean, rstd, eps, needs)
    dx, dscale = how(
        MaskedRMSNormBackwardFunction, dy, x, valid, scale, rstd, eps, offset, needs[:2]
    )
    return dx, dscale, None


def call_op(
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
) -> Statistics:
    """``(y, mean, rstd)`` from the norm's registered forward op."""
    if norm.centered:
        return tuple(torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, eps))  # type: ignore[return-value]
    y, rstd = torch.ops.maskln.masked_rms_norm(x, valid, scale, eps, offset)
    return y, None, rstd


def call_backward_op(
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
) -> Grads:
    """``(dx, dscale, dbias)`` from the norm's registered backward op."""
    if norm.centered:
        computed = torch.ops.maskln.masked_layer_norm_backward(
            dy, x, valid, scale, mean, rstd, eps, list(needs)
        )
        return backend.spread(computed, needs)
    computed = torch.ops.maskln.masked_rms_norm_backward(
        dy, x, valid, scale, rstd, eps, offset, list(needs[:2])
    )
    return backend.spread(computed, (needs[0], needs[1], False))


# --- the kernels, or the registered ops on anything but plain tensors -------------------------


def run_forward(
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
) -> Statistics:
    """``(y, mean, rstd)``: the kernels for plain tensors, else the registered op."""
    if plain(x, valid, scale, bias):
        return backend.forward(x, valid, scale, bias, eps, True, norm, offset)  # type: ignore[return-value]
    return call_op(norm, x, valid, scale, bias, eps, offset)


def run_backward(
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
) -> Grads:
    """``(dx, dscale, dbias)``, None where ``needs`` says so: the kernels for plain tensors,
    else the registered backward op."""
    if plain(dy, x, valid, scale, mean, rstd):
        return backend.backward(dy, x, valid, scale, mean, rstd, eps, needs, norm, offset)
    return call_backward_op(norm, dy, x, valid, scale, mean, rstd, eps, offset, needs)


def composite_forward(
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    offset: float,
) -> Statistics:
    """``(y, mean, rstd)`` from the float64 composite (:mod:`maskln_cli.op.functional`)."""
    return with_statistics(norm, x, valid, scale, bias, eps, offset, compute_dtype(x.dtype))  # type: ignore[return-value]


def composite_backward(
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
) -> Grads:
    """``(dx, dscale, dbias)`` from the float64 composite, in x's and scale's dtypes."""
    dx, dscale, dbias = gradients(
        dy.double(), x.double(), valid, scale.double(), eps, needs, norm, offset
    )
    return (
        None if dx is None else dx.to(x.dtype),
        None if dscale is None else dscale.to(scale.dtype),
        None if dbias is None else dbias.to(scale.dtype),
    )


def op_autograd_forward(norm: Norm, *inner: Any) -> Statistics:
    """The registered op's autograd (the norm's forward op differentiated), in the inner
    convention.

    Under torch.func this runs inside the dispatcher, at the one level the transforms have
    unwrapped so far, where torch.func's route for a Function (``Function.apply``) is closed to
    the levels below: the composite, whose every operation each level differentiates in turn.
    Elsewhere (eager, and the graphs torch.compile and export trace) the Function.
    """
    if torch._C._are_functorch_transforms_active():
        return composite_forward(norm, *inner)
    return apply_forward(norm, *inner, eager=True)


def op_autograd_backward(
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
) -> Grads:
    """The registered backward op's autograd, as :func:`op_autograd_forward`."""
    if torch._C._are_functorch_transforms_active():
        return composite_backward(norm, dy, x, valid, scale, eps, offset, needs)
    return apply_backward(norm, dy, x, valid, scale, mean, rstd, eps, offset, needs, eager=True)


def differentiable_backward(
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
) -> Grads:
    """The gradients by the rule of :data:`BACKWARD_WAYS` for the incoming ``dy``."""
    way = backward_way(dy)
    if way is Way.COMPOSITE:
        return composite_backward(norm, dy, x, valid, scale, eps, offset, needs)
    if way is Way.DIFFERENTIABLE:
        return apply_backward(norm, dy, x, valid, scale, mean, rstd, eps, offset, needs)
    return run_backward(norm, dy, x, valid, scale, mean, rstd, eps, offset, needs)


# --- what the Functions compute, for either norm ----------------------------------------------


def save_forward(
    ctx: Any,
    norm: Norm,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    offset: float,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
) -> None:
    # Gradients and tangents that were never made stay None (no zeros made for mean and rstd,
    # which take none: they are not differentiable): forward_gradients and forward_tangent take
    # None for zero.
    ctx.set_materialize_grads(False)
    if mean is None:
        ctx.mark_non_differentiable(rstd)
    else:
        ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, valid, scale, mean, rstd)
    if transformed():  # only then may forward AD call jvp (its dual level is active now)
        ctx.save_for_forward(x, valid, scale, mean, rstd)
    ctx.norm, ctx.eps, ctx.offset = norm, eps, offset


def forward_gradients(ctx: Any, dy: torch.Tensor, needs: Needs) -> Grads:
    """The forward Function's gradients for the incoming ``dy`` (None: zero, so are they)."""
    if dy is None:
        return None, None, None
    x, valid, scale, mean, rstd = ctx.saved_tensors
    return differentiable_backward(
        ctx.norm, dy, x, valid, scale, mean, rstd, ctx.eps, ctx.offset, needs
    )


def forward_tangent(ctx: Any, tx: Any, tscale: Any, tbias: Any) -> torch.Tensor:
    """The op's output tangent, ``g * J tx + xhat * tscale + tbias`` (see the module
    docstring)."""
    x, valid, scale, mean, rstd = ctx.saved_tensors
    norm = ctx.norm
    ty = None
    if tx is not None:  # g * J tx, J symmetric: the backward with unit gain
        ones = torch.ones_like(scale)
        unit = (True, False, False)
        jx = differentiable_backward(norm, tx, x, valid, ones, mean, rstd, ctx.eps, 0.0, unit)
        ty = jx[0] * (scale if norm.centered else ctx.offset + scale)  # type: ignore[operator]
    if tscale is not None:
        xhat = normalized(norm, x, valid, ctx.eps, functools.partial(apply_forward, norm))
        ty = xhat * tscale if ty is None else ty + xhat * tscale
    if tbias is not None:
        ty = tbias.expand(x.shape) if ty is None else ty + tbias
    assert ty is not None  # forward AD asks only when some input has a tangent
    return ty.masked_fill(~valid.unsqueeze(-1), 0.0).to(x.dtype)


def forward_vmap(norm: Norm, size: int, dims: tuple[int | None, ...], *inner: Any) -> Statistics:
    """The forward Function's batch (``dims``: those of x, valid, scale, bias)."""
    return batched_forward(norm, size, dims, *inner, forward=functools.partial(apply_forward, norm))


def save_backward(
    ctx: Any,
    norm: Norm,
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    offset: float,
    needs: Needs,
) -> None:
    ctx.save_for_backward(dy, x, valid, scale)
    ctx.save_for_forward(dy, x, valid, scale)
    ctx.norm, ctx.eps, ctx.offset, ctx.needs = norm, eps, offset, needs


def backward_cotangents(ctx: Any, cotangents: tuple[Any, ...]) -> Grads:
    """The backward Function's own gradients ``(ddy, ddx, dscale)``, from the composite."""
    dy, x, valid, scale = ctx.saved_tensors
    function, wanted = _composite(ctx, valid)
    _, vjp = torch.func.vjp(function, dy, x, scale)
    reference = (x, scale, scale)
    taken = tuple(
        torch.zeros_like(reference[i]) if cotangents[i] is None else cotangents[i] for i in wanted
    )
    return vjp(taken)


def backward_tangents(ctx: Any, tdy: Any, tx: Any, tscale: Any) -> Grads:
    """The backward Function's output tangents ``(dx', dscale', dbias')``, from the composite."""
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
    return tuple(next(computed) if i in wanted else None for i in range(3))  # type: ignore[return-value]


def backward_vmap(norm: Norm, size: int, dims: tuple[int | None, ...], *inner: Any) -> Grads:
    """The backward Function's batch (``dims``: those of dy, x, valid, scale, mean, rstd)."""
    return batched_backward(
        norm, size, dims, *inner, forward=functools.partial(apply_forward, norm),
        backward=functools.partial(apply_backward, norm),
    )  # fmt: skip


def _composite(ctx: Any, valid: torch.Tensor) -> tuple[Callable[..., Any], list[int]]:
    """The backward as the composite function of (dy, x, scale) whose derivatives are the
    second-order terms, in the dtypes of x and scale; and the indices of the gradients it
    returns (those the backward computed)."""
    wanted = [i for i, need in enumerate(ctx.needs) if need]

    def function(dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> tuple[Any, ...]:
        grads = gradients(
            dy.double(), x.double(), valid, scale.double(), ctx.eps, ctx.needs, ctx.norm,
            ctx.offset,
        )  # fmt: skip
        dtypes = (x.dtype, scale.dtype, scale.dtype)
        return tuple(grads[i].to(dtypes[i]) for i in wanted)  # type: ignore[union-attr]

    return function, wanted


def _dims(grads: tuple[torch.Tensor | None, ...]) -> tuple[int | None, ...]:
    return tuple(None if g is None else 0 for g in grads)


# --- the Functions: each norm's signature -----------------------------------------------------


class MaskedLayerNormFunction(torch.autograd.Function):
    """``(y, mean, rstd)`` of checked inputs, differentiable in x, scale and bias (mean and rstd
    are not); see the module docstring."""

    @staticmethod
    def forward(x, valid, scale, bias, eps):  # type: ignore[override]
        return run_forward(LAYER, x, valid, scale, bias, eps, 0.0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, valid, scale, bias, eps = inputs
        save_forward(ctx, LAYER, x, valid, scale, eps, 0.0, *output[1:])
        ctx.bias_dtype = bias.dtype

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: object, _drstd: object) -> tuple[Any, ...]:
        need_dx, _, need_dscale, need_dbias, _ = ctx.needs_input_grad
        dx, dscale, dbias = forward_gradients(ctx, dy, (need_dx, need_dscale, need_dbias))
        if dbias is not None and dbias.dtype != ctx.bias_dtype:  # bias may be x's dtype
            dbias = dbias.to(ctx.bias_dtype)
        return dx, None, dscale, dbias, None

    @staticmethod
    def jvp(
        ctx: Any, tx: Any, _tvalid: Any, tscale: Any, tbias: Any, _teps: Any
    ) -> tuple[Any, ...]:
        return forward_tangent(ctx, tx, tscale, tbias), None, None

    @staticmethod
    def vmap(info: Any, in_dims: Any, x, valid, scale, bias, eps) -> Any:  # type: ignore[no-untyped-def]
        inner = (x, valid, scale, bias, eps, 0.0)
        return forward_vmap(LAYER, info.batch_size, in_dims[:4], *inner), (0, 0, 0)


class MaskedRMSNormFunction(torch.autograd.Function):
    """``(y, rstd)`` of checked RMSNorm inputs, differentiable in x and scale (rstd is not)."""

    @staticmethod
    def forward(x, valid, scale, eps, offset):  # type: ignore[override]
        y, _, rstd = run_forward(RMS, x, valid, scale, None, eps, offset)
        return y, rstd

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        x, valid, scale, eps, offset = inputs
        save_forward(ctx, RMS, x, valid, scale, eps, offset, None, output[1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _drstd: object) -> tuple[Any, ...]:
        need_dx, _, need_dscale, _, _ = ctx.needs_input_grad
        dx, dscale, _ = forward_gradients(ctx, dy, (need_dx, need_dscale, False))
        return dx, None, dscale, None, None

    @staticmethod
    def jvp(ctx: Any, tx: Any, _tvalid: Any, tscale: Any, _teps: Any, _toffset: Any) -> Any:
        return forward_tangent(ctx, tx, tscale, None), None

    @staticmethod
    def vmap(info: Any, in_dims: Any, x, valid, scale, eps, offset) -> Any:  # type: ignore[no-untyped-def]
        dims = (*in_dims[:3], None)
        y, _, rstd = forward_vmap(RMS, info.batch_size, dims, x, valid, scale, None, eps, offset)
        return (y, rstd), (0, 0)


class MaskedLayerNormBackwardFunction(torch.autograd.Function):
    """``(dx, dscale, dbias)`` (None where not needed) from the backward kernel, differentiable
    in dy, x and scale through the float64 composite (see the module docstring)."""

    @staticmethod
    def forward(dy, x, valid, scale, mean, rstd, eps, needs):  # type: ignore[override]
        return run_backward(LAYER, dy, x, valid, scale, mean, rstd, eps, 0.0, needs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        dy, x, valid, scale, _, _, eps, needs = inputs
        save_backward(ctx, LAYER, dy, x, valid, scale, eps, 0.0, needs)

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        ddy, ddx, dscale = backward_cotangents(ctx, cotangents)
        return ddy, ddx, None, dscale, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, tdy: Any, tx: Any, _tvalid: Any, tscale: Any, *_rest: Any) -> tuple[Any, ...]:
        return backward_tangents(ctx, tdy, tx, tscale)

    @staticmethod
    def vmap(info: Any, in_dims: Any, *args: Any) -> Any:
        dy, x, valid, scale, mean, rstd, eps, needs = args
        inner = (dy, x, valid, scale, mean, rstd, eps, 0.0, needs)
        grads = backward_vmap(LAYER, info.batch_size, in_dims[:6], *inner)
        return grads, _dims(grads)


class MaskedRMSNormBackwardFunction(torch.autograd.Function):
    """RMSNorm's ``(dx, dscale)`` (None where not needed), as
    :class:`MaskedLayerNormBackwardFunction`; ``needs`` has two entries."""

    @staticmethod
    def forward(dy, x, valid, scale, rstd, eps, offset, needs):  # type: ignore[override]
        inner = (dy, x, valid, scale, None, rstd, eps, offset, (*needs, False))
        return run_backward(RMS, *inner)[:2]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        dy, x, valid, scale, _, eps, offset, needs = inputs
        save_backward(ctx, RMS, dy, x, valid, scale, eps, offset, (*needs, False))

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        ddy, ddx, dscale = backward_cotangents(ctx, (*cotangents, None))
        return ddy, ddx, None, dscale, None, None, None, None

    @staticmethod
    def jvp(ctx: Any, tdy: Any, tx: Any, _tvalid: Any, tscale: Any, *_rest: Any) -> tuple[Any, ...]:
        return backward_tangents(ctx, tdy, tx, tscale)[:2]

    @staticmethod
    def vmap(info: Any, in_dims: Any, *args: Any) -> Any:
        dy, x, valid, scale, rstd, eps, offset, needs = args
        inner = (dy, x, valid, scale, None, rstd, eps, offset, (*needs, False))
        dims = (*in_dims[:4], None, in_dims[4])
        grads = backward_vmap(RMS, info.batch_size, dims, *inner)[:2]
        return grads, _dims(grads)
