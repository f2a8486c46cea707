"""maskln_cli.testing.check_kernel: the kernel called on copies of the inputs, its output (and
its gradients by autograd) judged against the inputs as given, and any change it made to an
input a failure that names the input. `assert_close(kernel(*inputs), *inputs)` judges against
inputs the kernel may have changed: a kernel that zeroes `valid` and returns zeros passed it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization, testing
from maskln_cli.testing import InputModified, VerifyFailed, check_kernel


def batch(dtype=torch.float32, param_dtype=None, shape=(3, 8, 16), seed=0, grad=False):
    """A padded batch (NaN in the padding of x and grad_out), as a kernel's test has one."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 3).to(dtype)
    valid = torch.rand(shape[:-1], generator=generator) < 0.7
    valid.view(-1)[0] = True
    x[~valid] = float("nan")
    channels = shape[-1]
    scale = torch.randn(channels, generator=generator).to(param_dtype or dtype)
    bias = torch.randn(channels, generator=generator).to(param_dtype or dtype)
    inputs = [x, valid, scale, bias, 1e-5]
    if grad:
        grad_out = torch.randn(shape, generator=generator).to(dtype)
        grad_out[~valid] = float("inf")
        inputs.append(grad_out)
    return tuple(inputs)


def masked_fill_kernel(x, valid, scale, bias, eps):
    """A correct two-pass kernel in plain torch ops, in x's dtype (examples/my_kernel.py's)."""
    padding = ~valid.unsqueeze(-1)
    x = x.masked_fill(padding, 0.0)
    mean = x.mean(dim=-1, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    y = centered / torch.sqrt(variance + eps) * scale + bias
    return y.masked_fill(padding, 0.0)


def layer_norm_kernel(x, valid, scale, bias, eps):
    """PyTorch's own layer norm, the padding selected away before and after."""
    keep = valid[..., None]
    out = F.layer_norm(torch.where(keep, x, 0), x.shape[-1:], scale, bias, eps)
    return torch.where(keep, out, 0)


def float32_kernel(x, valid, scale, bias, eps):
    """A mixed-precision kernel: statistics and affine in float32, out in x's dtype."""
    return masked_fill_kernel(x.float(), valid, scale.float(), bias.float(), eps).to(x.dtype)


CORRECT = {
    "maskln": masked_layer_normalization,
    "masked_fill": masked_fill_kernel,
    "F.layer_norm": layer_norm_kernel,
    "float32": float32_kernel,
}


def every_other_channel(tensor: torch.Tensor) -> torch.Tensor:
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
    wide[..., ::2] = tensor
    return wide[..., ::2]


def channels_first(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.movedim(-1, 0).contiguous().movedim(0, -1)


@pytest.mark.parametrize(
    ("kernel", "dtype", "param_dtype", "layout"),
    [
        ("maskln", torch.float32, None, None),
        ("masked_fill", torch.float64, None, every_other_channel),
        ("float32", torch.float16, torch.float32, channels_first),
        ("maskln", torch.bfloat16, torch.float32, every_other_channel),
        ("F.layer_norm", torch.bfloat16, None, None),
    ],
    ids=["float32", "float64-strided", "float16-mixed", "bfloat16-mixed-strided", "bfloat16"],
)
def test_correct_kernels_pass_with_their_gradients(kernel, dtype, param_dtype, layout):
    x, valid, scale, bias, eps, grad_out = batch(dtype, param_dtype, grad=True)
    if layout is not None:
        x, grad_out = layout(x), layout(grad_out)
        assert not x.is_contiguous()
    seen = {}

    def recorded(*args):  # the kernel gets the inputs' dtypes, strides and device
        seen.update({i: (a.dtype, a.stride(), a.device) for i, a in enumerate(args[:4])})
        return CORRECT[kernel](*args)

    check_kernel(recorded, x, valid, scale, bias, eps, grad_out)
    check_kernel(recorded, x, valid, scale, bias, eps)  # out alone
    given = (x, valid, scale, bias)
    assert seen == {i: (a.dtype, a.stride(), a.device) for i, a in enumerate(given)}


def test_negative_zero_padding_fails_unless_strict_is_false():
    def negative_zeros(x, valid, scale, bias, eps):
        return torch.where(valid[..., None], masked_fill_kernel(x, valid, scale, bias, eps), -0.0)

    with pytest.raises(VerifyFailed, match=r"^FAIL: 1 of 1 tensors: out: -0\.0 at 96 padded"):
        check_kernel(negative_zeros, *batch())
    check_kernel(negative_zeros, *batch(), strict=False)


def test_the_copies_require_grad_as_the_inputs_do():
    """With grad_out, x, scale and bias; without, as given (a kernel may take another path)."""
    seen = []

    def recorded(x, valid, scale, bias, eps):
        seen.append((x.requires_grad, scale.requires_grad, bias.requires_grad, x.is_leaf))
        return masked_layer_normalization(x, valid, scale, bias, eps)

    x, valid, scale, bias, eps, grad_out = batch(grad=True)
    check_kernel(recorded, x, valid, scale, bias, eps, grad_out)
    check_kernel(recorded, x, valid, scale, bias, eps)
    check_kernel(recorded, x.requires_grad_(), valid, scale, bias, eps)
    assert seen == [
        (True, True, True, True),
        (False, False, False, True),
        (True, False, False, True),
    ]


def test_the_strategy_s_tuple_is_the_arguments():
    """check_kernel(kernel, *inputs), with and without grad_out, as the strategies draw them."""
    check_kernel(masked_fill_kernel, *batch())
    check_kernel(masked_fill_kernel, *batch(grad=True))


def test_a_wrong_kernel_fails_as_assert_close_fails_it():
    """The report and the message are assert_close's for the same tensors."""
    inputs = batch(grad=True)

    def unbiased(x, valid, scale, bias, eps):
        rows = torch.where(valid[..., None], x, 0)
        out = (rows - rows.mean(-1, keepdim=True)) / torch.sqrt(rows.var(-1, keepdim=True) + eps)
        return torch.where(valid[..., None], out * scale + bias, 0)

    with pytest.raises(VerifyFailed) as raised:
        check_kernel(unbiased, *inputs)
    x, valid, scale, bias, eps, grad_out = inputs
    leaves = [t.clone().requires_grad_() for t in (x, scale, bias)]
    out = unbiased(leaves[0], valid, leaves[1], leaves[2], eps)
    grads = torch.autograd.grad(out, leaves, grad_out)
    with pytest.raises(VerifyFailed) as again:
        testing.assert_close(
            out, x, valid, scale, bias, eps, grad_out=grad_out,
            **dict(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True)),
        )  # fmt: skip
    assert str(raised.value) == str(again.value)
    assert str(raised.value).startswith("FAIL: 3 of 4 tensors: out, grad_x and grad_scale")


# --- kernels that change their inputs -------------------------------------------------------


def zeroes_valid(x, valid, scale, bias, eps):
    """Every row made invalid, then the right output for that: zeros."""
    valid.zero_()
    return torch.zeros_like(x)


def zeroes_x(x, valid, scale, bias, eps):
    """x made 0, then the right output for that: the bias at the valid rows."""
    with torch.no_grad():
        x.zero_()
    return torch.where(valid[..., None], bias.to(x.dtype).expand_as(x), 0)


def identity_parameters(x, valid, scale, bias, eps):
    """scale set to 1 and bias to 0 in place, then the right output for those."""
    with torch.no_grad():
        scale.fill_(1)
        bias.zero_()
    return masked_layer_normalization(x, valid, scale, bias, eps)


def sanitizes_x_in_place(x, valid, scale, bias, eps):
    """Right, but its NaN padding set to 0 in x itself, through a view."""
    x.detach()[~valid] = 0
    return masked_layer_normalization(x, valid, scale, bias, eps)


def one_element_through_a_view(x, valid, scale, bias, eps):
    out = masked_layer_normalization(x, valid, scale, bias, eps)
    x.detach().view(-1)[-1] = 1  # one element of the padding's NaN (or a value) overwritten
    return out


def resizes_valid(x, valid, scale, bias, eps):
    out = masked_layer_normalization(x, valid, scale, bias, eps)
    valid.resize_(0)
    return out


def swaps_x_s_data(x, valid, scale, bias, eps):
    out = masked_layer_normalization(x, valid, scale, bias, eps)
    x.data = torch.zeros_like(x)
    return out


def writes_between_channels(x, valid, scale, bias, eps):
    """Right, but it writes into the memory between x's strided channels (the caller's)."""
    out = masked_layer_normalization(x, valid, scale, bias, eps)
    x.detach().as_strided((1,), (1,), x.storage_offset() + 1).fill_(7)
    return out


class ChangesGradOut(torch.autograd.Function):
    """maskln's forward and backward, whose backward scales its incoming gradient in place."""

    @staticmethod
    def forward(ctx, x, valid, scale, bias, eps):
        leaves = [t.detach().requires_grad_() for t in (x, scale, bias)]
        with torch.enable_grad():
            out = masked_layer_normalization(leaves[0], valid, leaves[1], leaves[2], eps)
        ctx.graph = (out, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        out, leaves = ctx.graph
        grads = torch.autograd.grad(out, leaves, grad)
        grad.mul_(0.5)
        return grads[0], None, grads[1], grads[2], None


def changes_grad_out(x, valid, scale, bias, eps):
    return ChangesGradOut.apply(x, valid, scale, bias, eps)


MUTATIONS = {
    "zeroes valid": (zeroes_valid, ["valid"], False),
    "zeroes x": (zeroes_x, ["x"], False),
    "zeroes x (grad_out given)": (zeroes_x, ["x"], True),
    "scale and bias": (identity_parameters, ["scale", "bias"], True),
    "sanitizes x": (sanitizes_x_in_place, ["x"], False),
    "one element, via a view": (one_element_through_a_view, ["x"], False),
    "resizes valid": (resizes_valid, ["valid"], False),
    "x.data swapped": (swaps_x_s_data, ["x"], False),
    "between strided channels": (writes_between_channels, ["x"], False),
    "grad_out, in the backward": (changes_grad_out, ["grad_out"], True),
}


@pytest.mark.parametrize(("kernel", "names", "grad"), MUTATIONS.values(), ids=MUTATIONS.keys())
def test_a_kernel_that_changes_an_input_fails_naming_it(kernel, names, grad):
    inputs = batch(grad=grad)
    if kernel is writes_between_channels:
        inputs = (every_other_channel(inputs[0]), *inputs[1:])
    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    with pytest.raises(InputModified) as raised:
        check_kernel(kernel, *inputs)
    message = str(raised.value)
    assert isinstance(raised.value, AssertionError)
    first = message.split("\n", 1)[0]
    assert first.startswith("FAIL: the kernel modified its input")
    assert sorted(raised.value.modified) == sorted(names), message
    for name in names:
        assert f" {name} (" in first
    for given, kept in zip(inputs, before, strict=True):  # the caller's tensors: untouched
        if isinstance(given, torch.Tensor):
            assert torch.equal(given.nan_to_num(), kept.nan_to_num())
            assert given.shape == kept.shape


def test_the_trick_passes_the_pattern_check_kernel_replaces():
    """Why check_kernel: the kernel runs before assert_close reads the inputs it changed."""
    for kernel in (zeroes_valid, zeroes_x, identity_parameters):
        inputs = batch()
        testing.assert_close(kernel(*inputs), *inputs)  # passes: judged on what it left
        with pytest.raises(AssertionError):
            check_kernel(kernel, *batch())


def test_a_kernel_that_changes_an_input_and_is_wrong_says_both():
    with pytest.raises(InputModified) as raised:
        check_kernel(zeroes_valid, *batch())
    message = str(raised.value)
    assert "valid (" in message.split("\n", 1)[0]
    assert "\nits out, judged against the inputs as given: FAIL: 1 of 1 tensors: out" in message
    assert not raised.value.report.passed


def test_what_the_kernel_returns_is_judged_and_a_non_tensor_fails():
    with pytest.raises(AssertionError, match=r"^FAIL: the kernel returned a tuple, not a tensor"):
        check_kernel(lambda *a: (masked_layer_normalization(*a), None), *batch())

    def detached(*args):
        return masked_layer_normalization(*args).detach()

    check_kernel(detached, *batch())  # no gradients asked
    with pytest.raises(AssertionError, match=r"^FAIL: grad_out given, but the kernel's out does"):
        check_kernel(detached, *batch(grad=True))


def test_bad_arguments_raise_naming_them():
    x, valid, scale, bias, eps = batch()
    with pytest.raises(TypeError, match=r"^kernel must be callable, got Tensor"):
        check_kernel(x, x, valid, scale, bias, eps)
    with pytest.raises(ValueError, match=r"^valid must have x's leading shape"):
        check_kernel(masked_fill_kernel, x, valid[0], scale, bias, eps)
    with pytest.raises(TypeError, match=r"^strict must be True or False"):
        check_kernel(masked_fill_kernel, x, valid, scale, bias, eps, strict=1)
    called = []
    with pytest.raises(ValueError, match=r"^factor must be"):
        check_kernel(lambda *a: called.append(a), x, valid, scale, bias, eps, factor=0)
    assert not called  # arguments are checked before the kernel runs
