"""The fast path of :meth:`Comparison.update` (blocks measured on worker threads, then merged)
against the general path: every figure the same, bit for bit, on random chunks with NaN, inf,
-0.0, huge and tiny values, in every floating dtype, with and without allowances, yardsticks,
budget units and invalid rows."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maskln_cli.compare import comparison as compare
from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import PerElement
from maskln_cli.op.threads import map_blocks

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30, -1e-30, 3e38, -3e38, 1e300, 65504.0]


def _chunk(
    draw: st.DrawFn, rows: int, length: int, dtype: torch.dtype, special: bool
) -> torch.Tensor:
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-6, 1.0, 1e4]))
    values = torch.randn(rows, length, generator=generator, dtype=torch.float64) * scale
    if special:
        count = draw(st.integers(1, 6))
        for _ in range(count):
            row = draw(st.integers(0, rows - 1))
            column = draw(st.integers(0, length - 1))
            values[row, column] = draw(st.sampled_from(SPECIAL))
    return values.to(dtype)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    rows = draw(st.integers(1, 24))
    length = draw(st.sampled_from([1, 3, 8, 33]))
    actual_dtype = draw(st.sampled_from(DTYPES))
    verify = draw(st.booleans())  # verify's way: float64 expected, allowances, yardstick
    expected_dtype = torch.float64 if verify else draw(st.sampled_from(DTYPES))
    expected = _chunk(draw, rows, length, expected_dtype, draw(st.booleans()))
    noise = _chunk(draw, rows, length, torch.float64, False) * draw(
        st.sampled_from([0.0, 1e-7, 1e-3, 1.0])
    )
    actual = (expected.double() + noise).to(actual_dtype)
    if draw(st.booleans()):  # special values in actual too, some where expected has them
        actual = torch.where(
            _chunk(draw, rows, length, torch.float64, True).isfinite(),
            actual,
            expected.to(actual_dtype),
        )
    if draw(st.booleans()):
        actual[draw(st.integers(0, rows - 1))] = draw(st.sampled_from([0.0, -0.0, 1e-9]))
    case: dict[str, object] = {
        "actual": actual,
        "expected": expected,
        "rank_by_ratio": verify,
        "tolerance": draw(st.sampled_from([(None, None), (0.0, 0.0), (1e-3, 0.0), (0.0, 1e-5)])),
    }
    if draw(st.booleans()):
        case["invalid_rows"] = torch.rand(rows, generator=torch.Generator().manual_seed(rows)) > 0.6
    if verify:
        unit = _chunk(draw, rows, length, torch.float64, False).abs() * 1e-3
        if draw(st.booleans()):
            unit[0] = 0.0
        always = expected.double().abs().mul(1e-6).add(1e-7)
        allowance = torch.maximum(unit * 3, always)
        if "invalid_rows" in case:
            invalid = case["invalid_rows"].unsqueeze(1)  # type: ignore[union-attr]
            allowance = allowance.masked_fill(invalid, 0.0)
            always = always.masked_fill(invalid, math.inf)
        case["allowance"] = allowance
        if draw(st.booleans()):
            case["budget_unit"], case["always"] = unit, always
        if draw(st.booleans()):
            yardstick = (expected.double() + noise / 2).to(actual_dtype)
            if draw(st.booleans()):
                yardstick[0, 0] = draw(st.sampled_from([math.nan, math.inf]))
            case["yardstick"] = yardstick
    case["chunks"] = draw(st.integers(1, 3))
    return case


def _figures(comparison: Comparison) -> dict[str, object]:
    figures = comparison.result().to_dict()
    figures.update(
        failing_rows=list(comparison.failing_rows),
        beyond=comparison.beyond,
        beyond_in_invalid_rows=comparison.beyond_in_invalid_rows,
        nonfinite_in_invalid_rows=comparison.nonfinite_in_invalid_rows,
        factor_needed_=comparison.factor_needed(),
        yardstick_row_error_sum=comparison.yardstick_row_error_sum,
    )
    return figures


def _same(fast: object, general: object) -> bool:
    """Equal, NaN equal to NaN, and 0.0 told from -0.0."""
    if isinstance(fast, float) and isinstance(general, float):
        if math.isnan(fast) or math.isnan(general):
            return math.isnan(fast) and math.isnan(general)
        return fast == general and math.copysign(1, fast) == math.copysign(1, general)
    if isinstance(fast, dict) and isinstance(general, dict):
        return fast.keys() == general.keys() and all(_same(fast[k], general[k]) for k in fast)
    if isinstance(fast, list) and isinstance(general, list):
        return len(fast) == len(general) and all(map(_same, fast, general))
    return fast == general


def _run(case: dict[str, object], fast: bool) -> dict[str, object]:
    actual, expected = case["actual"], case["expected"]
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    rtol, atol = case["tolerance"]  # type: ignore[misc]
    comparison = Comparison(
        "t", list(actual.shape), str(actual.dtype).removeprefix("torch."),
        list(expected.shape), str(expected.dtype).removeprefix("torch."), rtol, atol,
        rank_by_ratio=bool(case["rank_by_ratio"]), same_dtype=False,
    )  # fmt: skip
    rows = actual.shape[0]
    step = max(1, -(-rows // int(case["chunks"])))  # type: ignore[call-overload]
    per_row = ("invalid_rows",)
    per_element = ("allowance", "yardstick", "budget_unit", "always")
    for start in range(0, rows, step):
        part = slice(start, start + step)
        extra = {k: case[k][part] for k in per_row + per_element if k in case}  # type: ignore[index]
        if fast:
            comparison.update(actual[part], expected[part], **extra)
        else:
            invalid_rows = extra.pop("invalid_rows", None)
            comparison._update_general(
                actual[part], expected[part], invalid_rows, PerElement(**extra)
            )
    return _figures(comparison)


@settings(deadline=None)
@given(case=cases(), block=st.sampled_from([1, 8, 40, 1 << 16]))
def test_fast_path_matches_the_general_path(case: dict[str, object], block: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compare, "BLOCK_ELEMENTS", block)
        fast = _run(case, fast=True)
    general = _run(case, fast=False)
    differing = [k for k in general if not _same(fast[k], general[k])]
    assert not differing, {k: (fast[k], general[k]) for k in differing}


def test_blocks_run_on_worker_threads_and_threads_are_restored() -> None:
    threads = torch.get_num_threads()
    seen = map_blocks(lambda _: torch.get_num_threads(), list(range(4)))
    assert torch.get_num_threads() == threads
    assert seen == [1] * 4 if threads > 1 else seen == [threads] * 4


def test_a_clean_chunk_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk without NaN or inf never reaches the general path (the point of it)."""

    def general(*args: object, **kwargs: object) -> None:
        raise AssertionError("general path taken")

    monkeypatch.setattr(Comparison, "_update_general", general)
    monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 16)
    comparison = Comparison("t", [20, 4], "float32", [20, 4], "float32")
    values = torch.randn(20, 4)
    comparison.update(values + 1e-3, values)
    assert comparison.result().mismatched == 80


