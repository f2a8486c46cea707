"""The clauses on what a call must leave alone and must not use: no input changes (values,
shape, version counter), no ready-made normalization runs (:mod:`.recorders`), and neither
scale, bias nor the global random state is reinitialized.

Each calls the function in a forward without grad, a forward with grad and its backward:
no_mutation and no_reinit check what they watch after each (:func:`_probe`), raw_ops records
what runs in them.
"""

from __future__ import annotations

import contextlib
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
    Upstream,
    announce,
    checked_output,
    describe_exception,
    invoke,
    weighted_sum,
)
from maskln_cli.grading.clauses.cases import Case, describe_inputs, make_case
from maskln_cli.grading.clauses.clause import Judge, make_clause
from maskln_cli.grading.clauses.judging import PASSED, Verdict
from maskln_cli.grading.clauses.recorders import (
    GRADING_MASKLN,
    PythonRecorder,
    is_ready_made,
    op_recorders,
)
from maskln_cli.op.mistakes import MORE_MISTAKES, Diagnosis

# no_mutation --------------------------------------------------------------------------------------


def _probe_cases(seed: int, clause: str) -> list[Case]:
    g = draws.generator(seed, clause)
    cases = []
    for dtype in (torch.float32, torch.float64):
        x = draws.rows(g, (2, 5), 8)
        label = describe_inputs(x, dtype, 1e-5)
        cases.append(
            make_case(label, x, draws.mask(g, (2, 5)), draws.params(g, 8), 1e-5, dtype, g, True)
        )
    cases += families.family_cases(
        g,
        grad=True,
        families=(families.ONE_CHANNEL, families.CONSTANT, families.PRIME),
        dtypes=(torch.float64,),
    )
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


def _probe(fn: Fn, case: Case, device: str, start: Hook, check: Hook) -> None:
    """Two calls, each on fresh inputs: a forward without grad; then a forward with x, scale
    and bias requiring grad, and its backward, given the caller's ``grad_out`` itself (an
    input too, whose values and version must not change). ``start(phase, inputs)`` runs before
    each call, ``check(phase, inputs)`` after each phase ("no-grad forward", "forward",
    "backward")."""
    announce(f"{case.label}, a no-grad forward, a forward and its backward")
    t = case.inputs(device)
    start("no-grad forward", t)
    with torch.no_grad():
        checked_output(invoke(fn, t, case.eps, "positional"))
    check("no-grad forward", t)
    t = case.inputs(device)
    for name in GRAD_INPUTS:
        t[name].requires_grad_()
    start("forward", t)
    out = checked_output(invoke(fn, t, case.eps, "positional"))
    check("forward", t)
    if not out.requires_grad:
        names = list(GRAD_INPUTS)
        inputs = f"{', '.join(names[:-1])} and {names[-1]}"
        raise Misbehaved(f"the output does not require grad although {inputs} do")
    upstream = Upstream.apply(out, t["grad_out"]).sum()  # its gradient at out: grad_out itself
    torch.autograd.grad(upstream, [t[n] for n in GRAD_INPUTS], allow_unused=True)
    check("backward", t)


def _probe_run(
    fn: Fn,
    cases: list[Case],
    device: str,
    start: Callable[[], tuple[Hook, Inspect, dict[str, Any]]],
) -> ClauseRun:
    """Probe each case with the hooks ``start()`` makes (one to run before each call, one
    that returns the problems it sees after each phase, and a dict of facts they found); record
    the problems and facts found, or the error (unless problems came first: a mutated input can
    make the next call fail)."""
    run = ClauseRun()
    for i, case in enumerate(cases):
        problems: list[str] = []
        begin, check, facts = start()

        def found(phase: str, t: dict[str, torch.Tensor], check=check, problems=problems) -> None:
            problems.extend(check(phase, t))

        try:
            _probe(fn, case, device, begin, found)
        except CAUGHT as error:
            if not problems:
                run.errors[str(i)] = describe_exception(error)
                continue
        run.meta[str(i)] = {"problems": problems[:5], **facts}
    return run


def _constant(t: torch.Tensor) -> float | None:
    """The one value every element of ``t`` holds (a parameter reinitialized with
    ``nn.init.ones_``, ``zeros_`` or ``constant_``), or None."""
    flat = t.detach().reshape(-1)
    if not flat.numel() or not bool((flat == flat[0]).all()):
        return None
    return float(flat[0])


def _reinitialized(
    before: dict[str, dict[str, Any]], t: dict[str, torch.Tensor], facts: dict[str, Any]
) -> None:
    """Record in ``facts["reinitialized"]`` which of scale and bias now hold one value they did
    not hold before (``{"scale": 1.0}``)."""
    for name in ("scale", "bias"):
        old = before.get(name, {}).get("values")
        if old is None or torch.equal(t[name].detach(), old):
            continue
        value = _constant(t[name])
        if value is not None and _constant(old) != value:
            facts.setdefault("reinitialized", {})[name] = value


def _no_mutation_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    def start() -> tuple[Hook, Inspect, dict[str, Any]]:
        before: dict[str, Any] = {}
        facts: dict[str, Any] = {}

        def begin(phase: str, t: dict[str, torch.Tensor]) -> None:
            before.clear()
            before.update(_snapshot(t))

        def check(phase: str, t: dict[str, torch.Tensor]) -> list[str]:
            _reinitialized(before, t, facts)
            return _changes(before, t, phase)

        return begin, check, facts

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
                detail = f"{case.label}: {'; '.join(map(str, problems))}"
                found = reinitialized_diagnosis(run.meta.get(key, {}))
                return Verdict(False, detail, found or _problem_causes(problems))
        return PASSED

    return judge


