"""The clauses on gradients: dx, dscale and dbias for each subset of inputs requiring grad,
second-order products (strict), and when the output requires grad (strict).
"""

from __future__ import annotations

import itertools

import torch

from maskln_cli.grading.clauses import draws, families
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
from maskln_cli.grading.clauses.cases import RANDOM, Case, describe_inputs, make_case
from maskln_cli.grading.clauses.causes import (
    BACKWARD_FROM_SAVED,
    NAN_AT_ZERO_VARIANCE,
    gradgradcheck_words,
    second_order_cause,
)
from maskln_cli.grading.clauses.clause import make_clause
from maskln_cli.grading.clauses.judging import (
    PASSED,
    Verdict,
    condition_causes,
    diagnose_failures,
    failure_detail,
    grad_mismatch,
    gradient_causes,
    judge_gradients,
    judge_outputs,
    value_mismatch,
)
from maskln_cli.grading.clauses.own_mistakes import (
    MEAN_DETACHED_IN_VARIANCE,
    mean_detached_formula,
)
from maskln_cli.grading.exercise import current
from maskln_cli.op.mistakes import Diagnosis

# gradients ----------------------------------------------------------------------------------------


def subsets() -> list[tuple[str, ...]]:
    """Every non-empty subset of the inputs taking gradients (the exercise's)."""
    names = tuple(GRAD_INPUTS)
    return [s for r in range(1, len(names) + 1) for s in itertools.combinations(names, r)]


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
    cases += families.family_cases(g, grad=True)
    cases += families.family_cases(g, grad=True, families=(families.TIES,))
    for dtype, eps in GRADIENT_EPS:
        x = families.eps_rows(g, (2, 5), 8, eps)
        label = describe_inputs(x, dtype, eps, "row variances 0.01, 1 and 100 times eps")
        cases.append(
            make_case(
                label,
                x,
                draws.mask(g, (2, 5)),
                draws.params(g, 8),
                eps,
                dtype,
                g,
                True,
                family=families.EPS,
            )
        )
    for layout, dtype in itertools.product(
        families.UPSTREAM_LAYOUTS, (torch.float64, torch.float32)
    ):
        cases.append(families.upstream_case(g, (3, 4, 6), layout, dtype))
    cases += families.family_cases(g, grad=True, families=(families.IDENTITY,))  # last: the
    if current().name == "rms":  # cases before these draw what they always drew
        cases += families.rms_cases(g, grad=True)
    return cases


GRADIENT_EPS = (
    (torch.float64, 1e-12),
    (torch.float64, 1e-8),
    (torch.float64, 10.0),
    (torch.float32, 1e-8),
    (torch.float32, 10.0),
)


def _gradient_calls(cases: list[Case]) -> list[Call]:
    """Random cases with each subset of inputs requiring grad; the other families with x,
    scale and bias requiring grad."""
    return [
        Call(f"{i}.{'+'.join(subset)}", i, requires=subset, backward=True)
        for i, case in enumerate(cases)
        for subset in (subsets() if case.family == RANDOM else [tuple(GRAD_INPUTS)])
    ]


def _gradients_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    return judge_outputs(
        cases,
        run,
        _gradient_calls(cases),
        diagnose=True,
        what=lambda call: f", {', '.join(call.requires)} requiring grad",
    )


GRADIENTS = make_clause(
    "gradients",
    "required",
    "dx, dscale, dbias against autograd through the float64 reference, for each subset"
    " of inputs requiring grad; constant rows, exact zeros, exact ties, C = 1, a prime C, eps"
    " from 1e-12"
    " to 10, upstream gradients transposed, stepped and expanded, and the identity affine"
    " (scale 1, bias 0)",
    _gradient_cases,
    calls=_gradient_calls,
    judge=_gradients_judge,
)


# second_order -------------------------------------------------------------------------------------


