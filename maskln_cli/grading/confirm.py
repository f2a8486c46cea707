"""A cause is named only when a test confirms it (issue 38, item 4): the counterexample re-run with
the suspected cause's condition varied.

A clause that fails suggests causes: a formula its output matches, the one family of data its
failures share, an exception's words, a pattern of its gradients. Each can match by coincidence
(a C = 1 special case returning zeros matches "bias not added" at C = 1; a clamped variance
matches "eps squared" where the variance is large). So before the grader names one, it calls the
function again (:func:`build_probe`, :func:`run_probe`: in the grader's child, as the clauses)
and judges what came back (:func:`judge_probe`):

- every probe first re-runs the counterexample twice, the same call on the same inputs given as
  new tensors (at addresses no earlier tensor had): right this time, the function's result
  depends on earlier calls (a cache), and that is the cause, whatever was suspected
  (:data:`~.clauses.own_mistakes.RESULT_FROM_EARLIER_CALL`);
- a formula must match the function on new data, another number of positions, other channels
  and the eps range, wherever the formula differs from the op, and the function must be right
  where the formula is;
- a family of data must be what makes it wrong: wrong on new data of that family, right once
  the condition is gone (C = 2 for C = 1, C = 192 for a prime C, the rows perturbed, the
  upstream gradient contiguous, eps at 1e-3 for a small one);
- an exception must be raised again, by the same call, with the same words;
- a precision must show again on new data; a backward "written from saved values" needs a
  custom autograd Function in the graph; the padding's upstream gradient must be what reaches
  grad_bias or grad_x (zeroed, the gradient is right).

Causes the clause saw directly (an input mutated, the random state changed, -0.0 where a
multiplication puts it, a later call changing an earlier result) need no probe:
:data:`OBSERVED`. :data:`KINDS` is the table of every cause the grader can name and how it is
confirmed; ``tests/grading/test_confirmations.py`` enumerates it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from maskln_cli.grading.clauses import draws, families
from maskln_cli.grading.clauses.calls import (
    CAUGHT,
    GRAD_INPUTS,
    Call,
    ClauseRun,
    Fn,
    announce,
    describe_exception,
    perform,
)
from maskln_cli.grading.clauses.cases import RANDOM, Case, describe_inputs, make_case
from maskln_cli.grading.clauses.catalogue import (
    EVERY_FORMULA,
    correct_formula,
    diagnose_formulas,
    formulas,
)
from maskln_cli.grading.clauses.causes import (
    EXCEPTION_CAUSES,
    FAMILY_CAUSES,
    explain_exception,
)
from maskln_cli.grading.clauses.judging import (
    detached_match,
    grad_mismatch,
    reference_gradients,
    value_mismatch,
)
from maskln_cli.grading.clauses.own_mistakes import (
    FLOAT32_GRADIENT_ERROR,
    RESULT_FROM_EARLIER_CALL,
    gradient_pattern,
    mean_detached_formula,
)
from maskln_cli.op.mistakes import (
    ONE_PASS,
    PRECISION_MISTAKES,
    Diagnosis,
    diagnose_output,
    diagnose_precision,
)

OBSERVED = "observed"
FORMULA = "formula"
PRECISION = "precision"
ONE_PASS_KIND = "one pass"
GRADIENT_PRECISION = "gradient precision"
FAMILY = "family"
STALE = "stale"
RERUN = "rerun"
CUSTOM_BACKWARD = "custom backward"
SECOND_ORDER_FORMULA = "second-order formula"
GRADIENT_FORMULA = "gradient formula"
PADDING_UPSTREAM = "padding upstream"
EPS_UNUSED = "eps unused"
PADDING_NAN = "padding nan"

FAMILY_OF_CAUSE = {cause.mistake: family for family, cause in FAMILY_CAUSES.items()}
FAMILY_OF_CAUSE.update(
    {
        "eps_floored": families.EPS,
        "gradient_lost_at_zero_variance": families.CONSTANT,
        "nan_at_zero_variance": families.CONSTANT,
    }
)
"""The family of data whose condition each family cause names."""

KINDS: dict[str, str] = {
    **{name: FORMULA for name in EVERY_FORMULA},
    **{name: PRECISION for name in PRECISION_MISTAKES},
    **{name: FAMILY for name in FAMILY_OF_CAUSE},
    **{cause.mistake: RERUN for cause in EXCEPTION_CAUSES},
    ONE_PASS.name: ONE_PASS_KIND,
    "gradients_in_float32": GRADIENT_PRECISION,
    "stale_mask": STALE,
    "backward_from_saved_values": CUSTOM_BACKWARD,
    "mean_detached_in_variance": SECOND_ORDER_FORMULA,
    "statistics_detached": GRADIENT_FORMULA,
    "mean_detached": GRADIENT_FORMULA,
    "variance_detached": GRADIENT_FORMULA,
    "padding_in_grad_bias": PADDING_UPSTREAM,
    "grad_x_in_padding": PADDING_UPSTREAM,
    "nan_without_padding": EPS_UNUSED,
    "nan_made_in_padding": PADDING_NAN,
    # Seen by the clause itself, the very thing it tests:
    "input_mutated": OBSERVED,
    "random_state_changed": OBSERVED,
    "ready_made_normalization": OBSERVED,  # recorded running
    "not_deterministic": OBSERVED,  # the same inputs, other bits
    "shared_result": OBSERVED,  # a later call changed an earlier result
    "global_state_changed": OBSERVED,
    "hooks_left": OBSERVED,
    "negative_zero": OBSERVED,  # -0.0 exactly where a multiplication by the mask puts it
    "output_uninitialized": OBSERVED,  # valid rows right, invalid ones hold what nothing computes
    "nan_from_padding": OBSERVED,  # NaN with poisoned padding, none with clean padding
    "eps_default": OBSERVED,  # called without eps: wrong, and the signature declares another
    "result_from_earlier_call": OBSERVED,  # right when the same inputs came again
}
"""How each cause the grader can name is confirmed (one kind each: a probe of
:func:`build_probe`, or :data:`OBSERVED`)."""


STYLES = ("positional", "keyword", "positional_default", "keyword_default")
MODES = ("grad", "no_grad", "inference")


@dataclass(frozen=True)
class Spec:
    """How the counterexample was called: its style, grad mode, the inputs requiring grad,
    whether its backward ran, whether it was a second-order computation, whether its padding
    was clean (else as the case holds it: poisoned, for a poisoned case)."""

    style: str = "positional"
    mode: str = "grad"
    requires: tuple[str, ...] = ()
    backward: bool = False
    second_order: bool = False
    clean: bool = False
    gradgradcheck: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"style": self.style, "mode": self.mode, "requires": list(self.requires),
                "backward": self.backward, "second_order": self.second_order,
                "clean": self.clean, "gradgradcheck": self.gradgradcheck}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Spec:
        requires = tuple(str(n) for n in data.get("requires") or () if n in GRAD_INPUTS)
        style, mode = str(data.get("style")), str(data.get("mode"))
        return cls(
            style if style in STYLES else "positional",
            mode if mode in MODES else "grad",
            requires,
            bool(data.get("backward")) and bool(requires),
            bool(data.get("second_order")),
            bool(data.get("clean")),
            bool(data.get("gradgradcheck")),
        )

    @classmethod
    def of(cls, clause: str, call: Call | None, detail: str | None) -> Spec:
        """The spec of a clause's counterexample: its call's, when the judge knew it; else
        read from the failure's words (a gradient named, or an output without a graph: the
        backward ran; under torch.no_grad(): that grad mode)."""
        if clause == "second_order":
            checked = "gradgradcheck failed" in (detail or "")
            return cls(requires=GRAD_INPUTS, backward=True, second_order=True,
                       gradgradcheck=checked)  # fmt: skip
        if call is not None:
            requires = call.requires if call.backward else ()
            backward = call.backward and bool(requires)
            return cls(call.style, call.mode, tuple(requires), backward, clean=call.clean)
        words = detail or ""
        mode = "no_grad" if "torch.no_grad()" in words else "grad"
        mode = "inference" if "inference_mode()" in words else mode
        gradient = any(name in words for name in ("grad_x", "grad_scale", "grad_bias",
                                                  "require grad", "grad_fn"))  # fmt: skip
        requires = GRAD_INPUTS if gradient and mode == "grad" else ()
        return cls(mode=mode, requires=requires, backward=bool(requires))


@dataclass
class Step:
    """One call of a probe: its case, how it is called, and its role in the judgement
    (``again``: the counterexample re-run; ``kept``/``removed``: the suspected condition kept
    or taken away; ``varied``: new data where a formula must still hold)."""

    case: Case
    spec: Spec
    role: str


@dataclass
class Probe:
    mistake: str
    kind: str
    steps: list[Step] = field(default_factory=list)


# --- the cases a probe calls ------------------------------------------------------------------


def _channels(case: Case) -> int:
    return int(case.x.shape[-1]) if case.x.dim() else 1


def _leading(case: Case) -> tuple[int, ...]:
    return tuple(int(n) for n in case.x.shape[:-1])


def fresh(
    case: Case,
    g: torch.Generator,
    family: str = RANDOM,
    leading: tuple[int, ...] | None = None,
    channels: int | None = None,
    eps: float | None = None,
) -> Case:
    """A case like ``case`` (dtype, eps, shape), with new data of ``family`` and a new mask;
    the shape and eps changed where asked. Contiguous, clean padding, an upstream gradient."""
    leading = _leading(case) if leading is None else leading
    channels = _channels(case) if channels is None else channels
    eps = case.eps if eps is None else eps
    dtype = case.x.dtype
    if family == families.CONSTANT:
        x = families.constant_rows(g, leading, channels)
    elif family == families.ZEROS:
        x = families.zero_holding_rows(g, leading, channels)
    elif family == families.TIES and channels >= 3:
        x = families.tie_rows(g, leading, channels)
    elif family == families.EPS:
        x = families.eps_rows(g, leading, channels, eps)
    else:
        x = draws.rows(g, leading, channels)
    valid = families.mask_for(family, x, g, leading)
    label = describe_inputs(x, dtype, eps)
    return make_case(label, x, valid, draws.params(g, channels), eps, dtype, g, grad=True,
                     family=family)  # fmt: skip


def _contiguous_upstream(case: Case) -> Case:
    """``case`` with its upstream gradient's values in a contiguous tensor."""
    t = case.inputs()
    views = {k: v for k, v in case.views.items() if k != "grad_out"}
    return Case(case.label, case.x, case.valid, case.scale, case.bias, case.eps,
                t["grad_out"].contiguous().clone(), views, case.clean_x, case.directions,
                case.family)  # fmt: skip


