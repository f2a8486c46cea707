"""The clauses on gradients: dx, dscale and dbias for each subset of inputs requiring grad,
second-order products (strict), and when the output requires grad (strict).
"""

from __future__ import annotations

import itertools

import torch

from maskln_cli.grading.clauses import draws
from maskln_cli.grading.clauses.assumed import reference_formula
from maskln_cli.grading.clauses.calls import (
    CAUGHT,
    GRAD_INPUTS,
    Call,
    ClauseRun,
    Fn,
    Misbehaved,
    announce,
    checked_output,
    describe_exception,
    export_tensor,
    invoke,
    weighted_sum,
)
from maskln_cli.grading.clauses.cases import Case, describe_inputs, make_case
from maskln_cli.grading.clauses.clause import make_clause
from maskln_cli.grading.clauses.judging import (
    PASSED,
    Verdict,
    failure_detail,
    grad_mismatch,
    judge_gradients,
    value_mismatch,
)

# gradients ----------------------------------------------------------------------------------------

SUBSETS = [s for r in (1, 2, 3) for s in itertools.combinations(GRAD_INPUTS, r)]


def _gradient_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "gradients")
    cases = []
    for dtype, (channels, eps) in itertools.product(
        (torch.float64, torch.float32), ((8, 1e-5), (3, 0.1), (17, 1e-5))
    ):
        x = draws.rows(g, (2, 5), channels)
        label = describe_inputs(x, dtype, eps)
        cases.append(
            make_case(
                label, x, draws.mask(g, (2, 5)), draws.params(g, channels), eps, dtype, g, True
            )
        )
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
        problem = failure_detail(case, call, run, what) or judge_gradients(case, call, run, what)
        if problem is not None:
            return Verdict(False, problem)
    return PASSED


GRADIENTS = make_clause(
    "gradients",
    "required",
    "dx, dscale, dbias against autograd through the float64 reference, for each subset"
    " of inputs requiring grad",
    _gradient_cases,
    calls=_gradient_calls,
    judge=_gradients_judge,
)


# second_order -------------------------------------------------------------------------------------


def _second_order_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "second_order")
    x = draws.rows(g, (2, 3), 4)
    label = describe_inputs(x, torch.float64, 0.1)
    case = make_case(
        label, x, draws.mask(g, (2, 3)), draws.params(g, 4), 0.1, torch.float64, g, grad=True
    )
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
    out = checked_output(invoke(fn, t, case.eps, "positional"))
    grads = torch.autograd.grad(weighted_sum(out, t), leaves, create_graph=True)
    pairs = zip(GRAD_INPUTS, grads, strict=True)
    total = sum((grad * directions[name].to(grad.device)).sum() for name, grad in pairs)
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        raise Misbehaved("the first-order gradients are not differentiable")
    second = torch.autograd.grad(total, leaves, allow_unused=True)
    return {
        f"second_{n}": export_tensor(s if s is not None else torch.zeros_like(leaf))
        for n, s, leaf in zip(GRAD_INPUTS, second, leaves, strict=True)
    }


def _second_order_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = ClauseRun()
    case = cases[0]
    t = case.inputs(device)
    inputs = tuple(t[n].requires_grad_() for n in GRAD_INPUTS)

    def function(x, scale, bias):
        return fn(x, t["valid"].clone(), scale, bias, case.eps)  # a fresh mask each call

    announce(f"{case.label}, gradgradcheck and second-order products")
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
    expected = _second_order_products(reference_formula(), case, "cpu")
    for name, reference in expected.items():
        mismatch = grad_mismatch(run.tensor("0", name), reference, torch.float64)
        if mismatch is not None:
            return Verdict(False, f"{case.label}: second-order product {name} {mismatch}")
    return PASSED


SECOND_ORDER = make_clause(
    "second_order",
    "strict",
    "gradgradcheck passes in float64, and second-order products are right",
    _second_order_cases,
    run=_second_order_run,
    judge=_second_order_judge,
)


# grad_flags ---------------------------------------------------------------------------------------


def _flags_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "grad_flags")
    x = draws.rows(g, (2, 5), 8)
    label = describe_inputs(x, torch.float32, 1e-5)
    return [make_case(label, x, draws.mask(g, (2, 5)), draws.params(g, 8), 1e-5, torch.float32)]


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
        problem = failure_detail(case, call, run, f", {where}")
        if problem is not None:
            return Verdict(False, problem)
        expected = bool(call.requires) and call.mode == "grad"
        got = run.meta.get(call.key, {}).get("requires_grad")
        if got is not expected:
            says = "requires" if got else "does not require"
            return Verdict(False, f"{case.label}, {where}: the output {says} grad")
        if call.mode != "grad":
            mismatch = value_mismatch(run.tensor(call.key, "out"), case.reference(), case.x.dtype)
            if mismatch is not None:
                return Verdict(False, f"{case.label}, {where}: {mismatch}")
    return PASSED


GRAD_FLAGS = make_clause(
    "grad_flags",
    "strict",
    "the output requires grad exactly when an input does; no_grad and inference_mode work",
    _flags_cases,
    calls=_flags_calls,
    judge=_flags_judge,
)
