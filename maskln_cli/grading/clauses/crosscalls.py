"""The clauses that check calls against each other and against what is around them (issue 32,
item 2), all required: a function's result is its own, every call.

- ``deterministic``: the same inputs give the same bits, call after call, and on another number
  of threads (``torch.set_num_threads``): outputs and gradients;
- ``no_shared_results``: the result of a call is not changed by a later call, and shares no
  storage with the inputs or with another call's result;
- ``no_global_effects``: torch's global state is the same after a call (default dtype and
  device, deterministic algorithms, grad mode, threads, anomaly mode, autocast, print options,
  float32 matmul precision, flush-denormal); the random state is ``no_reinit``'s. Calls are
  made in the usual state and in an unusual one (:func:`.state.unusual_state`), so that a
  function that "restores" torch's defaults rather than what it found is seen;
- ``no_hooks_left``: no hook, attribute or ``.grad`` is left on the caller's tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from maskln_cli.grading.clauses import draws, families
from maskln_cli.grading.clauses.calls import (
    CAUGHT,
    GRAD_INPUTS,
    ClauseRun,
    Fn,
    Misbehaved,
    announce,
    checked_output,
    describe_exception,
    export_tensor,
    invoke,
    requiring_grad_words,
    weighted_sum,
)
from maskln_cli.grading.clauses.cases import Case, describe_inputs, make_case
from maskln_cli.grading.clauses.clause import make_clause
from maskln_cli.grading.clauses.judging import PASSED, Verdict, format_pair, unravel
from maskln_cli.grading.clauses.rows import UNINITIALIZED
from maskln_cli.grading.clauses.state import (
    UNUSUAL_THREADS,
    global_state,
    preserved_state,
    restore,
    state_changes,
    unusual_state,
)
from maskln_cli.op.mistakes import Diagnosis

# deterministic ------------------------------------------------------------------------------------

THREAD_COUNTS = (1, 1, 1, 3, 3)
"""torch's thread count for each repetition of a call: three on one thread, two on three."""
DETERMINISM_SHAPES = (
    (families.RANDOM, (4, 48), 96, torch.float32),
    (families.RANDOM, (3, 40), 64, torch.float64),
    (families.PRIME, (5, 30), 31, torch.float32),
    (families.ONE_CHANNEL, (6, 20), 1, torch.float64),
)
"""(family, leading shape, C, dtype): small enough (under 32,768 elements) that torch's own
reductions run on one thread whatever the thread count, so a correct function gives the
same bits; long enough rows that an order of summation that changes shows."""

NOT_DETERMINISTIC = Diagnosis(
    "not_deterministic",
    "the same inputs give other bits from call to call: sums added in an order that changes"
    " (partial sums added as threads complete, a block size tuned at run time or chosen by"
    " the number of threads, random numbers)",
    "add partial sums in a fixed order that depends on nothing but the shape (torch's own"
    " reductions do): no completion order, timing, thread count or randomness",
    0.0,
)


def _determinism_cases(seed: int) -> list[Case]:
    g = draws.generator(seed, "deterministic")
    cases = []
    for family, leading, channels, dtype in DETERMINISM_SHAPES:
        x = draws.rows(g, leading, channels)
        eps = families.eps_for(family, dtype)
        label = describe_inputs(x, dtype, eps)
        cases.append(
            make_case(label, x, draws.mask(g, leading), draws.params(g, channels), eps, dtype,
                      g, grad=True, family=family)
        )  # fmt: skip
    return cases


def _with_threads(count: int) -> Any:
    class Threads:
        def __enter__(self) -> None:
            self.saved = torch.get_num_threads()
            torch.set_num_threads(count)

        def __exit__(self, *exc: object) -> None:
            torch.set_num_threads(self.saved)

    return Threads()