def _padding_upstream_zeroed(case: Case) -> Case:
    t = case.inputs()
    grad_out = torch.where(t["valid"][..., None], t["grad_out"], 0.0).contiguous()
    views = {k: v for k, v in case.views.items() if k != "grad_out"}
    return Case(case.label, case.x, case.valid, case.scale, case.bias, case.eps, grad_out,
                views, case.clean_x, case.directions, case.family)  # fmt: skip


def _every_row_valid(case: Case, g: torch.Generator) -> Case:
    """``case`` (clean padding) with every row valid: the padding's rows become rows of data."""
    x = case.clean_x if case.clean_x is not None else case.x
    filled = draws.rows(g, _leading(case), _channels(case)).to(x.dtype)
    keep = case.valid[..., None] if case.valid.dim() else case.valid
    x = torch.where(keep, x, filled)
    return Case(case.label, x, torch.ones_like(case.valid), case.scale, case.bias, case.eps,
                case.grad_out, case.views, None, case.directions, case.family)  # fmt: skip


def _with_eps(case: Case, eps: float) -> Case:
    return Case(case.label, case.x, case.valid, case.scale, case.bias, eps, case.grad_out,
                case.views, case.clean_x, case.directions, case.family)  # fmt: skip


def _second_order_case(case: Case, g: torch.Generator) -> Case:
    """``case`` with directions for its second-order products (those it has, else new ones)."""
    if case.directions is None:
        channels = _channels(case)
        case.directions = {
            "x": torch.randn(case.x.shape, generator=g, dtype=torch.float64),
            "scale": torch.randn(channels, generator=g, dtype=torch.float64),
            "bias": torch.randn(channels, generator=g, dtype=torch.float64),
        }
    return case


