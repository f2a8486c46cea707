"""``check_kernel``: a kernel called on copies of its inputs, judged against the inputs as given.

``assert_close(kernel(*inputs), *inputs)`` judges the output against the inputs as the kernel
left them: a kernel that zeroes ``valid`` in place and returns zeros, or zeroes ``x`` and
returns the bias, passes it. :func:`check_kernel` checks the inputs first, gives the kernel
copies of them (the same dtypes, devices and strides: the same memory layout, offset and gaps
included), takes the gradients of ``sum(out * grad_out)`` by autograd when ``grad_out`` is
given, judges it all against the inputs as given (:func:`~maskln_cli.testing.judging.judge`),
and fails when the kernel changed any copy: its values, its shape or strides, its memory
(``set_``, ``.data =``), or the memory between its elements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maskln_cli.testing.judging import (
    DEFAULT_FACTOR,
    VerifyFailed,
    check_judging,
    judge,
    warn_not_checked,
)

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.data import ComparisonReport

ARGUMENTS = ("x", "valid", "scale", "bias")
"""The kernel's tensor arguments, in the order it takes them (then eps)."""
DIFFERENTIABLE = ("x", "scale", "bias")
"""The arguments the gradients are taken with respect to (grad_x, grad_scale, grad_bias)."""


class InputModified(AssertionError):
    """Raised by :func:`check_kernel` when the kernel changed an input in place: the message
    names each input and what changed, then the verdict on its output (judged against the
    inputs as given); ``modified`` maps each input's name to what changed, ``report`` is the
    output's report as data."""

    def __init__(self, message: str, modified: dict[str, str], report: ComparisonReport) -> None:
        super().__init__(message)
        self.modified = modified
        self.report = report


def check_kernel(
    kernel: Callable[..., Any],
    x: torch.Tensor,
    valid: torch.Tensor | None,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float | None = None,
    grad_out: torch.Tensor | None = None,
    *,
    factor: float = DEFAULT_FACTOR,
    strict: bool = True,
    norm: str = "layer",
    offset: float = 0.0,
) -> None:
    """Assert that ``kernel(x, valid, scale, bias, eps)`` computes masked layer normalization
    right (with ``norm="rms"``: ``kernel(x, valid, scale, eps)`` masked RMSNorm), and leaves
    its inputs as it found them.

    The kernel is called on copies of the inputs (same dtypes, devices and strides); its
    output, and with ``grad_out`` its gradients of ``sum(out * grad_out)`` by autograd, are
    judged as :func:`~maskln_cli.testing.assert_close` judges them, against the inputs as
    given: a kernel cannot pass by changing what it is judged against. Any change it made to
    a copy (of x, valid, scale, bias or grad_out: values, shape, strides, memory) fails too.
    ``check_kernel(kernel, *inputs)`` takes the strategies' draws as they are, with or without
    ``grad_out``.

    Args:
        kernel: called as ``kernel(x, valid, scale, bias, eps)`` (RMSNorm's: ``kernel(x,
            valid, scale, eps)``, and ``offset=offset`` when it is not 0, as
            :func:`~maskln_cli.masked_rms_normalization` takes them); returns ``out``, a
            tensor of x's shape, differentiable by autograd when ``grad_out`` is given.
        x, valid, scale, bias, eps, grad_out: the inputs, as :func:`assert_close` takes them
            (``valid``, ``scale`` and ``bias`` may be None: the kernel gets None; bias None
            for RMSNorm; eps None: the norm's default).
        factor, strict, norm, offset: as :func:`assert_close`'s (``norm="rms"``: RMSNorm,
            its gain ``offset + scale``).

    Raises:
        AssertionError: the kernel changed an input (an :class:`InputModified`, naming it),
            its output or a gradient fails (a :class:`VerifyFailed`, whose message is the
            report), it returned no tensor, or ``grad_out`` was given and its output does not
            require grad.
        TypeError, ValueError: an argument is wrong (before the kernel is called); the
            message names it.

    Example:
        >>> import torch
        >>> from maskln_cli import masked_layer_normalization
        >>> x, valid = torch.randn(3, 16), torch.tensor([True, False, True])
        >>> check_kernel(masked_layer_normalization, x, valid, torch.ones(16), torch.zeros(16))
        >>> def sanitizing(x, valid, scale, bias, eps):  # right, but it zeroes x's padding
        ...     x[~valid] = 0
        ...     return masked_layer_normalization(x, valid, scale, bias, eps)
        >>> check_kernel(sanitizing, x, valid, torch.ones(16), torch.zeros(16))
        Traceback (most recent call last):
        ...
        maskln_cli.testing.checking.InputModified: FAIL: the kernel modified its input ...
        its out, judged against the inputs as given: PASS: out within the float32 error budget...
    """
    __tracebackhide__ = True  # pytest shows the test's line, not this function's
    import torch

    from maskln_cli.testing.inputs import problem_of, result_of
    from maskln_cli.testing.text import failure_message, verdict_line

    if not callable(kernel):
        raise TypeError(f"kernel must be callable, got {type(kernel).__name__}")
    check_judging(factor, strict)
    problem = problem_of(x, valid, scale, bias, eps, grad_out, norm, offset)  # checks all first
    given = dict(zip(ARGUMENTS, (x, valid, scale, bias), strict=True))
    if grad_out is not None:
        given["grad_out"] = grad_out
    copies = {
        name: _Copy.of(tensor, grad_out is not None and name in DIFFERENTIABLE)
        for name, tensor in given.items()
        if tensor is not None
    }
    arguments = [copies[n].tensor if n in copies else None for n in ARGUMENTS]
    if problem.norm.centered:
        out = kernel(*arguments, problem.eps)
    else:  # RMSNorm's arguments: no bias, the offset by keyword as the op takes it
        options = {"offset": problem.offset} if problem.offset else {}
        out = kernel(*arguments[:3], problem.eps, **options)
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"FAIL: the kernel returned {_a(type(out).__name__)}, not a tensor")
    gradients: dict[str, torch.Tensor | None] = {}
    if grad_out is not None and out.shape == grad_out.shape:  # else out fails on its shape
        gradients = _gradients(out, copies, arguments)
    modified = {name: change for name, copy in copies.items() if (change := copy.change())}
    result = result_of(out, gradients, problem)
    names = ("out", *(name for name, value in gradients.items() if value is not None))
    report = judge(problem, result, names, factor, strict)
    if modified:
        changes = "; ".join(f"{name} ({change})" for name, change in modified.items())
        inputs = "inputs" if len(modified) > 1 else "input"
        raise InputModified(
            f"FAIL: the kernel modified its {inputs} in place: {changes}\n"
            f"its out, judged against the inputs as given: {verdict_line(report)}",
            modified,
            report,
        )
    if not report.passed:
        raise VerifyFailed(failure_message(report), report)
    warn_not_checked(report, "check_kernel")


