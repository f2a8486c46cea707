"""The instructor's rules in one place (issue 32, item 4): a maskln-grade.toml beside the
submissions or [tool.maskln.grade] in a pyproject.toml says which clauses count, the time limit,
the jobs and the seed; presets (specification, strict); every report and gradebook says which
rule set graded it; a wrong rules file is a one-line error naming the file and the key."""

from __future__ import annotations

import csv
import json

import pytest

from maskln_cli.errors import MasklnError
from maskln_cli.grading.rules import (
    PRESETS,
    Rules,
    find_rules,
    load_rules,
    parse_rules,
    resolve_rules,
)
from tests.clitools import ROOT, assert_one_line_error, grade_command, run_without_torch_check

HANDOUT = 'preset = "specification"\nextra = ["positive_zero", "second_order"]\ntimeout = 30\n'
MULTIPLIES = (
    "from tests.solutions.broken import zeroes_by_multiplying as masked_layer_normalization\n"
)
CORRECT = "from tests.solutions.correct import masked_layer_normalization  # noqa: F401\n"


def test_a_rules_file_in_the_folder_graded_is_found_one_beside_a_file_is_not(tmp_path):
    (tmp_path / "maskln-grade.toml").write_text(HANDOUT)
    (tmp_path / "alice.py").write_text(CORRECT)
    rules = find_rules([str(tmp_path)])
    assert rules.path == str(tmp_path / "maskln-grade.toml") and len(rules.digest) == 12
    beside = find_rules([str(tmp_path / "alice.py")])  # a file TARGET's folder: the student's
    assert beside.ignored == (str(tmp_path / "maskln-grade.toml"),) and beside.extra == ()
    assert rules.extra == ("positive_zero", "second_order") and rules.timeout == 30.0
    assert rules.grading_options() == {
        "strict": False,
        "only": [],
        "include": ["positive_zero", "second_order"],
        "op": "layer",
    }
    assert rules.name.endswith("maskln-grade.toml: specification + positive_zero, second_order")


def test_pyproject_tables_are_found_from_the_nearest_pyproject_up(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "course"\n\n[tool.maskln.grade]\npreset = "strict"\njobs = 2\n'
    )
    submissions = tmp_path / "week3" / "submissions"
    submissions.mkdir(parents=True)
    (submissions / "bob.py").write_text(CORRECT)
    rules = find_rules([str(submissions)])
    assert rules.preset == "strict" and rules.jobs == 2
    assert "[tool.maskln.grade]" in rules.name
    # A nearer pyproject.toml without the table decides: no rules.
    (tmp_path / "week3" / "pyproject.toml").write_text('[project]\nname = "week3"\n')
    assert find_rules([str(submissions)]) is None
    assert resolve_rules(None, [str(submissions)]) == Rules()


def test_presets_and_the_command_line():
    assert set(PRESETS) == {"specification", "strict"}
    assert resolve_rules("strict", []).grading_options()["strict"] is True
    rules = resolve_rules("specification", []).with_command_line(include=["second_order"])
    assert rules.name == "specification + second_order"
    only = Rules(extra=("positive_zero",)).with_command_line(only=["values"])
    assert only.grading_options() == {"strict": False, "only": ["values"], "include": [],
                                      "op": "layer"}  # fmt: skip
    required = parse_rules({"required": ["values", "gradients"], "extra": ["second_order"]}, "f")
    assert required.name == "f: only values, gradients + second_order"
    assert required.grading_options()["only"] == ["values", "gradients", "second_order"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('preset = "handout"\n', "preset 'handout' is not one of specification, strict"),
        ('extra = ["nope"]\n', "extra: no clause 'nope'"),
        ('required = "values"\nextra = 3\n', "extra must be a list of clause names"),
        ("timeout = -1\n", "timeout must be a positive number of seconds, got -1"),
        ("jobs = 0\n", "jobs must be a whole number of at least 1"),
        ("jobz = 2\n", "unknown key 'jobz'; the keys are preset, required, extra"),
        ("extra = [\n", "not valid TOML"),
    ],
)
def test_a_wrong_rules_file_is_a_one_line_error_naming_file_and_key(tmp_path, text, fragment):
    path = tmp_path / "maskln-grade.toml"
    path.write_text(text)
    with pytest.raises(MasklnError, match=r"maskln-grade\.toml"):
        load_rules(path)
    result = run_without_torch_check("grade", tmp_path, "--rules", path)
    assert result.exit_code == 2
    assert not result.torch_imported  # refused before torch is imported
    assert_one_line_error(result.stderr, "maskln-grade.toml", fragment)


