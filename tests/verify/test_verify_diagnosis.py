"""A cause is named only when its model explains the evidence (issue 37, section 2): wrong
kernels of tests/kernels.py's catalogue (one subtle mistake each, forward or backward) are given
their own cause or none, never another; correct kernels pass on every data family.

The full matrix (every family, three gradient scales, two seeds) is marked slow; it is
benchmarks/verify_diagnosis.py, whose confusion table docs/verify-budget.md shows."""

from __future__ import annotations

import pytest
import torch

from maskln_cli.testing import verify
from tests import kernels


def judge(kernel, inputs, dtype=None):
    result = kernels.run(kernel, inputs, dtype)
    report = verify(
        result["out"], inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"], 1e-5,
        grad_out=inputs["grad_out"], grad_x=result["grad_x"], grad_scale=result["grad_scale"],
        grad_bias=result["grad_bias"],
    )  # fmt: skip
    return report, {t.name: t.to_dict() for t in report.tensors}


def causes(tensors):
    return {d["mistake"] for t in tensors.values() if not t["passed"] for d in t["diagnosis"]}


def named(name, family, scale=1.0, seed=0, dtype="float32"):
    inputs = kernels.DATA_FAMILIES[family](seed, dtype=dtype)
    inputs["grad_out"] = (inputs["grad_out"].double() * scale).to(inputs["grad_out"].dtype)
    report, tensors = judge(kernels.CATALOGUE[name].kernel, inputs)
    return report, tensors


SHOWN = {
    name: "spread 1e-2..10"
    if "eps" in name or name.startswith("variance clamped")
    else "offset 1e3"
    for name in kernels.CATALOGUE
}
"""A family where each mistake shows (eps matters on rows of small spread)."""
SHOWN.update({"statistics in the half dtype": "N(0, 300)", "one-pass variance": "offset 1e3"})


@pytest.mark.parametrize("name", list(kernels.CATALOGUE))
def test_no_wrong_cause_is_named(name):
    wrong = kernels.CATALOGUE[name]
    report, tensors = named(name, SHOWN[name], dtype=wrong.dtypes[0])
    assert not report.passed
    assert causes(tensors) <= wrong.causes, {n: t["diagnosis"] for n, t in tensors.items()}


@pytest.mark.parametrize("scale", [1.0, 1e-6])
@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("grad_x without its xhat term", "backward_missing_xhat_term"),
        ("grad_x without its mean term", "backward_missing_mean_term"),
        ("unbiased variance in the backward", "backward_unbiased_variance"),
        ("padding's grad_out in grad_scale, grad_bias", "padding_in_parameter_gradients"),
    ],
)
def test_the_backward_mistakes_are_named(name, cause, scale):
    """Before: a missing term had no diagnosis (or 'no square root' on a BERT dump), the
    unbiased backward was called the forward's unbiased variance (out is right), the padding
    summed into grad_bias had none."""
    _, tensors = named(name, "N(0, 1)", scale)
    assert tensors["out"]["passed"]
    failing = {n for n, t in tensors.items() if not t["passed"]}
    assert failing and all(
        [d["mistake"] for d in tensors[n]["diagnosis"]] == [cause] for n in failing
    ), {n: tensors[n]["diagnosis"] for n in failing}


@pytest.mark.parametrize(
    "family", ["offset 1e3", *(pytest.param(f, marks=pytest.mark.slow) for f in (
        "N(0, 1)", "spread 1e-2..10", "heavy tails", "C = 768, N(0, 1)",
    ))]
)  # fmt: skip
@pytest.mark.parametrize(
    "name", ["mean over C - 1", "c1 over C - 1", "last row: unbiased variance"]
)
def test_formula_mistakes_are_not_called_rounding(name, family):
    """Before: 'errors look like float16 rounding' (their size is a float16 kernel's): now a
    precision cause needs the dtype's granularity, which they do not have; said unknown, with
    where the error is."""
    _, tensors = named(name, family)
    assert not any(c.startswith("rounding_") for c in causes(tensors)), causes(tensors)
    for tensor in tensors.values():
        if not tensor["passed"] and not tensor["diagnosis"]:
            assert any("not one of the known mistakes" in p for p in tensor["problems"])


def test_a_row_sum_accumulated_in_float16_has_its_granularity_and_is_named():
    _, tensors = named("row sums in float16", "N(0, 1)")
    assert [d["mistake"] for d in tensors["out"]["diagnosis"]] == ["rounding_float16"]


@pytest.mark.parametrize("scale", [1.0, 1e-3])
def test_float16_statistics_overflowing_are_not_blamed_on_the_padding(scale):
    """Before: no cause on these rows, and 'NaN or inf from the padding of x' on rows of small
    spread, where this kernel's float16 statistics leave NaN in grad_x (the padding holds NaN
    too; see also the test below)."""
    _, tensors = named("statistics in the half dtype", "N(0, 300)", scale, dtype="float16")
    found = causes(tensors)
    assert found == {"statistics_overflow"}, {n: t["diagnosis"] for n, t in tensors.items()}


OVERFLOWING = {
    # the float16 backward's rstd**3 = eps**-1.5 on rows float16 stores as constant
    "all in float16": (kernels.all_in_half, "1e4 + N(0, 0.1)", "float16", 1.0),
    # c1 and c2 summed in float16, of an upstream gradient of 1e4
    "backward sums in float16": (kernels.written("half_backward_sums"), "N(0, 1)", "float32", 1e4),
}