def build_probe(mistake: str, case: Case, spec: Spec, seed: int, where: str) -> Probe | None:
    """The calls that confirm or refute ``mistake`` on the counterexample ``case`` (called as
    ``spec`` says), deterministic from ``seed`` and ``where`` (the clause and case), so that
    the grader's child and the grader build the same; None when it needs none (observed) or
    has none."""
    kind = KINDS.get(mistake)
    if kind is None or kind == OBSERVED:
        return None
    g = draws.generator(seed, f"confirm {mistake} {where}")
    probe = Probe(mistake, kind, [Step(case, spec, "again"), Step(case, spec, "again")])
    if spec.gradgradcheck:  # the products too: their error may say more than gradgradcheck's
        products = Spec(requires=GRAD_INPUTS, backward=True, second_order=True)
        probe.steps += [Step(case, products, "again"), Step(case, products, "again")]
    add = probe.steps.append
    channels, leading = _channels(case), _leading(case)
    out_only = Spec(style="positional", mode=spec.mode)
    grads = Spec(requires=GRAD_INPUTS, backward=True)
    if kind == FORMULA:
        longer = (*leading[:-1], leading[-1] + 3) if leading else (4,)
        add(Step(fresh(case, g), out_only, "varied"))
        add(Step(fresh(case, g, leading=longer), out_only, "varied"))
        add(Step(fresh(case, g, families.EPS, eps=0.1), out_only, "varied"))
        add(Step(fresh(case, g, channels=channels + 5), out_only, "varied"))
    elif kind in (PRECISION, GRADIENT_PRECISION, GRADIENT_FORMULA):
        how = out_only if kind == PRECISION else grads
        add(Step(fresh(case, g), how, "varied"))
        if kind == GRADIENT_PRECISION:
            add(Step(fresh(case, g, channels=channels + 5), how, "varied"))
    elif kind == ONE_PASS_KIND:
        # Offset enough that a one-pass variance loses most of its digits, not all of them:
        # at 1e4 +- 0.1 in float32 it is rounding noise, which a one-pass kernel need not
        # match (3% of draws unconfirmed; none of 300 at 300 +- 0.1).
        x = 300 + 0.1 * torch.randn(8, 64, generator=g, dtype=torch.float64)
        offset = make_case("offset rows", x, torch.ones(8, dtype=torch.bool),
                           draws.params(g, 64), 1e-5, case.x.dtype)  # fmt: skip
        add(Step(offset, out_only, "varied"))
    elif kind == FAMILY:
        _family_steps(probe, case, spec, g)
    elif kind == STALE:  # a shape no earlier call had (``where`` holds a salt of the grader's)
        # One of some 2,700 shapes, so that no earlier call in this process (an in-process
        # grade of the same function, a test suite's) likely had it: with 89 a stale cache
        # left by another grade of the same function sometimes held it already.
        rows, length = (int(torch.randint(0, n, (1,), generator=g)) for n in (30, 89))
        shape = (2 + rows, 11 + length)
        add(Step(fresh(case, g, leading=shape), out_only, "first"))
        add(Step(fresh(case, g, leading=shape), out_only, "second"))
    elif kind in (CUSTOM_BACKWARD, SECOND_ORDER_FORMULA):
        second = Spec(requires=GRAD_INPUTS, backward=True, second_order=True)
        again = Step(_second_order_case(case, g), second, "again")
        probe.steps[:2] = [again, again]
        if kind == SECOND_ORDER_FORMULA:
            add(Step(_second_order_case(fresh(case, g), g), second, "varied"))
    elif kind == PADDING_UPSTREAM:
        add(Step(_padding_upstream_zeroed(case), grads, "removed"))
    elif kind in (EPS_UNUSED, PADDING_NAN):
        rows = fresh(case, g, families.EPS, eps=0.1)
        add(Step(rows, out_only, "eps"))
        add(Step(_with_eps(rows, 1.0), out_only, "eps"))
        if kind == PADDING_NAN:
            add(Step(_every_row_valid(case, g), grads, "removed"))
    for step in probe.steps:
        if step.spec.second_order:
            _second_order_case(step.case, g)
    return probe