SECOND_ORDER_FAMILIES = (
    (families.ONE_CHANNEL, 1),
    (families.PRIME, 7),
    (families.CONSTANT, 5),
    (families.ZEROS, 6),
    (families.TIES, 8),
)
"""The families whose second-order products are checked besides the random case's (which
gradgradcheck checks too): (family, C)."""


def _second_order_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "second_order")
    shapes = [(RANDOM, 4), *SECOND_ORDER_FAMILIES]
    cases = []
    for family, channels in shapes:
        if family == families.CONSTANT:
            x = families.constant_rows(g, (2, 3), channels)
        elif family == families.ZEROS:
            x = families.zero_holding_rows(g, (2, 3), channels)
        elif family == families.TIES:
            x = families.tie_rows(g, (2, 3), channels)
        else:
            x = draws.rows(g, (2, 3), channels)
        label = describe_inputs(x, torch.float64, 0.1)
        case = make_case(
            label,
            x,
            families.mask_for(family, x, g, (2, 3)),
            draws.params(g, channels),
            0.1,
            torch.float64,
            g,
            grad=True,
            family=family,
        )
        # Directions of the second-order products: d/d(inputs) of <first-order grads, direction>.
        case.directions = {
            "x": torch.randn(x.shape, generator=g, dtype=torch.float64),
            "scale": torch.randn(channels, generator=g, dtype=torch.float64),
            "bias": torch.randn(channels, generator=g, dtype=torch.float64),
        }
        cases.append(case)
    return cases


