"""The contract of masked layer normalization as clauses: cases, runs and judges.

Each :class:`Clause` is a property from the specification (required) or one of maskln's own
stronger guarantees (strict). ``build(seed)`` makes its cases, deterministic from the seed;
``run(fn, cases, device)`` calls the function on them where the function lives (this process,
or the grader's child process) and returns what it computed as tensors and plain facts
(:class:`ClauseRun`); ``judge(cases, run)`` compares that with the float64 reference
(:mod:`maskln_cli.op.reference`) in the grading process and, on a failure, names the likely
mistake (:mod:`maskln_cli.op.mistakes`). :mod:`maskln_cli.grading` puts them together.

Cases are small (tens of rows) so that the whole contract runs in about a second.

Example:
    >>> from maskln_cli import masked_layer_normalization
    >>> run = CLAUSES["worked_example"].run(
    ...     masked_layer_normalization, CLAUSES["worked_example"].build(0), "cpu")
    >>> run.tensors["0.out"]
    tensor([[[-0.5000,  0.5000],
             [ 0.0000,  0.0000]]], dtype=torch.float64)
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import math
import os
import sys
import traceback
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from maskln_cli.op.mistakes import Diagnosis, diagnose_nan_gradient, diagnose_output
from maskln_cli.op.reference import reference_masked_layer_norm

FORBIDDEN_OPS = ("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm")
"""A torch function, or an op of torch's own (:data:`TORCH_NAMESPACES`), whose name holds one
of these is a ready-made normalization. An op of another namespace is the user's own (a
kernel author's ``mykernels::masked_layer_norm``): the grader looks inside it instead."""
TORCH_NAMESPACES = ("aten", "prims")
MASKLN_OP_PACKAGE = "op"
"""maskln's own implementations of the op (every module of ``maskln_cli.op``): calling them is
using a ready-made implementation, unless the function graded is maskln's own op
(:func:`is_maskln_function`)."""

VALUE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}
"""rtol = atol for outputs against the float64 reference, by input dtype, on well-conditioned
rows (|mean| <= 2 * std): a few hundred roundings of a correct kernel, far below what any
known mistake gives."""
GRAD_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
"""rtol, and atol relative to the largest reference gradient, for gradients (sums over rows
and the backward's cancellations round more than the forward)."""
EXACT = 1e-12
"""The worked example's numbers are exact binary fractions: a correct kernel errs by 0."""
TWO_PASS_FACTOR = 4.0
OFFSET_FACTOR = 2.0

Fn = Callable[..., Any]


# --- cases ---------------------------------------------------------------------------------------


@dataclass
class Case:
    """Inputs of one call, kept as contiguous CPU base tensors plus the views that give each
    input its layout, so that the child and the parent build the same tensors, on any device.

    ``views[name]`` is a tuple of ``("permute", dims)``, ``("step", dim, step)`` or
    ``("expand", sizes)``. ``clean_x``, when set, is ``x`` with ordinary numbers in its
    invalid rows instead of the NaN, inf and 1e30 of ``x``.
    """

    label: str
    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    eps: float
    grad_out: torch.Tensor | None = None
    views: dict[str, tuple[tuple[Any, ...], ...]] = field(default_factory=dict)
    clean_x: torch.Tensor | None = None
    directions: dict[str, torch.Tensor] | None = None

    def inputs(self, device: str | torch.device = "cpu", clean: bool = False) -> dict[str, Any]:
        """Fresh tensors (a call may mutate them) on ``device``, in their layouts."""
        bases = {
            "x": self.clean_x if clean and self.clean_x is not None else self.x,
            "valid": self.valid,
            "scale": self.scale,
            "bias": self.bias,
        }
        tensors = {}
        for name, base in bases.items():
            tensor = base.clone().to(device)
            for view in self.views.get(name, ()):
                tensor = _apply_view(tensor, view)
            tensors[name] = tensor
        if self.grad_out is not None:
            tensors["grad_out"] = self.grad_out.clone().to(device)
        return tensors

    def invalid(self) -> torch.Tensor:
        """Where x's elements are in invalid rows (bool, x's logical shape)."""
        t = self.inputs()
        return ~t["valid"][..., None].expand(t["x"].shape)

    def reference(self) -> torch.Tensor:
        """The float64 reference output for this case's inputs."""
        t = self.inputs()
        return reference_masked_layer_norm(t["x"], t["valid"], t["scale"], t["bias"], self.eps)


def _apply_view(tensor: torch.Tensor, view: tuple[Any, ...]) -> torch.Tensor:
    kind = view[0]
    if kind == "permute":
        return tensor.permute(*view[1])
    if kind == "step":
        _, dim, step = view
        return tensor[(slice(None),) * dim + (slice(None, None, step),)]
    if kind == "expand":
        return tensor.expand(*view[1])
    raise ValueError(f"unknown view {kind!r}")


def _generator(seed: int, clause: str) -> torch.Generator:
    """One generator per clause: a clause's cases do not change when another clause's do.
    (Every draw names its dtype: a function that changes torch's default dtype in the child
    must not change the cases the child builds.)"""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(clause.encode())) % 2**62)


def _mask(g: torch.Generator, leading: Sequence[int], fraction: float = 0.7) -> torch.Tensor:
    """A random mask with at least one valid and one invalid row (when it has two rows)."""
    valid = torch.rand(tuple(leading), generator=g, dtype=torch.float64) < fraction
    flat = valid.view(-1)
    if flat.numel() >= 2:
        flat[0], flat[-1] = True, False
        flat.copy_(flat[torch.randperm(flat.numel(), generator=g)])
    return valid