VERIFY_CASES = [
    ("two_pass", 0.0, "float32", ()),
    ("two_pass", 1e3, "float32", ()),
    ("one_pass", 1e3, "float32", ()),
    ("eps_outside", 0.0, "float32", ("--tolerance", "fixed")),
    ("padding_returns_bias", 0.0, "float32", ("--strict",)),
    ("nan_leak", 0.0, "float32", ()),
    ("torch_layer_norm", 0.0, "bfloat16", ()),
    ("torch_layer_norm", 0.0, "float16", ("--rtol", "1e-4", "--atol", "0")),
]


@pytest.mark.parametrize(("kernel", "offset", "dtype", "options"), VERIFY_CASES)
def test_verify_in_blocks_reports_what_whole_chunks_report(
    tmp_path, monkeypatch: pytest.MonkeyPatch, kernel: str, offset: float, dtype: str,
    options: tuple[str, ...],
) -> None:  # fmt: skip
    """``maskln verify`` without gradients computes a chunk's rows in blocks on worker threads
    (StreamingPass._start_chunks, BlockWork.measure); its JSON is byte for byte that of whole
    chunks (StreamingPass._chunk)."""
    from tests import kernels

    inputs = kernels.offset_batch(offset, seed=7, shape=(4, 96, 40), dtype=dtype)
    del inputs["grad_out"]
    result = kernels.run(getattr(kernels, kernel), inputs)
    merged = _verify_blocked_and_whole(
        tmp_path, monkeypatch, inputs, {"out": result["out"]}, options
    )
    assert merged or kernel == "nan_leak"  # NaN takes the general path


@pytest.mark.parametrize(
    ("kernel", "options"),
    [
        ("two_pass", ()),
        ("one_pass", ()),
        ("padding_returns_bias", ("--strict",)),
        ("eps_outside", ("--tolerance", "fixed")),
        ("nan_leak", ()),
    ],
)
def test_verify_valid_in_blocks_reports_what_whole_chunks_report(
    tmp_path, monkeypatch: pytest.MonkeyPatch, kernel: str, options: tuple[str, ...]
) -> None:
    """With ``--valid`` too: rows left out (here garbage, one NaN) agree on every side."""
    from tests import kernels

    inputs = kernels.offset_batch(1e3, seed=8, shape=(4, 96, 40), dtype="float32")
    del inputs["grad_out"]
    out = kernels.run(getattr(kernels, kernel), inputs)["out"].clone()
    keep = torch.rand(inputs["valid"].shape, generator=torch.Generator().manual_seed(9)) > 0.3
    out[~keep] = 123.0
    out[tuple((~keep).nonzero()[0])] = math.nan
    tensors = {"out": out, "keep": keep}
    options = ("--valid", "RESULT:keep", *options)
    merged = _verify_blocked_and_whole(tmp_path, monkeypatch, inputs, tensors, options)
    assert merged or kernel == "nan_leak"


