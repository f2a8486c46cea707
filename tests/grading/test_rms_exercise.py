"""maskln grade for the RMSNorm exercise (issue 39's grade item): ``--op rms`` or the rules'
``op = "rms"`` grade ``masked_rms_normalization(x, valid, scale, eps=1e-6)`` with the same
clauses and machinery as LayerNorm's, against RMSNorm's own float64 reference and data families.
The class tests/solutions/class_rms/ holds correct submissions in varied styles and wrong ones
with one mistake each (_expected.py): each correct one passes, each wrong one fails the clause
its mistake lives in, with a right cause or none.

The default run grades a few clauses in process; whole grades, the child processes and the
class grade are slow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from maskln_cli.errors import MasklnError
from maskln_cli.grading import grade
from maskln_cli.grading.exercise import EXERCISES, exercising
from maskln_cli.grading.rules import parse_rules
from maskln_cli.grading.selection import CLAUSE_LEVELS, select
from tests.clitools import ROOT, assert_one_line_error, grade_command, run_without_torch_check
from tests.grading.classes import load_module, submission, submissions

CLASS = ROOT / "tests" / "solutions" / "class_rms"


EXPECTED = load_module(CLASS / "_expected.py", "class_rms_expected").EXPECTED
CORRECT = sorted(name for name, wrong in EXPECTED.items() if wrong is None)
WRONG = sorted(name for name, wrong in EXPECTED.items() if wrong is not None)


def solution(name: str):
    return submission(CLASS, name, "class_rms").masked_rms_normalization


def test_the_class_is_the_manifest():
    assert submissions(CLASS) == sorted(EXPECTED)
    assert len(CORRECT) >= 4 and len(WRONG) >= 8


def test_rms_runs_the_clauses_that_apply():
    layer, rms = select(), select(op="rms")
    assert set(layer.run) - set(rms.run) == {"two_pass", "offset_accuracy"}
    assert set(rms.run) <= set(CLAUSE_LEVELS)
    assert "two_pass" not in select(op="rms", strict=True).counted
    with pytest.raises(MasklnError, match=r"--op: no exercise 'group'"):
        select(op="group")
    with pytest.raises(MasklnError, match=r"two_pass.*RMSNorm"):
        select(only=["two_pass"], op="rms")


def test_the_rms_reference_is_rmsnorm_and_zero_padding():
    """The exercise's reference against the formula written out here, on a zero row (rstd is
    1/sqrt(eps)), a constant row, C = 1 and NaN padding."""
    x = torch.tensor([[[0.0, 0.0, 0.0], [2.0, 2.0, 2.0], [3.0, -4.0, 12.0], [math.nan, 1, 2]]])
    valid = torch.tensor([[True, True, True, False]])
    scale = torch.tensor([2.0, -1.0, 0.5])
    with exercising("rms"):
        out = EXERCISES["rms"].reference(x, valid, scale, None, 1e-6)
    rows = x[0, :3].double()
    expected = rows / torch.sqrt((rows**2).mean(-1, keepdim=True) + 1e-6) * scale.double()
    assert torch.equal(out[0, :3], expected)
    assert out[0, 3].tolist() == [0.0, 0.0, 0.0]
    assert all(math.copysign(1.0, v) == 1.0 for v in out[0, 3].tolist())


def test_the_rms_families_are_right_for_a_correct_solution_and_catch_float16():
    """Huge and tiny magnitudes, heavy tails and rows of zeros: the correct float32 rsqrt
    solution is right on every case, a float16 mean square wrong on every huge and tiny one
    (and a zero row's rstd is 1/sqrt(eps): the output 0, grad_x dy * scale / sqrt(eps))."""
    from maskln_cli.grading.clauses import draws, families
    from maskln_cli.grading.clauses.judging import reference_gradients, value_mismatch

    right, float16 = solution("bruno.py"), solution("hana.py")
    with exercising("rms"):
        cases = families.rms_cases(draws.generator(0, "test"), grad=True)
        assert {c.family for c in cases} == set(families.RMS_FAMILIES)
        for case in cases:
            t = case.inputs()
            args = (t["x"], t["valid"], t["scale"], case.eps)
            assert value_mismatch(right(*args), case.reference(), case.x.dtype) is None, case.label
            wrong = value_mismatch(float16(*args), case.reference(), case.x.dtype)
            if case.family in (families.HUGE, families.TINY):
                assert wrong is not None, case.label
        zeros = next(c for c in cases if c.family == families.ZERO_ROWS)
        t = zeros.inputs()
        x, valid = t["x"].reshape(-1, 16), t["valid"].reshape(-1)
        rows = [i for i in range(len(valid)) if valid[i] and bool((x[i] == 0).all())]
        assert rows, "no valid row of zeros"
        grad_x = reference_gradients(zeros, ("x",))["grad_x"].reshape(-1, 16)[rows]
        upstream = t["grad_out"].double().reshape(-1, 16)[rows]
        expected = upstream * t["scale"].double() / math.sqrt(zeros.eps)
        assert torch.allclose(grad_x, expected, rtol=1e-12, atol=0)


def test_maskln_own_rms_op_passes_and_layer_norm_fails_the_rms_exercise():
    from maskln_cli import masked_layer_normalization, masked_rms_normalization

    only = ["signature", "worked_example", "values"]
    assert grade(masked_rms_normalization, op="rms", only=only).passed
    report = grade(masked_layer_normalization, op="rms", only=only)
    assert not report.passed and report.op == "rms"
    assert report.to_dict()["op"] == "rms"
    assert "op rms" in report.text().splitlines()[0]


FAST = ["signature", "worked_example", "values", "sanitized_padding", "gradients",
        "sanitized_gradients", "raw_ops"]  # fmt: skip


@pytest.mark.parametrize("name", CORRECT)
def test_a_correct_rms_solution_passes(name):
    report = grade(solution(name), op="rms", only=FAST)
    assert report.passed, report.text()


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_rms_solution_fails_where_its_mistake_is(name):
    clause, causes, _ = EXPECTED[name]
    report = grade(solution(name), op="rms", only=FAST)
    assert clause in report.failed, report.text()
    named = report.root_cause.mistake if report.root_cause else None
    assert named in causes, report.text()


def test_rules_say_the_op():
    rules = parse_rules({"op": "rms", "extra": ["second_order"]}, "x.toml")
    assert rules.op == "rms"
    assert rules.grading_options()["op"] == "rms"
    assert "rms" in rules.name
    with pytest.raises(MasklnError, match=r"x.toml: op 'batch'"):
        parse_rules({"op": "batch"}, "x.toml")
    with pytest.raises(MasklnError, match=r"x.toml: .*two_pass"):
        parse_rules({"op": "rms", "extra": ["two_pass"]}, "x.toml")


def test_a_wrong_op_is_a_usage_error_before_torch():
    result = run_without_torch_check("grade", str(CLASS / "ama.py"), "--op", "batch")
    assert result.exit_code == 2 and not result.torch_imported
    assert_one_line_error(result.stderr, "--op: no exercise 'batch'", "layer, rms")
    result = run_without_torch_check("grade", str(CLASS / "ama.py"), "--op", "rms",
                                     "--only", "two_pass")  # fmt: skip
    assert result.exit_code == 2 and not result.torch_imported
    assert_one_line_error(result.stderr, "--only: two_pass is not run for RMSNorm")


# --- slow: whole grades, child processes, the class ----------------------------------------------


@pytest.mark.slow  # real children: make test-slow
def test_the_command_grades_an_rms_file_in_its_child():
    """The file's masked_rms_normalization, found by the exercise's name, graded in the same
    sandboxed child as LayerNorm's; the op in the JSON and the header."""
    result = grade_command(CLASS / "bruno.py", "--op", "rms", "--strict", "--json")
    assert result.exit_code == 0, result.stdout
    document = json.loads(result.stdout)
    assert document["passed"] is True and document["op"] == "rms"
    names = [c["name"] for c in document["clauses"]]
    assert "two_pass" not in names and "offset_accuracy" not in names and "second_order" in names
    wrong = grade_command(CLASS / "gus.py", "--op", "rms")
    assert wrong.exit_code == 1, wrong.stdout
    header, *rest = wrong.stdout.splitlines()
    assert "(op rms, seed 0, device cpu" in header
    assert any(line.split()[:2] == ["FAIL", "values"] for line in rest), wrong.stdout


@pytest.mark.slow  # a whole class in real children: make test-slow
def test_a_class_graded_by_rules_saying_op_rms(tmp_path):
    """The rules' op = "rms" grades the class as RMSNorm: exactly the correct ones pass, each
    wrong one fails its clause, and every JSON line and gradebook row says op rms."""
    import csv
    import shutil

    folder = tmp_path / "class"
    shutil.copytree(CLASS, folder, ignore=shutil.ignore_patterns("_*"))
    (folder / "maskln-grade.toml").write_text('op = "rms"\nextra = ["second_order"]\n')
    result = grade_command(folder, "--json", "--jobs", "2", "--csv", tmp_path / "book.csv")
    assert result.exit_code == 1, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    reports = {Path(line["target"]).name: line for line in lines if "target" in line}
    assert sorted(reports) == sorted(EXPECTED)
    assert {r["op"] for r in reports.values()} == {"rms"}
    failing = {
        name: [(c["name"], c["detail"]) for c in report["clauses"] if not c["passed"]]
        for name, report in reports.items()
        if name in CORRECT
    }
    assert sorted(n for n, r in reports.items() if r["passed"]) == CORRECT, failing
    for name in WRONG:
        clause, causes, _ = EXPECTED[name]
        assert clause in reports[name]["failed"], (name, reports[name]["failed"])
        cause = reports[name]["root_cause"]
        assert (cause["mistake"] if cause else None) in causes, (name, cause)
    with (tmp_path / "book.csv").open(newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert {row["op"] for row in rows} == {"rms"} and len(rows) == len(EXPECTED)
    assert all(row["rules"].endswith("rms, specification + second_order") for row in rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", CORRECT)
def test_a_correct_rms_solution_passes_strict(name):
    report = grade(solution(name), op="rms", strict=True)
    assert report.passed, report.text()
    assert "two_pass" not in [c.name for c in report.clauses]


@pytest.mark.slow
@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_rms_solution_fails_a_whole_grade_with_a_right_or_no_cause(name):
    clause, causes, _ = EXPECTED[name]
    report = grade(solution(name), op="rms")
    assert clause in report.failed, report.text()
    named = report.root_cause.mistake if report.root_cause else None
    assert named in causes, report.text()


def test_the_words_of_a_call_name_the_exercise_inputs():
    from maskln_cli.grading.clauses.calls import requiring_grad_words

    assert requiring_grad_words() == ", x, scale and bias requiring grad"
    with exercising("rms"):
        assert requiring_grad_words() == ", x and scale requiring grad"