@pytest.mark.parametrize("name", list(OVERFLOWING))
def test_nan_in_the_valid_rows_alone_is_not_blamed_on_the_padding(name):
    """Before: 'NaN or inf from the padding of x reaches grad_x' (the padding holds NaN; so
    does grad_x, but on the valid rows only: a kernel's rows are its own, and the padding's
    rows of grad_x are right). An overflow of the valid rows' own: not a cause of the
    catalogue here, so none is named, and where the error is is said."""
    kernel, family, dtype, scale = OVERFLOWING[name]
    inputs = kernels.DATA_FAMILIES[family](0, dtype=dtype)
    inputs["grad_out"] = inputs["grad_out"] * scale
    result = kernels.run(kernel, inputs)
    valid = inputs["valid"]
    assert not result["grad_x"][valid].isfinite().all() and (result["grad_x"][~valid] == 0).all()
    _, tensors = judge(kernel, inputs)
    assert tensors["out"]["passed"] and not tensors["grad_x"]["passed"]
    assert causes(tensors) == set(), {n: t["diagnosis"] for n, t in tensors.items()}
    problems = tensors["grad_x"]["problems"]
    assert "all in valid rows (the padding's are right)" in problems[0]
    # No cause named: the generic words, or in their place where grad_x's error is (c1 and c2
    # summed in float16 err on each row alike: its mean error beyond the row's rounding).
    assert (
        "not one of the known mistakes" in problems[-1]
        or "mean error on each row beyond that row's rounding" in problems[-1]
    ), problems


def test_a_forward_mistake_is_not_named_for_a_gradient_when_out_is_right():
    """grad_x / rstd fits 'another eps' on rows of one variance, but out is right and so is
    grad_scale (the backward's xhat): no eps explains it."""
    _, tensors = named("grad_x without rstd", "1e4 + N(0, 0.1)")
    assert tensors["out"]["passed"] and not tensors["grad_x"]["passed"]
    assert causes(tensors) == set()
    assert "not one of the known mistakes" in tensors["grad_x"]["problems"][0]


def test_where_an_unknown_mistake_is_is_said():
    _, tensors = named("last channel wrong", "N(0, 1)")
    assert causes(tensors) == set()
    assert tensors["out"]["problems"][0].endswith(
        "not one of the known mistakes: channel 63 (of 64)"
    )
    assert "element 63" in tensors["grad_scale"]["problems"][0]
    _, tensors = named("last row: unbiased variance", "N(0, 1)")
    assert tensors["out"]["problems"][0].endswith("not one of the known mistakes: row [7, 99]")


@pytest.mark.parametrize(
    "dtype", ["float32", "float16", *(pytest.param(d, marks=pytest.mark.slow) for d in (
        "bfloat16", "float64",
    ))]
)  # fmt: skip
def test_pytorch_passes_on_every_family(dtype):
    for family in kernels.DATA_FAMILIES:
        if family == "N(0, 300)" and dtype != "float16":
            continue
        inputs = kernels.DATA_FAMILIES[family](1, dtype=dtype)
        report, tensors = judge(kernels.torch_layer_norm, inputs)
        assert report.passed, (family, {n: t["problems"] for n, t in tensors.items()})


# --- the whole matrix ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(kernels.CATALOGUE))
def test_no_wrong_cause_on_any_family_scale_or_seed(name):
    from benchmarks.verify_diagnosis import SCALES

    wrong = kernels.CATALOGUE[name]
    for dtype in wrong.dtypes:
        for family in kernels.DATA_FAMILIES:
            if dtype == "float32" and family == "N(0, 300)":
                continue
            for scale in SCALES:
                for seed in (2, 3):
                    _, tensors = named(name, family, scale, seed, dtype)
                    assert causes(tensors) <= wrong.causes, (family, dtype, scale, seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(kernels.CORRECT_EVERYWHERE))
def test_correct_kernels_pass_on_every_family_scale_and_dtype(name):
    from benchmarks.verify_diagnosis import SCALES

    kernel, dtypes = kernels.CORRECT_EVERYWHERE[name]
    for dtype in dtypes:
        for family in kernels.DATA_FAMILIES:
            if family == "N(0, 300)" and dtype != "float16":
                continue
            for scale in SCALES:
                inputs = kernels.DATA_FAMILIES[family](4, dtype=dtype)
                upstream = inputs["grad_out"]
                inputs["grad_out"] = (upstream.double() * scale).to(upstream.dtype)
                report, tensors = judge(kernel, inputs)
                assert report.passed, (family, dtype, scale, {
                    n: t["problems"] for n, t in tensors.items()
                })  # fmt: skip


@pytest.mark.slow
def test_the_docs_table_is_the_scripts():
    """docs/verify-budget.md's confusion table is what benchmarks/verify_diagnosis.py makes."""
    from benchmarks import verify_diagnosis

    torch.set_num_threads(1)
    page = verify_diagnosis.DOCS.read_text()
    shown = page.split(verify_diagnosis.MARKER)[1].strip()
    counts = verify_diagnosis.confusion(list(kernels.CATALOGUE), seeds=1)[0]
    assert shown == verify_diagnosis.table(counts, list(kernels.CATALOGUE))
