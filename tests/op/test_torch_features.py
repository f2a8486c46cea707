"""The op as a first-class PyTorch operator: torch.func transforms, forward-mode AD, gradcheck
with torch's own defaults, torch.compile, meta and fake tensors, torch.export, autocast and
mixed dtypes; PyTorch's own OpInfo sample inputs for layer_norm; and the nn.Module.

Every value is checked against the float64 reference (maskln_cli.op.reference) or torch's own
F.layer_norm in float64 on the valid rows, and the contract (invalid rows +0.0, nothing from the
padding in any output or gradient) is checked under each feature.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from maskln_cli import MaskedLayerNorm, masked_layer_normalization
from maskln_cli.op.functional import masked_layer_norm_functional
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.op.test_core import make_inputs

TIGHT = {"rtol": 1e-9, "atol": 1e-10}


def padded_case(leading=(3, 4), channels=5, seed=0):
    """float64 inputs with NaN, inf and 1e30 in the padding, and an upstream gradient."""
    x, valid, scale, bias = make_inputs(leading, channels, seed=seed, poison=True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=x.dtype)
    return x, valid, scale, bias, dy


def clean(x, valid):
    return torch.where(valid[..., None], x, 0.0)


def assert_no_padding_in(tensor, valid):
    """Invalid rows of an output or of dx are +0.0."""
    rows = tensor[~valid]
    assert torch.equal(rows, torch.zeros_like(rows)) and not rows.signbit().any()


# --- torch.func: grad, jacrev, hessian, vmap ----------------------------------------------------


def test_func_grad_matches_the_reference_for_every_input():
    x, valid, scale, bias, dy = padded_case()

    def loss(fn, x, scale, bias):
        return (fn(x, valid, scale, bias) * dy).sum()

    ours = grad(lambda *a: loss(masked_layer_normalization, *a), argnums=(0, 1, 2))(x, scale, bias)
    want = grad(lambda *a: loss(reference_masked_layer_norm, *a), argnums=(0, 1, 2))(
        clean(x, valid), scale, bias
    )
    for got, expected in zip(ours, want, strict=True):
        assert got.isfinite().all()
        torch.testing.assert_close(got, expected, **TIGHT)
    assert_no_padding_in(ours[0], valid)


def test_jacrev_and_hessian_match_the_reference():
    x, valid, scale, bias, dy = padded_case((2, 2), 3)

    def loss(fn, x, scale):
        return (fn(x, valid, scale, bias) * dy).sum()

    for transform in (jacrev, hessian):
        ours = transform(lambda a, s: loss(masked_layer_normalization, a, s), argnums=(0, 1))(
            x, scale
        )
        want = transform(lambda a, s: loss(reference_masked_layer_norm, a, s), argnums=(0, 1))(
            clean(x, valid), scale
        )
        for got, expected in zip(torch.utils._pytree.tree_leaves(ours),
                                 torch.utils._pytree.tree_leaves(want), strict=True):  # fmt: skip
            assert got.isfinite().all()
            torch.testing.assert_close(got, expected, **TIGHT)


def test_vmap_over_x_over_scale_and_bias_and_over_the_mask():
    x, valid, scale, bias, _ = padded_case()
    xs = torch.stack([x, 2 * x + 1, -x])
    scales = torch.stack([scale, scale * 2, -scale])
    biases = torch.stack([bias, bias + 1, bias * 0])
    valids = torch.stack([valid, ~valid, valid])

    def each(fn, *batched):
        return torch.stack([fn(*args) for args in zip(*batched, strict=True)])

    over_x = vmap(lambda a: masked_layer_normalization(a, valid, scale, bias))(xs)
    torch.testing.assert_close(
        over_x, each(lambda a: reference_masked_layer_norm(clean(a, valid), valid, scale, bias), xs)
    )
    over_params = vmap(lambda s, b: masked_layer_normalization(x, valid, s, b))(scales, biases)
    torch.testing.assert_close(
        over_params,
        each(lambda s, b: reference_masked_layer_norm(clean(x, valid), valid, s, b), scales,
             biases),
    )  # fmt: skip
    over_all = vmap(masked_layer_normalization, in_dims=(0, 0, 0, 0, None))(
        xs, valids, scales, biases, 1e-5
    )
    want = each(lambda a, v, s, b: reference_masked_layer_norm(clean(a, v), v, s, b), xs, valids,
                scales, biases)  # fmt: skip
    torch.testing.assert_close(over_all, want, equal_nan=True)  # ~valid makes poison valid
    for out, mask in zip(over_all, valids, strict=True):
        assert_no_padding_in(out, mask)


def test_vmap_of_grad_gives_per_sample_gradients():
    x, valid, scale, bias, dy = padded_case()
    xs = torch.stack([x, 3 * x - 2])

    def loss(fn, x, scale, bias):
        return (fn(x, valid, scale, bias) * dy).sum()

    per_sample = vmap(grad(lambda *a: loss(masked_layer_normalization, *a), argnums=(0, 1)),
                      in_dims=(0, None, None))(xs, scale, bias)  # fmt: skip
    for i in range(2):
        want = grad(lambda *a: loss(reference_masked_layer_norm, *a), argnums=(0, 1))(
            clean(xs[i], valid), scale, bias
        )
        for got, expected in zip(per_sample, want, strict=True):
            torch.testing.assert_close(got[i], expected, **TIGHT)


# --- forward-mode AD ----------------------------------------------------------------------------


def test_jvp_jacfwd_and_dual_tensors_match_the_reference():
    x, valid, scale, bias, dy = padded_case()
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    tangent_scale = torch.randn(scale.shape, dtype=x.dtype)

    def ours(a, s):
        return masked_layer_normalization(a, valid, s, bias)

    def reference(a, s):
        return reference_masked_layer_norm(clean(a, valid), valid, s, bias)

    out, derivative = jvp(ours, (x, scale), (tangent, tangent_scale))
    want_out, want_derivative = jvp(reference, (clean(x, valid), scale), (tangent, tangent_scale))
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(derivative, want_derivative, **TIGHT)
    assert_no_padding_in(derivative, valid)

    forward = jacfwd(lambda s: (ours(x, s) * dy).sum())(scale)
    backward = jacrev(lambda s: (reference(x, s) * dy).sum())(scale)
    torch.testing.assert_close(forward, backward, **TIGHT)

    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        unpacked = fwAD.unpack_dual(masked_layer_normalization(dual, valid, scale, bias))
    torch.testing.assert_close(unpacked.tangent, jvp(reference, (clean(x, valid), scale),
                                                     (tangent, torch.zeros_like(scale)))[1],
                               **TIGHT)  # fmt: skip


@pytest.mark.parametrize("needs", ["x", "scale", "bias", "x+scale+bias"])
def test_gradcheck_with_every_check_torch_runs_on_its_own_ops(needs):
    """OpInfo's defaults: forward AD, batched gradients (vmap over the backward), batched
    forward gradients, and second order both ways."""
    x, valid, scale, bias, _ = padded_case((2, 3), 4)
    inputs = {"x": x, "scale": scale, "bias": bias}
    names = needs.split("+")
    args = tuple(inputs[name].clone().requires_grad_() for name in names)

    def op(*differentiable):
        values = dict(inputs, **dict(zip(names, differentiable, strict=True)))
        return masked_layer_normalization(values["x"], valid, values["scale"], values["bias"])

    assert torch.autograd.gradcheck(
        op, args, check_forward_ad=True, check_backward_ad=True, check_batched_grad=True,
        check_batched_forward_grad=True,
    )  # fmt: skip
    assert torch.autograd.gradgradcheck(
        op, args, check_fwd_over_rev=True, check_rev_over_rev=True, check_batched_grad=True
    )


# --- torch.compile, meta and fake tensors, torch.export ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_compile_fullgraph_forward_and_backward(dtype):
    """fullgraph=True: one graph, no break; the op is one opaque node with its own backward."""
    torch._dynamo.reset()
    x, valid, scale, bias, dy = padded_case((4, 6), 16)
    x, scale, bias, dy = (t.to(dtype) for t in (x, scale, bias, dy))
    compiled = torch.compile(masked_layer_normalization, fullgraph=True)
    results = []
    for fn in (compiled, masked_layer_normalization):
        leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
        out = fn(leaves[0], valid, leaves[1], leaves[2], 1e-5)
        results.append((out, torch.autograd.grad(out, leaves, dy)))
    (out, grads), (eager_out, eager_grads) = results
    assert torch.equal(out, eager_out)  # the same kernels run
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert_no_padding_in(out, valid)
    assert_no_padding_in(grads[0], valid)


def test_meta_tensors_give_shapes_dtypes_and_strides():
    x = torch.empty(4, 5, 6, device="meta").permute(1, 0, 2)
    valid = torch.empty(5, 4, dtype=torch.bool, device="meta")
    out = masked_layer_normalization(x, valid, torch.empty(6, device="meta"),
                                     torch.empty(6, device="meta"))  # fmt: skip
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == x.dtype
    assert out.stride() == torch.empty_like(x).stride()


def test_fake_tensor_mode_runs_forward_and_backward():
    with FakeTensorMode():
        x = torch.empty(3, 4, 8, dtype=torch.float64, requires_grad=True)
        scale = torch.empty(8, dtype=torch.float64, requires_grad=True)
        bias = torch.empty(8, dtype=torch.float64, requires_grad=True)
        out = masked_layer_normalization(x, torch.empty(3, 4, dtype=torch.bool), scale, bias)
        out.sum().backward()
        assert out.shape == x.shape and x.grad.shape == x.shape
        assert scale.grad.shape == bias.grad.shape == (8,)


class Block(nn.Module):
    """A transformer-style block: pre-norm, MLP, residual, norm."""

    def __init__(self, channels: int = 8, norm: type[nn.Module] = MaskedLayerNorm) -> None:
        super().__init__()
        self.norm1 = norm(channels)
        self.up = nn.Linear(channels, 4 * channels)
        self.down = nn.Linear(4 * channels, channels)
        self.norm2 = norm(channels)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x, mask)
        return self.norm2(h + self.down(F.gelu(self.up(h))), mask)


def test_torch_export_holds_the_op_as_one_node():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    exported = torch.export.export(block, (x, mask))
    targets = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert targets.count("maskln.masked_layer_norm.default") == 2
    assert not [t for t in targets if "norm" in t and "maskln" not in t]
    x_poisoned = x.clone()
    x_poisoned[0, 3:] = math.nan
    torch.testing.assert_close(exported.module()(x_poisoned, mask), block(x, mask))


# --- autocast and mixed dtypes ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_half_activations_with_float32_parameters(dtype):
    """nn.Linear under autocast gives half-precision x; the norm's parameters stay float32.
    As F.layer_norm: the output has x's dtype, each gradient its input's dtype."""
    torch.manual_seed(0)
    linear, norm = nn.Linear(16, 16), MaskedLayerNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1, 1)
    x = torch.randn(4, 6, 16)
    valid = torch.rand(4, 6) < 0.7
    with torch.autocast("cpu", dtype=dtype):
        h = linear(x)
        out = norm(h, valid)
    assert h.dtype == dtype and out.dtype == dtype
    want = reference_masked_layer_norm(h, valid, norm.weight, norm.bias)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    h.retain_grad()
    out.float().square().sum().backward()
    assert h.grad.dtype == dtype and norm.weight.grad.dtype == torch.float32
    assert_no_padding_in(out, valid)
    assert_no_padding_in(h.grad, valid)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_x_with_float32_parameters_is_computed_in_float32(dtype):
    x, valid, scale, bias = make_inputs((5, 6), 12, torch.float32, poison=True)
    half_x = x.to(dtype)
    leaves = [half_x.clone().requires_grad_(), scale.clone().requires_grad_(),
              bias.clone().requires_grad_()]  # fmt: skip
    out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2])
    as_float32 = masked_layer_normalization(half_x.float(), valid, scale, bias)
    assert out.dtype == dtype and torch.equal(out, as_float32.to(dtype))
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert [g.dtype for g in grads] == [dtype, torch.float32, torch.float32]


@pytest.mark.parametrize(
    ("x_dtype", "param_dtype"),
    [(torch.float32, torch.bfloat16), (torch.float64, torch.float32), (torch.bfloat16,
                                                                         torch.float16)],
)  # fmt: skip
def test_other_mixed_dtypes_are_refused_as_torch_refuses_them(x_dtype, param_dtype):
    x, valid, scale, bias = make_inputs((2, 3), 4, x_dtype)
    with pytest.raises(TypeError, match=r"^scale must have x's dtype"):
        masked_layer_normalization(x, valid, scale.to(param_dtype), bias)


# --- PyTorch's own sample inputs for layer_norm -------------------------------------------------


def layer_norm_samples(dtype: torch.dtype):
    """OpInfo's sample inputs for nn.functional.layer_norm, as (x, normalized_shape, weight,
    bias, eps)."""
    from torch.testing._internal.common_methods_invocations import op_db

    (op,) = [op for op in op_db if op.name == "nn.functional.layer_norm"]
    for sample in op.sample_inputs("cpu", dtype, requires_grad=False):
        shape, *params = sample.args
        weight = params[0] if params else None
        bias = params[1] if len(params) > 1 else None
        yield sample.input, tuple(shape), weight, bias, sample.kwargs.get("eps", 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask", ["all valid", "random"])
def test_opinfo_samples_for_layer_norm(dtype, mask):
    """Normalizing over several trailing axes is normalizing over them flattened into one."""
    checked = 0
    for index, (x, shape, weight, bias, eps) in enumerate(layer_norm_samples(dtype)):
        size = math.prod(shape)
        rows = x.reshape(*x.shape[: x.dim() - len(shape)], size)
        scale = torch.ones(size, dtype=dtype) if weight is None else weight.reshape(size)
        shift = torch.zeros(size, dtype=dtype) if bias is None else bias.reshape(size)
        generator = torch.Generator().manual_seed(index)
        valid = torch.ones(rows.shape[:-1], dtype=torch.bool)
        if mask == "random":
            valid = torch.rand(rows.shape[:-1], generator=generator) < 0.6
        if eps <= 0:  # F.layer_norm takes a negative eps; the op's contract refuses it
            with pytest.raises(ValueError, match=r"^eps "):
                masked_layer_normalization(rows, valid, scale, shift, eps)
            continue
        leaves = [t.clone().requires_grad_() for t in (rows, scale, shift)]
        out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2], eps)
        dy = torch.randn(rows.shape, generator=generator, dtype=dtype)
        grads = torch.autograd.grad(out, leaves, dy, allow_unused=True)
        # torch's own layer_norm in float64 on the valid rows alone
        peers = [t.detach().double().requires_grad_() for t in (rows[valid], scale, shift)]
        want = F.layer_norm(peers[0], (size,), peers[1], peers[2], eps)
        want_grads = torch.autograd.grad(want, peers, dy[valid].double(), allow_unused=True)
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else TIGHT
        torch.testing.assert_close(out[valid].double(), want, **tolerance)
        assert_no_padding_in(out, valid)
        torch.testing.assert_close(grads[0][valid].double(), want_grads[0], **tolerance)
        for got, expected in zip(grads[1:], want_grads[1:], strict=True):
            torch.testing.assert_close(got.double(), expected, **tolerance)
        checked += 1
    assert checked >= 4


# --- the composite and the eager kernels agree ---------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_functional_composite_matches_the_eager_op(seed, dtype):
    x, valid, scale, bias = make_inputs((5, 7), 33, dtype, seed=seed, poison=True, offset=3.0)
    eager = masked_layer_normalization(x, valid, scale, bias)
    composite = masked_layer_norm_functional(x, valid, scale, bias, 1e-5)
    assert torch.equal(composite[~valid], torch.zeros_like(composite[~valid]))
    torch.testing.assert_close(composite, eager, rtol=4e-7, atol=4e-7)


# --- MaskedLayerNorm -----------------------------------------------------------------------------


@pytest.mark.parametrize(("affine", "has_bias"), [(True, True), (True, False), (False, False)])
def test_state_dict_moves_between_layer_norm_and_masked_layer_norm(affine, has_bias):
    torch.manual_seed(0)
    layer_norm = nn.LayerNorm(12, eps=1e-12, elementwise_affine=affine, bias=has_bias)
    with torch.no_grad():
        for parameter in layer_norm.parameters():
            parameter.uniform_(-2, 2)
    ours = MaskedLayerNorm(12, eps=1e-12, elementwise_affine=affine, bias=has_bias)
    ours.load_state_dict(layer_norm.state_dict())
    back = nn.LayerNorm(12, eps=1e-12, elementwise_affine=affine, bias=has_bias)
    back.load_state_dict(ours.state_dict())
    assert ours.state_dict().keys() == layer_norm.state_dict().keys()
    converted = MaskedLayerNorm.from_layer_norm(layer_norm)
    x = torch.randn(3, 4, 12, dtype=torch.float32)
    everything = torch.ones(3, 4, dtype=torch.bool)
    for module in (ours, converted):
        torch.testing.assert_close(module(x, everything), layer_norm(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back(x), layer_norm(x))
    assert repr(converted) == repr(ours)


def test_module_takes_masks_by_the_one_mask_rule():
    """bool, or 0/1 of any integer or floating dtype; 2 or an additive mask refused (the rule's
    own tests: tests/op/test_mask_rule.py)."""
    torch.manual_seed(0)
    norm = MaskedLayerNorm(6)
    with torch.no_grad():
        norm.bias.fill_(0.5)
    x = torch.randn(2, 3, 6)
    attention_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = norm(x, attention_mask)
    assert torch.equal(out, norm(x, attention_mask.bool()))
    assert torch.equal(out, norm(x, attention_mask.to(torch.uint8)))
    assert torch.equal(out, norm(x, attention_mask.float()))
    assert_no_padding_in(out, attention_mask.bool())
    with pytest.raises(ValueError, match="additive"):
        norm(x, torch.where(attention_mask.bool(), 0.0, -math.inf))
    with pytest.raises(
        ValueError, match=r"valid must hold only 0 and 1.*found 2 at index \[0, 1\]"
    ):
        norm(x, attention_mask * torch.tensor([1, 2, 1]))
    norm.reset_parameters()
    assert torch.equal(norm.bias, torch.zeros(6)) and torch.equal(norm.weight, torch.ones(6))
    assert repr(norm) == "MaskedLayerNorm((6,), eps=1e-05, elementwise_affine=True)"
    with pytest.raises(ValueError, match="last axis"):
        MaskedLayerNorm.from_layer_norm(nn.LayerNorm([2, 3]))
    with pytest.raises(TypeError, match=r"expected an nn\.LayerNorm, got RMSNorm"):
        MaskedLayerNorm.from_layer_norm(nn.RMSNorm(6))  # type: ignore[arg-type]


def test_module_inputs_from_torch_module_db_for_layer_norm():
    """nn.LayerNorm's ModuleInfo cases (1-d normalized shapes) give the same outputs."""
    from torch.testing._internal.common_modules import module_db

    (info,) = [m for m in module_db if m.module_cls is nn.LayerNorm]
    checked = 0
    for case in info.module_inputs_func(info, device="cpu", dtype=torch.float64,
                                        requires_grad=False, training=True):  # fmt: skip
        args, kwargs = case.constructor_input.args, case.constructor_input.kwargs
        if len(args[0]) != 1:
            continue
        layer_norm = nn.LayerNorm(*args, **kwargs, dtype=torch.float64)
        ours = MaskedLayerNorm.from_layer_norm(layer_norm)
        (x,) = case.forward_input.args
        everything = torch.ones(x.shape[:-1], dtype=torch.bool)
        torch.testing.assert_close(ours(x, everything), layer_norm(x), **TIGHT)
        checked += 1
    assert checked >= 3