INPUT_MUTATED = Diagnosis(
    "input_mutated",
    "an input written in place (x.masked_fill_, x.sub_, valid.unsqueeze_, grad_out.mul_):"
    " the caller's tensor changes, and every later use of it",
    "work on new tensors: torch.where(valid[..., None], x, 0.0), x - mean; never a method"
    " ending in _ on an input",
    0.0,
)
RANDOM_STATE_CHANGED = Diagnosis(
    "random_state_changed",
    "the global random state changed by the call (torch.manual_seed, or a draw from the"
    " global generator): every later random number of the caller changes",
    "draw nothing and seed nothing: the op needs no randomness (a torch.Generator of your own,"
    " if some helper must)",
    0.0,
)


def _problem_causes(problems: list[Any]) -> list[Diagnosis] | None:
    """The cause of a mutation or a changed random state, from the problems seen."""
    words = " ".join(map(str, problems))
    if "random state changed" in words:
        return [RANDOM_STATE_CHANGED]
    if "values changed" in words or "version counter" in words or "shape or strides" in words:
        return [INPUT_MUTATED]
    return None


def reinitialized_diagnosis(facts: dict[str, Any]) -> list[Diagnosis] | None:
    """The diagnosis of parameters reinitialized to one value each (``facts["reinitialized"]``,
    ``{"scale": 1.0, "bias": 0.0}``), or None."""
    found = facts.get("reinitialized")
    if not isinstance(found, dict) or not found:
        return None
    values = ", ".join(f"{name} to {value:g}" for name, value in found.items())
    mistake = MORE_MISTAKES["parameters_reinitialized"]
    return [
        Diagnosis(
            mistake.name,
            f"parameters reinitialized in the call ({values}: nn.init.ones_/zeros_ or"
            " .fill_() on them, or a fresh nn.LayerNorm's own)",
            mistake.fix,
            0.0,
        )
    ]


NO_MUTATION = make_clause(
    "no_mutation",
    "required",
    "no input's values, shape or version counter change, in forward or backward",
    lambda seed: _probe_cases(seed, "no_mutation"),
    run=_no_mutation_run,
    judge=_problems_judge("mutation"),
)


# raw_ops -----------------------------------------------------------------------------------------


def _raw_ops_run(fn: Fn, cases: list[Case], device: str) -> ClauseRun:
    """Record what runs in a no-grad forward, a forward and its backward: the ops, the torch
    functions and the Python functions (:class:`PythonRecorder`)."""
    RecordFunctions, RecordOps = op_recorders()
    maskln = GRADING_MASKLN.get()
    run = ClauseRun()
    for i, case in enumerate(cases):
        announce(f"{case.label}, a no-grad forward, a forward and its backward, recorded")
        try:
            python = PythonRecorder(allow_maskln=maskln)
            with RecordOps() as ops, RecordFunctions() as functions:
                with torch.no_grad():
                    t = case.inputs(device)
                    with python:
                        checked_output(invoke(fn, t, case.eps, "positional"))
                t = case.inputs(device)
                for name in GRAD_INPUTS:
                    t[name].requires_grad_()
                with python:
                    out = checked_output(invoke(fn, t, case.eps, "positional"))
            forward = ops.names | functions.names | python.names
            python = PythonRecorder(allow_maskln=maskln)
            with RecordOps() as ops:
                if out.requires_grad:
                    leaves = [t[n] for n in GRAD_INPUTS]
                    with python:  # a CPU backward runs on this thread
                        torch.autograd.grad(weighted_sum(out, t), leaves, allow_unused=True)
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
            detail = f"{case.label}: a ready-made normalization ran: {', '.join(found[:6])}"
            return Verdict(False, detail, [READY_MADE])
    return PASSED


READY_MADE = Diagnosis(
    "ready_made_normalization",
    "a ready-made normalization does the work (F.layer_norm, group_norm, batch_norm, rms_norm,"
    " or maskln's own op): the exercise asks for raw tensor operations",
    "compute the mean, the population variance and (x - mean) / sqrt(var + eps) yourself",
    0.0,
)


RAW_OPS = make_clause(
    "raw_ops",
    "required",
    "no ready-made normalization kernel runs, forward or backward",
    lambda seed: _probe_cases(seed, "raw_ops"),
    run=_raw_ops_run,
    judge=_raw_ops_judge,
)


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
    def start() -> tuple[Hook, Inspect, dict[str, Any]]:
        before: dict[str, Any] = {}
        facts: dict[str, Any] = {}

        def begin(phase: str, t: dict[str, torch.Tensor]) -> None:
            before["states"] = _rng_states(device)
            before["params"] = {n: {"values": t[n].detach().clone()} for n in ("scale", "bias")}

        def check(phase: str, t: dict[str, torch.Tensor]) -> list[str]:
            problems = []
            now = _rng_states(device)
            if not all(torch.equal(a, b) for a, b in zip(before["states"], now, strict=True)):
                problems.append(f"the global random state changed in the {phase}")
            _reinitialized(before["params"], t, facts)
            for name, old in before["params"].items():
                if not torch.equal(t[name].detach(), old["values"]):
                    value = _constant(t[name])
                    now_holds = f" (to all {value:g})" if value is not None else ""
                    problems.append(f"{name} was reinitialized in the {phase}{now_holds}")
            return problems

        return begin, check, facts

    with _distinct_random_state(len(cases), device):
        return _probe_run(fn, cases, device, start)


NO_REINIT = make_clause(
    "no_reinit",
    "required",
    "scale, bias and the global random state are unchanged by a call",
    lambda seed: _probe_cases(seed, "no_reinit"),
    run=_no_reinit_run,
    judge=_problems_judge("random state"),
)
