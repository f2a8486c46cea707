"""The op in torch's dispatcher: ``maskln::masked_layer_norm``, ``maskln::masked_rms_norm`` and
their backward ops.

What torch.compile, torch.export, torch.jit.trace, fake and meta tensors and users calling
``torch.ops.maskln.masked_layer_norm`` (or ``masked_rms_norm``) see: each op is one node of a
graph, checked as the public functions check (the same messages), with

- a CPU kernel: the native C++ kernels once they load (registered from C++ by
  :mod:`maskln_cli.op.backend`), else the Python implementation below, which runs the raw-op
  kernels (and every device but the CPU);
- a fake (meta) implementation giving the real outputs' shapes, dtypes and strides;
- autograd (reverse and forward mode) by the Functions of :mod:`maskln_cli.op.autograd`, the
  backward op differentiable in turn (second order);
- vmap rules, one call for the batch.

Schemas::

    masked_layer_norm(Tensor x, Tensor valid, Tensor scale, Tensor bias, float eps)
        -> (Tensor y, Tensor mean, Tensor rstd)
    masked_layer_norm_backward(Tensor dy, Tensor x, Tensor valid, Tensor scale, Tensor mean,
        Tensor rstd, float eps, bool[] output_mask) -> Tensor[]   # the requested of dx,
                                                                  # dscale, dbias
    masked_rms_norm(Tensor x, Tensor valid, Tensor scale, float eps, float offset)
        -> (Tensor y, Tensor rstd)
    masked_rms_norm_backward(Tensor dy, Tensor x, Tensor valid, Tensor scale, Tensor rstd,
        float eps, float offset, bool[] output_mask) -> Tensor[]  # the requested of dx, dscale

y and dx have x's dtype and layout (``torch.empty_like(x)``); mean and rstd ``[..., 1]`` in
the compute dtype; dscale and dbias scale's dtype. Each kernel below is written once for both
norms, in the inner calling convention of :mod:`maskln_cli.op.norms`, and registered for each
norm's ops through :meth:`~maskln_cli.op.norms.Norm.inner` and
:meth:`~maskln_cli.op.norms.Norm.outer`, which convert by argument name. Importing this module
defines the ops; :mod:`maskln_cli.op.registration` imports it as soon as torch is imported.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from maskln_cli.op import backend
from maskln_cli.op.autograd import differentiable, op_autograd_backward, op_autograd_forward
from maskln_cli.op.batching import batched_backward, batched_forward
from maskln_cli.op.checks import (
    check_backward_inputs,
    check_inputs,
    check_rms_backward_inputs,
    check_rms_inputs,
    compute_dtype,
)
from maskln_cli.op.norms import INNER_BACKWARD, INNER_FORWARD, LAYER, NORMS, RMS, Norm

__all__ = [
    "BACKWARD_SCHEMA",
    "FORWARD_SCHEMA",
    "RMS_BACKWARD_SCHEMA",
    "RMS_FORWARD_SCHEMA",
    "backward_op",
    "forward_op",
    "rms_backward_op",
    "rms_forward_op",
]

FORWARD_SCHEMA = (
    "masked_layer_norm(Tensor x, Tensor valid, Tensor scale, Tensor bias, float eps)"
    " -> (Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "masked_layer_norm_backward(Tensor dy, Tensor x, Tensor valid, Tensor scale, Tensor mean,"
    " Tensor rstd, float eps, bool[] output_mask) -> Tensor[]"
)
RMS_FORWARD_SCHEMA = (
    "masked_rms_norm(Tensor x, Tensor valid, Tensor scale, float eps, float offset)"
    " -> (Tensor, Tensor)"
)
RMS_BACKWARD_SCHEMA = (
    "masked_rms_norm_backward(Tensor dy, Tensor x, Tensor valid, Tensor scale, Tensor rstd,"
    " float eps, float offset, bool[] output_mask) -> Tensor[]"
)
SCHEMAS = {
    LAYER.name: (FORWARD_SCHEMA, BACKWARD_SCHEMA),
    RMS.name: (RMS_FORWARD_SCHEMA, RMS_BACKWARD_SCHEMA),
}

_library = torch.library.Library("maskln", "DEF")
for _forward_schema, _backward_schema in SCHEMAS.values():
    _library.define(_forward_schema)
    _library.define(_backward_schema)
forward_op = torch.ops.maskln.masked_layer_norm.default
backward_op = torch.ops.maskln.masked_layer_norm_backward.default
rms_forward_op = torch.ops.maskln.masked_rms_norm.default
rms_backward_op = torch.ops.maskln.masked_rms_norm_backward.default
OPS = {LAYER.name: (forward_op, backward_op), RMS.name: (rms_forward_op, rms_backward_op)}
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _inner(norm: Norm, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return norm.inner(norm.forward_arguments, args, INNER_FORWARD)


def _inner_backward(norm: Norm, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return norm.inner(norm.backward_arguments, args, INNER_BACKWARD)


def _outputs(norm: Norm, y: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor) -> tuple:
    return (y, mean, rstd) if norm.centered else (y, rstd)


def _checked(norm: Norm, x, valid, scale, bias, eps, offset) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """eps and offset as floats, after the norm's checks (each message naming its argument)."""
    if norm.centered:
        return check_inputs(x, valid, scale, bias, eps), 0.0
    return check_rms_inputs(x, valid, scale, eps, offset)


