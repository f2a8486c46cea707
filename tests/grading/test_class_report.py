"""The class report read at a glance (issue 32, item 5), off a terminal as in a file or a pipe:
counted and uncounted failures have different marks, paths are relative to the folder graded,
the closing line counts (it lists no paths), a failure's detail is shown whole and wrapped at
words only. Rendered from plain reports, in process."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from maskln_cli.cli.report import consoles
from maskln_cli.cli.report.gradebook import PIPED_WRAP, gradebook_rows, render_class
from maskln_cli.grading.classroom import ClassReport
from maskln_cli.grading.report import ClauseResult, GradeReport, RootCause
from maskln_cli.grading.selection import select

DETAIL = (
    "[strided inputs] x [3, 5, 6] float32, eps 1e-05, x permuted, strides [6, 18, 1]: output"
    " strides [30, 6, 1], torch.empty_like(x)'s [6, 18, 1]; the output_layout clause asks for"
    " x's own layout, which a contiguous() at the end loses, as does a torch.stack of the rows"
    " or a reshape of a transposed view, everywhere the grader tried it and in every dtype"
)


@pytest.fixture
def piped(monkeypatch):
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=consoles.PIPED_WIDTH)
    monkeypatch.setattr(consoles, "stdout_console", lambda: console)
    return out


def _class(folder):
    cause = RootCause("unbiased_variance", "unbiased variance (divides by C - 1)", "fix", "values",
                      ["values", "gradients"])  # fmt: skip
    wrong = GradeReport(
        str(folder / "bob.py"),
        False,
        [
            ClauseResult("values", True, False, 0.1, "x", []),
            ClauseResult("gradients", True, False, 0.1, "y", cause="values"),
            ClauseResult("second_order", False, False, 0.1, "z", counted=False),
        ],
        root_cause=cause,
    )
    layout = GradeReport(
        str(folder / "carol.py"),
        False,
        [
            ClauseResult("values", True, True, 0.1),
            ClauseResult("gradients", True, True, 0.1),
            ClauseResult("output_layout", False, False, 0.1, DETAIL, level="strict"),
        ],
    )
    right = GradeReport(str(folder / "alice.py"), False, [ClauseResult("values", True, True, 0.1)])
    targets = [str(folder / name) for name in ("alice.py", "bob.py", "carol.py", "dan.py")]
    return ClassReport(targets, [right, wrong, layout], interrupted=True)


def test_the_class_report_reads_without_colour(tmp_path, piped):
    for name in ("alice.py", "bob.py", "carol.py", "dan.py"):
        (tmp_path / name).write_text("")
    result = _class(tmp_path)
    render_class(result, select(), folder=str(tmp_path), rules="handout.toml: specification")
    text = piped.getvalue()
    lines = text.splitlines()
    assert lines[0] == f"maskln grade: 4 submissions in {tmp_path}"
    assert lines[1] == "rules: handout.toml: specification"
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.endswith(".py")
            or re.match(r"^\w+\.py ", line)}  # fmt: skip
    assert set(rows) == {"alice.py", "bob.py", "carol.py", "dan.py"}  # relative to the folder
    assert str(tmp_path) not in "\n".join(lines[2:])
    # bob: values counted ✗, gradients through the root cause =, second_order not counted ○
    assert rows["bob.py"] == ["FAIL", "✗", "=", "·", "○"], rows
    assert rows["carol.py"] == ["FAIL", "✓", "✓", "✗", "·"], rows
    assert rows["dan.py"][:2] == ["not", "graded"]
    # carol's detail is shown whole, under her row, wrapped at words within PIPED_WRAP
    under = lines[lines.index(next(x for x in lines if x.startswith("carol.py"))) + 1 :]
    shown = []
    for line in under:
        if not line.startswith("    "):
            break
        assert len(line) <= PIPED_WRAP, line
        shown.append(line.strip())
    assert " ".join(shown) == f"output_layout: {DETAIL}"  # every word whole, none cut
    # the legend keeps each number with its clause
    legend = [line for line in lines if line.startswith(("1 ", "✓"))]
    assert legend and all(len(line) <= PIPED_WRAP for line in legend)
    assert not any(re.search(r"\d,?$", line) for line in legend), legend
    assert "○ fails but is not counted" in text
    assert (
        lines[-1]
        == "INTERRUPTED: 1 of 4 submissions pass, 2 fail; interrupted before 1 were graded"
    )


def test_the_gradebook_is_relative_and_names_its_rules(tmp_path):
    for name in ("alice.py", "bob.py", "carol.py", "dan.py"):
        (tmp_path / name).write_text("")
    rows = gradebook_rows(_class(tmp_path), folder=str(tmp_path), rules="strict")
    header = rows[0]
    assert header[:8] == ["submission", "verdict", "passed", "counted", "failed", "root_cause",
                          "why", "rules"]  # fmt: skip
    assert [row[0] for row in rows[1:]] == ["alice.py", "bob.py", "carol.py", "dan.py"]
    bob = dict(zip(header, rows[2], strict=True))
    assert bob["second_order"] == "fail (not counted)" and bob["values"] == "fail"
    carol = dict(zip(header, rows[3], strict=True))
    assert carol["why"] == f"output_layout: {DETAIL}"  # whole
    assert {row[7] for row in rows[1:]} == {"strict"}


def _terminal(monkeypatch, width: int) -> io.StringIO:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=width, color_system=None)
    monkeypatch.setattr(consoles, "stdout_console", lambda: console)
    return out


@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_class_table_fits_the_terminal_folding_marks_that_do_not(tmp_path, monkeypatch, width):
    """Issue 38, item 5: with every clause (24, --strict), a row was some 90 columns and wrapped
    in an 80-column terminal. Every line fits now; the marks past the line's end are folded
    under the row, those that are not a pass, each with its clause's number."""
    from rich.cells import cell_len

    chosen = select(strict=True)
    names = list(chosen.run)
    failing = {3: "values", 17: "no_global_effects", 23: "grad_flags"}  # 1-based numbers
    reports = []
    for who in ("alice.py", "a_rather_long_name_for_a_submission_file.py"):
        (tmp_path / who).write_text("")
        clauses = [
            ClauseResult(name, True, who == "alice.py" or i not in failing, 0.1, "why not")
            for i, name in enumerate(names, 1)
        ]
        reports.append(GradeReport(str(tmp_path / who), who == "alice.py", clauses))
    result = ClassReport([r.target for r in reports], reports)
    rules = f"handout ({tmp_path / 'maskln-grade.toml'}, sha256 0123456789ab)"
    out = _terminal(monkeypatch, width)
    render_class(result, chosen, folder=str(tmp_path), rules=rules)
    lines = out.getvalue().splitlines()
    assert all(cell_len(line) <= width for line in lines), [x for x in lines if cell_len(x) > width]
    header = next(line for line in lines if line.startswith("submission"))
    shown = [int(n) for n in header.split()[2:]]
    assert shown == list(range(1, len(shown) + 1)) and shown  # the first marks stay on the row
    long_row = next(i for i, line in enumerate(lines) if line.startswith("a_rather"))
    under = " ".join(lines[long_row + 1 : long_row + 4])
    for number in failing:  # on the row, or folded under it
        if number <= len(shown):
            column = header.index(f" {number} ") + len(str(number))
            assert lines[long_row][column] == "✗", (number, lines[long_row])
        else:
            assert f"{number} ✗" in under, (number, under)
    folded = len(names) - len(shown)
    assert folded > 0 if width == 80 else folded == 0 if width == 200 else True, (width, shown)
    if folded:
        assert f"    clauses {len(shown) + 1} to {len(names)}: ✓ unless under the row" in lines
        alice = next(i for i, line in enumerate(lines) if line.startswith("alice.py"))
        assert lines[alice + 1].startswith("a_rather")  # nothing folded under a row that passes
    # the rules' line wraps where the test's folder path puts it: read it as one text
    assert "sha256 0123456789ab" in " ".join(" ".join(lines).split())


def test_every_gradebook_row_names_the_rules_file_and_hash_those_not_graded_too(tmp_path):
    """Issue 38, item 1: the rules' path and hash on every row; a row not graded (dan) had
    none."""
    for name in ("alice.py", "bob.py", "carol.py", "dan.py"):
        (tmp_path / name).write_text("")
    source = f"{tmp_path / 'maskln-grade.toml'}, sha256 0123456789ab"
    rows = gradebook_rows(_class(tmp_path), folder=str(tmp_path), rules="week 3",
                          rules_source=source)  # fmt: skip
    column = rows[0].index("rules_source")
    assert [row[column] for row in rows[1:]] == [source] * 4, rows
