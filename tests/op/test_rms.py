"""The RMSNorm op's contract (issue 39), checked against independent float64 references.

Two oracles: maskln_cli.op.reference.reference_masked_rms_norm (the formula, out of place in
float64) and the plain-ops peer ``x * rsqrt(mean(x**2) + eps) * (offset + scale)`` in float64 on
the valid rows alone (tests may use torch's own F.rms_norm; the op may not). Each test runs on
whichever backend the suite runs (native by default, raw with MASKLN_BACKEND=raw); the shared
machinery (checks, ways, modules) is the LayerNorm op's, so this file checks what RMSNorm adds.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import maskln_cli
from maskln_cli import MaskedRMSNorm, masked_rms_normalization
from maskln_cli.op.functional import masked_norm_functional
from maskln_cli.op.norms import RMS
from maskln_cli.op.reference import reference_masked_rms_norm
from tests.op.test_core import (
    LAYOUTS,
    TOLERANCE,
    RecordOps,
    apply_layout,
    forbidden_ops,
    poison_invalid_rows,
)

OFFSETS = (0.0, 1.0)


def make_rms_inputs(leading, channels, dtype=torch.float64, seed=0, valid_fraction=0.7,
                    poison=False, mean=0.5, spread=2.0, offset=0.0):  # fmt: skip
    """x, valid and scale; with ``offset`` 1 the scale is near 0 (Gemma's zero-centred gain)."""
    generator = torch.Generator().manual_seed(seed)
    x = mean + spread * torch.randn(*leading, channels, generator=generator, dtype=torch.float64)
    valid = torch.rand(leading, generator=generator) < valid_fraction
    scale = 1.0 - offset + 0.5 * torch.randn(channels, generator=generator, dtype=torch.float64)
    if poison:
        x = poison_invalid_rows(x, valid)
    return x.to(dtype), valid, scale.to(dtype)


def peer(x, valid, scale, eps, offset):
    """The plain-ops RMSNorm of the issue, in float64, zeroed where invalid."""
    x = torch.where(valid[..., None], x.double(), 0.0)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + scale.double())
    return y.masked_fill(~valid[..., None], 0.0)


def reference_gradients(x, valid, scale, eps, offset, grad_out):
    leaves = [t.detach().double().requires_grad_() for t in (x, scale)]
    out = reference_masked_rms_norm(leaves[0], valid, leaves[1], eps, offset)
    return torch.autograd.grad(out, leaves, grad_out.double())


def assert_matches_reference(out, x, valid, scale, eps, offset):
    expected = reference_masked_rms_norm(x, valid, scale, eps, offset)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[x.dtype])


def assert_no_padding_in(tensor, valid):
    rows = tensor[~valid]
    assert torch.equal(rows, torch.zeros_like(rows)) and not rows.signbit().any()


# --- the worked example and the signature -------------------------------------------------------


def test_worked_example_and_signature():
    """[3, 4]: mean square 12.5, with eps 3.5 its root is 4; Gemma's gain 1 + [0, 1]."""
    x = torch.tensor([[[3.0, 4.0], [math.nan, math.inf]]], dtype=torch.float64)
    valid, scale = torch.tensor([[True, False]]), torch.tensor([0.0, 1.0], dtype=torch.float64)
    out = masked_rms_normalization(x, valid, scale, eps=3.5, offset=1.0)
    assert out.tolist() == [[[0.75, 2.0], [0.0, 0.0]]]
    assert masked_rms_normalization(x, valid, scale, 3.5).tolist() == [[[0.0, 1.0], [0.0, 0.0]]]
    parameters = inspect.signature(masked_rms_normalization).parameters
    assert list(parameters) == ["x", "valid", "scale", "eps", "offset"]
    assert parameters["eps"].default == 1e-6 and parameters["offset"].default == 0.0
    assert parameters["offset"].kind is inspect.Parameter.KEYWORD_ONLY
    assert maskln_cli.masked_rms_normalization is masked_rms_normalization
    assert maskln_cli.MaskedRMSNorm is MaskedRMSNorm