def _verify_blocked_and_whole(
    tmp_path, monkeypatch: pytest.MonkeyPatch, inputs: dict, result: dict,
    options: tuple[str, ...],
) -> bool:  # fmt: skip
    """Run ``maskln verify --json`` in blocks of 7 rows, then with whole chunks of 50 rows
    only; assert the same exit code and bytes, and return whether blocks were merged."""
    from maskln_cli.verify import blockwork, measure
    from tests.clitools import invoke, write

    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    target = write(tmp_path / "result.safetensors", result)
    options = tuple(f"{target}:keep" if o == "RESULT:keep" else o for o in options)
    monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 40 * 7)  # blocks of 7 rows
    monkeypatch.setattr(measure, "CHUNK_ELEMENTS", 40 * 50)  # chunks of 50 rows
    merged: list[int] = []
    merge = Comparison.merge

    def counted(self: Comparison, *args: object) -> None:
        merged.append(1)
        merge(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Comparison, "merge", counted)
    blocked = invoke("verify", source, target, "--json", *options)
    # Every block as one holding NaN or inf: each chunk compared whole.
    monkeypatch.setattr(blockwork.BlockWork, "measure", lambda self, start, stop: None)
    whole = invoke("verify", source, target, "--json", *options)
    assert blocked.exit_code == whole.exit_code and blocked.exit_code in (0, 1)
    assert blocked.stdout == whole.stdout
    return bool(merged)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_a_block_kept_error_is_the_float64_difference_and_changes_no_figure(
    dtype: torch.dtype,
) -> None:
    """``keep_error``: the block's figures hold ``actual - expected`` in float64, bit for bit
    the difference of the values promoted (however it is computed), and every other figure is
    that of the block measured without it."""
    generator = torch.Generator().manual_seed(3)
    expected = torch.randn(64, 32, generator=generator, dtype=torch.float64) * 7
    actual = (expected + 1e-3 * torch.randn(64, 32, generator=generator, dtype=torch.float64)).to(
        dtype
    )
    invalid = torch.zeros(64, dtype=torch.bool)
    measured = {}
    for keep in (False, True):
        comparison = Comparison("out", [64, 32], str(dtype)[6:], [64, 32], "float64")
        measured[keep] = comparison.measure(actual, expected, invalid, keep_error=keep)
    assert measured[False] is not None and measured[True] is not None
    assert measured[False].error is None
    error = measured[True].error
    assert error is not None and error.dtype == torch.float64
    truth = torch.tensor(
        [
            float(a) - float(e)
            for a, e in zip(actual.reshape(-1).tolist(), expected.reshape(-1).tolist(), strict=True)
        ],
        dtype=torch.float64,
    )  # Python floats: each element's promoted difference, independently
    assert torch.equal(error, truth)
    measured[True].error = None
    for item in dataclasses.fields(measured[False]):
        plain, kept = getattr(measured[False], item.name), getattr(measured[True], item.name)
        if isinstance(plain, torch.Tensor):
            assert torch.equal(plain, kept), item.name
        else:
            assert repr(plain) == repr(kept), item.name


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_padding_of_is_the_plain_count(dtype: torch.dtype, data: st.DataObject) -> None:
    """padding_of (its first pass by the least and greatest value) finds what comparing with
    0 and reading the sign bits finds, on paddings of +0.0 and -0.0 with or without one
    other value (NaN, inf, the smallest subnormal, 1)."""
    from maskln_cli.compare.figures import padding_of

    rows, length = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 9))
    signs = data.draw(st.lists(st.booleans(), min_size=rows * length, max_size=rows * length))
    values = torch.tensor([-0.0 if s else 0.0 for s in signs]).view(rows, length)
    other = data.draw(st.sampled_from([None, math.nan, math.inf, -math.inf, 1.0, -1.0, 1e-45]))
    if other is not None:
        values.view(-1)[data.draw(st.integers(0, rows * length - 1))] = other
    padded = values.to(dtype)
    zeros = padded.double() == 0
    expected = (bool(zeros.all()), int((zeros & padded.double().signbit()).sum()))
    assert padding_of(padded) == expected