def _one_result(fn: Fn, case: Case, device: str, grad: bool) -> dict[str, torch.Tensor]:
    """The output (and, with ``grad``, the gradients of x, scale and bias) of one call."""
    t = case.inputs(device)
    if grad:
        for name in GRAD_INPUTS:
            t[name].requires_grad_()
        out = checked_output(invoke(fn, t, case.eps, "positional"))
        leaves = [t[name] for name in GRAD_INPUTS]
        grads = torch.autograd.grad(weighted_sum(out, t), leaves, allow_unused=True)
        found = {"out": export_tensor(out)}
        for name, value in zip(GRAD_INPUTS, grads, strict=True):
            if value is not None:
                found[f"grad_{name}"] = export_tensor(value)
        return found
    with torch.no_grad():
        return {"out": export_tensor(checked_output(invoke(fn, t, case.eps, "positional")))}


def _determinism_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = ClauseRun()
    for i, case in enumerate(cases):
        announce(f"{case.label}, the same call repeated, on 1 and 3 threads")
        for repeat, threads in enumerate(THREAD_COUNTS):
            for grad in (False, True):
                key = f"{i}.{repeat}.{'grad' if grad else 'no_grad'}"
                try:
                    with _with_threads(threads):
                        found = _one_result(fn, case, device, grad)
                except CAUGHT as error:
                    run.errors[key] = describe_exception(error)
                    continue
                run.tensors.update({f"{key}.{name}": t for name, t in found.items()})
                run.meta[key] = {"threads": threads}
    return run


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _determinism_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for i, case in enumerate(cases):
        for grad in ("no_grad", "grad"):
            first = f"{i}.0.{grad}"
            if first in run.errors:
                return Verdict(False, f"{case.label}: {run.errors[first]}")
            for repeat, threads in enumerate(THREAD_COUNTS[1:], 1):
                key = f"{i}.{repeat}.{grad}"
                if key in run.errors:
                    return Verdict(False, f"{case.label}: {run.errors[key]}")
                for name in ("out", "grad_x", "grad_scale", "grad_bias"):
                    a = run.tensors.get(f"{first}.{name}")
                    b = run.tensors.get(f"{key}.{name}")
                    if a is None and b is None:
                        continue
                    if a is None or b is None or not _same_bits(a, b):
                        return _differs(case, name, a, b, repeat, threads, grad == "grad")
    return PASSED


def _differs(
    case: Case,
    name: str,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    repeat: int,
    threads: int,
    grad: bool,
) -> Verdict:
    how = f"call {repeat + 1} ({threads} thread{'s' if threads > 1 else ''})"
    what = requiring_grad_words() if grad else ", without grad"
    if a is None or b is None or a.shape != b.shape:
        return Verdict(False, f"{case.label}{what}: {name} came back in one call, not the other")
    differ = ~((a == b) | (a.isnan() & b.isnan()))
    index = unravel(int(differ.reshape(-1).double().argmax()), a.shape)
    pair = format_pair(b[tuple(index)], a[tuple(index)], a.dtype).replace(
        "the reference gives", "call 1 (1 thread) gave"
    )
    detail = (
        f"{case.label}{what}: the same inputs gave other bits in {how}: {name} at {index} {pair}"
    )
    diagnosis = NOT_DETERMINISTIC
    if (
        name == "out"
        and a.shape == case.invalid().shape
        and not bool(differ[~case.invalid()].any())
    ):
        diagnosis = UNINITIALIZED  # only the invalid rows differ: whatever memory held
    return Verdict(False, detail, [diagnosis])


DETERMINISTIC = make_clause(
    "deterministic",
    "required",
    "the same inputs give the same bits, outputs and gradients, call after call and on 1 and"
    " 3 threads",
    _determinism_cases,
    run=_determinism_run,
    judge=_determinism_judge,
)


# no_shared_results ------------------------------------------------------------------------------

SHARED_RESULT = Diagnosis(
    "shared_result",
    "results shared between calls: the output is a buffer kept between calls (a global, an"
    " lru_cache, an object's attribute) or a view of an input, so a later call, or a write to"
    " an input, changes a result the caller holds",
    "return a new tensor from every call (torch.empty_like(x), or the result of the last"
    " operation); keep nothing between calls",
    0.0,
)
SHARING_MODES = (
    ("no_grad", "under torch.no_grad()"),
    ("inference", "under torch.inference_mode()"),
    ("grad", "x, scale and bias requiring grad"),
)