def _gradients(
    out: torch.Tensor, copies: dict[str, _Copy], arguments: list[torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """grad_x, grad_scale and grad_bias of ``sum(out * grad_out)`` by autograd (zeros for an
    argument ``out`` does not depend on; None for one not given)."""
    import torch

    if not out.requires_grad:
        raise AssertionError(
            "FAIL: grad_out given, but the kernel's out does not require grad: autograd"
            " cannot take its gradients (give no grad_out to judge out alone)"
        )
    leaves = {n: t for n, t in zip(ARGUMENTS, arguments, strict=True) if n in DIFFERENTIABLE}
    wrt = [n for n, t in leaves.items() if t is not None]
    upstream = copies["grad_out"].tensor
    if upstream.dtype != out.dtype:  # a kernel whose out is promoted: grad_out, exactly
        upstream = upstream.to(out.dtype)
    grads = torch.autograd.grad(
        out, [leaves[n] for n in wrt], upstream, allow_unused=True, materialize_grads=True
    )
    found = dict(zip(wrt, grads, strict=True))
    return {f"grad_{n}": found.get(n) for n in DIFFERENTIABLE}


@dataclass
class _Copy:
    """A copy of an input for the kernel (``tensor``), laid out as the original is in memory
    (``memory``: a copy of the span of memory the original views), and what to compare it
    with afterwards."""

    original: torch.Tensor
    tensor: torch.Tensor
    memory: torch.Tensor
    layout: tuple[object, ...]

    @classmethod
    def of(cls, given: torch.Tensor, requires_grad: bool) -> _Copy:
        """A copy of ``given``, a leaf that requires grad when asked or when ``given`` does."""
        original = given.detach()
        span = _span(original)
        memory = original.as_strided((span,), (1,), original.storage_offset()).clone()
        tensor = memory.as_strided(original.shape, original.stride(), 0).detach()
        if requires_grad or given.requires_grad:
            tensor.requires_grad_()
        return cls(original, tensor, memory, _layout(tensor))

    def change(self) -> str | None:
        """What the kernel changed, in words (None: nothing)."""
        import torch

        tensor, original = self.tensor, self.original
        if tensor.shape != original.shape:
            return f"resized: shape {list(original.shape)}, now {list(tensor.shape)}"
        if tensor.dtype != original.dtype:
            return f"dtype {_name(original.dtype)}, now {_name(tensor.dtype)}"
        if _layout(tensor) != self.layout:
            return "now views other memory, or other strides of it: set_, .data = or as_strided_"
        changed = _bits(tensor.detach()) != _bits(original)
        count = int(changed.sum())
        if count:
            first = tuple(int(i) for i in changed.nonzero()[0])
            was, now = _value(original[first]), _value(tensor.detach()[first])
            return (
                f"{count:,} of {original.numel():,} elements changed, the first at"
                f" {list(first)}: {was}, now {now}"
            )
        before = original.as_strided((self.memory.numel(),), (1,), original.storage_offset())
        if not torch.equal(_bits(self.memory), _bits(before)):
            return "memory between its strided elements written: the caller's, not the input's"
        return None


def _span(tensor: torch.Tensor) -> int:
    """How many elements of memory ``tensor`` views, from its first to its last."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )


def _layout(tensor: torch.Tensor) -> tuple[object, ...]:
    return (
        tuple(tensor.stride()),
        tensor.storage_offset(),
        tensor.untyped_storage().data_ptr(),
        tensor.device,
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their size: equal exactly when the bits are (NaN
    equals itself, -0.0 differs from +0.0)."""
    import torch

    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(integer[tensor.element_size()])


def _value(element: torch.Tensor) -> str:
    value = element.item()
    return f"{value:.7g}" if isinstance(value, float) else str(value)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _a(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"