# --- values against the references, over random shapes, dtypes, layouts and masks ---------------


@st.composite
def cases(draw, dtypes=(torch.float32, torch.float64)):
    leading = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    channels = draw(st.integers(1, 40))
    offset = draw(st.sampled_from([0.0, 1.0, -0.5]))
    x, valid, scale = make_rms_inputs(
        leading, channels, draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)),
        valid_fraction=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])), poison=draw(st.booleans()),
        mean=draw(st.sampled_from([0.0, 3.0, -7.0])),
        spread=draw(st.sampled_from([1e-2, 1.0, 30.0])), offset=offset,
    )  # fmt: skip
    x = apply_layout(x, draw(st.sampled_from(LAYOUTS)))
    if draw(st.booleans()):  # non-contiguous scale and valid too
        scale = apply_layout(scale, "stepped")
        valid = apply_layout(valid[..., None], "stepped" if valid.dim() else "contiguous")[..., 0]
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1, 3.0]))
    return x, valid, scale, eps, offset


@given(cases())
def test_values_match_both_float64_oracles_and_padding_is_positive_zero(case):
    x, valid, scale, eps, offset = case
    out = masked_rms_normalization(x, valid, scale, eps, offset=offset)
    assert_matches_reference(out, x, valid, scale, eps, offset)
    torch.testing.assert_close(out.double(), peer(x, valid, scale, eps, offset),
                               **TOLERANCE[x.dtype])  # fmt: skip
    assert out.stride() == torch.empty_like(x).stride()
    assert_no_padding_in(out, valid)
    assert out[valid].isfinite().all()


@given(cases(dtypes=(torch.float64,)), st.integers(0, 2**16))
def test_gradients_match_the_reference(case, seed):
    x, valid, scale, eps, offset = case
    leaves = [t.detach().clone().requires_grad_() for t in (x, scale)]
    out = masked_rms_normalization(leaves[0], valid, leaves[1], eps, offset=offset)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)
    grads = torch.autograd.grad(out, leaves, grad_out)
    expected = reference_gradients(x, valid, scale, eps, offset, grad_out)
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-8, atol=1e-8)
    assert_no_padding_in(grads[0], valid)


def test_valid_rows_match_torch_rms_norm():
    """A third oracle: torch's F.rms_norm in float64 on the valid rows."""
    x, valid, scale = make_rms_inputs((6, 7), 33, torch.float32, poison=True)
    out = masked_rms_normalization(x, valid, scale, 1e-5)
    want = F.rms_norm(x[valid].double(), (33,), scale.double(), 1e-5)
    torch.testing.assert_close(out[valid].double(), want, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset", OFFSETS)
def test_half_dtypes_are_computed_in_float32_and_returned_in_their_dtype(dtype, offset):
    x, valid, scale = make_rms_inputs((6, 7), 24, dtype, poison=True, offset=offset)
    out = masked_rms_normalization(x, valid, scale, offset=offset)
    assert out.dtype == dtype
    as_float32 = masked_rms_normalization(x.float(), valid, scale.float(), offset=offset)
    assert torch.equal(out, as_float32.to(dtype))  # rounded once
    assert_matches_reference(out, x, valid, scale, 1e-6, offset)
    with_float32_scale = masked_rms_normalization(x, valid, scale.float(), offset=offset)
    assert with_float32_scale.dtype == dtype  # autocast's mix: half x, float32 parameters
    leaves = [t.clone().requires_grad_() for t in (x, scale.float())]
    out = masked_rms_normalization(leaves[0], valid, leaves[1], offset=offset)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert grads[0].dtype == dtype and grads[1].dtype == torch.float32
    expected = reference_gradients(x, valid, scale, 1e-6, offset, torch.ones_like(out))
    torch.testing.assert_close(grads[0].double(), expected[0], **TOLERANCE[dtype])
    torch.testing.assert_close(grads[1].double(), expected[1], rtol=1e-4, atol=1e-4)


# --- data families random draws never make ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_and_constant_rows_and_one_channel(dtype):
    """A zero row is 0 (rstd 1/sqrt(eps)), with the gradient eps gives; a constant row is its
    sign times sqrt(c**2 / (c**2 + eps)); one channel likewise."""
    eps = 1e-6
    x = torch.tensor([[0.0] * 4, [2.5] * 4, [-1e-3] * 4], dtype=dtype)
    valid = torch.ones(3, dtype=torch.bool)
    scale = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=dtype)
    leaves = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
    out = masked_rms_normalization(leaves[0], valid, leaves[1], eps)
    assert torch.equal(out[0], torch.zeros(4, dtype=dtype))
    assert_matches_reference(out, x, valid, scale, eps, 0.0)
    dy = torch.arange(12, dtype=dtype).reshape(3, 4)
    grads = torch.autograd.grad(out, leaves, dy)
    for got, want in zip(grads, reference_gradients(x, valid, scale, eps, 0.0, dy), strict=True):
        torch.testing.assert_close(got.double(), want, **TOLERANCE[dtype])
    torch.testing.assert_close(grads[0][0].double(), dy[0].double() * scale.double() / eps**0.5,
                               **TOLERANCE[dtype])  # fmt: skip
    one = masked_rms_normalization(torch.tensor([[3.0], [-2.0]], dtype=dtype), valid[:2],
                                   torch.ones(1, dtype=dtype), eps)  # fmt: skip
    torch.testing.assert_close(one.double().flatten(), torch.tensor([3 / (9 + eps) ** 0.5,
                               -2 / (4 + eps) ** 0.5], dtype=torch.float64))  # fmt: skip