def _sharing_cases(seed: int) -> list[Case]:
    """Pairs of cases of one shape and dtype, with other values: a buffer reused by the second
    call of a pair changes the first call's result."""
    g = draws.generator(seed, "no_shared_results")
    cases = []
    for family, leading, channels, dtype in (
        (families.RANDOM, (2, 5), 8, torch.float32),
        (families.RANDOM, (3, 4), 6, torch.float64),
        (families.ONE_CHANNEL, (3, 4), 1, torch.float64),
        (families.PRIME, (2, 3), 7, torch.float32),
    ):
        for _ in range(2):
            x = draws.rows(g, leading, channels)
            valid = torch.ones(leading, dtype=torch.bool) if family == families.ONE_CHANNEL \
                else draws.mask(g, leading)  # fmt: skip
            eps = families.eps_for(family, dtype)
            label = describe_inputs(x, dtype, eps)
            cases.append(make_case(label, x, valid, draws.params(g, channels), eps, dtype,
                                   family=family))  # fmt: skip
    return cases


def _call_in(fn: Fn, case: Case, device: str, mode: str) -> tuple[torch.Tensor, dict[str, Any]]:
    t = case.inputs(device)
    if mode == "grad":
        for name in GRAD_INPUTS:
            t[name].requires_grad_()
        return checked_output(invoke(fn, t, case.eps, "positional")), t
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        return checked_output(invoke(fn, t, case.eps, "positional")), t


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else -1


def _sharing_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = ClauseRun()
    for pair in range(0, len(cases), 2):
        first, second = cases[pair], cases[pair + 1]
        for mode, _ in SHARING_MODES:
            key = f"{pair}.{mode}"
            announce(f"{first.label}, then another call of the same shape, {mode}")
            try:
                out, inputs = _call_in(fn, first, device, mode)
                held = export_tensor(out)
                shares = [name for name in ("x", "valid", "scale", "bias")
                          if _storage(out) == _storage(inputs[name]) != -1]  # fmt: skip
                later, _ = _call_in(fn, second, device, mode)
                run.tensors[f"{key}.held"] = held
                run.tensors[f"{key}.after"] = export_tensor(out)
                run.meta[key] = {
                    "shares": shares,
                    "same_storage": _storage(out) == _storage(later) != -1,
                }
            except CAUGHT as error:
                run.errors[key] = describe_exception(error)
    return run


def _sharing_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for pair in range(0, len(cases), 2):
        case = cases[pair]
        for mode, words in SHARING_MODES:
            key = f"{pair}.{mode}"
            if key in run.errors:
                return Verdict(False, f"{case.label}, {words}: {run.errors[key]}")
            facts = run.meta.get(key)
            if not isinstance(facts, dict):
                raise Misbehaved("no record of the calls came back")
            held, after = run.tensor(key, "held"), run.tensor(key, "after")
            if not _same_bits(held, after):
                differ = ~((held == after) | (held.isnan() & after.isnan()))
                index = unravel(int(differ.reshape(-1).double().argmax()), held.shape)
                detail = (
                    f"{case.label}, {words}: a later call changed this call's result: at"
                    f" {index} {float(held[tuple(index)]):.7g} became"
                    f" {float(after[tuple(index)]):.7g}"
                )
                return Verdict(False, detail, [SHARED_RESULT])
            if facts.get("same_storage"):
                detail = f"{case.label}, {words}: two calls returned the same storage"
                return Verdict(False, detail, [SHARED_RESULT])
            shares = facts.get("shares") or []
            if shares:
                detail = (
                    f"{case.label}, {words}: the result shares its storage with the input"
                    f" {', '.join(map(str, shares))}"
                )
                return Verdict(False, detail, [SHARED_RESULT])
    return PASSED


NO_SHARED_RESULTS = make_clause(
    "no_shared_results",
    "required",
    "a later call does not change an earlier call's result; a result shares no storage with"
    " the inputs or another call's (without grad, under inference_mode, with grad)",
    _sharing_cases,
    run=_sharing_run,
    judge=_sharing_judge,
)