def _family_steps(probe: Probe, case: Case, spec: Spec, g: torch.Generator) -> None:
    """Kept: the condition on new data; removed: the same without it."""
    family = FAMILY_OF_CAUSE[probe.mistake]
    channels = _channels(case)
    how = spec if spec.backward else Spec(mode=spec.mode)
    add = probe.steps.append
    if family == families.ONE_CHANNEL:
        add(Step(fresh(case, g, channels=1), how, "kept"))
        add(Step(fresh(case, g, channels=2), how, "removed"))
        add(Step(fresh(case, g, channels=3), how, "removed"))
    elif family == families.PRIME:
        add(Step(fresh(case, g, channels=11), how, "kept"))
        add(Step(fresh(case, g, channels=192), how, "removed"))
    elif family == families.UPSTREAM:
        add(Step(_contiguous_upstream(case), how, "removed"))
    elif family == families.EPS:
        add(Step(fresh(case, g, families.EPS, eps=1e-3), how, "removed"))
        add(Step(fresh(case, g, families.EPS, eps=0.1), how, "removed"))
    else:  # constant rows, exact zeros, exact ties: C as it was (C = 1 is always constant)
        kept = fresh(case, g, family) if channels > 1 else fresh(case, g, channels=1)
        add(Step(kept, how, "kept"))
        add(Step(fresh(case, g, channels=max(channels, 2)), how, "removed"))


