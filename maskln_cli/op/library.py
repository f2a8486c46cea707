"""The op in torch's dispatcher: ``maskln::masked_layer_norm`` and its backward.

What torch.compile, torch.export, torch.jit.trace, fake and meta tensors and users calling
``torch.ops.maskln.masked_layer_norm`` see: each op is one node of a graph, checked as the
public function checks (the same messages), with

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

y and dx have x's dtype and layout (``torch.empty_like(x)``); mean and rstd ``[..., 1]`` in
the compute dtype; dscale and dbias scale's dtype. Importing this module defines the ops;
:mod:`maskln_cli.op.registration` imports it as soon as torch is imported.
"""

from __future__ import annotations

import contextlib

import torch

from maskln_cli.op import backend
from maskln_cli.op.autograd import (
    differentiable,
    op_autograd_backward,
    op_autograd_forward,
)
from maskln_cli.op.batching import batched_backward, batched_forward
from maskln_cli.op.checks import check_backward_inputs, check_inputs, compute_dtype

__all__ = ["BACKWARD_SCHEMA", "FORWARD_SCHEMA", "backward_op", "forward_op"]

FORWARD_SCHEMA = (
    "masked_layer_norm(Tensor x, Tensor valid, Tensor scale, Tensor bias, float eps)"
    " -> (Tensor, Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "masked_layer_norm_backward(Tensor dy, Tensor x, Tensor valid, Tensor scale, Tensor mean,"
    " Tensor rstd, float eps, bool[] output_mask) -> Tensor[]"
)

_library = torch.library.Library("maskln", "DEF")
_library.define(FORWARD_SCHEMA)
_library.define(BACKWARD_SCHEMA)
forward_op = torch.ops.maskln.masked_layer_norm.default
backward_op = torch.ops.maskln.masked_layer_norm_backward.default
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


# --- fake (and meta) implementations: the real outputs' shapes, dtypes and strides -----------


def _forward_fake(x, valid, scale, bias, eps):  # type: ignore[no-untyped-def]
    check_inputs(x, valid, scale, bias, eps)
    statistics = x.new_empty((*x.shape[:-1], 1), dtype=compute_dtype(x.dtype))
    return torch.empty_like(x), statistics, torch.empty_like(statistics)


def _backward_fake(dy, x, valid, scale, mean, rstd, eps, output_mask):  # type: ignore[no-untyped-def]
    check_backward_inputs(dy, x, valid, scale, mean, rstd, eps, output_mask)
    made = (torch.empty_like(x), torch.empty_like(scale), torch.empty_like(scale))
    return [t for t, need in zip(made, output_mask, strict=True) if need]


torch.library.register_fake("maskln::masked_layer_norm", _forward_fake, lib=_library)
torch.library.register_fake("maskln::masked_layer_norm_backward", _backward_fake, lib=_library)


# --- the Python implementations (every device; CPU until the native kernels load) -------------


def _forward(x, valid, scale, bias, eps):  # type: ignore[no-untyped-def]
    eps = check_inputs(x, valid, scale, bias, eps)
    return backend.forward(x, valid, scale, bias, eps)


def _backward(dy, x, valid, scale, mean, rstd, eps, output_mask):  # type: ignore[no-untyped-def]
    eps = check_backward_inputs(dy, x, valid, scale, mean, rstd, eps, output_mask)
    grads = backend.backward(dy, x, valid, scale, mean, rstd, eps, tuple(output_mask))
    return [g for g in grads if g is not None]


_library.impl("masked_layer_norm", _forward, "CompositeExplicitAutograd")
_library.impl("masked_layer_norm_backward", _backward, "CompositeExplicitAutograd")


# --- autograd: the Functions when a derivative may be taken, else straight to the kernel ------


def _forward_autograd(keyset, x, valid, scale, bias, eps):  # type: ignore[no-untyped-def]
    if differentiable(x, scale, bias):
        eps = check_inputs(x, valid, scale, bias, eps)  # the Function may call kernels directly
        return op_autograd_forward(x, valid, scale, bias, eps)
    with torch._C._AutoDispatchBelowAutograd():
        return forward_op.redispatch(keyset & _AFTER_AUTOGRAD, x, valid, scale, bias, eps)


def _backward_autograd(keyset, dy, x, valid, scale, mean, rstd, eps, output_mask):  # type: ignore[no-untyped-def]
    if differentiable(dy, x, scale):
        eps = check_backward_inputs(dy, x, valid, scale, mean, rstd, eps, output_mask)
        needs = tuple(output_mask)
        grads = op_autograd_backward(dy, x, valid, scale, mean, rstd, eps, needs)  # type: ignore[arg-type]
        return [g for g in grads if g is not None]
    with torch._C._AutoDispatchBelowAutograd():
        return backward_op.redispatch(
            keyset & _AFTER_AUTOGRAD, dy, x, valid, scale, mean, rstd, eps, output_mask
        )


_library.impl("masked_layer_norm", _forward_autograd, "Autograd", with_keyset=True)
_library.impl("masked_layer_norm_backward", _backward_autograd, "Autograd", with_keyset=True)
# On the CPU, the native library's C++ autograd kernels stand in front of these, and call them
# back only when a derivative may be taken (no Python per call in compiled graphs).
backend.use_python_autograd(_forward_autograd, _backward_autograd)


# --- vmap: the rules of batching.py, the op itself computing the batch -----------------------


def _forward_call(x, valid, scale, bias, eps):  # type: ignore[no-untyped-def]
    return tuple(forward_op(x, valid, scale, bias, eps))


def _backward_call(dy, x, valid, scale, mean, rstd, eps, needs):  # type: ignore[no-untyped-def]
    return backend.spread(backward_op(dy, x, valid, scale, mean, rstd, eps, list(needs)), needs)


def _forward_vmap(info, in_dims, x, valid, scale, bias, eps):  # type: ignore[no-untyped-def]
    return batched_forward(
        info.batch_size, in_dims, x, valid, scale, bias, eps, forward=_forward_call
    )


def _backward_vmap(info, in_dims, dy, x, valid, scale, mean, rstd, eps, output_mask):  # type: ignore[no-untyped-def]
    grads, dims = batched_backward(
        info.batch_size, in_dims, dy, x, valid, scale, mean, rstd, eps, tuple(output_mask),
        forward=_forward_call, backward=_backward_call,
    )  # fmt: skip
    return [g for g in grads if g is not None], [d for d in dims if d is not None]


torch.library.register_vmap("maskln::masked_layer_norm", _forward_vmap, lib=_library)
torch.library.register_vmap("maskln::masked_layer_norm_backward", _backward_vmap, lib=_library)

# The native kernels, when built, become the ops' CPU implementation now; when not, the first
# call on CPU builds them (or warns once and stays on the raw-op kernels). A wrong
# MASKLN_BACKEND must not fail this import (the ops are defined by now, and importing this
# module again would define them twice): the op's first call names it.
with contextlib.suppress(backend.BackendChoiceError):
    backend.native_kernels(build=False)