def _checked_backward(norm: Norm, dy, x, valid, scale, mean, rstd, eps, offset, mask):  # type: ignore[no-untyped-def]
    """As :func:`_checked`, for the backward op (``mask``: the op's own output_mask)."""
    if norm.centered:
        return check_backward_inputs(dy, x, valid, scale, mean, rstd, eps, mask), 0.0
    return check_rms_backward_inputs(dy, x, valid, scale, rstd, eps, offset, mask)


# --- fake (and meta) implementations: the real outputs' shapes, dtypes and strides -----------


def _forward_fake(norm: Norm, *args: Any) -> tuple[torch.Tensor, ...]:
    x, valid, scale, bias, eps, offset = _inner(norm, args)
    _checked(norm, x, valid, scale, bias, eps, offset)
    statistics = x.new_empty((*x.shape[:-1], 1), dtype=compute_dtype(x.dtype))
    return (torch.empty_like(x), statistics, *(torch.empty_like(statistics) for _ in
                                                norm.statistics[1:]))  # fmt: skip


def _backward_fake(norm: Norm, *args: Any) -> list[torch.Tensor]:
    dy, x, valid, scale, mean, rstd, eps, offset, mask = _inner_backward(norm, args)
    _checked_backward(norm, dy, x, valid, scale, mean, rstd, eps, offset, args[-1])
    made = (torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale))
    return [t for t, need in zip(made, mask, strict=True) if need]


# --- the Python implementations (every device; CPU until the native kernels load) -------------


def _forward(norm: Norm, *args: Any) -> tuple[torch.Tensor, ...]:
    x, valid, scale, bias, eps, offset = _inner(norm, args)
    eps, offset = _checked(norm, x, valid, scale, bias, eps, offset)
    return _outputs(norm, *backend.forward(x, valid, scale, bias, eps, True, norm, offset))  # type: ignore[arg-type]


def _backward(norm: Norm, *args: Any) -> list[torch.Tensor]:
    dy, x, valid, scale, mean, rstd, eps, offset, mask = _inner_backward(norm, args)
    eps, offset = _checked_backward(norm, dy, x, valid, scale, mean, rstd, eps, offset, args[-1])
    grads = backend.backward(dy, x, valid, scale, mean, rstd, eps, tuple(mask), norm, offset)
    return [g for g in grads if g is not None]


# --- autograd: the Functions when a derivative may be taken, else straight to the kernel ------


def _forward_autograd(norm: Norm, keyset, *args: Any):  # type: ignore[no-untyped-def]
    x, valid, scale, bias, eps, offset = _inner(norm, args)
    if differentiable(x, scale, bias):
        # checked: the Function may call kernels directly
        eps, offset = _checked(norm, x, valid, scale, bias, eps, offset)
        return _outputs(norm, *op_autograd_forward(norm, x, valid, scale, bias, eps, offset))
    with torch._C._AutoDispatchBelowAutograd():
        return OPS[norm.name][0].redispatch(keyset & _AFTER_AUTOGRAD, *args)