# --- running a probe (where the function is) --------------------------------------------------


BALLAST = 20_000
"""Objects made before the first probe (:func:`keeper`): they take the addresses freed by the
clauses' calls, so that a probe's inputs have ids no earlier tensor had."""


def keeper() -> list[Any]:
    """Where probes keep what they made alive, for one grade: every input of every probe call
    (no later input reuses its address, or its id), and a ballast made first."""
    return [torch.empty(0) for _ in range(BALLAST)]


def run_probe(fn: Fn, probe: Probe, device: str, kept: list[Any] | None = None) -> ClauseRun:
    """Each step's call, its tensors and facts under its index (as a clause's run). The new
    tensors of each call are kept alive in ``kept`` (:func:`keeper`), so that no input reuses
    an address, or an id, an earlier tensor had: a cache keyed by id(x) misses."""
    from maskln_cli.grading.clauses.gradients import second_order_products

    kept = keeper() if kept is None else kept
    run = ClauseRun()
    for index, step in enumerate(probe.steps):
        key = str(index)
        try:
            if step.spec.gradgradcheck and step.role == "again":
                announce(f"{step.case.label}, gradgradcheck (a cause confirmed)")
                _gradgradcheck(fn, step.case, device)
                run.meta[key] = {"custom": []}
                continue
            if step.spec.second_order:
                announce(f"{step.case.label}, second-order products (a cause confirmed)")
                found, names = second_order_products(fn, step.case, device, kept)
                run.tensors.update({f"{key}.{n}": t for n, t in found.items()})
                run.meta[key] = {"custom": names}
                continue
            call = Call(key, index, style=step.spec.style, requires=step.spec.requires,
                        backward=step.spec.backward, mode=step.spec.mode,
                        clean=step.spec.clean)  # fmt: skip
            tensors, meta = perform(fn, step.case, call, device, keep=kept)
        except CAUGHT as error:
            run.errors[key] = describe_exception(error)
            continue
        run.meta[key] = meta
        run.tensors.update({f"{key}.{n}": t for n, t in tensors.items()})
    return run


def _gradgradcheck(fn: Fn, case: Case, device: str) -> None:
    """gradgradcheck of the function on ``case``, as the second_order clause runs it (raises
    what it raises)."""
    t = case.inputs(device)
    inputs = tuple(t[n].requires_grad_() for n in GRAD_INPUTS)

    def function(x, scale, bias):
        return fn(x, t["valid"].clone(), scale, bias, case.eps)

    torch.autograd.gradgradcheck(function, inputs, fast_mode=True)