def _rows(
    g: torch.Generator,
    leading: Sequence[int],
    channels: int,
    spreads: Sequence[float] = (1.0,),
    offset: float = 1.0,
) -> torch.Tensor:
    """float64 rows ``mean + spread * randn``: row r takes ``spreads[r % len(spreads)]`` and a
    random mean within ``offset * spread`` (well conditioned for offset <= 2)."""
    rows = math.prod(leading)
    spread = torch.tensor(spreads, dtype=torch.float64).repeat(rows // len(spreads) + 1)[:rows]
    spread = spread * (0.5 + torch.rand(rows, generator=g, dtype=torch.float64))
    mean = offset * spread * (2 * torch.rand(rows, generator=g, dtype=torch.float64) - 1)
    noise = torch.randn(rows, channels, generator=g, dtype=torch.float64)
    return (mean[:, None] + spread[:, None] * noise).reshape(*leading, channels)


def _params(
    g: torch.Generator, channels: int, negative_bias: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """scale around 1 (some entries negative) and bias of size at least 0.5."""
    scale = 1.0 + 0.6 * torch.randn(channels, generator=g, dtype=torch.float64)
    magnitude = 0.5 + torch.rand(channels, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(channels, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    bias = -magnitude if negative_bias else sign * magnitude
    return scale, bias


_POISON = (math.nan, math.inf, -math.inf, 1e30)


def _poison(x: torch.Tensor, valid: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """x with NaN, +inf, -inf and 1e30 in its invalid rows: whole rows of each, and mixes."""
    poison = torch.tensor(_POISON, dtype=x.dtype)
    pick = torch.randint(0, len(_POISON), x.shape, generator=g)
    rows = torch.randint(0, 2 * len(_POISON), x.shape[:-1], generator=g)
    whole = rows < len(_POISON)  # half the rows hold one poison throughout
    pick = torch.where(whole[..., None], rows[..., None].clamp_max(len(_POISON) - 1), pick)
    return torch.where(valid[..., None], x, poison[pick])


def _case(
    label: str,
    x: torch.Tensor,
    valid: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    dtype: torch.dtype,
    g: torch.Generator | None = None,
    grad: bool = False,
) -> Case:
    """A case from float64 data, in ``dtype``; with ``g`` and ``grad``, a random upstream
    gradient (finite everywhere, in invalid rows too)."""
    scale, bias = params
    grad_out = None
    if grad:
        assert g is not None
        grad_out = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    return Case(
        label=label,
        x=x.to(dtype),
        valid=valid,
        scale=scale.to(dtype),
        bias=bias.to(dtype),
        eps=eps,
        grad_out=grad_out,
    )


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(x: torch.Tensor, dtype: torch.dtype, eps: float, layout: str = "contiguous") -> str:
    return f"x {_shape(x)} {dtype_name(dtype)}, eps {eps:g}, {layout}"


# --- calls ----------------------------------------------------------------------------------------


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


GRAD_INPUTS = ("x", "scale", "bias")


class Misbehaved(Exception):
    """The function returned something that is not an output of the op."""


CAUGHT = (Exception, SystemExit)
"""What a call of the graded function may raise and still be reported (sys.exit() too)."""


def _invoke(fn: Fn, t: dict[str, Any], eps: float, style: str) -> Any:
    x, valid, scale, bias = t["x"], t["valid"], t["scale"], t["bias"]
    if style == "positional":
        return fn(x, valid, scale, bias, eps)
    if style == "keyword":
        return fn(x=x, valid=valid, scale=scale, bias=bias, eps=eps)
    if style == "positional_default":
        return fn(x, valid, scale, bias)
    if style == "keyword_default":
        return fn(x=x, valid=valid, scale=scale, bias=bias)
    raise ValueError(f"unknown call style {style!r}")


def _mode(mode: str) -> contextlib.AbstractContextManager[Any]:
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference":
        return torch.inference_mode()
    return contextlib.nullcontext()


def _checked_output(out: Any) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise Misbehaved(f"returned {type(out).__name__}, not a tensor")
    if not out.is_floating_point():
        raise Misbehaved(f"returned a {dtype_name(out.dtype)} tensor, not a floating one")
    return out


def _export(t: torch.Tensor) -> torch.Tensor:
    """A plain (not a subclass), contiguous CPU copy: what the child can send."""
    return t.detach().as_subclass(torch.Tensor).to("cpu", copy=True).contiguous()


def perform(
    fn: Fn, case: Case, call: Call, device: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Make one call; returns the tensors it gave (``out``, ``grad_x``, ...) and facts about
    its output (requires_grad, dtype, device, strides)."""
    t = case.inputs(device, clean=call.clean)
    for name in call.requires:
        t[name].requires_grad_()
    with _mode(call.mode):
        out = _checked_output(_invoke(fn, t, case.eps, call.style))
    meta = {
        "requires_grad": bool(out.requires_grad),
        "device": str(out.device),
        "dtype": dtype_name(out.dtype),
        "shape": list(out.shape),
        "stride": list(out.stride()),
    }
    tensors = {"out": _export(out)}
    if call.backward:
        if not out.requires_grad:
            raise Misbehaved(
                f"the output does not require grad although {', '.join(call.requires)} does"
            )
        if tuple(out.shape) != tuple(t["x"].shape):
            raise Misbehaved(f"returned shape {list(out.shape)} for x {list(t['x'].shape)}")
        leaves = [t[name] for name in call.requires]
        grads = torch.autograd.grad(_weighted(out, t), leaves, allow_unused=True)
        for name, grad in zip(call.requires, grads, strict=True):
            if grad is None:
                raise Misbehaved(f"no gradient reached {name}: it is not used differentiably")
            tensors[f"grad_{name}"] = _export(grad)
    return tensors, meta


def _weighted(out: torch.Tensor, t: dict[str, Any]) -> torch.Tensor:
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


# --- verdicts ----------------------------------------------------------------------------------


@dataclass
class Verdict:
    """A clause's verdict: its first counterexample in words, and the known mistakes it
    matches (None: not a failure known mistakes explain; []: none matches)."""

    passed: bool
    detail: str | None = None
    diagnosis: list[Diagnosis] | None = None


PASSED = Verdict(True)


def _number(value: float) -> str:
    """``-0`` stays ``-0``; NaN and inf are spelled out."""
    return f"{value:.7g}"


def _first_mismatch(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
) -> str | None:
    """Where ``actual`` is furthest beyond ``atol + rtol * |expected|`` (NaN is beyond
    everything), in words; None when every element is within."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {list(actual.shape)}, the reference's {list(expected.shape)}"
    if actual.numel() == 0:
        return None
    a, e = actual.double(), expected.double()
    allowed = atol + rtol * e.abs()
    error = (a - e).abs()
    bad = ~(error <= allowed)  # NaN compares False
    if not bad.any():
        return None
    excess = torch.where(bad, (error - allowed).nan_to_num(math.inf), -math.inf)
    index = [int(i) for i in torch.unravel_index(excess.argmax(), a.shape)]
    gave, expected = _number(a[tuple(index)]), _number(e[tuple(index)])
    return f"at {index} gave {gave}, the reference gives {expected}"


def _value_mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    tolerance = VALUE_TOLERANCE.get(dtype, VALUE_TOLERANCE[torch.float32])
    return _first_mismatch(actual, expected, tolerance, tolerance)


def _grad_mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    tolerance = GRAD_TOLERANCE.get(dtype, GRAD_TOLERANCE[torch.float32])
    largest = float(expected.abs().max()) if expected.numel() else 0.0
    return _first_mismatch(actual, expected, tolerance, tolerance * max(1.0, largest))


def reference_gradients(case: Case, requires: Sequence[str] = GRAD_INPUTS) -> dict[str, Any]:
    """Gradients of ``sum(reference * grad_out)`` by autograd through the float64 reference."""
    t = case.inputs()
    leaves = {name: t[name].detach().double().requires_grad_() for name in GRAD_INPUTS}
    out = reference_masked_layer_norm(
        leaves["x"], t["valid"], leaves["scale"], leaves["bias"], case.eps
    )
    assert case.grad_out is not None
    weighted = (out * case.grad_out.double()).sum()
    grads = torch.autograd.grad(weighted, list(leaves.values()))
    found = dict(zip(GRAD_INPUTS, grads, strict=True))
    return {f"grad_{name}": found[name] for name in requires}


def _failure_detail(case: Case, call: Call, run: ClauseRun, what: str = "") -> str | None:
    """The error of a call, in words, or None when it ran."""
    if call.key in run.errors:
        return f"{case.label}{what}: {run.errors[call.key]}"
    return None


def _judge_outputs(
    cases: list[Case],
    run: ClauseRun,
    calls: Iterable[Call],
    diagnose: bool = False,
    what: Callable[[Call], str] = lambda call: "",
) -> Verdict:
    """Every call's output against the reference, and its gradients when it made them."""
    failing: list[tuple[Case, torch.Tensor]] = []
    first: str | None = None
    for call in calls:
        case = cases[call.case]
        problem = _failure_detail(case, call, run, what(call))
        if problem is None:
            dtype = case.x.dtype
            out = run.tensor(call.key, "out")
            mismatch = _value_mismatch(out, case.reference(), dtype)
            if mismatch is not None:
                problem = f"{case.label}{what(call)}: {mismatch}"
                failing.append((case, out))
            elif call.backward:
                problem = _judge_gradients(case, call, run, what(call))
        if problem is not None and first is None:
            first = problem
    if first is None:
        return PASSED
    return Verdict(False, first, _diagnose(failing) if diagnose else None)


def _judge_gradients(case: Case, call: Call, run: ClauseRun, what: str = "") -> str | None:
    expected = reference_gradients(case, call.requires)
    for name, reference in expected.items():
        mismatch = _grad_mismatch(run.tensor(call.key, name), reference, case.x.dtype)
        if mismatch is not None:
            return f"{case.label}{what}: {name} {mismatch}"
    return None


def _diagnose(failing: list[tuple[Case, torch.Tensor]], limit: int = 8) -> list[Diagnosis] | None:
    """The known mistakes that explain the most of the first ``limit`` failing cases (one
    output per case), best first; None when no output could be diagnosed (wrong shapes).
    Several wrong formulas agree on degenerate rows (C = 1, a variance of 1), so one case
    alone can be ambiguous where a few are not."""
    matches: dict[str, list[Diagnosis]] = {}
    seen: set[int] = set()
    diagnosed = 0
    for case, out in failing:
        if id(case) in seen or len(seen) >= limit:
            continue
        seen.add(id(case))
        t = case.inputs()
        if tuple(out.shape) != tuple(t["x"].shape):
            continue
        found = diagnose_output(
            out, t["x"], t["valid"], t["scale"], t["bias"], case.eps, case.x.dtype
        )
        diagnosed += 1
        for diagnosis in found:
            matches.setdefault(diagnosis.mistake, []).append(diagnosis)
    if not matches:
        return [] if diagnosed else None
    most = max(len(found) for found in matches.values())
    best = [found for found in matches.values() if len(found) == most]
    best.sort(key=lambda found: sum(d.distance for d in found) / len(found))
    return [found[0] for found in best]


# --- the clauses ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clause:
    """One property of the contract.

    ``build(seed)`` makes the cases; ``run(fn, cases, device)`` calls the function (in the
    child, for ``maskln grade``); ``judge(cases, run)`` gives the verdict (in the parent).
    """

    name: str
    required: bool
    summary: str
    build: Callable[[int], list[Case]]
    run: Callable[[Fn, list[Case], str], ClauseRun]
    judge: Callable[[list[Case], ClauseRun], Verdict]

    def __repr__(self) -> str:
        return f"Clause({self.name!r}, {'required' if self.required else 'strict'})"


Run = Callable[[Fn, list[Case], str], ClauseRun]
Judge = Callable[[list[Case], ClauseRun], Verdict]


def _calls_run(calls: Callable[[list[Case]], list[Call]]) -> Run:
    def run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
        return run_calls(fn, cases, calls(cases), device)

    return run


def _outputs_judge(
    calls: Callable[[list[Case]], list[Call]],
    diagnose: bool = False,
    what: Callable[[Call], str] = lambda call: "",
) -> Judge:
    def judge(cases: list[Case], run: ClauseRun) -> Verdict:
        return _judge_outputs(cases, run, calls(cases), diagnose, what)

    return judge


def _each(cases: list[Case], **kwargs: Any) -> list[Call]:
    return [Call(str(i), i, **kwargs) for i in range(len(cases))]


# signature ----------------------------------------------------------------------------------------

_STYLES = {
    "positional": "called f(x, valid, scale, bias, eps)",
    "keyword": "called f(x=x, valid=valid, scale=scale, bias=bias, eps=eps)",
    "positional_default": "called f(x, valid, scale, bias) without eps",
    "keyword_default": "called f(x=x, valid=valid, scale=scale, bias=bias) without eps",
}


def _signature_cases(seed: int) -> list[Case]:
    g = _generator(seed, "signature")
    # Rows of variance near 1e-5: eps 1e-5, 1e-6 or 1e-12 give clearly different outputs.
    x = _rows(g, (2, 6), 16, spreads=(3e-3, 5e-3))
    valid = _mask(g, (2, 6))
    params = _params(g, 16)
    given = _case(_describe(x, torch.float64, 0.1), x, valid, params, 0.1, torch.float64)
    default = _case(_describe(x, torch.float64, 1e-5), x, valid, params, 1e-5, torch.float64)
    return [given, default]


def _signature_calls(cases: list[Case]) -> list[Call]:
    return [
        Call("positional", 0, style="positional"),
        Call("keyword", 0, style="keyword"),
        Call("positional_default", 1, style="positional_default"),
        Call("keyword_default", 1, style="keyword_default"),
    ]


def _signature_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = run_calls(fn, cases, _signature_calls(cases), device)
    with contextlib.suppress(Exception):  # a builtin or C function may have no signature
        parameter = inspect.signature(fn).parameters.get("eps")
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            run.meta["declared"] = {"eps": repr(parameter.default)}
    return run


def _signature_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    verdict = _judge_outputs(
        cases, run, _signature_calls(cases), what=lambda call: f", {_STYLES[call.style]}"
    )
    declared = run.meta.get("declared", {}).get("eps")
    if not verdict.passed and isinstance(declared, str) and declared != repr(1e-5):
        verdict.detail = f"{verdict.detail} (the signature declares eps={declared[:40]})"
    return verdict


# worked_example -----------------------------------------------------------------------------------

WORKED_EXPECTED = [[[-0.5, 0.5], [0.0, 0.0]]]


def _worked_cases(seed: int) -> list[Case]:
    x = torch.tensor([[[1.0, 3.0], [99.0, -99.0]]], dtype=torch.float64)
    valid = torch.tensor([[True, False]], dtype=torch.bool)
    scale = torch.tensor([2.0, -1.0], dtype=torch.float64)
    bias = torch.tensor([0.5, 1.0], dtype=torch.float64)
    label = "the specification's worked example (x [1, 2, 2] float64, eps 3)"
    return [Case(label, x, valid, scale, bias, 3.0)]


# As the specification writes it: x, scale and bias require grad; every argument is named.
_WORKED_CALL = Call("0", 0, style="keyword", requires=GRAD_INPUTS)


def _worked_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    case = cases[0]
    problem = _failure_detail(case, _WORKED_CALL, run)
    if problem is not None:
        return Verdict(False, problem)
    out = run.tensor("0", "out")
    if out.dtype != torch.float64:
        return Verdict(False, f"{case.label}: returned {dtype_name(out.dtype)}, not float64")
    expected = torch.tensor(WORKED_EXPECTED, dtype=torch.float64)
    mismatch = _first_mismatch(out, expected, 0.0, EXACT)
    if mismatch is None:
        return PASSED
    return Verdict(False, f"{case.label}: {mismatch}", _diagnose([(case, out)]))


# values -------------------------------------------------------------------------------------------

VALUE_CHANNELS = (1, 2, 3, 16, 64)
EPSILONS = (1e-5, 0.1, 3.0)
# Row spreads from 1e-4 (variance 1e-8: eps dominates) to 2: where eps is added matters.
VALUE_SPREADS = (1.0, 1e-4, 2.0, 1e-3, 0.3, 3e-3, 1e-2, 1.5, 3e-4, 0.05)
TAIL_CHANNELS = (9, 12, 17, 31, 33, 100, 129, 257)
"""Channel counts past a vector width that are not multiples of 8 or 16: a kernel that loses
its remainder loop (the last C % 8 channels) is wrong on these only."""
MANY_ROWS = ((3, 331), 20)
"""993 rows (not a multiple of any block of rows) of 20 channels."""


def _values_cases(seed: int) -> list[Case]:
    g = _generator(seed, "values")
    cases = []
    for dtype, channels, eps in itertools.product(
        (torch.float64, torch.float32), VALUE_CHANNELS, EPSILONS
    ):
        x = _rows(g, (2, 5), channels, spreads=VALUE_SPREADS, offset=2.0)
        label = _describe(x, dtype, eps, "row variances 1e-8 to 4")
        cases.append(_case(label, x, _mask(g, (2, 5)), _params(g, channels), eps, dtype))
    for dtype, channels in itertools.product((torch.float64, torch.float32), TAIL_CHANNELS):
        x = _rows(g, (3, 3), channels, spreads=VALUE_SPREADS, offset=2.0)
        label = _describe(x, dtype, 1e-5, "row variances 1e-8 to 4")
        cases.append(_case(label, x, _mask(g, (3, 3)), _params(g, channels), 1e-5, dtype))
    leading, channels = MANY_ROWS
    for dtype in (torch.float64, torch.float32):
        x = _rows(g, leading, channels, spreads=VALUE_SPREADS, offset=2.0)
        label = _describe(x, dtype, 1e-5, "row variances 1e-8 to 4")
        cases.append(_case(label, x, _mask(g, leading), _params(g, channels), 1e-5, dtype))
    return cases


def _values_calls(cases: list[Case]) -> list[Call]:
    """Each case without grad, and with x, scale and bias requiring grad (a training path
    must give the same values)."""
    return [
        call
        for i in range(len(cases))
        for call in (Call(str(i), i), Call(f"{i}.grad", i, requires=GRAD_INPUTS))
    ]


def _grad_words(call: Call) -> str:
    return ", x, scale and bias requiring grad" if call.requires else ""


# leading_axes -------------------------------------------------------------------------------------

LEADING_SHAPES = ((), (5,), (2, 5), (2, 3, 2, 2), (0,), (3, 0), (0, 4))


def _leading_cases(seed: int) -> list[Case]:
    g = _generator(seed, "leading_axes")
    cases = []
    for i, leading in enumerate(LEADING_SHAPES):
        dtype = torch.float32 if i % 2 else torch.float64
        empty = torch.zeros(*leading, 6, dtype=torch.float64)
        x = _rows(g, leading, 6) if math.prod(leading) else empty
        valid = _mask(g, leading) if leading else torch.tensor(True)
        valid_shape = "a 0-d valid" if not leading else f"valid {list(leading)}"
        label = f"{_describe(x, dtype, 1e-5)}, {valid_shape}"
        cases.append(_case(label, x, valid, _params(g, 6), 1e-5, dtype, g, grad=True))
    return cases


def _leading_calls(cases: list[Case]) -> list[Call]:
    return [
        Call(str(i), i, requires=GRAD_INPUTS, backward=True)
        if case.x.numel()
        else Call(str(i), i)  # zero-size: the output's shape and dtype
        for i, case in enumerate(cases)
    ]


# invalid_rows_zero --------------------------------------------------------------------------------


def _invalid_cases(seed: int) -> list[Case]:
    g = _generator(seed, "invalid_rows_zero")
    cases = []
    masks = {
        "trailing padding": torch.arange(6)[None, :] < torch.tensor([4, 1])[:, None],
        "leading padding": torch.arange(6)[None, :] >= torch.tensor([2, 5])[:, None],
        "interleaved padding": _mask(g, (2, 6)),
        "every row invalid": torch.zeros(2, 6, dtype=torch.bool),
    }
    for dtype in (torch.float64, torch.float32):
        for what, valid in masks.items():
            x = _rows(g, (2, 6), 8)
            label = f"{_describe(x, dtype, 1e-5)}, {what}, bias nonzero"
            cases.append(_case(label, x, valid, _params(g, 8), 1e-5, dtype))
    x = torch.zeros(2, 6, 8, dtype=torch.float64)
    label = f"{_describe(x, torch.float32, 1e-5)}, zero padding, bias nonzero"
    cases.append(_case(label, x, masks["trailing padding"], _params(g, 8), 1e-5, torch.float32))
    x = _rows(g, (), 8)
    label = f"{_describe(x, torch.float64, 1e-5)}, a 0-d valid False, bias nonzero"
    cases.append(_case(label, x, torch.tensor(False), _params(g, 8), 1e-5, torch.float64))
    return cases


def _invalid_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    failing = []
    first = None
    for call in _each(cases):
        case = cases[call.case]
        problem = _failure_detail(case, call, run)
        if problem is None:
            out = run.tensor(call.key, "out")
            problem = _nonzero_invalid(out, case)
            if problem is not None:
                failing.append((case, out))
        first = first or problem
    if first is None:
        return PASSED
    return Verdict(False, first, _diagnose(failing))


def _nonzero_invalid(out: torch.Tensor, case: Case) -> str | None:
    invalid = case.invalid()
    if out.shape != invalid.shape:
        return f"{case.label}: shape {list(out.shape)}, the reference's {list(invalid.shape)}"
    wrong = invalid & (out != 0)  # NaN != 0 too
    if not wrong.any():
        return None
    index = [int(i) for i in wrong.nonzero()[0]]
    value = out[tuple(index)]
    return f"{case.label}: at {index} (an invalid row) gave {_number(value)}, the reference gives 0"


# sanitized_padding --------------------------------------------------------------------------------

POISON_LABEL = "NaN, ±inf and 1e30 in invalid rows"


def _poisoned_cases(seed: int, clause: str, grad: bool) -> list[Case]:
    g = _generator(seed, clause)
    cases = []
    for dtype, channels in itertools.product((torch.float64, torch.float32), (8, 3)):
        x = _rows(g, (3, 6), channels)
        valid = _mask(g, (3, 6))
        label = f"{_describe(x, dtype, 1e-5)}, {POISON_LABEL}"
        case = _case(label, x, valid, _params(g, channels), 1e-5, dtype, g, grad=grad)
        case.clean_x = case.x
        case.x = _poison(case.x, valid, g)
        cases.append(case)
    return cases


def _sanitized_padding_calls(cases: list[Case]) -> list[Call]:
    return [
        call
        for i in range(len(cases))
        for call in (Call(str(i), i), Call(f"{i}.clean", i, clean=True))
    ]


def _sanitized_padding_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for i, case in enumerate(cases):
        call = Call(str(i), i)
        problem = _failure_detail(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
        out = run.tensor(call.key, "out")
        t = case.inputs()
        nonfinite = _nonfinite(out, case.reference(), case.invalid())
        if nonfinite is not None:
            clean = run.tensors.get(f"{i}.clean.out")
            diagnosis = _nan_diagnosis("the output", out, clean, case.reference(), t)
            return Verdict(False, f"{case.label}: {nonfinite}", [diagnosis] if diagnosis else [])
        problem = _nonzero_invalid(out, case) or _prefixed(
            case, _value_mismatch(out, case.reference(), case.x.dtype)
        )
        if problem is None and f"{i}.clean.out" in run.tensors:
            clean = run.tensor(f"{i}.clean", "out")
            mismatch = _value_mismatch(out, clean, case.x.dtype)
            if mismatch is not None:
                problem = f"{case.label}: {mismatch.replace('the reference', 'clean padding')}"
        if problem is not None:
            return Verdict(False, problem)
    return PASSED


def _nan_diagnosis(
    name: str,
    actual: torch.Tensor,
    clean: torch.Tensor | None,
    reference: torch.Tensor,
    t: dict[str, torch.Tensor],
) -> Diagnosis | None:
    """Why ``actual`` (the output, or gradient ``name``) holds NaN or inf where the reference is
    finite: the padding's NaN only when the same call with clean padding (``clean``) is finite
    at those places; when it is not finite there either, a division by zero (None: no clean
    result to tell)."""
    leaked = ~actual.isfinite() & reference.isfinite()
    if clean is None or tuple(clean.shape) != tuple(actual.shape):
        return None
    if (leaked & ~clean.isfinite()).any():
        return Diagnosis(
            NAN_WITHOUT_PADDING,
            f"NaN or inf in {name} with clean padding too, so not from the padding: a division"
            " by zero, such as an invalid row (all zeros once sanitized, variance 0) divided by"
            " its standard deviation with eps missing, (x - mean) / sqrt(var)",
            "add eps inside the square root, (x - mean) / sqrt(var + eps), and divide by nothing"
            " that can be zero (torch.where hides such a NaN in the output, not in gradients)",
            0.0,
        )
    return diagnose_nan_gradient(name, actual, reference, t["x"], t["valid"], t.get("grad_out"))


NAN_WITHOUT_PADDING = "nan_without_padding"


def _prefixed(case: Case, mismatch: str | None) -> str | None:
    return None if mismatch is None else f"{case.label}: {mismatch}"


def _nonfinite(
    t: torch.Tensor, reference: torch.Tensor, invalid: torch.Tensor, name: str = ""
) -> str | None:
    """Where ``t`` first holds NaN or inf although the reference is finite, in words
    (``invalid``: where x's invalid rows are, to say which kind of row it is in)."""
    if tuple(t.shape) != tuple(reference.shape):
        return None
    bad = ~t.isfinite() & reference.isfinite()
    if not bad.any():
        return None
    index = [int(i) for i in bad.nonzero()[0]]
    row = ""
    if t.shape == invalid.shape:
        row = " (an invalid row)" if invalid[tuple(index)] else " (a valid row)"
    where = f"{name} at {index}" if name else f"at {index}"
    value, expected = _number(t[tuple(index)]), _number(reference[tuple(index)])
    return f"{where}{row} gave {value}, the reference gives {expected}"


# gradients ----------------------------------------------------------------------------------------

SUBSETS = [s for r in (1, 2, 3) for s in itertools.combinations(GRAD_INPUTS, r)]


def _gradient_cases(seed: int) -> list[Case]:
    g = _generator(seed, "gradients")
    cases = []
    for dtype, (channels, eps) in itertools.product(
        (torch.float64, torch.float32), ((8, 1e-5), (3, 0.1), (17, 1e-5))
    ):
        x = _rows(g, (2, 5), channels)
        label = _describe(x, dtype, eps)
        cases.append(_case(label, x, _mask(g, (2, 5)), _params(g, channels), eps, dtype, g, True))
    return cases


def _gradient_calls(cases: list[Case]) -> list[Call]:
    return [
        Call(f"{i}.{'+'.join(subset)}", i, requires=subset, backward=True)
        for i in range(len(cases))
        for subset in SUBSETS
    ]


def _gradients_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in _gradient_calls(cases):
        case = cases[call.case]
        what = f", {', '.join(call.requires)} requiring grad"
        problem = _failure_detail(case, call, run, what) or _judge_gradients(case, call, run, what)
        if problem is not None:
            return Verdict(False, problem)
    return PASSED


# sanitized_gradients ------------------------------------------------------------------------------


def _sanitized_gradients_calls(cases: list[Case]) -> list[Call]:
    """Each poisoned case's backward, and the same with clean padding (to tell a NaN from the
    padding from one the function makes itself; not judged: the gradients clause judges
    clean padding)."""
    return [
        call
        for i in range(len(cases))
        for call in (
            Call(str(i), i, requires=GRAD_INPUTS, backward=True),
            Call(f"{i}.clean", i, clean=True, requires=GRAD_INPUTS, backward=True),
        )
    ]


def _sanitized_gradients_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in _each(cases, requires=GRAD_INPUTS, backward=True):
        case = cases[call.case]
        problem = _failure_detail(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
        t = case.inputs()
        expected = reference_gradients(case)
        for name, reference in expected.items():
            grad = run.tensor(call.key, name)
            nonfinite = _nonfinite(grad, reference, case.invalid(), name)
            if nonfinite is not None:
                clean = run.tensors.get(f"{call.key}.clean.{name}")
                diagnosis = _nan_diagnosis(name, grad, clean, reference, t)
                return Verdict(
                    False, f"{case.label}: {nonfinite}", [diagnosis] if diagnosis else []
                )
        dx = run.tensor(call.key, "grad_x")
        if tuple(dx.shape) == tuple(case.x.shape):
            leaked = case.invalid() & (dx != 0)
            if leaked.any():
                index = [int(i) for i in leaked.nonzero()[0]]
                return Verdict(
                    False,
                    f"{case.label}: grad_x at {index} (an invalid row) gave"
                    f" {_number(dx[tuple(index)])}, the reference gives 0",
                )
        problem = _judge_gradients(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
    return PASSED


# dtypes -------------------------------------------------------------------------------------------


def _dtypes_cases(seed: int) -> list[Case]:
    g = _generator(seed, "dtypes")
    cases = []
    for dtype in (torch.float32, torch.float64):
        # Wide rows (std 1e4): eps is negligible, so only the precision of the arithmetic
        # shows: float32 arithmetic errs by ~1e-7, float64 by ~1e-15.
        x = _rows(g, (3, 5), 24, spreads=(1e4, 3e3), offset=1.0)
        label = _describe(x, dtype, 1e-5, "rows of std 1e4")
        cases.append(_case(label, x, _mask(g, (3, 5)), _params(g, 24), 1e-5, dtype))
    return cases


def same_device(reported: object, expected: str) -> bool:
    """Whether a tensor's reported device (a string) is ``expected``: of the same type, and of
    the same index (an index left out is 0; every CPU index is the one CPU).

    Example:
        >>> same_device("cpu", "cpu"), same_device("cuda:1", "cuda:0")
        (True, False)
    """
    try:
        got, want = torch.device(str(reported)), torch.device(expected)
    except (RuntimeError, TypeError):
        return False
    if got.type != want.type:
        return False
    return got.type == "cpu" or (got.index or 0) == (want.index or 0)


def _dtypes_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in _each(cases):
        case = cases[call.case]
        problem = _failure_detail(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
        out = run.tensor(call.key, "out")
        expected = dtype_name(case.x.dtype)
        if out.dtype != case.x.dtype:
            return Verdict(False, f"{case.label}: returned {dtype_name(out.dtype)}, not {expected}")
        got_device = run.meta.get(call.key, {}).get("device")
        if not same_device(got_device, run.device):
            return Verdict(
                False, f"{case.label}: returned a tensor on {got_device}, not on {run.device}"
            )
        if case.x.dtype == torch.float64:
            problem = _precision_problem(out, case.reference())
            if problem is not None:
                return Verdict(False, f"{case.label}: {problem}")
    return PASSED


FLOAT32_ROUNDING = (1e-8, 1e-5)
"""Relative RMS errors of float64 rows computed in float32 (about 6e-8 on the dtypes rows);
a wrong formula errs more (an unbiased variance: 1.5e-2), eps misplaced less (3e-9)."""


def _precision_problem(out: torch.Tensor, reference: torch.Tensor) -> str | None:
    """What is wrong with a float64 output that should be float64-accurate: a lower
    precision only when its error is the size of float32's rounding; else wrong values, or a
    shape that cannot be judged."""
    if tuple(out.shape) != tuple(reference.shape):
        return (
            f"returned shape {list(out.shape)} for x {list(reference.shape)}: its precision"
            " cannot be judged (leading_axes and values judge shapes)"
        )
    mismatch = _value_mismatch(out, reference, torch.float64)
    if mismatch is None:
        return None
    error = relative_rms_error(out, reference)
    low, high = FLOAT32_ROUNDING
    if low <= error <= high:
        return (
            f"relative RMS error {error:.2g}, float32's rounding, not float64's (~1e-16):"
            f" computed in a lower precision, float32?: {mismatch}"
        )
    return (
        f"{mismatch} (relative RMS error {error:.2g}: not a precision's rounding, the values"
        " are wrong; the values clause shows more)"
    )


# strided_inputs -----------------------------------------------------------------------------------


def _strided_cases(seed: int) -> list[Case]:
    g = _generator(seed, "strided_inputs")
    b, n, c = 3, 4, 6
    layouts = [
        ("x permuted", (n, b, c), (("permute", (1, 0, 2)),)),
        ("x a stepped slice", (b, 2 * n, 2 * c), (("step", 1, 2), ("step", 2, 2))),
        ("x expanded (stride 0)", (b, 1, c), (("expand", (b, n, c)),)),
        ("x channels-strided", (b, c, n), (("permute", (0, 2, 1)),)),
    ]
    cases = []
    for (what, base_shape, x_views), dtype in itertools.product(
        layouts, (torch.float64, torch.float32)
    ):
        x = _rows(g, base_shape[:-1], base_shape[-1])
        valid_base = _mask(g, (n, b))  # transposed below: non-contiguous
        scale, bias = _params(g, 2 * c)  # every second element below: non-contiguous
        label = (
            f"x [{b}, {n}, {c}] {dtype_name(dtype)}, eps 1e-05, {what};"
            " valid, scale and bias non-contiguous"
        )
        case = _case(label, x, valid_base, (scale, bias), 1e-5, dtype)
        case.views = {
            "x": x_views,
            "valid": (("permute", (1, 0)),),
            "scale": (("step", 0, 2),),
            "bias": (("step", 0, 2),),
        }
        cases.append(case)
    return cases


# no_mutation --------------------------------------------------------------------------------------


def _probe_cases(seed: int, clause: str) -> list[Case]:
    g = _generator(seed, clause)
    cases = []
    for dtype in (torch.float32, torch.float64):
        x = _rows(g, (2, 5), 8)
        label = _describe(x, dtype, 1e-5)
        cases.append(_case(label, x, _mask(g, (2, 5)), _params(g, 8), 1e-5, dtype, g, True))
    return cases


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "values": t.detach().clone(),
            "version": t._version,
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "data_ptr": t.data_ptr(),
            "requires_grad": t.requires_grad,
        }
        for name, t in tensors.items()
    }


def _changes(
    before: dict[str, dict[str, Any]], tensors: dict[str, torch.Tensor], when: str
) -> list[str]:
    """How ``tensors`` differ from their snapshot ``before``, in words."""
    problems = []
    for name, old in before.items():
        t = tensors[name]
        if list(t.shape) != old["shape"] or list(t.stride()) != old["stride"]:
            problems.append(
                f"{name}'s shape or strides changed in the {when}:"
                f" {old['shape']} -> {list(t.shape)}"
            )
        elif t.data_ptr() != old["data_ptr"]:
            problems.append(f"{name} was given new storage in the {when}")
        elif not torch.equal(t.detach(), old["values"]):
            problems.append(f"{name}'s values changed in the {when}")
        elif t._version != old["version"]:
            problems.append(
                f"{name}'s version counter changed in the {when} (an in-place operation)"
            )
        elif t.requires_grad != old["requires_grad"]:
            problems.append(f"{name}'s requires_grad flag changed in the {when}")
    return problems


Hook = Callable[[str, dict[str, torch.Tensor]], None]
Inspect = Callable[[str, dict[str, torch.Tensor]], list[str]]


class _Upstream(torch.autograd.Function):
    """Hands the caller's own ``grad_out`` tensor to the backward of ``out`` (as
    ``out.backward(grad_out)`` does), so a backward that writes into its incoming gradient is
    seen; ``torch.autograd.grad(out, inputs, grad_out)`` would do it too, but imports sympy
    (seconds) to check the shapes."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        ctx.grad_out = grad_out
        return out.clone()

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.grad_out, None


def _probe(fn: Fn, case: Case, device: str, start: Hook, check: Hook) -> None:
    """Two calls, each on fresh inputs: a forward without grad; then a forward with x, scale
    and bias requiring grad, and its backward, given the caller's ``grad_out`` itself (an
    input too, whose values and version must not change). ``start(phase, inputs)`` runs before
    each call, ``check(phase, inputs)`` after each phase ("no-grad forward", "forward",
    "backward")."""
    t = case.inputs(device)
    start("no-grad forward", t)
    with torch.no_grad():
        _checked_output(_invoke(fn, t, case.eps, "positional"))
    check("no-grad forward", t)
    t = case.inputs(device)
    for name in GRAD_INPUTS:
        t[name].requires_grad_()
    start("forward", t)
    out = _checked_output(_invoke(fn, t, case.eps, "positional"))
    check("forward", t)
    if not out.requires_grad:
        raise Misbehaved("the output does not require grad although x, scale and bias do")
    upstream = _Upstream.apply(out, t["grad_out"]).sum()  # its gradient at out: grad_out itself
    torch.autograd.grad(upstream, [t[n] for n in GRAD_INPUTS], allow_unused=True)
    check("backward", t)


def _probe_run(
    fn: Fn, cases: list[Case], device: str, start: Callable[[], tuple[Hook, Inspect]]
) -> ClauseRun:
    """Probe each case with the hooks ``start()`` makes (one to run before each call, one
    that returns the problems it sees after each phase); record the problems found, or the
    error (unless problems came first: a mutated input can make the next call fail)."""
    run = ClauseRun()
    for i, case in enumerate(cases):
        problems: list[str] = []
        begin, check = start()

        def found(phase: str, t: dict[str, torch.Tensor], check=check, problems=problems) -> None:
            problems.extend(check(phase, t))

        try:
            _probe(fn, case, device, begin, found)
        except CAUGHT as error:
            if not problems:
                run.errors[str(i)] = describe_exception(error)
                continue
        run.meta[str(i)] = {"problems": problems[:5]}
    return run


def _no_mutation_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    def start() -> tuple[Hook, Inspect]:
        before: dict[str, Any] = {}

        def begin(phase: str, t: dict[str, torch.Tensor]) -> None:
            before.clear()
            before.update(_snapshot(t))

        def check(phase: str, t: dict[str, torch.Tensor]) -> list[str]:
            return _changes(before, t, phase)

        return begin, check

    return _probe_run(fn, cases, device, start)


def _problems_judge(what: str) -> Judge:
    def judge(cases: list[Case], run: ClauseRun) -> Verdict:
        for i, case in enumerate(cases):
            key = str(i)
            if key in run.errors:
                return Verdict(False, f"{case.label}: {run.errors[key]}")
            problems = run.meta.get(key, {}).get("problems")
            if not isinstance(problems, list):
                return Verdict(False, f"{case.label}: no {what} report came back")
            if problems:
                return Verdict(False, f"{case.label}: {'; '.join(map(str, problems))}")
        return PASSED

    return judge


# raw_ops ------------------------------------------------------------------------------------------


def _recorders():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordFunctions(TorchFunctionMode):
        """Names of the torch functions called (F.rms_norm decomposes below this level). The
        mode is off while a function runs: what a custom op's implementation calls is not seen
        here, but by RecordOps and the Python recorder."""

        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(_function_name(func))
            return func(*args, **(kwargs or {}))

    class RecordOps(TorchDispatchMode):
        """The ops that run, forward and backward; inside an op that is not torch's own (a
        ``torch.library`` custom op), the ops its implementation runs too."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Nothing is compiled here: skipping dynamo would import it (seconds) for nothing.
            return False

        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            self.names.add(name)
            kwargs = kwargs or {}
            backend = _backend_key(args, kwargs)
            if name.partition("::")[0] in TORCH_NAMESPACES or backend is None:
                return func(*args, **kwargs)
            # This mode is off while its handler runs: a custom op's implementation would run
            # unseen. Run the op's backend kernel with the mode back on (calling the op again
            # would come back here).
            with self:
                try:
                    return func.redispatch(torch._C.DispatchKeySet(backend), *args, **kwargs)
                except NotImplementedError:  # no kernel for that key: run it as it comes
                    pass
            return func(*args, **kwargs)

    return RecordFunctions, RecordOps


def _function_name(func: Any) -> str:
    """``aten::layer_norm`` for an op, ``torch.nn.functional.layer_norm`` for a function."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return str(schema.name)
    qualified = getattr(func, "_qualified_op_name", None)  # an OpOverloadPacket
    if isinstance(qualified, str):
        return qualified
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__name__", None) or repr(func)
    return f"{module}.{name}" if module else name


def _backend_key(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The dispatch key of the backend of the first tensor argument (CPU or CUDA), or None."""
    for value in itertools.chain(args, kwargs.values()):
        candidates = value if isinstance(value, list | tuple) else (value,)
        for tensor in candidates:
            if isinstance(tensor, torch.Tensor):
                kind = tensor.device.type
                return {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}.get(
                    kind
                )
    return None


def is_ready_made(name: str) -> bool:
    """Whether a recorded name is a ready-made implementation: a normalization of torch's own
    (an aten or prims op, or a torch function in C or Python, ``torch._refs`` and
    ``torch._decomp`` included, whose name holds :data:`FORBIDDEN_OPS`), or maskln's own op
    (``maskln::`` ops, functions of ``maskln_cli``: recorded only when not grading maskln's op).
    Not a user's own custom op, whatever its name.

    Example:
        >>> is_ready_made("aten::native_layer_norm"), is_ready_made("mykernels::layer_norm")
        (True, False)
        >>> is_ready_made("torch._refs.native_layer_norm"), is_ready_made("mine.layer_norm")
        (True, False)
        >>> is_ready_made("maskln_cli.op.api.masked_layer_normalization")
        True
    """
    namespace, separator, op = name.partition("::")
    if separator:
        if namespace == "maskln":
            return True
        return namespace in TORCH_NAMESPACES and any(word in op for word in FORBIDDEN_OPS)
    if name.startswith("maskln_cli."):
        return True
    module, _, function = name.rpartition(".")
    torch_own = module == "torch" or module.startswith("torch.")
    return torch_own and any(word in function for word in FORBIDDEN_OPS)


def is_maskln_function(fn: Any) -> bool:
    """Whether ``fn`` is one of maskln's own functions (its op graded in process)."""
    module = getattr(fn, "__module__", None) or ""
    return module == "maskln_cli" or module.startswith("maskln_cli.")


_GRADING_MASKLN = contextvars.ContextVar("grading_maskln", default=False)
"""Set by :func:`run_clause` while maskln's own op is graded: its modules then run legitimately."""


class PythonRecorder:
    """The Python functions that run while it is on (``sys.setprofile``, this thread), kept
    when they are ready-made implementations: a function of torch's own Python code whose name
    holds :data:`FORBIDDEN_OPS` (``torch._refs.native_layer_norm``, a ``torch._decomp``
    decomposition, ``F.layer_norm``), or any function of maskln's op modules
    (:data:`MASKLN_OP_PACKAGE`) unless ``allow_maskln``. Names are ``module.function``.

    Example:
        >>> from torch._refs import native_layer_norm
        >>> with PythonRecorder() as recorder:
        ...     _ = native_layer_norm(torch.ones(2, 3), [3], None, None, 1e-5)
        >>> sorted(recorder.names)
        ['torch._refs.native_layer_norm']
    """

    def __init__(self, allow_maskln: bool = False) -> None:
        self.names: set[str] = set()
        self._torch = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
        op = Path(__file__).resolve().parent.parent / MASKLN_OP_PACKAGE
        self._maskln = set() if allow_maskln else {str(path) for path in op.glob("*.py")}
        self._known: dict[Any, str] = {}
        self._previous: Any = None

    def __enter__(self) -> PythonRecorder:
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._previous)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = self._name(frame.f_code)
        if not name or name.endswith(".<module>"):  # importing maskln runs none of the op
            return
        if not (name.startswith("maskln_cli.") and self._inside_maskln(frame)):
            self.names.add(name)

    def _inside_maskln(self, frame: Any) -> bool:
        """Whether a caller of ``frame`` is in maskln's op (named already: its entry point)."""
        caller = frame.f_back
        while caller is not None:
            if self._name(caller.f_code).startswith("maskln_cli."):
                return True
            caller = caller.f_back
        return False

    def _name(self, code: Any) -> str:
        name = self._known.get(code)
        if name is None:
            name = self._known[code] = self._classify(code)
        return name

    def _classify(self, code: Any) -> str:
        path = os.path.realpath(code.co_filename)
        if path.startswith(self._torch):
            if not any(word in code.co_name for word in FORBIDDEN_OPS):
                return ""
            module = "torch/" + path[len(self._torch) :]
        elif path in self._maskln:
            module = f"maskln_cli/{MASKLN_OP_PACKAGE}/" + os.path.basename(path)
        else:
            return ""
        module = module.removesuffix(".py").removesuffix("/__init__").replace(os.sep, ".")
        return f"{module.replace('/', '.')}.{code.co_qualname}"


def _raw_ops_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    """Record what runs in a no-grad forward, a forward and its backward: the ops, the torch
    functions and the Python functions (:class:`PythonRecorder`)."""
    RecordFunctions, RecordOps = _recorders()
    maskln = _GRADING_MASKLN.get()
    run = ClauseRun()
    for i, case in enumerate(cases):
        try:
            python = PythonRecorder(allow_maskln=maskln)
            with RecordOps() as ops, RecordFunctions() as functions:
                with torch.no_grad():
                    t = case.inputs(device)
                    with python:
                        _checked_output(_invoke(fn, t, case.eps, "positional"))
                t = case.inputs(device)
                for name in GRAD_INPUTS:
                    t[name].requires_grad_()
                with python:
                    out = _checked_output(_invoke(fn, t, case.eps, "positional"))
            forward = ops.names | functions.names | python.names
            python = PythonRecorder(allow_maskln=maskln)
            with RecordOps() as ops:
                if out.requires_grad:
                    leaves = [t[n] for n in GRAD_INPUTS]
                    with python:  # a CPU backward runs on this thread
                        torch.autograd.grad(_weighted(out, t), leaves, allow_unused=True)
            backward = ops.names | python.names
            if maskln:  # maskln's op graded: its own op and modules run legitimately
                forward, backward = (_not_maskln(names) for names in (forward, backward))
            run.meta[str(i)] = {"forward": sorted(forward), "backward": sorted(backward)}
        except CAUGHT as error:
            run.errors[str(i)] = describe_exception(error)
    return run


def _not_maskln(names: set[str]) -> set[str]:
    return {n for n in names if not n.startswith(("maskln::", "maskln_cli."))}


def _raw_ops_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for i, case in enumerate(cases):
        key = str(i)
        if key in run.errors:
            return Verdict(False, f"{case.label}: {run.errors[key]}")
        seen = run.meta.get(key, {})
        found = []
        for phase in ("forward", "backward"):
            names = seen.get(phase)
            if not isinstance(names, list):
                return Verdict(False, f"{case.label}: no record of the {phase} came back")
            found += [
                f"{name} ({phase})"
                for name in names
                if isinstance(name, str) and is_ready_made(name)
            ]
        if found:
            return Verdict(
                False, f"{case.label}: a ready-made normalization ran: {', '.join(found[:6])}"
            )
    return PASSED


# no_reinit ----------------------------------------------------------------------------------------


def _rng_states(device: str) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.device(device).type == "cuda":
        states += torch.cuda.get_rng_state_all()
    return states


@contextlib.contextmanager
def _distinct_random_state(seed: int, device: str):
    """Set the global random state to one a function could not produce by seeding (a
    manual_seed(0) is then seen, even if an earlier call made it), and restore the caller's."""
    saved = _rng_states(device)
    try:
        torch.manual_seed(0x5EED0 + seed)
        torch.rand(7)  # off any freshly seeded state
        if torch.device(device).type == "cuda":
            torch.cuda.manual_seed_all(0x5EED0 + seed)
            torch.rand(7, device=device)
        yield
    finally:
        torch.set_rng_state(saved[0])
        if len(saved) > 1:
            torch.cuda.set_rng_state_all(saved[1:])


def _no_reinit_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    def start() -> tuple[Hook, Inspect]:
        before: dict[str, Any] = {}

        def begin(phase: str, t: dict[str, torch.Tensor]) -> None:
            before["states"] = _rng_states(device)
            before["params"] = {n: t[n].detach().clone() for n in ("scale", "bias")}

        def check(phase: str, t: dict[str, torch.Tensor]) -> list[str]:
            problems = []
            now = _rng_states(device)
            if not all(torch.equal(a, b) for a, b in zip(before["states"], now, strict=True)):
                problems.append(f"the global random state changed in the {phase}")
            for name, old in before["params"].items():
                if not torch.equal(t[name].detach(), old):
                    problems.append(f"{name} was reinitialized in the {phase}")
            return problems

        return begin, check

    with _distinct_random_state(len(cases), device):
        return _probe_run(fn, cases, device, start)


# two_pass and offset_accuracy ---------------------------------------------------------------------

TWO_PASS_DATA = ((1e4, 0.1, 64),)
OFFSET_DATA = ((1e4, 0.1, 64), (1e3, 0.01, 64), (1e2, 1e-3, 64), (1e5, 1.0, 128))
OFFSET_ROWS = (32, 32)
"""About 920 valid rows per dataset: the RMS error of a correct kernel over that many rows
varies by a few percent from seed to seed (its worst element, by a factor of two)."""
ACCURACY_FLOOR = 1e-6
"""Relative RMS errors below this (float32 rounds to 6e-8) pass whatever F.layer_norm's is."""


def _offset_cases(seed: int, clause: str, data: Sequence[tuple[float, float, int]]) -> list[Case]:
    g = _generator(seed, clause)
    cases = []
    for offset, spread, channels in data:
        noise = torch.randn(*OFFSET_ROWS, channels, generator=g, dtype=torch.float64)
        x = offset + spread * noise
        valid = _mask(g, OFFSET_ROWS, fraction=0.9)
        label = _describe(x, torch.float32, 1e-5, f"rows {offset:g} ± {spread:g}")
        cases.append(_case(label, x, valid, _params(g, channels), 1e-5, torch.float32))
    return cases


def relative_rms_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` over every element (NaN or inf: inf).

    Example:
        >>> relative_rms_error(torch.tensor([3.0, 4.5]), torch.tensor([3.0, 4.0]))
        0.1
    """
    error = (actual.double() - reference).nan_to_num(math.inf, math.inf, math.inf)
    size = float(reference.norm())
    return float(error.norm()) / size if size > 0 else float(error.norm() > 0) * math.inf


def layer_norm_error(case: Case) -> float:
    """The relative RMS error of torch's own F.layer_norm (padding zeroed) against the float64
    reference on this case: the yardstick of two_pass and offset_accuracy. An RMS over about a
    thousand rows, not the worst element: the worst element of two correct kernels differs by
    chance (which rows' means happen to round badly), by up to a factor of two."""
    t = case.inputs()
    keep = t["valid"][..., None]
    clean = torch.where(keep, t["x"], 0.0)
    ours = torch.nn.functional.layer_norm(clean, clean.shape[-1:], t["scale"], t["bias"], case.eps)
    return relative_rms_error(torch.where(keep, ours, 0.0), case.reference())


def _accuracy_judge(factor: float, diagnose: bool) -> Judge:
    def judge(cases: list[Case], run: ClauseRun) -> Verdict:
        for call in _each(cases):
            case = cases[call.case]
            problem = _failure_detail(case, call, run)
            if problem is not None:
                return Verdict(False, problem)
            out = run.tensor(call.key, "out")
            reference = case.reference()
            if tuple(out.shape) != tuple(reference.shape):
                return Verdict(False, f"{case.label}: shape {list(out.shape)}")
            error = relative_rms_error(out, reference)
            yardstick = layer_norm_error(case)
            if not error <= max(factor * yardstick, ACCURACY_FLOOR):
                worst = (out.double() - reference).abs().nan_to_num(math.inf)
                index = [int(i) for i in torch.unravel_index(worst.argmax(), worst.shape)]
                detail = (
                    f"{case.label}: relative RMS error {error:.3g}; F.layer_norm's is"
                    f" {yardstick:.3g}, the limit {factor:g}x that (the worst element, at"
                    f" {index}, gave {_number(out[tuple(index)])}, the reference gives"
                    f" {_number(reference[tuple(index)])})"
                )
                return Verdict(False, detail, _diagnose([(case, out)]) if diagnose else None)
        return PASSED

    return judge


# positive_zero ------------------------------------------------------------------------------------


def _positive_zero_cases(seed: int) -> list[Case]:
    g = _generator(seed, "positive_zero")
    cases = []
    for dtype in (torch.float64, torch.float32):
        x = -_rows(g, (3, 6), 8).abs()  # negative rows and negative bias: -0.0 if multiplied
        label = f"{_describe(x, dtype, 1e-5)}, bias negative"
        valid = _mask(g, (3, 6))
        cases.append(_case(label, x, valid, _params(g, 8, negative_bias=True), 1e-5, dtype))
    return cases


def _positive_zero_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in _each(cases):
        case = cases[call.case]
        problem = _failure_detail(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
        out = run.tensor(call.key, "out")
        if tuple(out.shape) != tuple(case.x.shape):
            return Verdict(False, f"{case.label}: shape {list(out.shape)}")
        negative_zero = case.invalid() & (out == 0) & torch.signbit(out)
        if negative_zero.any():
            index = [int(i) for i in negative_zero.nonzero()[0]]
            return Verdict(False, f"{case.label}: at {index} (an invalid row) gave -0.0, not +0.0")
    return PASSED


# output_layout ------------------------------------------------------------------------------------


def _layout_cases(seed: int) -> list[Case]:
    g = _generator(seed, "output_layout")
    layouts = [
        ("x permuted", (5, 3, 6), (("permute", (1, 0, 2)),)),
        ("x permuted", (4, 3, 5, 6), (("permute", (2, 0, 1, 3)),)),
        ("x channels-strided", (3, 6, 5), (("permute", (0, 2, 1)),)),
        ("x channels-last", (2, 6, 3, 4), (("permute", (0, 2, 3, 1)),)),
    ]
    cases = []
    for what, base_shape, views in layouts:
        x = _rows(g, base_shape[:-1], base_shape[-1])
        logical = _apply_view(x, views[0])
        channels = logical.shape[-1]
        dtype = torch.float32
        label = _describe(logical, dtype, 1e-5, f"{what}, strides {list(logical.stride())}")
        case = _case(label, x, _mask(g, logical.shape[:-1]), _params(g, channels), 1e-5, dtype)
        case.views = {"x": views}
        cases.append(case)
    return cases


def _layout_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in _each(cases):
        case = cases[call.case]
        problem = _failure_detail(case, call, run)
        if problem is not None:
            return Verdict(False, problem)
        x = case.inputs()["x"]
        expected = list(torch.empty_like(x).stride())
        meta = run.meta.get(call.key, {})
        if meta.get("shape") != list(x.shape):
            return Verdict(False, f"{case.label}: shape {meta.get('shape')}")
        if meta.get("stride") != expected:
            return Verdict(
                False,
                f"{case.label}: output strides {meta.get('stride')}, torch.empty_like(x)'s"
                f" {expected}",
            )
    return PASSED


# second_order -------------------------------------------------------------------------------------


def _second_order_cases(seed: int) -> list[Case]:
    g = _generator(seed, "second_order")
    x = _rows(g, (2, 3), 4)
    label = _describe(x, torch.float64, 0.1)
    case = _case(label, x, _mask(g, (2, 3)), _params(g, 4), 0.1, torch.float64, g, grad=True)
    # Directions of the second-order products: d/d(inputs) of <first-order grads, direction>.
    case.directions = {
        "x": torch.randn(x.shape, generator=g, dtype=torch.float64),
        "scale": torch.randn(4, generator=g, dtype=torch.float64),
        "bias": torch.randn(4, generator=g, dtype=torch.float64),
    }
    return [case]


def _second_order_products(fn: Fn, case: Case, device: str) -> dict[str, torch.Tensor]:
    """d/d(x, scale, bias) of <first-order gradients, the case's directions>."""
    directions = case.directions or {}
    t = case.inputs(device)
    leaves = [t[n].requires_grad_() for n in GRAD_INPUTS]
    out = _checked_output(_invoke(fn, t, case.eps, "positional"))
    grads = torch.autograd.grad(_weighted(out, t), leaves, create_graph=True)
    pairs = zip(GRAD_INPUTS, grads, strict=True)
    total = sum((grad * directions[name].to(grad.device)).sum() for name, grad in pairs)
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        raise Misbehaved("the first-order gradients are not differentiable")
    second = torch.autograd.grad(total, leaves, allow_unused=True)
    return {
        f"second_{n}": _export(s if s is not None else torch.zeros_like(leaf))
        for n, s, leaf in zip(GRAD_INPUTS, second, leaves, strict=True)
    }


def _second_order_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = ClauseRun()
    case = cases[0]
    t = case.inputs(device)
    inputs = tuple(t[n].requires_grad_() for n in GRAD_INPUTS)

    def function(x, scale, bias):
        return fn(x, t["valid"].clone(), scale, bias, case.eps)  # a fresh mask each call

    try:
        torch.autograd.gradgradcheck(function, inputs, fast_mode=True)
        run.meta["gradgradcheck"] = {"passed": True}
    except CAUGHT as error:
        run.meta["gradgradcheck"] = {"passed": False, "error": describe_exception(error)}
    try:
        products = _second_order_products(fn, case, device)
        run.tensors.update({f"0.{name}": t for name, t in products.items()})
    except CAUGHT as error:
        run.errors["0"] = describe_exception(error)
    return run


def _second_order_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    case = cases[0]
    check = run.meta.get("gradgradcheck", {})
    if check.get("passed") is not True:
        return Verdict(False, f"{case.label}: gradgradcheck failed: {check.get('error')}")
    if "0" in run.errors:
        return Verdict(False, f"{case.label}: {run.errors['0']}")
    expected = _second_order_products(reference_masked_layer_norm, case, "cpu")
    for name, reference in expected.items():
        mismatch = _grad_mismatch(run.tensor("0", name), reference, torch.float64)
        if mismatch is not None:
            return Verdict(False, f"{case.label}: second-order product {name} {mismatch}")
    return PASSED


# grad_flags ---------------------------------------------------------------------------------------


def _flags_cases(seed: int) -> list[Case]:
    g = _generator(seed, "grad_flags")
    x = _rows(g, (2, 5), 8)
    return [_case(_describe(x, torch.float32, 1e-5), x, _mask(g, (2, 5)), _params(g, 8), 1e-5,
                  torch.float32)]  # fmt: skip


def _flags_calls(cases: list[Case]) -> list[Call]:
    calls = [Call("none", 0)]
    calls += [Call("+".join(s), 0, requires=s) for s in SUBSETS]
    calls += [
        Call("no_grad", 0, requires=GRAD_INPUTS, mode="no_grad"),
        Call("inference", 0, requires=GRAD_INPUTS, mode="inference"),
    ]
    return calls


def _flags_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    case = cases[0]
    for call in _flags_calls(cases):
        where = {
            "grad": f"{', '.join(call.requires) or 'no input'} requiring grad",
            "no_grad": "under torch.no_grad()",
            "inference": "under torch.inference_mode()",
        }[call.mode]
        problem = _failure_detail(case, call, run, f", {where}")
        if problem is not None:
            return Verdict(False, problem)
        expected = bool(call.requires) and call.mode == "grad"
        got = run.meta.get(call.key, {}).get("requires_grad")
        if got is not expected:
            says = "requires" if got else "does not require"
            return Verdict(False, f"{case.label}, {where}: the output {says} grad")
        if call.mode != "grad":
            mismatch = _value_mismatch(run.tensor(call.key, "out"), case.reference(), case.x.dtype)
            if mismatch is not None:
                return Verdict(False, f"{case.label}, {where}: {mismatch}")
    return PASSED


# the table ----------------------------------------------------------------------------------------


CallsOf = Callable[[list[Case]], list[Call]]


def _clause(
    name: str,
    required: bool,
    summary: str,
    build: Callable[[int], list[Case]],
    calls: CallsOf | None = None,
    run: Run | None = None,
    judge: Judge | None = None,
) -> Clause:
    """A clause; by default it makes ``calls`` and judges their outputs (and gradients)."""
    if run is None or judge is None:
        assert calls is not None
    return Clause(
        name, required, summary, build, run or _calls_run(calls), judge or _outputs_judge(calls)
    )


def _clauses() -> dict[str, Clause]:
    both = (
        _clause(
            "signature",
            True,
            "callable as (x, valid, scale, bias, eps=1e-05), positionally and by keyword",
            _signature_cases,
            run=_signature_run,
            judge=_signature_judge,
        ),
        _clause(
            "worked_example",
            True,
            "the specification's worked example, exactly (float64)",
            _worked_cases,
            calls=lambda cases: [_WORKED_CALL],
            judge=_worked_judge,
        ),
        _clause(
            "values",
            True,
            "random cases against the float64 reference: float32 and float64, C from 1 to 257"
            " (9, 17, 33, ...: not multiples of 8), 993 rows, eps 1e-5, 0.1 and 3, rows of"
            " small variance; with and without grad",
            _values_cases,
            calls=_values_calls,
            judge=_outputs_judge(_values_calls, diagnose=True, what=_grad_words),
        ),
        _clause(
            "leading_axes",
            True,
            "0, 1, 2 and 4 leading axes (x [C] with a 0-d valid), and zero-size inputs,"
            " values and gradients",
            _leading_cases,
            calls=_leading_calls,
        ),
        _clause(
            "invalid_rows_zero",
            True,
            "invalid rows are zero although bias is not",
            _invalid_cases,
            calls=_each,
            judge=_invalid_judge,
        ),
        _clause(
            "sanitized_padding",
            True,
            "NaN, ±inf and 1e30 in invalid rows of x change nothing",
            lambda seed: _poisoned_cases(seed, "sanitized_padding", grad=False),
            calls=_sanitized_padding_calls,
            judge=_sanitized_padding_judge,
        ),
        _clause(
            "gradients",
            True,
            "dx, dscale, dbias against autograd through the float64 reference, for each subset"
            " of inputs requiring grad",
            _gradient_cases,
            calls=_gradient_calls,
            judge=_gradients_judge,
        ),
        _clause(
            "sanitized_gradients",
            True,
            "with NaN and inf in invalid rows: dx is 0 there and every gradient is finite and"
            " right",
            lambda seed: _poisoned_cases(seed, "sanitized_gradients", grad=True),
            calls=_sanitized_gradients_calls,
            judge=_sanitized_gradients_judge,
        ),
        _clause(
            "dtypes",
            True,
            "the output has x's dtype and device; float64 is computed in float64",
            _dtypes_cases,
            calls=_each,
            judge=_dtypes_judge,
        ),
        _clause(
            "strided_inputs",
            True,
            "permuted, stepped-slice, expanded and channels-strided x; non-contiguous valid,"
            " scale and bias",
            _strided_cases,
            calls=_each,
        ),
        _clause(
            "no_mutation",
            True,
            "no input's values, shape or version counter change, in forward or backward",
            lambda seed: _probe_cases(seed, "no_mutation"),
            run=_no_mutation_run,
            judge=_problems_judge("mutation"),
        ),
        _clause(
            "raw_ops",
            True,
            "no ready-made normalization kernel runs, forward or backward",
            lambda seed: _probe_cases(seed, "raw_ops"),
            run=_raw_ops_run,
            judge=_raw_ops_judge,
        ),
        _clause(
            "no_reinit",
            True,
            "scale, bias and the global random state are unchanged by a call",
            lambda seed: _probe_cases(seed, "no_reinit"),
            run=_no_reinit_run,
            judge=_problems_judge("random state"),
        ),
        _clause(
            "two_pass",
            True,
            f"float32 rows 1e4 ± 0.1: RMS error within {TWO_PASS_FACTOR:g}x F.layer_norm's",
            lambda seed: _offset_cases(seed, "two_pass", TWO_PASS_DATA),
            calls=_each,
            judge=_accuracy_judge(TWO_PASS_FACTOR, diagnose=True),
        ),
        _clause(
            "positive_zero",
            False,
            "invalid outputs are +0.0, never -0.0",
            _positive_zero_cases,
            calls=_each,
            judge=_positive_zero_judge,
        ),
        _clause(
            "output_layout",
            False,
            "the output's strides are torch.empty_like(x)'s",
            _layout_cases,
            calls=_each,
            judge=_layout_judge,
        ),
        _clause(
            "second_order",
            False,
            "gradgradcheck passes in float64, and second-order products are right",
            _second_order_cases,
            run=_second_order_run,
            judge=_second_order_judge,
        ),
        _clause(
            "grad_flags",
            False,
            "the output requires grad exactly when an input does; no_grad and inference_mode work",
            _flags_cases,
            calls=_flags_calls,
            judge=_flags_judge,
        ),
        _clause(
            "offset_accuracy",
            False,
            f"offset float32 rows: RMS error within {OFFSET_FACTOR:g}x F.layer_norm's",
            lambda seed: _offset_cases(seed, "offset_accuracy", OFFSET_DATA),
            calls=_each,
            judge=_accuracy_judge(OFFSET_FACTOR, diagnose=False),
        ),
    )
    return {clause.name: clause for clause in both}


CLAUSES = _clauses()
"""Every clause, required first, in the order they run and are reported."""


def run_clause(
    fn: Fn,
    name: str,
    seed: int,
    device: str,
    cases: list[Case] | None = None,
    maskln: bool | None = None,
) -> ClauseRun:
    """Run clause ``name`` on ``fn`` where ``fn`` lives (this process, or the child).

    ``maskln``: whether the function graded is maskln's own op, whose modules ``raw_ops`` then
    allows (by default, whether ``fn`` is defined in maskln_cli; the child decides by the
    target, so that a file that imports maskln's op is not taken for it)."""
    clause = CLAUSES[name]
    cases = clause.build(seed) if cases is None else cases
    token = _GRADING_MASKLN.set(is_maskln_function(fn) if maskln is None else maskln)
    try:
        with warnings.catch_warnings():
            # The function's warnings are not verdicts (and under -W error would become
            # exceptions that fail a correct function).
            warnings.simplefilter("ignore")
            run = clause.run(fn, cases, device)
    except CAUGHT as error:  # outside any one call: the function broke the clause's machinery
        run = ClauseRun(failure=describe_exception(error))
    finally:
        _GRADING_MASKLN.reset(token)
    run.device = device
    return run