# no_global_effects --------------------------------------------------------------------------------

GLOBAL_STATE_CHANGED = Diagnosis(
    "global_state_changed",
    "torch's global state changed by the call and left so (torch.set_default_dtype,"
    " use_deterministic_algorithms, set_grad_enabled, set_num_threads, set_detect_anomaly,"
    " autocast, set_printoptions): every later computation of the caller changes with it",
    "change no global setting: give dtypes explicitly (dtype=x.dtype), use context managers"
    " (torch.no_grad(), torch.autocast(...)) that restore what they found",
    0.0,
)


PHASES = (
    ("no-grad forward", "no_grad", False),
    ("inference-mode forward", "inference", False),
    ("forward with grad enabled and no input requiring grad", "grad", False),
    ("forward", "grad", True),
)
"""(phase, the caller's grad mode, whether x, scale and bias require grad) of each call of
:func:`_probe_phases`: every grad mode a caller calls in."""


def _probe_phases(
    fn: Fn, case: Case, device: str, check: Callable[[str, dict[str, Any]], None]
) -> None:
    """A call in each of :data:`PHASES`, and the backward of the last; ``check(phase,
    expected)`` right after each call, inside the caller's context (a ``torch.no_grad()`` block
    puts grad mode back on exit, hiding a function that left it on), against the state read in
    that context just before the call."""
    for phase, mode, requires in PHASES:
        t = case.inputs(device)
        if requires:
            for name in GRAD_INPUTS:
                t[name].requires_grad_()
        with _caller_mode(mode):
            expected = global_state()
            out = checked_output(invoke(fn, t, case.eps, "positional"))
            check(phase, expected)
    if out.requires_grad:
        expected = global_state()
        leaves = [t[name] for name in GRAD_INPUTS]
        torch.autograd.grad(weighted_sum(out, t), leaves, allow_unused=True)
        check("backward", expected)


def _caller_mode(mode: str) -> Any:
    if mode == "no_grad":
        return torch.no_grad()
    if mode == "inference":
        return torch.inference_mode()
    return torch.enable_grad()


def _effects_cases(seed: int, clause: str = "no_global_effects") -> list[Case]:
    g = draws.generator(seed, clause)
    cases = []
    for dtype in (torch.float32, torch.float64):
        x = draws.rows(g, (2, 5), 8)
        label = describe_inputs(x, dtype, 1e-5)
        cases.append(
            make_case(label, x, draws.mask(g, (2, 5)), draws.params(g, 8), 1e-5, dtype, g, True)
        )
    return cases + families.family_cases(
        g, grad=True, families=(families.ONE_CHANNEL, families.PRIME), dtypes=(torch.float64,)
    )


def _effects_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = ClauseRun()
    for i, case in enumerate(cases):
        for where, context in (("usual", preserved_state), ("unusual", unusual_state)):
            key = f"{i}.{where}"
            announce(f"{case.label}, a no-grad forward, a forward and its backward ({where})")
            changes: list[str] = []
            with context():

                def check(
                    phase: str, expected: dict[str, Any], changes: list[str] = changes
                ) -> None:
                    found = state_changes(expected, global_state())
                    changes.extend(f"{change} (in the {phase})" for change in found)
                    restore(expected)  # judge each phase on its own

                try:
                    _probe_phases(fn, case, device, check)
                except CAUGHT as error:
                    if where == "usual" and not changes:
                        run.errors[key] = describe_exception(error)
                    # in the unusual state a correct function may fail: only changes count
            run.meta[key] = {"changes": changes[:6]}
    return run


def _effects_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for i, case in enumerate(cases):
        for where in ("usual", "unusual"):
            key = f"{i}.{where}"
            if key in run.errors:
                return Verdict(False, f"{case.label}: {run.errors[key]}")
            changes = run.meta.get(key, {}).get("changes")
            if not isinstance(changes, list):
                raise Misbehaved("no record of torch's global state came back")
            if changes:
                state = (
                    f" (called with a default dtype of float64, {UNUSUAL_THREADS} threads, other"
                    " print options)"
                )
                detail = f"{case.label}{state if where == 'unusual' else ''}: torch's global state"
                detail += f" changed: {'; '.join(map(str, changes))}"
                return Verdict(False, detail, [GLOBAL_STATE_CHANGED])
    return PASSED