# --- judging a probe -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """Whether the probe confirmed the suspected cause; when it did not, a cause it showed
    instead (the same inputs right when given again: a result from an earlier call)."""

    confirmed: bool
    alternative: Diagnosis | None = None


def _reference(step: Step) -> torch.Tensor:
    case = step.case
    t = case.inputs(clean=step.spec.clean)
    with torch.no_grad():
        return correct_formula()(t["x"].double(), t["valid"], t["scale"].double(),
                                 t["bias"].double(), case.eps)  # fmt: skip


def _output_right(step: Step, run: ClauseRun, key: str) -> bool:
    """Whether the step's output is right: in x's dtype, and within its tolerance."""
    out = run.tensors.get(f"{key}.out")
    if out is None or out.dtype != step.case.x.dtype:
        return False
    return value_mismatch(out, _reference(step), step.case.x.dtype) is None


def right(step: Step, run: ClauseRun, key: str) -> bool:
    """Whether the step's call ran and gave the right output (and gradients, or second-order
    products)."""
    if step.spec.gradgradcheck and step.role == "again":
        return key not in run.errors and key in run.meta
    if key in run.errors or not _output_right(step, run, key):
        return False
    if step.spec.second_order:
        from maskln_cli.grading.clauses.gradients import reference_second_order

        for name, reference in reference_second_order(step.case).items():
            actual = run.tensors.get(f"{key}.{name}")
            if actual is None or grad_mismatch(actual, reference, torch.float64) is not None:
                return False
        return True
    if step.spec.backward:
        expected = reference_gradients(step.case, step.spec.requires)
        for name, reference in expected.items():
            actual = run.tensors.get(f"{key}.{name}")
            if actual is None or grad_mismatch(actual, reference, step.case.x.dtype) is not None:
                return False
    return True


def judge_probe(probe: Probe, run: ClauseRun) -> Outcome:
    """Whether ``run`` (the probe's calls) confirms the probe's mistake."""
    if run.failure is not None:
        return Outcome(False)
    if any(right(step, run, key) for key, step in _steps(probe, "again")):
        return Outcome(False, RESULT_FROM_EARLIER_CALL)  # the counterexample, given again, is right
    judge = JUDGES.get(probe.kind)
    try:
        return Outcome(bool(judge and judge(probe, run)))
    except (RuntimeError, TypeError, ValueError, KeyError, IndexError):
        return Outcome(False)


def _steps(probe: Probe, *roles: str) -> list[tuple[str, Step]]:
    return [(str(i), s) for i, s in enumerate(probe.steps) if s.role in roles]


def _inputs64(step: Step) -> tuple[Any, ...]:
    t = step.case.inputs(clean=step.spec.clean)
    return t["x"].double(), t["valid"], t["scale"].double(), t["bias"].double(), step.case.eps


def _formula_holds(probe: Probe, run: ClauseRun) -> bool:
    mistake = formulas().get(probe.mistake)
    if mistake is None:  # another exercise's formula
        return False
    distinguishing = 0
    for key, step in _steps(probe, "again", "varied"):
        if key in run.errors:
            return False
        out = run.tensors[f"{key}.out"]
        args = _inputs64(step)
        with torch.no_grad():
            expected = mistake.formula(*args)
        if value_mismatch(expected, correct_formula()(*args), step.case.x.dtype) is None:
            if not _output_right(step, run, key):
                return False  # the formula is right here, the function is not
            continue
        distinguishing += 1
        found = diagnose_formulas(out, *args[:4], args[4], out.dtype,
                                  mistakes={mistake.name: mistake})  # fmt: skip
        if mistake.name not in {d.mistake for d in found}:
            return False
    return distinguishing >= 2


def _precision_holds(probe: Probe, run: ClauseRun) -> bool:
    for key, step in _steps(probe, "again", "varied"):
        out = run.tensors.get(f"{key}.out")
        if out is None:
            return False
        t = step.case.inputs(clean=step.spec.clean)
        found = diagnose_precision(out, t["x"], t["valid"], t["scale"], t["bias"], step.case.eps)
        names = {d.mistake for d in found}
        if probe.mistake not in names:
            return False
    return True


def _one_pass_holds(probe: Probe, run: ClauseRun) -> bool:
    (key, step), *_ = _steps(probe, "varied")
    out = run.tensors.get(f"{key}.out")
    if out is None:
        return False
    args = _inputs64(step)
    found = diagnose_output(out, *args[:4], args[4], out.dtype, mistakes={})
    return ONE_PASS.name in {d.mistake for d in found}


def _gradient_precision_holds(probe: Probe, run: ClauseRun) -> bool:
    low, high = FLOAT32_GRADIENT_ERROR
    for key, step in _steps(probe, "again", "varied"):
        if not _output_right(step, run, key) or step.case.x.dtype != torch.float64:
            return False
        expected = reference_gradients(step.case, step.spec.requires)
        errors = []
        for name, reference in expected.items():
            actual = run.tensors.get(f"{key}.{name}")
            if actual is None:
                return False
            size = float(reference.norm()) or 1.0
            errors.append(float((actual.double() - reference).norm()) / size)
        if not (max(errors) > low and max(errors) <= high):
            return False
    return True


def _family_holds(probe: Probe, run: ClauseRun) -> bool:
    kept = _steps(probe, "kept", "again")
    removed = _steps(probe, "removed")
    return all(not right(s, run, k) for k, s in kept) and all(right(s, run, k) for k, s in removed)


def _stale_holds(probe: Probe, run: ClauseRun) -> bool:
    (first_key, first), (second_key, second) = _steps(probe, "first", "second")
    return right(first, run, first_key) and not right(second, run, second_key)


def _rerun_holds(probe: Probe, run: ClauseRun) -> bool:
    """The same cause raised again by every re-run of one way of calling (gradgradcheck, or
    the second-order products, for second_order)."""
    ways: dict[bool, list[bool]] = {}
    for key, step in _steps(probe, "again"):
        found = explain_exception(run.errors.get(key))
        same = found is not None and found.mistake == probe.mistake
        ways.setdefault(step.spec.gradgradcheck, []).append(same)
    return any(all(each) for each in ways.values())


def _custom_backward_holds(probe: Probe, run: ClauseRun) -> bool:
    return bool(run.meta.get("0", {}).get("custom"))


def _second_order_formula_holds(probe: Probe, run: ClauseRun) -> bool:
    from maskln_cli.grading.clauses.gradients import reference_second_order

    for key, step in _steps(probe, "again", "varied"):
        if key in run.errors:
            return False
        expected = reference_second_order(step.case, mean_detached_formula)
        truth = reference_second_order(step.case)
        differs = False
        for name, reference in expected.items():
            actual = run.tensors.get(f"{key}.{name}")
            if actual is None or grad_mismatch(actual, reference, torch.float64) is not None:
                return False
            differs |= grad_mismatch(reference, truth[name], torch.float64) is not None
        if not differs:
            return False
    return True


def _gradient_formula_holds(probe: Probe, run: ClauseRun) -> bool:
    for key, step in _steps(probe, "again", "varied"):
        actual = run.tensors.get(f"{key}.grad_x")
        if actual is None:
            return False
        reference = reference_gradients(step.case, ("x",))["grad_x"]
        found = detached_match(step.case, actual.double(), reference)
        if probe.mistake not in {d.mistake for d in found}:
            return False
    return True


def _padding_upstream_holds(probe: Probe, run: ClauseRun) -> bool:
    step = probe.steps[0]
    t = step.case.inputs()
    expected = reference_gradients(step.case, step.spec.requires)
    name = "grad_bias" if probe.mistake == "padding_in_grad_bias" else "grad_x"
    actual = run.tensors.get(f"0.{name}")
    if actual is None or name not in expected:
        return False
    found = gradient_pattern(name, actual, expected[name], t["valid"], t.get("grad_out"),
                             _output_right(step, run, "0"), step.case.x.dtype)  # fmt: skip
    (key, removed), *_ = _steps(probe, "removed")
    return found is not None and found.mistake == probe.mistake and right(removed, run, key)


def _eps_unused(probe: Probe, run: ClauseRun) -> bool:
    (one, _), (other, _) = _steps(probe, "eps")
    a, b = run.tensors.get(f"{one}.out"), run.tensors.get(f"{other}.out")
    if a is None or b is None or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())  # the same, NaN where NaN


def _padding_nan_holds(probe: Probe, run: ClauseRun) -> bool:
    again = run.tensors
    leaked = any(
        not bool(t.isfinite().all()) for name, t in again.items() if name.startswith("0.grad_")
    )
    (key, removed), *_ = _steps(probe, "removed")
    return leaked and right(removed, run, key) and not _eps_unused(probe, run)


JUDGES: dict[str, Callable[[Probe, ClauseRun], bool]] = {
    FORMULA: _formula_holds,
    PRECISION: _precision_holds,
    ONE_PASS_KIND: _one_pass_holds,
    GRADIENT_PRECISION: _gradient_precision_holds,
    FAMILY: _family_holds,
    STALE: _stale_holds,
    RERUN: _rerun_holds,
    CUSTOM_BACKWARD: _custom_backward_holds,
    SECOND_ORDER_FORMULA: _second_order_formula_holds,
    GRADIENT_FORMULA: _gradient_formula_holds,
    PADDING_UPSTREAM: _padding_upstream_holds,
    EPS_UNUSED: _eps_unused,
    PADDING_NAN: _padding_nan_holds,
}
"""How each kind of probe is judged: whether the cause holds."""