def test_a_pyproject_named_without_the_table_is_refused(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n')
    with pytest.raises(MasklnError, match=r"no \[tool.maskln.grade\] table"):
        load_rules(path)


def test_the_class_is_graded_by_its_rules_and_the_gradebook_says_which(tmp_path):
    """A handout that counts positive_zero: -0.0 fails the class. Two clauses, to be quick."""
    folder = tmp_path / "submissions"
    folder.mkdir()
    (folder / "maskln-grade.toml").write_text(
        'required = ["worked_example"]\nextra = ["positive_zero"]\nname = "handout 3"\n'
    )
    (folder / "alice.py").write_text(CORRECT)
    (folder / "bob.py").write_text(MULTIPLIES)
    gradebook = tmp_path / "gradebook.csv"
    result = grade_command(folder, "--csv", gradebook, "--json", "--jobs", "2")
    assert result.exit_code == 1, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["rules"] for line in lines] == ["handout 3", "handout 3"]
    assert [line["passed"] for line in lines] == [True, False]
    rows = list(csv.DictReader(gradebook.open(newline="")))
    assert [row["submission"] for row in rows] == ["alice.py", "bob.py"]  # relative
    assert {row["rules"] for row in rows} == {"handout 3"}
    assert rows[1]["positive_zero"] == "fail" and rows[1]["root_cause"] == "negative_zero"
    assert "rules handout 3" in result.stderr  # the note saying where the gradebook went


def test_a_single_report_says_its_rules():
    result = grade_command(
        ROOT / "examples" / "my_kernel.py", "--rules", "strict", "--only", "worked_example"
    )
    assert result.exit_code == 0, result.stdout
    assert result.stdout.splitlines()[0].endswith("rules only worked_example (built in))")
    document = json.loads(
        grade_command(
            ROOT / "examples" / "my_kernel.py", "--rules", "strict", "--json", "--only", "signature"
        ).stdout
    )
    assert document["rules"] == "only signature" and document["rules_source"] == "built in"


NESTED = "required = " + "[" * 2000 + "]" * 2000 + "\n"


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        (b'preset = "specification"\nname = "caf\xe9"\n', ("not UTF-8 text", "line 2, key name")),
        (NESTED.encode(), ("nested too deeply to read", "key required")),
        (b"timeout = 1e-300\n", ("timeout must be between 1 and 86,400 seconds, got 1e-300",)),
        (b"timeout = 1e300\n", ("timeout must be between 1 and 86,400 seconds",)),
        (b"jobs = 9223372036854775807\n", ("jobs must be at most 1024",)),
        (b'required = ["signature"]\nname = "specification"\n', ("name 'specification' is a",)),
        (b'name = "a\\nb"\n', ("name must be one printable line",)),
        (b"# " + b"x" * (1 << 20) + b"\n", ("too large for a rules file",)),
    ],
    ids=[
        "not UTF-8",
        "nested 2,000 deep",
        "timeout 1e-300",
        "timeout 1e300",
        "jobs 2**63",
        "a preset's name on other rules",
        "a name of two lines",
        "2 MiB",
    ],
)
def test_a_hostile_rules_file_is_a_one_line_error_naming_file_and_key(tmp_path, data, fragments):
    """Issue 38, item 1: no internal error (UnicodeDecodeError, RecursionError), no timeout
    blamed on --timeout: the file, the key, exit 2, before torch is imported."""
    (tmp_path / "maskln-grade.toml").write_bytes(data)
    (tmp_path / "alice.py").write_text(CORRECT)
    result = run_without_torch_check("grade", tmp_path)
    assert result.exit_code == 2, result.stderr
    assert not result.torch_imported
    assert_one_line_error(result.stderr, "maskln-grade.toml", *fragments)
    assert "--timeout" not in result.stderr


def test_an_absurd_timeout_on_the_command_line_is_refused():
    result = run_without_torch_check("grade", "examples/my_kernel.py", "--timeout", "1e-300")
    assert result.exit_code == 2 and not result.torch_imported
    assert_one_line_error(result.stderr, "--timeout: must be between 1 and 86,400 seconds")
