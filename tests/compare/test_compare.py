"""Comparisons on hand-built pairs whose figures are known exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from maskln_cli.cli.report import to_json
from maskln_cli.compare import comparison as compare
from maskln_cli.compare import files as compare_files
from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import default_tolerance
from maskln_cli.compare.files import compare_tensors


def test_counts_and_worst_element():
    actual = torch.zeros(3, 4, dtype=torch.float64)
    expected = torch.zeros(3, 4, dtype=torch.float64)
    actual[1, 2] = 0.5
    actual[2, 0] = -0.125
    result = compare_tensors("t", actual, expected)
    assert not result.passed
    assert (result.numel, result.rows, result.mismatched, result.mismatched_rows) == (12, 3, 2, 2)
    assert result.mismatched_fraction == 2 / 12
    assert (result.max_abs_diff, result.max_abs_index) == (0.5, [1, 2])
    assert [(w.row, w.index, w.actual, w.expected) for w in result.worst] == [
        ([1], [1, 2], 0.5, 0.0),
        ([2], [2, 0], -0.125, 0.0),
    ]
    assert result.problems == ["2 of 12 elements differ beyond tolerance"]


def test_relative_figures():
    expected = torch.tensor([[1.0, 2.0], [4.0, -8.0]], dtype=torch.float64)
    actual = expected * 1.1
    actual[0, 0] = 1.0  # exact here
    result = compare_tensors("t", actual, expected)
    assert result.max_rel_diff == pytest.approx(0.1)
    assert result.max_abs_diff == pytest.approx(0.8) and result.max_abs_index == [1, 1]
    diff = (actual - expected).norm() / expected.norm()
    assert result.rel_l2 == pytest.approx(diff.item())


def test_relative_difference_at_an_expected_zero_is_infinite():
    result = compare_tensors("t", torch.tensor([0.0, 1e-3]), torch.tensor([0.0, 0.0]))
    assert result.max_rel_diff == math.inf and result.max_rel_index == [1]


@pytest.mark.parametrize(
    ("actual", "expected", "passed", "nan_mismatched", "inf_mismatched"),
    [
        (math.nan, math.nan, True, 0, 0),  # NaN matches NaN at the same position
        (math.nan, 1.0, False, 1, 0),
        (1.0, math.nan, False, 1, 0),
        (math.inf, math.inf, True, 0, 0),
        (-math.inf, -math.inf, True, 0, 0),
        (math.inf, -math.inf, False, 0, 1),
        (math.inf, 1e30, False, 0, 1),
        (5.0, -math.inf, False, 0, 1),
        (math.nan, math.inf, False, 1, 0),
    ],
)
def test_nan_and_inf_rules(actual, expected, passed, nan_mismatched, inf_mismatched):
    result = compare_tensors(
        "t", torch.tensor([2.0, actual]), torch.tensor([2.0, expected]), rtol=1.0, atol=1.0
    )
    assert result.passed is passed
    assert (result.nan_mismatched, result.inf_mismatched) == (nan_mismatched, inf_mismatched)
    assert result.mismatched == (0 if passed else 1)
    if not passed:
        assert result.worst[0].index == [1] and math.isinf(result.worst[0].abs_diff)


def test_element_exactly_at_the_bound_passes():
    expected = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    at_bound = torch.tensor([1.5, 0.5, -2.75], dtype=torch.float64)  # atol 0.25 + rtol 0.25 * |e|
    assert compare_tensors("t", at_bound, expected, rtol=0.25, atol=0.25).passed
    beyond = at_bound + torch.tensor([1e-12, 0.0, 0.0], dtype=torch.float64)
    result = compare_tensors("t", beyond, expected, rtol=0.25, atol=0.25)
    assert not result.passed and result.mismatched == 1


@pytest.mark.parametrize(
    ("dtype", "rtol", "atol"),
    [
        ("float64", 1e-7, 1e-7),
        ("float32", 1.3e-6, 1e-5),
        ("float16", 1e-3, 1e-5),
        ("bfloat16", 1.6e-2, 1e-5),
        ("int64", 0.0, 0.0),
        ("bool", 0.0, 0.0),
    ],
)
def test_default_tolerances_are_torch_testings(dtype, rtol, atol):
    assert default_tolerance(dtype) == (rtol, atol)
    if dtype.startswith(("float", "bfloat")):
        torch_dtype = getattr(torch, dtype)
        result = compare_tensors(
            "t", torch.zeros(2, dtype=torch_dtype), torch.zeros(2, dtype=torch_dtype)
        )
        assert (result.rtol, result.atol) == (rtol, atol)


def test_float32_default_tolerance_in_use():
    expected = torch.zeros(4)
    assert compare_tensors("t", torch.full((4,), 9e-6), expected).passed
    assert not compare_tensors("t", torch.full((4,), 2e-5), expected).passed


def test_shape_and_dtype_differences_are_mismatches():
    shape = compare_tensors("t", torch.zeros(2, 3), torch.zeros(3, 2))
    assert not shape.passed and shape.mismatched is None
    # Same size, another shape: said, since no values were compared.
    assert shape.problems == [
        "shape [2, 3] vs expected [3, 2]: the same number of elements in another shape;"
        " values not compared"
    ]
    other_size = compare_tensors("t", torch.zeros(2, 3), torch.zeros(2, 2))
    assert other_size.problems == ["shape [2, 3] vs expected [2, 2]"]
    dtype = compare_tensors("t", torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.float64))
    assert not dtype.passed and dtype.mismatched == 0  # values still compared, and equal
    assert dtype.problems == ["dtype float32 vs expected float64"]


def test_integer_and_bool_tensors_must_be_equal():
    assert compare_tensors("m", torch.tensor([True, False]), torch.tensor([True, False])).passed
    result = compare_tensors("m", torch.tensor([True, True]), torch.tensor([True, False]))
    assert result.mismatched == 1
    assert not compare_tensors("i", torch.tensor([1, 2]), torch.tensor([1, 3])).passed


def test_empty_tensors_compare_equal():
    result = compare_tensors("e", torch.zeros(0, 4), torch.zeros(0, 4))
    assert result.passed and result.numel == 0 and result.mismatched == 0


def test_chunked_comparison_equals_one_chunk(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    expected = torch.randn(50, 7, generator=generator)
    actual = expected + 1e-4 * (torch.rand(50, 7, generator=generator) > 0.9)
    actual[13, 3] = math.nan
    whole = json.loads(to_json(compare_tensors("t", actual, expected).to_dict()))
    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 7 * 3)
    chunked = json.loads(to_json(compare_tensors("t", actual, expected).to_dict()))
    assert whole["mismatched"] > 3 and whole["nan_mismatched"] == 1
    for key, value in whole.items():
        if isinstance(value, float):
            assert chunked[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert chunked[key] == value, key


def test_invalid_rows_of_actual_must_be_exactly_zero():
    comparison = Comparison("out", [3, 2], "float32", [3, 2], "float32")
    values = torch.tensor([[1.0, 2.0], [1e-9, 0.0], [0.0, -0.0]])
    comparison.update(values, values, invalid_rows=torch.tensor([False, True, True]))
    result = comparison.result()
    assert result.invalid_rows_zero is False and not result.passed
    assert result.mismatched == 0  # values agree: it is the masking contract that fails
    assert "actual is not exactly 0 at every invalid position" in result.problems
    assert result.negative_zeros == 1  # counted apart: -0.0 is 0, but not +0.0


def test_allowance_replaces_the_tolerance_and_ranks_worst_rows_by_ratio():
    comparison = Comparison(
        "g", [3, 2], "float32", [3, 2], "float64", rank_by_ratio=True, same_dtype=False
    )
    expected = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    actual = expected + torch.tensor([[0.5, 0.0], [0.0, 0.25], [0.0, 0.0]], dtype=torch.float64)
    allowance = torch.tensor([[1.0, 1.0], [0.1, 0.1], [0.0, 0.0]], dtype=torch.float64)
    comparison.update(actual.float(), expected, allowance=allowance)
    result = comparison.result()
    # Row 0 errs by 0.5 within 1.0; row 1 by 0.25 against 0.1: only it fails, at 2.5x.
    assert (result.mismatched, result.budget_ratio) == (1, pytest.approx(2.5))
    assert [w.index for w in result.worst] == [[1, 1], [0, 0]]  # then the max abs element
    assert result.worst[0].abs_diff > result.worst[0].allowed == pytest.approx(0.1)
    assert result.worst[1].abs_diff <= result.worst[1].allowed
    assert result.problems == ["1 of 6 elements differ beyond tolerance"]  # dtypes may differ


def test_worst_rows_are_the_worst_across_chunks():
    comparison = Comparison("t", [12, 2], "float64", [12, 2], "float64")
    expected = torch.zeros(12, 2, dtype=torch.float64)
    actual = expected.clone()
    for row in range(12):
        actual[row, row % 2] = row + 1.0  # the later the row, the worse
    for start in range(0, 12, 4):
        comparison.update(actual[start : start + 4], expected[start : start + 4])
    result = comparison.result()
    assert [w.row for w in result.worst] == [[11], [10], [9], [8], [7]]
    assert [w.index[-1] for w in result.worst] == [1, 0, 1, 0, 1]


def test_values_without_a_float64_form_are_compared_bit_for_bit():
    a = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    same = compare_tensors("c", a, a.clone())
    assert same.passed and same.mismatched is None  # no element figures without float64 values
    other = compare_tensors("c", a, a * 2)
    assert not other.passed and "bit for bit" in other.problems[0]
    against_float = compare_tensors("c", a, torch.ones(2))
    assert not against_float.passed


def test_plain_data_is_asdict():
    import dataclasses

    from maskln_cli.compare.data import RowErrors, plain_data

    result = compare_tensors("t", torch.tensor([[1.0, 2.0], [3.0, 9.0]]), torch.ones(2, 2))
    result.row_rel_error = RowErrors(2, 0.5, 0.1, 0.4, 0.6)
    result.diagnosis = [{"description": "x", "rows": [1, 2], "pair": (1, {"a": [2]})}]
    plain = plain_data(result)
    assert plain == dataclasses.asdict(result) and repr(plain) == repr(dataclasses.asdict(result))
    plain["worst"][0]["index"].append(99)  # a copy, as asdict makes
    plain["diagnosis"][0]["rows"].append(3)
    assert result.worst[0].index == [1, 1] and result.diagnosis[0]["rows"] == [1, 2]


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int32, torch.int64, torch.uint64])
@pytest.mark.parametrize(("rtol", "atol"), [(0.0, 0.0), (0.0, 2.0), (1e-3, 0.0), (1e-3, 1.0)])
def test_equal_integer_chunks_take_a_shortcut_to_the_same_result(dtype, rtol, atol):
    """IntegerComparison.update skips the exact arithmetic for a chunk whose two sides are
    equal; the outcome is the one the full path gives (a keep mask of all True takes it)."""
    from maskln_cli.compare.integers import IntegerComparison

    generator = torch.Generator().manual_seed(0)
    high = 2 if dtype == torch.bool else 2**7 if dtype == torch.uint8 else 2**31
    base = torch.randint(-high if dtype.is_signed else 0, high, (6, 4), generator=generator)
    if dtype == torch.uint64:
        base = (base.abs() * 2**32 + 5).view(torch.uint64)  # values of 2**63 and up
    base = base.to(dtype)
    zeros, changed = torch.zeros_like(base), base.clone()
    if dtype == torch.bool:
        changed[3, 1] = ~changed[3, 1]
    else:  # through int64 bits: torch adds no uint64
        bits = changed.view(torch.int64) if dtype == torch.uint64 else changed
        bits[3, 1] += 1
    for actual, expected in ((base, base), (zeros, zeros), (changed, base), (base, changed)):
        outcomes = []
        for keep in (None, torch.ones(8, dtype=torch.bool)):
            comparison = IntegerComparison("t", [6, 4], str(dtype)[6:], [6, 4], str(dtype)[6:],
                                           rtol, atol)  # fmt: skip
            for start in range(0, 24, 8):  # three chunks of two rows
                chunk = slice(start, start + 8)
                comparison.update(actual.reshape(-1)[chunk], expected.reshape(-1)[chunk], keep=keep)
            outcomes.append(comparison.result().to_dict())
        assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(("rtol", "atol"), [(None, None), (0.0, 0.0), (0.5, 0.0), (0.0, 1e-3)])
def test_small_tensors_compared_together_as_one_by_one(tmp_path, monkeypatch, rtol, atol):
    """diff compares small floating tensors many at a time (Comparison.update_many); every
    figure of every outcome is the one comparing them one by one gives."""
    from safetensors.torch import save_file

    from maskln_cli.cli.report import to_json

    generator = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
    shapes = [(1,), (5,), (3, 4), (2, 3, 2), (1, 1), ()]
    actual, expected = {}, {}
    for i in range(420):
        dtype, shape = dtypes[i % 5], shapes[i // 5 % 6]
        e = torch.randn(shape, generator=generator, dtype=torch.float64) * 10.0 ** (i % 7 - 3)
        kind = i // 30 % 7
        if kind == 1:  # nudged, within float32's tolerance
            a = e * (1 + 1e-7)
        elif kind == 2:  # zeros and ties: the first index of a maximum counts
            e = e.abs().round().clamp(max=2.0)
            a = e.flip(-1) if e.dim() else e
        elif kind == 3:  # beyond tolerance somewhere
            a = e + 1
        elif kind == 4:  # NaN and inf: compared one by one
            a = e.clone()
            a.reshape(-1)[0] = math.nan if i % 2 else math.inf
        elif kind == 5:  # an expected 0, an actual within atol: relative difference inf
            e = e * 0
            a = e + 1e-6
        else:
            a = e.clone()
        actual[f"t{i}"], expected[f"t{i}"] = a.to(dtype), e.to(dtype)
    save_file(actual, str(tmp_path / "a.safetensors"))
    save_file(expected, str(tmp_path / "e.safetensors"))

    def report() -> str:
        compared = compare_files.diff_files(
            str(tmp_path / "a.safetensors"), str(tmp_path / "e.safetensors"), rtol=rtol, atol=atol
        )
        return to_json(compared.to_dict())

    together = report()
    monkeypatch.setattr(compare_files, "SMALL_ELEMENTS", 0)
    assert together == report()
    passed = json.loads(together)["tensors"]
    assert 100 < sum(t["passed"] for t in passed) < len(passed)