def train_step(block: Block, x: torch.Tensor, mask: torch.Tensor, target: torch.Tensor):
    """One SGD step on a loss over the valid positions; returns (output, gradients)."""
    optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
    optimizer.zero_grad()
    out = block(x, mask)
    keep = mask.bool()[..., None]
    loss = torch.where(keep, (out - target).square(), 0.0).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    optimizer.step()
    return out.detach(), grads


def test_swapped_into_a_block_padding_influences_nothing_and_nan_never_leaks():
    torch.manual_seed(0)
    x = torch.randn(3, 7, 8)
    target = torch.randn(3, 7, 8)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    template = Block()
    runs = {}
    for name, padding in (("clean", 0.0), ("garbage", 1e30), ("nan", math.nan)):
        block = Block()
        block.load_state_dict(template.state_dict())
        x_in = torch.where(mask.bool()[..., None], x, padding)
        out, grads = train_step(block, x_in, mask, target)
        runs[name] = (out, grads, {k: v.clone() for k, v in block.state_dict().items()})
    clean_out, clean_grads, clean_params = runs["clean"]
    assert all(g.isfinite().all() for g in clean_grads.values())
    for name in ("garbage", "nan"):
        out, grads, params = runs[name]
        assert torch.equal(out, clean_out), name
        for key in clean_grads:
            assert torch.equal(grads[key], clean_grads[key]), (name, key)
        for key in clean_params:
            assert torch.equal(params[key], clean_params[key]), (name, key)
    assert_no_padding_in(clean_out, mask.bool())
    # The control: nn.LayerNorm in the same block lets NaN from the padding into the gradients.
    control = Block(norm=nn.LayerNorm)
    control.norm1.forward = lambda x, mask: nn.LayerNorm.forward(control.norm1, x)  # type: ignore[method-assign]
    control.norm2.forward = lambda x, mask: nn.LayerNorm.forward(control.norm2, x)  # type: ignore[method-assign]
    _, control_grads = train_step(control, torch.where(mask.bool()[..., None], x, math.nan),
                                  mask, target)  # fmt: skip
    assert not all(g.isfinite().all() for g in control_grads.values())


