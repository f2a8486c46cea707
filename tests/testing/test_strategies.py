"""maskln_cli.testing.strategies: the hard families are drawn, a one-pass variance is caught
within 150 examples and shrunk to a small case, PyTorch's own kernel passes them all."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, find, given, settings

from maskln_cli import masked_layer_normalization, testing
from maskln_cli.testing.strategies import layer_norm_inputs

RUNS = settings(
    max_examples=150, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
"""The issue's budget: a wrong kernel is caught within 150 examples, the same every run."""


def one_pass(x, valid, scale, bias, eps):
    """WRONG: the variance as E[x**2] - E[x]**2, in x's dtype."""
    rows = torch.where(valid[..., None], x, 0)
    mean = rows.mean(-1, keepdim=True)
    var = (rows * rows).mean(-1, keepdim=True) - mean * mean
    out = (rows - mean) / torch.sqrt(var.clamp_min(0) + eps) * scale + bias
    return torch.where(valid[..., None], out, 0)


def sanitized_layer_norm(x, valid, scale, bias, eps):
    """F.layer_norm with the padding zeroed before and after."""
    rows = torch.where(valid[..., None], x, 0)
    out = F.layer_norm(rows, (x.shape[-1],), scale, bias, eps)
    return torch.where(valid[..., None], out, 0)


def test_a_one_pass_variance_is_caught_and_shrunk_to_a_small_case():
    tried: list[bool] = []

    def fails(inputs) -> bool:
        tried.append(not testing.verify(one_pass(*inputs), *inputs).passed)
        return tried[-1]

    found = find(layer_norm_inputs(), fails, settings=RUNS)  # raises if none of 150 fails
    assert tried.index(True) < 150  # the first failure, before shrinking
    rows, channels = found.x.reshape(-1, found.x.shape[-1]).shape
    assert rows <= 2 and channels <= 8, found
    report = testing.verify(one_pass(*found), *found)
    assert report.tensors[0].diagnosis[0]["mistake"] == "one_pass_variance"


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.float64, marks=pytest.mark.slow), torch.bfloat16],
)
def test_pytorch_s_layer_norm_passes_every_example_with_gradients(dtype):
    """scale and bias in x's dtype. (PyTorch's CPU backward for bfloat16 x with float32 weights
    rounds grad_scale and grad_bias to bfloat16, relative L2 about 7e-3 where a float32 kernel's
    is 1e-7: they are judged in x's dtype, tests/verify/test_mixed_weights.py; the
    mixed-precision kernels are tested below.)"""

    @RUNS
    @given(layer_norm_inputs([dtype], grad_out=True, param_dtypes=[None]))
    def check(inputs):
        x, valid, scale, bias, eps, grad_out = inputs
        leaves = [t.detach().requires_grad_() for t in (x, scale, bias)]
        out = sanitized_layer_norm(leaves[0], valid, leaves[1], leaves[2], eps)
        grads = torch.autograd.grad(out, leaves, torch.where(valid[..., None], grad_out, 0))
        testing.assert_close(
            out, x, valid, scale, bias, eps, grad_out=grad_out,
            **dict(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True)),
        )  # fmt: skip

    check()


def test_pytorch_s_layer_norm_passes_every_float16_example():
    @RUNS
    @given(layer_norm_inputs([torch.float16]))
    def check(inputs):
        testing.assert_close(sanitized_layer_norm(*inputs), *inputs)

    check()


def _constant_row(i) -> bool:
    rows = _valid_rows(i)
    return i.x.shape[-1] > 1 and bool((rows == rows[:, :1]).all(dim=1).any())


def _tiny_variance(i) -> bool:
    rows = _valid_rows(i)
    if i.x.shape[-1] == 1 or not len(rows):
        return False
    return bool(((rows.var(dim=1, correction=0) < 1e-9) & (rows != 0).all(dim=1)).any())


FAMILIES = {
    "constant rows": _constant_row,
    "a row of exact zeros": lambda i: bool((_valid_rows(i) == 0).all(dim=1).any()),
    "exact zeros among values": lambda i: bool(
        ((_valid_rows(i) == 0).any(dim=1) & (_valid_rows(i) != 0).any(dim=1)).any()
    ),
    "an offset of 1e4 or more": lambda i: bool((_valid_rows(i).mean(dim=1).abs() > 9e3).any()),
    "heavy tails": lambda i: bool((_valid_rows(i).abs().amax(dim=1) > 1e5).any()),
    "tiny variance": _tiny_variance,
    "NaN padding": lambda i: bool(i.x[~i.valid].isnan().any()),
    "inf padding": lambda i: bool(i.x[~i.valid].isinf().any()),
    "every row invalid": lambda i: not bool(i.valid.any()),
    "one channel": lambda i: i.x.shape[-1] == 1,
    "a width one past a power of two": lambda i: i.x.shape[-1] in (17, 33, 65, 129, 257, 513),
    "a prime width": lambda i: i.x.shape[-1] in (13, 37, 61, 131, 251, 509, 1021),
    "channels not contiguous": lambda i: i.x.stride(-1) != 1,
    "rows not contiguous": lambda i: i.x.stride(-1) == 1 and not i.x.is_contiguous(),
    "two leading axes": lambda i: i.x.dim() == 3,
    "float16": lambda i: i.x.dtype == torch.float16,
    "float16 x, float16 scale and bias": lambda i: i.scale.dtype == torch.float16,
    "float16 x, float32 scale and bias": lambda i: (
        i.x.dtype == torch.float16 and i.scale.dtype == torch.float32
    ),
}


