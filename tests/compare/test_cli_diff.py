"""`maskln diff`: verdicts, exit codes, reports and JSON (verify: test_cli_verify.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.clitools import PAIRS, WORKED, assert_one_line_error, invoke, run, write

EXPECTED_PAIRS = PAIRS.with_name("pair_features_expected.safetensors")

REPORT_KEYS = {
    "name", "passed", "problems", "shape", "expected_shape", "dtype", "expected_dtype", "rtol",
    "atol", "numel", "rows", "mismatched", "mismatched_fraction", "mismatched_rows",
    "max_abs_diff", "max_abs_index", "max_rel_diff", "max_rel_index", "rel_l2", "nan_mismatched",
    "inf_mismatched", "invalid_rows_zero", "worst", "rows_left_out", "budget_ratio",
    "yardstick_max_abs_diff",
    "yardstick_rel_l2", "nan_where_finite", "inf_where_finite", "mismatched_invalid_rows",
    "negative_zeros", "row_rel_error", "factor_needed", "diagnosis",
}  # fmt: skip


def pair(tmp_path, actual, expected):
    return (
        write(tmp_path / "actual.safetensors", actual),
        write(tmp_path / "expected.safetensors", expected),
    )


# --- diff ---------------------------------------------------------------------------------------


def test_diff_identical_files_passes():
    result = invoke("diff", WORKED, WORKED)
    assert result.exit_code == 0
    assert "PASS" in result.stdout and "bias, scale, x, valid" in result.stdout


def test_diff_mismatch_report_for_people(tmp_path):
    expected = torch.zeros(4, 3)
    actual = expected.clone()
    actual[2, 1] = 0.75
    paths = pair(
        tmp_path, {"out": actual, "same": torch.ones(2)}, {"out": expected, "same": torch.ones(2)}
    )
    result = invoke("diff", *paths)
    assert result.exit_code == 1
    text = result.stdout
    for fragment in (
        "FAIL out",
        "1 of 12",
        "in 1 of 4 rows",
        "0.75 at [2, 1]",
        "worst rows of out",
        "PASS same",
    ):
        assert fragment in text, fragment
    assert text.strip().splitlines()[-1].startswith("FAIL: 1 of 2 tensors: out")


def test_diff_json_document(tmp_path):
    expected = torch.zeros(4, 3, dtype=torch.float64)
    actual = expected.clone()
    actual[3, 0] = math.nan
    paths = pair(
        tmp_path,
        {"out": actual, "extra": torch.ones(1)},
        {"out": expected, "only_e": torch.ones(2)},
    )
    result = invoke("diff", *paths, "--json")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["passed"] is False and document["command"] == "diff"
    tensors = {t["name"]: t for t in document["tensors"]}
    assert set(tensors) == {"out", "extra", "only_e"}
    assert all(set(t) == REPORT_KEYS for t in document["tensors"])
    out = tensors["out"]
    assert (out["mismatched"], out["nan_mismatched"], out["shape"]) == (1, 1, [4, 3])
    assert out["worst"][0]["index"] == [3, 0] and out["worst"][0]["row"] == [3]
    assert out["worst"][0]["actual"] is None  # NaN is null in JSON
    assert tensors["extra"]["problems"] == ["missing in expected"]
    assert tensors["only_e"]["problems"] == ["missing in actual"]
    assert tensors["only_e"]["shape"] is None and tensors["only_e"]["expected_shape"] == [2]


def test_diff_worst_rows_show_the_max_abs_element_within_tolerance(tmp_path):
    expected = torch.tensor([[100.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    actual = expected.clone()
    actual[0, 0] = 100.5  # within rtol 0.01 of 100: the greatest difference, and no mismatch
    actual[1, 1] = 0.1  # beyond atol 0.01: the mismatch
    paths = pair(tmp_path, {"t": actual}, {"t": expected})
    result = invoke("diff", *paths, "--rtol", "0.01", "--atol", "0.01")
    assert result.exit_code == 1
    table = result.stdout.split("worst rows of t")[1]
    lines = [line for line in table.splitlines() if line.strip().startswith("[")]
    assert lines[0].split()[:2] == ["[1]", "1"]
    assert lines[1].split()[:2] == ["[0]", "0"]
    assert lines[1].rstrip().endswith("max abs diff, within its tolerance")


@pytest.mark.parametrize("command", [["diff", PAIRS, EXPECTED_PAIRS], ["inspect", PAIRS]])
def test_piped_reports_have_no_trailing_spaces(command):
    """Table cells are padded to their column's width; a terminal hides it, a file does not."""
    result = run(*command)
    lines = result.stdout.decode().splitlines()
    assert len(lines) > 5 and all(line == line.rstrip() for line in lines), result.stdout