def test_nan_and_inf_in_the_padding_reach_nothing():
    x, valid, scale = make_rms_inputs((5, 6), 16, valid_fraction=0.5, offset=1.0)
    clean = torch.where(valid[..., None], x, 0.0)
    poisoned = poison_invalid_rows(x, valid)
    dy = torch.randn(x.shape, dtype=x.dtype)
    dy_poisoned = torch.where(valid[..., None], dy, math.nan)
    results = []
    for x_in, dy_in in ((clean, dy), (poisoned, dy_poisoned)):
        leaves = [x_in.clone().requires_grad_(), scale.clone().requires_grad_()]
        out = masked_rms_normalization(leaves[0], valid, leaves[1], offset=1.0)
        results.append((out, *torch.autograd.grad(out, leaves, dy_in)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert_no_padding_in(results[1][0], valid)
    assert_no_padding_in(results[1][1], valid)


def test_all_rows_invalid_empty_inputs_and_nan_in_a_valid_row():
    x, valid, scale = make_rms_inputs((3,), 4, valid_fraction=0.0, poison=True)
    leaves = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
    out = masked_rms_normalization(leaves[0], valid, leaves[1])
    grads = torch.autograd.grad(out.sum(), leaves)
    assert not out.any() and not grads[0].any() and not grads[1].any()
    for shape in ((0, 4), (2, 0), (0,)):
        empty = torch.empty(shape)
        got = masked_rms_normalization(empty, torch.ones(shape[:-1], dtype=torch.bool),
                                       torch.ones(shape[-1]))  # fmt: skip
        assert got.shape == empty.shape and got.dtype == empty.dtype
    x = torch.tensor([[1.0, math.nan], [1.0, 2.0]], dtype=torch.float64)
    out = masked_rms_normalization(x, torch.tensor([True, True]), torch.ones(2, dtype=x.dtype))
    assert out[0].isnan().all()  # NaN in a valid row is the user's data: as the formula
    assert_matches_reference(out[1:], x[1:], torch.tensor([True]), torch.ones(2, dtype=x.dtype),
                             1e-6, 0.0)  # fmt: skip


# --- autograd, and the machinery shared with the LayerNorm op -----------------------------------


@pytest.mark.parametrize("needs", ["x", "scale", "x+scale"])
@pytest.mark.parametrize("offset", OFFSETS)
def test_gradcheck_and_gradgradcheck_with_every_check(needs, offset):
    """Forward AD, batched gradients and forward gradients, second order both ways."""
    x, valid, scale = make_rms_inputs((2, 3), 4, poison=True, valid_fraction=0.6, offset=offset)
    inputs = {"x": x, "scale": scale}
    names = needs.split("+")
    args = tuple(inputs[name].clone().requires_grad_() for name in names)

    def op(*differentiable):
        values = dict(inputs, **dict(zip(names, differentiable, strict=True)))
        return masked_rms_normalization(values["x"], valid, values["scale"], 1e-3, offset=offset)

    assert torch.autograd.gradcheck(
        op, args, check_forward_ad=True, check_batched_grad=True, check_batched_forward_grad=True
    )
    assert torch.autograd.gradgradcheck(
        op, args, check_fwd_over_rev=True, check_rev_over_rev=True, check_batched_grad=True
    )


def test_no_ready_made_normalization_runs():
    """Neither rms_norm nor layer_norm nor any other norm op of torch, forward or backward."""
    x, valid, scale = make_rms_inputs((4, 5), 8, torch.float32, poison=True)
    leaves = [x.clone().requires_grad_(), scale.clone().requires_grad_()]
    with RecordOps() as recorded:
        out = masked_rms_normalization(leaves[0], valid, leaves[1], offset=1.0)
        out.backward(torch.ones_like(out))
    assert recorded.ops and not forbidden_ops(recorded.ops), recorded.ops


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"offset": math.nan}, ValueError, "offset must be a finite number, got nan"),
        ({"offset": math.inf}, ValueError, "offset must be a finite number"),
        ({"offset": True}, TypeError, "offset must be a finite number, got bool"),
        ({"offset": "1"}, TypeError, "offset must be a finite number, got str"),
        ({"eps": 0.0}, ValueError, "eps must be a finite positive number"),
        ({"eps": 1e-50}, ValueError, "eps 1e-50 rounds to 0 in float32"),
        ({"scale": torch.ones(5, dtype=torch.float64)}, TypeError, "scale must have x's dtype"),
        ({"scale": torch.ones(4)}, ValueError, r"scale must have shape \[5\]"),
        ({"valid": torch.tensor([1, 2, 0])}, ValueError, "valid must hold only 0 and 1"),
        ({"x": torch.zeros(3, 5, dtype=torch.int64)}, TypeError, "x must be a float32, float64"),
    ],
)  # fmt: skip
def test_bad_input_raises_naming_the_argument(change, error, message):
    arguments = {"x": torch.zeros(3, 5), "valid": torch.ones(3, dtype=torch.bool),
                 "scale": torch.ones(5), "eps": 1e-6, "offset": 0.0, **change}  # fmt: skip
    with pytest.raises(error, match=message):
        masked_rms_normalization(**arguments)
    if change.keys() & {"valid"} or type(next(iter(change.values()))) in (bool, str):
        return  # a mask of numbers is the function's to convert; a type is the dispatcher's
    with pytest.raises(error, match=message):  # the registered op: the same messages
        torch.ops.maskln.masked_rms_norm(*arguments.values())