def test_every_family_is_drawn_and_every_valid_row_is_finite():
    seen: dict[str, int] = dict.fromkeys(FAMILIES, 0)

    @settings(RUNS, max_examples=300, phases=[Phase.generate])
    @given(layer_norm_inputs([torch.float32, torch.float16]))
    def draw(inputs):
        assert bool(_valid_rows(inputs).isfinite().all())  # finite, within the dtype
        for family, holds in FAMILIES.items():
            seen[family] += bool(holds(inputs))

    draw()
    assert min(seen.values()) >= 3, seen  # each family in at least 1% of 300 draws


def _valid_rows(inputs) -> torch.Tensor:
    return inputs.x.reshape(-1, inputs.x.shape[-1])[inputs.valid.reshape(-1)].double()


@RUNS
@given(layer_norm_inputs([torch.float32, torch.bfloat16], grad_out=True, max_rows=6))
def test_every_draw_is_well_formed(inputs):
    x, valid, scale, bias, eps, grad_out = inputs
    assert valid.dtype == torch.bool and valid.shape == x.shape[:-1]
    assert scale.shape == bias.shape == (x.shape[-1],)
    assert scale.dtype == bias.dtype and grad_out.dtype == x.dtype and eps > 0
    assert scale.dtype in ((x.dtype, torch.float32) if x.dtype == torch.bfloat16 else (x.dtype,))
    assert grad_out.shape == x.shape and 1 <= valid.numel() <= 6
    assert bool(_valid_rows(inputs).isfinite().all())
    assert bool(grad_out[valid].isfinite().all())


@pytest.mark.parametrize(
    ("param_dtypes", "expected"),
    [
        (None, {(torch.float16, torch.float16), (torch.float16, torch.float32),
                (torch.float32, torch.float32)}),
        ([None], {(torch.float16, torch.float16), (torch.float32, torch.float32)}),
        ([torch.float32], {(torch.float16, torch.float32), (torch.float32, torch.float32)}),
        ([torch.float64, None], {(torch.float16, torch.float64), (torch.float16, torch.float16),
                                 (torch.float32, torch.float64), (torch.float32, torch.float32)}),
    ],
    ids=["default", "x's", "float32", "float64 or x's"],
)  # fmt: skip
def test_scale_and_bias_are_drawn_in_the_dtypes_asked(param_dtypes, expected):
    """By default half x gets float32 scale and bias too, as mixed-precision models keep them;
    None stands for x's dtype."""
    seen = set()

    @settings(RUNS, max_examples=50, phases=[Phase.generate])
    @given(layer_norm_inputs([torch.float16, torch.float32], param_dtypes=param_dtypes))
    def draw(inputs):
        assert inputs.scale.dtype == inputs.bias.dtype
        seen.add((inputs.x.dtype, inputs.scale.dtype))

    draw()
    assert seen == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_correct_mixed_precision_kernels_pass_every_example_with_gradients(dtype):
    """maskln's op and a kernel computing in float32 from half x, on half x with scale and
    bias in x's dtype or float32, gradients included (check_kernel: by autograd)."""

    def float32_kernel(x, valid, scale, bias, eps):
        keep = valid[..., None]
        rows = torch.where(keep, x.float(), 0)
        mean = rows.mean(-1, keepdim=True)
        centered = rows - mean
        rstd = torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)
        return torch.where(keep, centered * rstd * scale.float() + bias.float(), 0).to(x.dtype)

    mixed = []

    @settings(RUNS, max_examples=60)
    @given(layer_norm_inputs([dtype], grad_out=True))
    def check(inputs):
        mixed.append(inputs.scale.dtype != dtype)
        for kernel in (masked_layer_normalization, float32_kernel):
            testing.check_kernel(kernel, *inputs)

    check()
    assert 10 < sum(mixed) < len(mixed) - 10


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="dtypes must be floating torch dtypes"):
        layer_norm_inputs([torch.int32])
    with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
        layer_norm_inputs(max_rows=0)
    with pytest.raises(ValueError, match="channels must be ints >= 1"):
        layer_norm_inputs(channels=[0])
    with pytest.raises(ValueError, match="param_dtypes must be floating torch dtypes or None"):
        layer_norm_inputs(param_dtypes=[torch.int8])
    with pytest.raises(ValueError, match="param_dtypes must be floating torch dtypes or None"):
        layer_norm_inputs(param_dtypes=[])


def test_without_hypothesis_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    monkeypatch.delitem(sys.modules, "maskln_cli.testing.strategies")
    with pytest.raises(ImportError, match=r"pip install 'maskln\[testing\]'"):
        importlib.import_module("maskln_cli.testing.strategies")


def test_the_package_and_the_plugin_import_neither_torch_nor_hypothesis():
    """pytest loads the plugin in every run where maskln is installed."""
    code = (
        "import sys, maskln_cli, maskln_cli.testing, maskln_cli.testing.plugin\n"
        "print(sorted(m for m in ('torch', 'hypothesis') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