def _second_order_products(
    fn: Fn, case: Case, device: str, found: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """d/d(x, scale, bias) of <first-order gradients, the case's directions>; ``found``
    receives the names of the custom autograd Functions in the output's graph."""
    directions = case.directions or {}
    t = case.inputs(device)
    leaves = [t[n].requires_grad_() for n in GRAD_INPUTS]
    out = checked_output(invoke(fn, t, case.eps, "positional"))
    if found is not None:
        found += custom_functions(out)
    grads = torch.autograd.grad(weighted_sum(out, t), leaves, create_graph=True)
    pairs = zip(GRAD_INPUTS, grads, strict=True)
    total = sum((grad * directions[name].to(grad.device)).sum() for name, grad in pairs)
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        marked = once_differentiable_nodes(out)
        if marked:
            raise Misbehaved(
                "the first-order gradients are not differentiable: the backward of"
                f" {marked[0]} is marked @once_differentiable"
            )
        raise Misbehaved("the first-order gradients are not differentiable")
    second = torch.autograd.grad(total, leaves, allow_unused=True)
    products = {
        f"second_{n}": export_tensor(s if s is not None else torch.zeros_like(leaf))
        for n, s, leaf in zip(GRAD_INPUTS, second, leaves, strict=True)
    }
    first = {f"grad_{n}": export_tensor(g) for n, g in zip(GRAD_INPUTS, grads, strict=True)}
    return {"out": export_tensor(out), **first, **products}


def second_order_products(
    fn: Fn, case: Case, device: str, keep: list | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The second-order products of a call (:func:`_second_order_products`) and the custom
    autograd Functions in its graph (a cause's probe: :mod:`maskln_cli.grading.confirm`)."""
    names: list[str] = []
    products = _second_order_products(fn, case, device, names)
    if keep is not None:
        keep.append(products)
    return products, names


def reference_second_order(case: Case, formula: Fn | None = None) -> dict[str, torch.Tensor]:
    """The second-order products of the float64 reference (or of ``formula``) on ``case``."""
    if formula is None:
        found = _second_order_products(current().outer(reference_formula()), case, "cpu")
    else:

        def double(x, valid, scale, bias, eps):
            return formula(x.double(), valid, scale.double(), bias.double(), eps)

        found = _second_order_products(current().outer(double), case, "cpu")
    return {name: t for name, t in found.items() if name.startswith("second_")}


def custom_functions(out: torch.Tensor, limit: int = 10_000) -> list[str]:
    """The custom autograd Functions (defined outside torch) in ``out``'s graph, by name."""
    found: list[str] = []
    stack, seen = [out.grad_fn], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        forward_cls = getattr(node, "_forward_cls", None)
        module = getattr(forward_cls, "__module__", "") or ""
        if forward_cls is not None and not module.startswith(("torch.", "maskln_cli.")):
            found.append(getattr(forward_cls, "__name__", "a custom Function"))
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return found


def once_differentiable_nodes(out: torch.Tensor, limit: int = 10_000) -> list[str]:
    """The custom autograd Functions in ``out``'s graph whose backward is wrapped by
    ``@once_differentiable`` (a wrapper torch defines in its own autograd/function.py)."""
    found: list[str] = []
    stack, seen = [out.grad_fn], set()
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        forward_cls = getattr(node, "_forward_cls", None)
        backward = getattr(forward_cls, "backward", None)
        code = getattr(backward, "__code__", None)
        if (
            code is not None
            and code.co_name == "wrapper"
            and hasattr(backward, "__wrapped__")
            and code.co_filename.replace("\\", "/").endswith("torch/autograd/function.py")
        ):
            found.append(getattr(forward_cls, "__name__", "a custom Function"))
        stack.extend(next_node for next_node, _ in getattr(node, "next_functions", ()))
    return found


def _warm_up_gradgradcheck() -> None:
    """gradgradcheck once on plain ops, before the function's first call: its first double
    backward loads a part of torch lazily (sympy, through torch.fx: over a second, 3.7 s in a
    grader's child), which would otherwise count against the function's first call."""
    x = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64, requires_grad=True)
    torch.autograd.gradgradcheck(lambda t: t * (t * t).sum(-1, keepdim=True), (x,), fast_mode=True)


def _second_order_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    """gradgradcheck on the first (random) case; second-order products on every case."""
    run = ClauseRun()
    case = cases[0]
    t = case.inputs(device)
    inputs = tuple(t[n].requires_grad_() for n in GRAD_INPUTS)

    def function(*leaves: torch.Tensor) -> torch.Tensor:
        given = dict(zip(GRAD_INPUTS, leaves, strict=True))
        # a fresh mask each call
        return invoke(fn, {**t, **given, "valid": t["valid"].clone()}, case.eps, "positional")

    _warm_up_gradgradcheck()
    announce(f"{case.label}, gradgradcheck and second-order products")
    try:
        torch.autograd.gradgradcheck(function, inputs, fast_mode=True)
        run.meta["gradgradcheck"] = {"passed": True}
    except CAUGHT as error:
        run.meta["gradgradcheck"] = {"passed": False, "error": describe_exception(error)}
    for i, each in enumerate(cases):
        announce(f"{each.label}, second-order products")
        try:
            products = _second_order_products(fn, each, device)
            run.tensors.update({f"{i}.{name}": t for name, t in products.items()})
        except CAUGHT as error:
            run.errors[str(i)] = describe_exception(error)
    return run


def _second_order_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    case = cases[0]
    check = run.meta.get("gradgradcheck", {})
    if check.get("passed") is not True:
        error = check.get("error")
        detail = f"{case.label}: gradgradcheck failed: {gradgradcheck_words(error)}"
        # Taking the products themselves says more than a Jacobian mismatch, when it raises.
        found = [second_order_cause(run.errors.get("0") or error)]
        found += _second_order_formulas(case, "0", run)
        return Verdict(False, detail, found, case=0)
    for i, each in enumerate(cases):
        if str(i) in run.errors:
            error = run.errors[str(i)]
            found = [second_order_cause(error), *_family_causes(each)]
            return Verdict(False, f"{each.label}: {error}", found, case=i)
        first_order = _first_order_problem(each, str(i), run)
        if first_order is not None:
            return first_order
        expected = _second_order_products(current().outer(reference_formula()), each, "cpu")
        for name, reference in expected.items():
            if not name.startswith("second_"):
                continue
            actual = run.tensor(str(i), name)
            mismatch = grad_mismatch(actual, reference, torch.float64)
            if mismatch is not None:
                detail = f"{each.label}: second-order product {name} {mismatch}"
                nonfinite = bool((~actual.isfinite() & reference.isfinite()).any())
                cause = NAN_AT_ZERO_VARIANCE if nonfinite else BACKWARD_FROM_SAVED
                found = [cause.diagnosis(), *_second_order_formulas(each, str(i), run)]
                found += _family_causes(each)
                return Verdict(False, detail, found, case=i)
    return PASSED


def _second_order_formulas(case: Case, key: str, run: ClauseRun) -> list[Diagnosis]:
    """The grader's own second-order mistakes whose products the function's match."""
    if f"{key}.second_x" not in run.tensors or not current().patterns:
        return []
    try:
        expected = reference_second_order(case, mean_detached_formula)
    except RuntimeError:
        return []
    for name, reference in expected.items():
        if grad_mismatch(run.tensor(key, name), reference, torch.float64) is not None:
            return []
    return [MEAN_DETACHED_IN_VARIANCE]


def _family_causes(case: Case) -> list[Diagnosis]:
    """The cause of the case's family of data, as a candidate (its probe says whether it
    holds)."""
    return condition_causes([case])


def _first_order_problem(case: Case, key: str, run: ClauseRun) -> Verdict | None:
    """A failure of the forward or the first derivatives (which the values and gradients
    clauses judge): the second derivatives cannot be right, and their causes are those."""
    out = run.tensor(key, "out")
    mismatch = value_mismatch(out, case.reference(), torch.float64)
    if mismatch is not None:
        return Verdict(False, f"{case.label}: {mismatch}", diagnose_failures([(case, out)]) or None)
    call = Call(key, 0, requires=GRAD_INPUTS, backward=True)
    problem = judge_gradients(case, call, run)
    if problem is not None:
        return Verdict(False, problem, gradient_causes(case, call, run))
    return None


SECOND_ORDER = make_clause(
    "second_order",
    "strict",
    "gradgradcheck passes in float64, and second-order products are right, at C = 1, a prime"
    " C, on constant rows, exact zeros and exact ties too",
    _second_order_cases,
    run=_second_order_run,
    judge=_second_order_judge,
)


# grad_flags ---------------------------------------------------------------------------------------


def _flags_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "grad_flags")
    x = draws.rows(g, (2, 5), 8)
    label = describe_inputs(x, torch.float32, 1e-5)
    cases = [make_case(label, x, draws.mask(g, (2, 5)), draws.params(g, 8), 1e-5, torch.float32)]
    return cases + families.family_cases(
        g, families=(families.ONE_CHANNEL, families.PRIME), dtypes=(torch.float64,)
    )


def _flags_calls(cases: list[Case]) -> list[Call]:
    calls = []
    for i in range(len(cases)):
        calls.append(Call(f"{i}.none", i))
        calls += [Call(f"{i}.{'+'.join(s)}", i, requires=s) for s in subsets()]
        calls += [
            Call(f"{i}.no_grad", i, requires=GRAD_INPUTS, mode="no_grad"),
            Call(f"{i}.inference", i, requires=GRAD_INPUTS, mode="inference"),
        ]
    return calls


def _flags_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for call in _flags_calls(cases):
        case = cases[call.case]
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
            out = run.tensor(call.key, "out")
            mismatch = value_mismatch(out, case.reference(), case.x.dtype)
            if mismatch is not None:
                found = diagnose_failures([(case, out)], order=cases)
                return Verdict(False, f"{case.label}, {where}: {mismatch}", found)
    return PASSED


GRAD_FLAGS = make_clause(
    "grad_flags",
    "strict",
    "the output requires grad exactly when an input does; no_grad and inference_mode work",
    _flags_cases,
    calls=_flags_calls,
    judge=_flags_judge,
)