def test_diff_key_option_limits_the_comparison(tmp_path):
    paths = pair(
        tmp_path,
        {"a": torch.ones(2), "b": torch.ones(2)},
        {"a": torch.ones(2), "b": torch.zeros(2)},
    )
    assert invoke("diff", *paths, "--key", "a").exit_code == 0
    assert invoke("diff", *paths, "--key", "a", "--key", "b").exit_code == 1
    unknown = invoke("diff", *paths, "--key", "zzz")
    assert unknown.exit_code == 2
    assert_one_line_error(unknown.stderr, "--key", "'zzz'")


def test_diff_tolerance_options(tmp_path):
    paths = pair(
        tmp_path,
        {"t": torch.tensor([1.5], dtype=torch.float64)},
        {"t": torch.tensor([1.0], dtype=torch.float64)},
    )
    assert invoke("diff", *paths).exit_code == 1
    assert invoke("diff", *paths, "--rtol", "0.25", "--atol", "0.25").exit_code == 0
    assert invoke("diff", *paths, "--rtol", "0.25", "--atol", "0.24").exit_code == 1


def test_diff_quiet_prints_only_the_verdict(tmp_path):
    paths = pair(tmp_path, {"t": torch.ones(3)}, {"t": torch.zeros(3)})
    result = invoke("diff", *paths, "--quiet")
    assert result.exit_code == 1
    assert result.stdout.strip().splitlines() == [
        "FAIL: 1 of 1 tensors: t (3 of 3 elements differ beyond tolerance)"
    ]


def test_diff_from_stdin_pipeline(tmp_path):
    with open(PAIRS, "rb") as stdin:
        normalized = run("normalize", "-", "-", stdin=stdin)
    result = run("diff", "-", EXPECTED_PAIRS, input=normalized.stdout)
    assert result.returncode == 0, result.stdout
    assert b"PASS" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("-", "-"), ("both be '-'",)),
        (("missing.safetensors", WORKED), ("missing.safetensors", "no such file")),
        ((WORKED, WORKED, "--rtol", "-1"), ("--rtol",)),
        ((WORKED, WORKED, "--atol", "nan"), ("--atol",)),
    ],
)
def test_diff_errors_exit_2(args, fragments):
    result = invoke("diff", *args)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, *fragments)


# --- checkpoints: folders and index files on either side (issue 23, 5) --------------------------


def test_diff_takes_checkpoint_folders_and_index_files_on_either_side(tmp_path):
    from tests.files.test_checkpoint import parameters, write_sharded

    params = parameters()
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    whole.mkdir()
    sharded.mkdir()
    write(whole / "model.safetensors", params)
    write_sharded(sharded, params)
    index = sharded / "model.safetensors.index.json"
    for left, right in ((whole, sharded), (index, whole), (sharded, index)):
        result = invoke("diff", left, right, "--json")
        assert result.exit_code == 0, result.stdout + result.stderr
        document = json.loads(result.stdout)
        assert sorted(t["name"] for t in document["tensors"]) == sorted(params)
        assert all(t["max_abs_diff"] == 0 for t in document["tensors"])
    # One tensor changed in one shard: named, by key, across the shards.
    key = sorted(params)[-1]
    changed = dict(params, **{key: params[key] + 1e-3})
    other = tmp_path / "other"
    other.mkdir()
    write_sharded(other, changed)
    result = invoke("diff", whole, other, "--json")
    assert result.exit_code == 1
    failed = [t["name"] for t in json.loads(result.stdout)["tensors"] if not t["passed"]]
    assert failed == [key]


def test_a_json_index_where_a_safetensors_file_is_needed_is_said_for_what_it_is(tmp_path):
    from tests.files.test_checkpoint import parameters, write_sharded

    write_sharded(tmp_path, parameters())
    index = tmp_path / "model.safetensors.index.json"
    result = invoke("normalize", index, tmp_path / "out.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "model.safetensors.index.json", "a JSON file")
    result = invoke("verify", WORKED, index)
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "a JSON file, not a safetensors file")
