"""`maskln grade FOLDER` as an 80-column terminal shows it (issue 38, item 5): each row was some
90 to 125 columns and wrapped; now every line fits, and the marks that do not fit a row are
folded under it. A real class of two in a pseudo-terminal: slow (two grades of 17 clauses)."""

from __future__ import annotations

import pytest
from rich.cells import cell_len

from tests.verify.test_verify_folder_report import in_terminal

pytestmark = pytest.mark.slow

CHEAP = (
    "signature,worked_example,values,leading_axes,invalid_rows_zero,sanitized_padding,dtypes,"
    "strided_inputs,no_mutation,raw_ops,no_reinit,no_shared_results,no_global_effects,"
    "no_hooks_left,two_pass,positive_zero,grad_flags"
)
"""17 clauses that take a fraction of a second each: more marks than 80 columns hold."""
CORRECT = """
import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
"""


def test_the_class_table_fits_80_columns_in_a_terminal(tmp_path):
    (tmp_path / "a_correct_solution.py").write_text(CORRECT)
    (tmp_path / "b_left_grad_mode_on.py").write_text(
        CORRECT.replace("    keep =", "    torch.set_grad_enabled(True)\n    keep =")
    )
    code, shown = in_terminal(80, "grade", tmp_path, "--only", CHEAP, "--jobs", "1")
    lines = shown.splitlines()
    assert code == 1, shown
    assert all(cell_len(line) <= 80 for line in lines), shown
    header = next(line for line in lines if line.startswith("submission"))
    numbers = [int(n) for n in header.split()[2:]]
    assert 0 < len(numbers) < 17, header  # some marks on the row, the rest folded
    assert f"    clauses {len(numbers) + 1} to 17: ✓ unless under the row" in lines, shown
    wrong = next(i for i, line in enumerate(lines) if line.startswith("b_left_grad_mode_on.py"))
    assert "FAIL" in lines[wrong]
    # no_global_effects (13) fails: on the row, or folded under it
    if len(numbers) >= 13:
        assert lines[wrong][header.index(" 13") + 2] in "✗=", lines[wrong]
    else:
        assert "13 ✗" in lines[wrong + 1] or "13 =" in lines[wrong + 1], shown
    assert any(line.startswith("a_correct_solution.py") and "PASS" in line for line in lines)