def test_the_composite_matches_the_eager_op():
    x, valid, scale = make_rms_inputs((5, 6), 32, poison=True, offset=1.0)
    composite = masked_norm_functional(RMS, x, valid, scale, None, 1e-6, 1.0)
    torch.testing.assert_close(composite, masked_rms_normalization(x, valid, scale, offset=1.0),
                               rtol=1e-14, atol=1e-14)  # fmt: skip


# --- torch.compile, export, meta and fake tensors, jit.trace -----------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_compile_fullgraph_forward_and_backward(dtype):
    torch._dynamo.reset()
    x, valid, scale = make_rms_inputs((4, 6), 16, dtype, poison=True, offset=1.0)
    dy = torch.randn(x.shape, dtype=dtype)
    compiled = torch.compile(masked_rms_normalization, fullgraph=True)
    results = []
    for fn in (compiled, masked_rms_normalization):
        leaves = [t.clone().requires_grad_() for t in (x, scale)]
        out = fn(leaves[0], valid, leaves[1], 1e-6, offset=1.0)
        results.append((out, *torch.autograd.grad(out, leaves, dy)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)  # the same kernels
    assert_no_padding_in(results[0][0], valid)


class Block(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.norm1 = MaskedRMSNorm(channels)
        self.up = nn.Linear(channels, channels)
        self.norm2 = MaskedRMSNorm(channels, offset=1.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x, mask)
        return self.norm2(h + self.up(h), mask)


def test_torch_export_holds_the_op_as_one_node_and_meta_and_fake_tensors_work():
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    exported = torch.export.export(block, (x, mask))
    targets = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert targets.count("maskln.masked_rms_norm.default") == 2
    assert not [t for t in targets if "norm" in t and "maskln" not in t]
    x_poisoned = x.clone()
    x_poisoned[0, 3:] = math.nan
    torch.testing.assert_close(exported.module()(x_poisoned, mask), block(x, mask))
    meta = torch.empty(4, 5, 6, device="meta").permute(1, 0, 2)
    out = masked_rms_normalization(meta, torch.empty(5, 4, dtype=torch.bool, device="meta"),
                                   torch.empty(6, device="meta"))  # fmt: skip
    assert out.device.type == "meta" and out.stride() == torch.empty_like(meta).stride()
    with FakeTensorMode():
        x = torch.empty(3, 4, 8, dtype=torch.float64, requires_grad=True)
        scale = torch.empty(8, dtype=torch.float64, requires_grad=True)
        out = masked_rms_normalization(x, torch.empty(3, 4, dtype=torch.bool), scale)
        out.sum().backward()
        assert x.grad.shape == x.shape and scale.grad.shape == (8,)


def test_vmap_over_x_scale_and_the_mask():
    x, valid, scale = make_rms_inputs((3, 4), 6, offset=1.0)
    scales = torch.stack([scale, 2 * scale, -scale])
    valids = torch.stack([valid, ~valid, torch.ones_like(valid)])
    xs = poison_invalid_rows(torch.stack([x, 2 * x, x.flip(0)]), valids)
    got = torch.func.vmap(lambda a, v, s: masked_rms_normalization(a, v, s, offset=1.0))(
        xs, valids, scales
    )
    for i in range(3):
        want = reference_masked_rms_norm(xs[i], valids[i], scales[i], 1e-6, 1.0)
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)


# --- the module ---------------------------------------------------------------------------------


def test_the_module_moves_state_dicts_with_nn_rms_norm_and_takes_its_eps_rule():
    rms = nn.RMSNorm(6)
    with torch.no_grad():
        rms.weight.normal_()
    masked = MaskedRMSNorm.from_rms_norm(rms)
    assert (
        masked.eps is None
        and repr(masked) == "MaskedRMSNorm((6,), eps=None, elementwise_affine=True)"
    )
    x = torch.randn(3, 4, 6)
    valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = masked(x, valid)
    with torch.no_grad():
        want = rms(x)  # eps None: float32's machine epsilon, as nn.RMSNorm
    torch.testing.assert_close(out[valid == 1], want[valid == 1])
    assert_no_padding_in(out, valid.bool())
    assert rms.state_dict().keys() == masked.state_dict().keys()
    gemma = MaskedRMSNorm(6, offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(6))  # a gain of 1 at first
    plain = MaskedRMSNorm(6, elementwise_affine=False, offset=1.0)
    torch.testing.assert_close(plain(x, valid), MaskedRMSNorm(6)(x, valid))
    with pytest.raises(ValueError, match="x must have 6 channels"):
        masked(torch.randn(2, 5), torch.ones(2))
    with pytest.raises(TypeError, match=r"from_rms_norm: expected an nn\.RMSNorm, got LayerNorm"):
        MaskedRMSNorm.from_rms_norm(nn.LayerNorm(6))
    with pytest.raises(TypeError, match=r"\(MaskedRMSNorm.from_rms_norm converts it\)"):
        maskln_cli.MaskedLayerNorm.from_layer_norm(rms)
