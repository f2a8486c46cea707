"""verify and grade name the same cause for the same RMSNorm mistake (issue 39): the class's
wrong submissions whose mistake is a formula of RMSNorm's catalogue are run as a kernel on a
verify problem (``norm=rms``), and verify's cause for their output is the cause a grade of the
same function names, confirmed (tests/solutions/class_rms/_expected.py)."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.grading import grade
from maskln_cli.verify.job import verify_file
from tests.clitools import write
from tests.grading.test_rms_exercise import EXPECTED, FAST, solution

EPS = 1e-6
NAMED = sorted(name for name, wrong in EXPECTED.items() if wrong and None not in wrong[1])
FORMULA_MISTAKES = {"mean_subtracted", "gain_plus_one", "gain_minus_one",
                    "squares_over_c_minus_1", "mask_inverted"}  # fmt: skip


def test_the_class_holds_a_submission_for_each_named_formula():
    named = {next(iter(EXPECTED[name][1])) for name in NAMED}
    assert named >= FORMULA_MISTAKES, named


@pytest.mark.parametrize("name", [n for n in NAMED if next(iter(EXPECTED[n][1])) in
                                  FORMULA_MISTAKES])  # fmt: skip
def test_verify_names_the_cause_grade_names(tmp_path, name):
    function = solution(name)
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(12, 8, generator=generator, dtype=torch.float64) * 2 + 0.5).float()
    valid = torch.rand(12, generator=generator) > 0.3
    valid[0], valid[1] = True, False
    scale = (1 + 0.5 * torch.randn(8, generator=generator, dtype=torch.float64)).float()
    source = write(tmp_path / "in.safetensors", {"x": x, "valid": valid, "scale": scale},
                   norm="rms", eps=repr(EPS))  # fmt: skip
    with torch.no_grad():
        out = function(x, valid, scale, EPS)
    result = write(tmp_path / "result.safetensors", {"out": out})
    report = verify_file(str(source), str(result))
    (tensor,) = report.tensors
    assert not tensor.passed
    by_verify = [d["mistake"] for d in tensor.diagnosis]
    graded = grade(function, op="rms", only=FAST)
    by_grade = graded.root_cause.mistake if graded.root_cause else None
    assert by_grade == next(iter(EXPECTED[name][1])), graded.text()
    assert by_verify[:1] == [by_grade], (by_verify, by_grade)
