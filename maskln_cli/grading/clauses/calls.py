"""Calls of the graded function: how each is made (:class:`Call`, :func:`perform`), and what a
clause's calls gave (:class:`ClauseRun`: tensors, facts, and each failed call's error in words).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from maskln_cli.grading.clauses.cases import Case, dtype_name
from maskln_cli.grading.exercise import current

Fn = Callable[..., Any]


@dataclass(frozen=True)
class Call:
    """One call of the function on a case: how it is called, and what comes back.

    ``style``: ``positional`` ``f(x, valid, scale, bias, eps)``, ``keyword`` (every argument
    named, as the specification's example), ``positional_default`` and ``keyword_default``
    (eps omitted). ``mode``: ``grad``, ``no_grad`` or ``inference`` (``torch.inference_mode``).
    With ``backward``, the gradients of ``sum(out * grad_out)`` w.r.t. ``requires``.
    """

    key: str
    case: int
    style: str = "positional"
    clean: bool = False
    requires: tuple[str, ...] = ()
    backward: bool = False
    mode: str = "grad"


class _GradInputs(Sequence[str]):
    """The inputs a gradient is taken with respect to, of the exercise in force
    (:func:`~maskln_cli.grading.exercise.current`): x, scale and bias for LayerNorm, x and
    scale for RMSNorm. Read when iterated, so that every clause's calls and leaves follow the
    exercise graded, in the child as in the parent, without a copy of any clause."""

    def __getitem__(self, index: Any) -> Any:
        return current().grad_inputs[index]

    def __len__(self) -> int:
        return len(current().grad_inputs)

    def __repr__(self) -> str:
        return repr(current().grad_inputs)


GRAD_INPUTS: Sequence[str] = _GradInputs()
MODE_WORDS = {
    "grad": "grad enabled",
    "no_grad": "under torch.no_grad()",
    "inference": "under torch.inference_mode()",
}


_WATCHER: list[Callable[[str], None]] = []


def watch_calls(watcher: Callable[[str], None] | None) -> None:
    """Have ``watcher`` told, before each call of the graded function, which case it is about
    (the grader's child tells the grader, so that a timeout names the case that hung)."""
    _WATCHER[:] = [watcher] if watcher is not None else []


def announce(what: str) -> None:
    """Tell the watcher (:func:`watch_calls`), if any, that the function is called on ``what``."""
    for watcher in _WATCHER:
        watcher(what)


def requiring_grad_words() -> str:
    """``, x, scale and bias requiring grad``: every input taking gradients, of the exercise
    in force, in words."""
    names = list(GRAD_INPUTS)
    return f", {', '.join(names[:-1])} and {names[-1]} requiring grad"


def call_words(call: Call) -> str:
    """How a call is made, in words, after its case's label: ``, x requiring grad, and its
    backward``; ``, under torch.no_grad()``.

    Example:
        >>> call_words(Call("0", 0, requires=("x", "bias"), backward=True))
        ', x and bias requiring grad, and its backward'
    """
    words = ""
    names = list(current().arguments(*call.requires))
    if names:
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        words += f", {listed} requiring grad"
    if call.mode != "grad":
        words += f", {MODE_WORDS[call.mode]}"
    if call.backward:
        words += ", and its backward"
    if call.clean:
        words += ", clean padding"
    return words


class Misbehaved(Exception):
    """The function returned something that is not an output of the op."""


CAUGHT = (Exception, SystemExit)
"""What a call of the graded function may raise and still be reported (sys.exit() too)."""


def invoke(fn: Fn, t: dict[str, Any], eps: float, style: str) -> Any:
    """Call ``fn`` on the inputs ``t`` as the exercise in force takes them (``f(x, valid,
    scale, bias, eps)``, RMSNorm's without bias), in a ``style``."""
    names = current().arguments("x", "valid", "scale", "bias")
    given = {name: t[name] for name in names}
    if style == "positional":
        return fn(*given.values(), eps)
    if style == "keyword":
        return fn(**given, eps=eps)
    if style == "positional_default":
        return fn(*given.values())
    if style == "keyword_default":
        return fn(**given)
    raise ValueError(f"unknown call style {style!r}")


def _mode(mode: str) -> contextlib.AbstractContextManager[Any]:
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference":
        return torch.inference_mode()
    return contextlib.nullcontext()


def checked_output(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise Misbehaved(f"returned {type(out).__name__}, not a tensor")
    if not out.is_floating_point():
        raise Misbehaved(f"returned a {dtype_name(out.dtype)} tensor, not a floating one")
    return out


def export_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain (not a subclass), contiguous CPU copy: what the child can send."""
    return t.detach().as_subclass(torch.Tensor).to("cpu", copy=True).contiguous()


def perform(
    fn: Fn, case: Case, call: Call, device: str, keep: list[Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Make one call; returns the tensors it gave (``out``, ``grad_x``, ...) and facts about
    its output (requires_grad, dtype, device, strides). ``keep``: where the call's inputs are
    kept alive (no later input then reuses their addresses, or ids)."""
    announce(f"{case.label}{call_words(call)}")
    t = case.inputs(device, clean=call.clean)
    if keep is not None:
        keep.append(t)
    requires = current().arguments(*call.requires)
    for name in requires:
        t[name].requires_grad_()
    with _mode(call.mode):
        out = checked_output(invoke(fn, t, case.eps, call.style))
    meta = {
        "requires_grad": bool(out.requires_grad),
        "device": str(out.device),
        "dtype": dtype_name(out.dtype),
        "shape": list(out.shape),
        "stride": list(out.stride()),
    }
    tensors = {"out": export_tensor(out)}
    if call.backward:
        if not out.requires_grad:
            raise Misbehaved(
                f"the output does not require grad although {', '.join(requires)} does"
            )
        if tuple(out.shape) != tuple(t["x"].shape):
            raise Misbehaved(f"returned shape {list(out.shape)} for x {list(t['x'].shape)}")
        leaves = [t[name] for name in requires]
        if "grad_out" in case.views:  # the upstream gradient in its own layout, as it is
            upstream = Upstream.apply(out, t["grad_out"]).sum()
        else:
            upstream = weighted_sum(out, t)
        grads = torch.autograd.grad(upstream, leaves, allow_unused=True)
        for name, grad in zip(requires, grads, strict=True):
            if grad is None:
                raise Misbehaved(f"no gradient reached {name}: it is not used differentiably")
            tensors[f"grad_{name}"] = export_tensor(grad)
    return tensors, meta


class Upstream(torch.autograd.Function):
    """Hands the caller's own ``grad_out`` tensor, in its own layout, to the backward of ``out``
    (as ``out.backward(grad_out)`` does): a backward that writes into its incoming gradient,
    or assumes it contiguous, is seen. (``torch.autograd.grad(out, inputs, grad_out)`` would
    do it too, but imports sympy, seconds, to check the shapes.)"""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        ctx.grad_out = grad_out
        return out.clone()

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.grad_out, None


def weighted_sum(out: torch.Tensor, t: dict[str, Any]) -> torch.Tensor:
    """``sum(out * grad_out)``: its gradient w.r.t. out is exactly grad_out. (Passing
    grad_out to autograd.grad instead imports sympy, seconds of start-up.)"""
    return (out * t["grad_out"]).sum()


@dataclass
class ClauseRun:
    """What running a clause gave: tensors by ``"<call key>.<name>"``, facts by call key,
    the error of each call that failed, why the whole clause could not run (a crash, a
    timeout) when it could not, and the device the cases were built on."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    device: str = "cpu"

    def tensor(self, key: str, name: str) -> torch.Tensor:
        try:
            return self.tensors[f"{key}.{name}"]
        except KeyError:
            raise Misbehaved(f"no {name} came back") from None


def describe_exception(error: BaseException) -> str:
    """The exception's last line, ``RuntimeError: ...``, shortened to one line.

    Example:
        >>> describe_exception(ValueError("bad\\nthings"))
        'ValueError: bad things'
    """
    if isinstance(error, Misbehaved):
        text = str(error)
    else:
        text = traceback.format_exception_only(type(error), error)[-1].strip()
        if isinstance(error, MemoryError) or "can't allocate memory" in text:
            text = f"out of memory: {text}"
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


def run_calls(fn: Fn, cases: list[Case], calls: Iterable[Call], device: str) -> ClauseRun:
    """Make every call, recording each one's tensors and facts, or its error."""
    run = ClauseRun()
    for call in calls:
        try:
            tensors, meta = perform(fn, cases[call.case], call, device)
        except CAUGHT as error:
            run.errors[call.key] = describe_exception(error)
            continue
        run.meta[call.key] = meta
        run.tensors.update({f"{call.key}.{name}": t for name, t in tensors.items()})
    return run


def one_call_each(cases: list[Case], **kwargs: Any) -> list[Call]:
    """One call of each case, all made alike (``kwargs``: the :class:`Call`'s options)."""
    return [Call(str(i), i, **kwargs) for i in range(len(cases))]