def _backward_autograd(norm: Norm, keyset, *args: Any):  # type: ignore[no-untyped-def]
    dy, x, valid, scale, mean, rstd, eps, offset, mask = _inner_backward(norm, args)
    if differentiable(dy, x, scale):
        eps, offset = _checked_backward(
            norm, dy, x, valid, scale, mean, rstd, eps, offset, args[-1]
        )
        inner = (dy, x, valid, scale, mean, rstd, eps, offset, tuple(mask))
        return [g for g in op_autograd_backward(norm, *inner) if g is not None]
    with torch._C._AutoDispatchBelowAutograd():
        return OPS[norm.name][1].redispatch(keyset & _AFTER_AUTOGRAD, *args)


# --- vmap: the rules of batching.py, the op itself computing the batch -----------------------


def _forward_call(norm: Norm, *inner: Any) -> tuple[Any, ...]:
    """The forward op on inner arguments, ``(y, mean, rstd)``."""
    outputs = OPS[norm.name][0](*norm.outer(INNER_FORWARD, inner, norm.forward_arguments))
    return tuple(outputs) if norm.centered else (outputs[0], None, outputs[1])


def _backward_call(norm: Norm, *inner: Any) -> tuple[Any, ...]:
    """The backward op on inner arguments, ``(dx, dscale, dbias)``."""
    args = norm.outer(INNER_BACKWARD, inner, norm.backward_arguments)
    return backend.spread(OPS[norm.name][1](*args), inner[-1])


def _forward_vmap(norm: Norm, info, in_dims, *args: Any):  # type: ignore[no-untyped-def]
    dims = _inner(norm, in_dims)[:4]
    y, mean, rstd = batched_forward(
        norm, info.batch_size, dims, *_inner(norm, args),
        forward=functools.partial(_forward_call, norm),
    )  # fmt: skip
    outputs = _outputs(norm, y, mean, rstd)
    return outputs, (0,) * len(outputs)


def _backward_vmap(norm: Norm, info, in_dims, *args: Any):  # type: ignore[no-untyped-def]
    names = norm.backward_arguments[:-1]  # the output_mask has no batch dimension
    dims = norm.inner(names, in_dims[:-1], INNER_BACKWARD[:-1])[:6]
    inner = _inner_backward(norm, args)
    grads = batched_backward(
        norm, info.batch_size, dims, *inner[:-1], tuple(inner[-1]),
        forward=functools.partial(_forward_call, norm),
        backward=functools.partial(_backward_call, norm),
    )  # fmt: skip
    return [g for g in grads if g is not None], [0 for g in grads if g is not None]


AUTOGRAD_KERNELS: dict[str, tuple[Any, Any]] = {}
"""Each norm's forward and backward autograd kernels, by name (the native library calls them
back)."""

for _norm in NORMS.values():
    _name = f"maskln::{_norm.op}"
    _backward_name = f"maskln::{_norm.backward_op}"
    torch.library.register_fake(_name, functools.partial(_forward_fake, _norm), lib=_library)
    torch.library.register_fake(
        _backward_name, functools.partial(_backward_fake, _norm), lib=_library
    )
    _library.impl(_norm.op, functools.partial(_forward, _norm), "CompositeExplicitAutograd")
    _library.impl(
        _norm.backward_op, functools.partial(_backward, _norm), "CompositeExplicitAutograd"
    )
    _forward_kernel = functools.partial(_forward_autograd, _norm)
    _backward_kernel = functools.partial(_backward_autograd, _norm)
    _library.impl(_norm.op, _forward_kernel, "Autograd", with_keyset=True)
    _library.impl(_norm.backward_op, _backward_kernel, "Autograd", with_keyset=True)
    # On the CPU, the native library's C++ autograd kernels stand in front of these, and call
    # them back only when a derivative may be taken (no Python per call in compiled graphs).
    AUTOGRAD_KERNELS[_norm.name] = (_forward_kernel, _backward_kernel)
    backend.use_python_autograd(_norm, _forward_kernel, _backward_kernel)
    torch.library.register_vmap(_name, functools.partial(_forward_vmap, _norm), lib=_library)
    torch.library.register_vmap(
        _backward_name, functools.partial(_backward_vmap, _norm), lib=_library
    )

# The native kernels, when built, become the ops' CPU implementation now; when not, the first
# call on CPU builds them (or warns once and stays on the raw-op kernels). A wrong
# MASKLN_BACKEND must not fail this import (the ops are defined by now, and importing this
# module again would define them twice): the op's first call names it.
with contextlib.suppress(backend.BackendChoiceError):
    backend.native_kernels(build=False)