NO_GLOBAL_EFFECTS = make_clause(
    "no_global_effects",
    "required",
    "torch's global state is the same after a call: default dtype and device, deterministic"
    " algorithms, grad mode, threads, anomaly mode, autocast, print options, matmul precision",
    _effects_cases,
    run=_effects_run,
    judge=_effects_judge,
)


# no_hooks_left ------------------------------------------------------------------------------------

HOOKS_LEFT = Diagnosis(
    "hooks_left",
    "hooks or attributes left on the caller's tensors (register_hook, an attribute set on x or"
    " valid, .grad filled by a backward inside the call): they act on every later use of them",
    "leave the inputs as they came: no register_hook on them (a custom autograd.Function"
    " shapes its own gradients), no attributes, no .backward() inside the op",
    0.0,
)
WATCHED = ("x", "valid", "scale", "bias", "grad_out")


def _traces(t: torch.Tensor) -> dict[str, Any]:
    """What a function could leave on a tensor."""
    hooks = getattr(t, "_backward_hooks", None) or {}
    post = getattr(t, "_post_accumulate_grad_hooks", None) or {}
    return {
        "hooks": len(hooks),
        "post-accumulate-grad hooks": len(post),
        "attributes": sorted(vars(t)) if hasattr(t, "__dict__") else [],
        ".grad": t.grad is not None if t.is_leaf else False,
        "retains_grad": bool(t.retains_grad),
    }


def _hooks_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    run = ClauseRun()
    for i, case in enumerate(cases):
        announce(f"{case.label}, a no-grad forward, a forward and its backward")
        left: list[str] = []
        try:
            for phase, grad in (("no-grad call", False), ("call with grad and its backward", True)):
                t = case.inputs(device)
                if grad:
                    for name in GRAD_INPUTS:
                        t[name].requires_grad_()
                before = {name: _traces(t[name]) for name in WATCHED}
                _one_call(fn, case, t, grad)
                for name in WATCHED:
                    after = _traces(t[name])
                    left += [
                        f"{name} {what} ({before[name][what]} -> {value})"
                        for what, value in after.items()
                        if value != before[name][what]
                    ]
                if left:
                    left = [f"{item} after the {phase}" for item in left]
                    break
        except CAUGHT as error:
            if not left:
                run.errors[str(i)] = describe_exception(error)
                continue
        run.meta[str(i)] = {"left": left[:6]}
    return run


def _one_call(fn: Fn, case: Case, t: dict[str, Any], grad: bool) -> None:
    if not grad:
        with torch.no_grad():
            checked_output(invoke(fn, t, case.eps, "positional"))
        return
    out = checked_output(invoke(fn, t, case.eps, "positional"))
    if out.requires_grad:
        leaves = [t[name] for name in GRAD_INPUTS]
        torch.autograd.grad(weighted_sum(out, t), leaves, allow_unused=True)


def _hooks_judge(cases: list[Case], run: ClauseRun) -> Verdict:
    for i, case in enumerate(cases):
        key = str(i)
        if key in run.errors:
            return Verdict(False, f"{case.label}: {run.errors[key]}")
        left = run.meta.get(key, {}).get("left")
        if not isinstance(left, list):
            raise Misbehaved("no record of the caller's tensors came back")
        if left:
            detail = f"{case.label}: left on the caller's tensors: {'; '.join(map(str, left))}"
            return Verdict(False, detail, [HOOKS_LEFT])
    return PASSED


NO_HOOKS_LEFT = make_clause(
    "no_hooks_left",
    "required",
    "no hook, attribute or .grad is left on the caller's tensors (x, valid, scale, bias, the"
    " upstream gradient)",
    lambda seed: _effects_cases(seed, "no_hooks_left"),
    run=_hooks_run,
    judge=_hooks_judge,
)
