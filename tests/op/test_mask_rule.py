"""One mask rule (issue 26, item 4), in all three places a mask comes in: the function
``masked_layer_normalization``, the module ``MaskedLayerNorm``, and a file's ``valid`` tensor
on the command line.

The rule: bool, or an integer or floating tensor holding only 0 and 1, 1 meaning valid (a
transformers ``attention_mask`` is int64 0/1). Anything else is refused with a message naming
the argument (or file and key) and the first offending value; a floating mask holding other
values is most likely additive (0 and -inf), and the message says so.
"""

from __future__ import annotations

import math

import pytest
import torch

from maskln_cli import MaskedLayerNorm, masked_layer_normalization
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.clitools import assert_one_line_error, invoke, read, write

VALID = torch.tensor([[True, True, False], [True, False, False]])


def inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=generator)
    x[~VALID] = math.nan  # padding never reaches an output
    scale = 1 + 0.1 * torch.randn(8, generator=generator)
    bias = 0.1 * torch.randn(8, generator=generator)
    return x, scale, bias


def module(scale, bias):
    norm = MaskedLayerNorm(8)
    with torch.no_grad():
        norm.weight.copy_(scale)
        norm.bias.copy_(bias)
    return norm


@pytest.mark.parametrize(
    "dtype",
    [torch.int64, torch.int32, torch.uint8, torch.float32, torch.float16, torch.bfloat16],
)
def test_a_mask_of_0_and_1_is_the_bool_mask_in_the_function_and_the_module(dtype):
    x, scale, bias = inputs()
    mask = VALID.to(dtype)
    expected = reference_masked_layer_norm(x, VALID, scale, bias)
    out = masked_layer_normalization(x, mask, scale, bias)
    torch.testing.assert_close(out.double(), expected, rtol=1.3e-6, atol=1e-5)
    assert torch.equal(out, masked_layer_normalization(x, VALID, scale, bias))
    assert torch.equal(module(scale, bias)(x, mask), out)


@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_a_mask_of_0_and_1_is_the_bool_mask_in_a_file(tmp_path, dtype):
    x, scale, bias = inputs()
    mask = VALID.to(getattr(torch, dtype))
    source = write(tmp_path / "in.safetensors", {"x": x, "valid": mask, "scale": scale,
                                                 "bias": bias})  # fmt: skip
    result = invoke("normalize", source, tmp_path / "out.safetensors", "-q")
    assert result.exit_code == 0, result.stderr
    out = read(tmp_path / "out.safetensors")["out"]
    assert torch.equal(out, masked_layer_normalization(x, VALID, scale, bias))


REFUSED = {
    "2": (VALID.long() * torch.tensor([1, 2, 1]), "found 2 at index [0, 1]", False),
    "-1": (torch.where(VALID, 1, -1), "found -1 at index [0, 2]", False),
    "additive": (torch.where(VALID, 0.0, -math.inf), "found -inf at index [0, 2]", True),
    "a half": (VALID.float() * 0.5, "found 0.5 at index [0, 0]", True),
    "NaN": (torch.where(VALID, 1.0, math.nan), "found nan at index [0, 2]", True),
}


@pytest.mark.parametrize(("mask", "found", "floating"), REFUSED.values(), ids=list(REFUSED))
def test_any_other_value_is_refused_naming_it_in_all_three(tmp_path, mask, found, floating):
    x, scale, bias = inputs()
    rule = "valid must hold only 0 and 1 (1 = valid), or be bool; "
    for call in (
        lambda: masked_layer_normalization(x, mask, scale, bias),
        lambda: module(scale, bias)(x, mask),
    ):
        with pytest.raises(ValueError) as raised:
            call()
        message = str(raised.value)
        assert message.startswith(rule + found), message
        assert ("most likely additive" in message) == floating, message
    source = write(tmp_path / "in.safetensors", {"x": x, "valid": mask})
    result = invoke("normalize", source, tmp_path / "out.safetensors")
    assert result.exit_code == 2
    fragments = ("in.safetensors: tensor 'valid' must hold only 0 and 1", found)
    assert_one_line_error(result.stderr, *fragments, *(("most likely additive",) * floating))
    assert not (tmp_path / "out.safetensors").exists()


def test_a_mask_of_another_kind_is_a_type_error_naming_it():
    x, scale, bias = inputs()
    for call in (masked_layer_normalization, lambda x, m, *_: module(scale, bias)(x, m)):
        with pytest.raises(TypeError, match=r"^valid must be bool, or an integer or floating"):
            call(x, VALID.to(torch.complex64), scale, bias)
        with pytest.raises(TypeError, match=r"^valid must be a torch\.Tensor, got list"):
            call(x, VALID.tolist(), scale, bias)


def test_torch_compile_fullgraph_takes_bool_and_integer_masks():
    """A bool mask costs the graph nothing; a mask of numbers is checked inside it."""
    torch._dynamo.reset()
    x, scale, bias = inputs()
    compiled = torch.compile(masked_layer_normalization, fullgraph=True)
    eager = masked_layer_normalization(x, VALID, scale, bias)
    assert torch.equal(compiled(x, VALID, scale, bias), eager)
    assert torch.equal(compiled(x, VALID.long(), scale, bias), eager)
    with pytest.raises(RuntimeError, match=r"valid must hold only 0 and 1 \(1 = valid\)"):
        compiled(x, VALID.long() * 2, scale, bias)
    explained = torch._dynamo.explain(masked_layer_normalization)(x, VALID, scale, bias)
    assert explained.graph_break_count == 0


def batched_masks(dtype: torch.dtype) -> torch.Tensor:
    """Three masks of VALID's shape, as a batch of attention masks would come (the NaN
    padding of inputs() invalid in each)."""
    fewer = VALID.clone()
    fewer[0, 0] = False
    return torch.stack([VALID, fewer, torch.zeros_like(VALID)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool])
def test_vmap_over_a_mask_of_0_and_1_is_vmap_over_the_bool_mask(dtype):
    """Under vmap the 0/1 check was a data-dependent branch, which vmap refuses."""
    x, scale, bias = inputs()
    masks = batched_masks(dtype)
    out = torch.func.vmap(lambda v: masked_layer_normalization(x, v, scale, bias))(masks)
    for got, mask in zip(out, masks, strict=True):
        assert torch.equal(got, masked_layer_normalization(x, mask.bool(), scale, bias))
    mapped = torch.func.vmap(lambda v: module(scale, bias)(x, v))(masks)
    assert torch.equal(mapped, out)


def test_vmap_and_grad_with_a_mask_of_0_and_1():
    """grad inside vmap, the mask batched and x too: the same gradients as the bool mask's."""
    x, scale, bias = inputs()
    masks = batched_masks(torch.int64)

    def loss(a, v):  # type: ignore[no-untyped-def]
        return (masked_layer_normalization(a, v, scale, bias) ** 2).sum()

    xs = torch.stack([x, x * 2, x - 1])
    got = torch.func.vmap(torch.func.grad(loss))(xs, masks)
    want = torch.func.vmap(torch.func.grad(loss))(xs, masks.bool())
    assert torch.equal(got, want)


def test_under_vmap_any_other_value_is_refused_naming_it():
    x, scale, bias = inputs()
    masks = batched_masks(torch.int64)
    masks[1, 0, 2] = 2
    with pytest.raises(ValueError, match=r"^valid must hold only 0 and 1 \(1 = valid\), or be"):
        torch.func.vmap(lambda v: masked_layer_normalization(x, v, scale, bias))(masks)
