"""How each cause is confirmed (issue 38, item 4), by enumeration: every cause the grader can
name has a way to be confirmed (maskln_cli.grading.confirm.KINDS), every probe is built the same
twice (the grader's child and the grader build it apart), and a correct function confirms none
of them: a cause is named only when its test holds. In process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from maskln_cli.grading import confirm
from maskln_cli.grading.clauses import CLAUSES, families
from maskln_cli.grading.clauses.catalogue import EVERY_FORMULA
from maskln_cli.grading.clauses.causes import EXCEPTION_CAUSES, FAMILY_CAUSES
from maskln_cli.op.mistakes import NEGATIVE_ZERO, ONE_PASS, PRECISION_MISTAKES
from tests.solutions.correct import masked_layer_normalization as correct

GRADING = Path(confirm.__file__).parent


def nameable() -> set[str]:
    """Every cause a grade can name: the catalogues (LayerNorm's and RMSNorm's), and each
    Diagnosis or Cause the grading package writes."""
    names = {*EVERY_FORMULA, *PRECISION_MISTAKES, ONE_PASS.name, NEGATIVE_ZERO.name}
    names |= {c.mistake for c in EXCEPTION_CAUSES} | {c.mistake for c in FAMILY_CAUSES.values()}
    pattern = re.compile(r'(?:Diagnosis\(|_diagnosis\(|Cause\(\s*"",)\s*"([a-z_0-9]+)"')
    for path in GRADING.rglob("*.py"):
        names |= set(pattern.findall(path.read_text()))
    names |= {"nan_without_padding", "statistics_detached", "mean_detached", "variance_detached"}
    return names


def test_every_cause_the_grader_can_name_has_a_way_to_be_confirmed():
    missing = sorted(nameable() - set(confirm.KINDS))
    assert not missing, missing
    assert set(confirm.JUDGES) | {confirm.OBSERVED} == set(confirm.KINDS.values())
    for name, kind in confirm.KINDS.items():
        if kind == confirm.FAMILY:
            assert name in confirm.FAMILY_OF_CAUSE, name


def _counterexample(kind: str):
    clause = "second_order" if kind in (confirm.CUSTOM_BACKWARD, confirm.SECOND_ORDER_FORMULA) \
        else "gradients"  # fmt: skip
    cases = CLAUSES[clause].build(0)
    index = next(i for i, c in enumerate(cases) if c.family == "random rows")
    spec = confirm.Spec.of(clause, None, "grad_x at [0]" if clause == "gradients" else "")
    return clause, cases[index], spec


PROBED = sorted(name for name, kind in confirm.KINDS.items() if kind != confirm.OBSERVED)


@pytest.mark.parametrize("mistake", PROBED)
def test_a_probe_is_built_the_same_twice_and_a_correct_function_confirms_none(mistake):
    clause, case, spec = _counterexample(confirm.KINDS[mistake])
    first = confirm.build_probe(mistake, case, spec, 0, f"{clause} 0 7")
    again = confirm.build_probe(mistake, case, spec, 0, f"{clause} 0 7")
    assert first is not None and len(first.steps) == len(again.steps) >= 2
    for a, b in zip(first.steps, again.steps, strict=True):
        assert a.spec == b.spec and a.role == b.role
        assert torch.equal(a.case.x, b.case.x) and torch.equal(a.case.valid, b.case.valid)
    run = confirm.run_probe(correct, first, "cpu", [])
    assert not confirm.JUDGES[first.kind](first, run), mistake  # its test does not hold
    outcome = confirm.judge_probe(first, run)
    assert not outcome.confirmed  # the counterexample, right again, was no counterexample
    assert outcome.alternative.mistake == "result_from_earlier_call"


def _holds_a_valid_constant_row(case) -> bool:
    t = case.inputs()
    rows = t["x"].reshape(-1, t["x"].shape[-1])
    valid = t["valid"].reshape(-1)
    return bool(((rows == rows[:, :1]).all(-1) & valid).any())


def test_a_constant_rows_probe_always_holds_a_valid_constant_row():
    """The probe's own data must hold the condition it confirms: a kernel that loses the
    gradient of constant rows was left unconfirmed ("no known cause confirmed") whenever the
    mask happened to leave every constant row of its fresh data invalid (8 of 3,000 salts on
    the gradients clause's [2, 5, 8] counterexample; once in CI)."""
    cases = CLAUSES["gradients"].build(0)
    spec = confirm.Spec.of("gradients", None, "grad_x at [0]")
    for index, case in enumerate(cases):
        if case.family != "constant rows":
            continue
        for salt in range(1500):
            probe = confirm.build_probe("gradient_lost_at_zero_variance", case, spec, 0,
                                        f"gradients {index} {salt}")  # fmt: skip
            kept = [step.case for step in probe.steps if step.role == "kept"]
            assert kept and all(map(_holds_a_valid_constant_row, kept)), (case.label, salt)


def test_a_single_row_of_a_constant_rows_probe_is_valid():
    """One row, which the mask draws invalid three times in ten: then the probe had no valid row
    at all, and nothing to confirm."""
    g = torch.Generator().manual_seed(0)
    x = torch.full((1, 8), 0.375, dtype=torch.float64)
    for _ in range(20):
        valid = torch.rand(1, generator=g) < 0.7
        kept = families.with_a_valid_constant_row(x, valid)
        assert kept.shape == valid.shape and bool(kept.all())