# --- regressions from an adversarial review --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "dtype"),
    [(1e17, torch.float32), (1e15, torch.float32), (3e10, torch.float32), (1e200, torch.float64),
     (1.7e308, torch.float64), (1e120, torch.float64)],
)  # fmt: skip
def test_constant_rows_of_any_magnitude_have_the_right_gradient_on_every_path(value, dtype):
    """A constant row has xhat = 0 and rstd = 1/sqrt(eps): dx = rstd * (wdy - mean(wdy)).
    Huge constant rows once got dx near 1e-47 (eager) or NaN (torch.func)."""
    channels = 4
    x = torch.full((2, channels), value, dtype=dtype)
    valid = torch.tensor([True, False])
    scale = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=dtype)
    bias = torch.zeros(channels, dtype=dtype)
    dy = torch.tensor([[1.0, -2.0, 0.5, 3.0]] * 2, dtype=dtype)
    wdy = (dy[0] * scale).double()
    want = (wdy - wdy.mean()) / math.sqrt(1e-5)

    def loss(a):
        return (masked_layer_normalization(a, valid, scale, bias) * dy).sum()

    leaf = x.clone().requires_grad_()
    (eager,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    for dx in (eager, grad(loss)(x), vmap(grad(loss))(x[None])[0]):
        torch.testing.assert_close(dx[0].double(), want, rtol=1e-5, atol=0)
        assert_no_padding_in(dx, valid)
    (second,) = torch.autograd.grad(eager.square().sum(), leaf)
    assert second.isfinite().all()


@pytest.mark.parametrize(
    ("value", "eps", "dtype"),
    [(0.0, 1e-30, torch.float32), (1e-30, 1e-45, torch.float32), (1e-120, 1e-210, torch.float64)],
)
def test_tiny_rows_and_tiny_eps_agree_on_every_path(value, eps, dtype):
    """var + eps far below the dtype's smallest normal number: torch.func once gave NaN (an
    overflowing rsqrt derivative) or values 2900 times off (a clamp to the smallest normal)."""
    x = torch.tensor([[value, -value, 2 * value, -2 * value]], dtype=dtype)
    valid = torch.tensor([True])
    scale, bias = torch.ones(4, dtype=dtype), torch.zeros(4, dtype=dtype)
    dy = torch.tensor([[3.0, -1.0, -1.0, -1.0]], dtype=dtype)
    want_y = reference_masked_layer_norm(x.double(), valid, scale, bias, eps)
    leaf = x.clone().requires_grad_()
    eager = masked_layer_normalization(leaf, valid, scale, bias, eps)
    (eager_dx,) = torch.autograd.grad(eager, leaf, dy)
    transformed = vmap(lambda a: masked_layer_normalization(a, valid, scale, bias, eps))(x[None])
    func_dx = grad(lambda a: (masked_layer_normalization(a, valid, scale, bias, eps) * dy).sum())(x)
    tolerance = {"rtol": 1e-5, "atol": 0.0}
    torch.testing.assert_close(eager.detach().double(), want_y, **tolerance)
    torch.testing.assert_close(transformed[0].double(), want_y, **tolerance)
    assert func_dx.isfinite().all()
    torch.testing.assert_close(func_dx.double(), eager_dx.double(), **tolerance)


def test_a_rows_bits_do_not_depend_on_its_company():
    """A lone row, the same row among others, and a rescued (overflowing) row next to an
    ordinary or another rescued row: identical bits (torch splits a lone row's reduction)."""
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    row = torch.randn(40000, generator=generator, dtype=torch.float64)
    valid1, valid2 = torch.tensor([True]), torch.tensor([True, True])
    ones, zeros = torch.ones(40000, dtype=torch.float64), torch.zeros(40000, dtype=torch.float64)
    alone = masked_layer_normalization(row[None], valid1, ones, zeros)
    together = masked_layer_normalization(torch.stack([row, row.flip(0)]), valid2, ones, zeros)
    assert torch.equal(alone[0], together[0])
    huge = row * 1e200
    with_ordinary = masked_layer_normalization(torch.stack([huge, row]), valid2, ones, zeros)
    with_huge = masked_layer_normalization(torch.stack([huge, huge.flip(0)]), valid2, ones, zeros)
    assert torch.equal(with_ordinary[0], with_huge[0])


def test_torch_compile_with_dynamic_shapes_and_a_varying_eps():
    torch._dynamo.reset()
    compiled = torch.compile(masked_layer_normalization, fullgraph=True, dynamic=True)
    module = torch.compile(MaskedLayerNorm(16), fullgraph=True, dynamic=True)
    for length, eps in ((5, 1e-5), (9, 1e-6), (3, 0.1)):
        x, valid, scale, bias = make_inputs((2, length), 16, torch.float32, poison=True)
        want = masked_layer_normalization(x, valid, scale, bias, eps)
        assert torch.equal(compiled(x, valid, scale, bias, eps), want)
        assert torch.equal(compiled(x, valid, scale, bias), masked_layer_normalization(
            x, valid, scale, bias))  # fmt: skip
        assert torch.equal(module(x, valid), MaskedLayerNorm(16)(x, valid))


def test_torch_compile_of_torch_func_grad():
    torch._dynamo.reset()
    x, valid, scale, bias, dy = padded_case()

    def loss(a):
        return (masked_layer_normalization(a, valid, scale, bias) * dy).sum()

    compiled = torch.compile(grad(loss))
    torch.testing.assert_close(compiled(x), grad(loss)(x), **TIGHT)


def test_eps_beyond_float32_range_works_on_every_path():
    x, valid, scale, bias = make_inputs((3,), 4, torch.float32)
    want = reference_masked_layer_norm(x, valid, scale, bias, 1e39)
    eager = masked_layer_normalization(x, valid, scale, bias, 1e39)
    transformed = vmap(lambda a: masked_layer_normalization(a, valid, scale, bias, 1e39))(x[None])
    for out in (eager, transformed[0]):
        torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("argument", ["x", "valid", "scale"])
def test_non_strided_layouts_are_refused_by_name(argument):
    x, valid, scale, bias = make_inputs((2, 3), 4, torch.float32)
    inputs = {"x": x, "valid": valid, "scale": scale, "bias": bias}
    inputs[argument] = inputs[argument].to_sparse()
    with pytest.raises(TypeError, match=rf"^{argument} must be a dense \(strided\) tensor"):
        masked_layer_normalization(**inputs)


def test_outputs_keep_xs_layout_under_forward_mode_ad():
    x = torch.randn(4, 5, 6).permute(2, 0, 1)
    valid = torch.rand(6, 4) < 0.5
    scale, bias = torch.randn(5), torch.randn(5)
    out, tangent = jvp(lambda a: masked_layer_normalization(a, valid, scale, bias), (x,),
                       (torch.ones_like(x),))  # fmt: skip
    assert out.stride() == tangent.stride() == torch.empty_like(x).stride()


def test_module_errors_name_its_own_terms():
    with pytest.raises(ValueError, match=r"^x must have 5 channels"):
        MaskedLayerNorm(5)(torch.randn(2, 4), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="normalized_shape"):
        MaskedLayerNorm("4")  # type: ignore[arg-type]


def test_the_eager_autograd_path_binds_no_signature(monkeypatch):
    # Function.apply binds default arguments through inspect.signature on every call, which
    # cost more than the whole op on small tensors (fwd+bwd of [8, 16, 64]: 2x the peer).
    import inspect

    from maskln_cli.op.autograd import MaskedLayerNormFunction

    signature = inspect.signature

    def refuse(function, *args, **kwargs):
        if function is MaskedLayerNormFunction.forward:
            raise AssertionError("inspect.signature called on the op's eager path")
        return signature(function, *args, **kwargs)

    x, valid, scale, bias, dy = padded_case()
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    monkeypatch.setattr(inspect, "signature", refuse)
    out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2])
    got = torch.autograd.grad(out, leaves, dy)
    monkeypatch.undo()
    reference_leaves = [t.clone().requires_grad_() for t in (clean(x, valid), scale, bias)]
    want_out = reference_masked_layer_norm(reference_leaves[0], valid, *reference_leaves[1:])
    want = torch.autograd.grad(want_out, reference_leaves, dy)
    torch.testing.assert_close(out, want_out, **TIGHT)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TIGHT)
    assert_no_padding_in(out, valid)
    assert_no_padding_in(got[0], valid)
