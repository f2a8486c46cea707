"""RMSNorm in models (issue 39): capture and swap_layer_norms on LLaMA-family models.

Each kind of :data:`maskln_cli.models.kinds.KINDS` is checked against its class's own forward
(LLaMA's gain is ``weight``, Gemma's ``1 + weight``); tiny LLaMA, Qwen2 and Gemma models built
from their configs (nothing downloaded) are captured (each dump against the float64 reference)
and swapped: padded positions exactly 0, valid positions the stock model's within float32
rounding, a few training steps the same as the stock model's, and NaN in the padding, which
reaches the stock model's valid outputs through attention, reaching nothing. A model with no
norm maskln knows is an error for capture and a warning for the swap, naming its lookalikes.
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from maskln_cli import capture, swap_layer_norms
from maskln_cli.models.kinds import KINDS, kind_of
from maskln_cli.models.swap import SwappedRMSNorm
from maskln_cli.op.norms import RMS
from maskln_cli.op.reference import reference_masked_rms_norm

LENGTHS = (9, 5, 2)
COMMON = {
    "vocab_size": 50,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}
MODELS = {
    "llama": ("LlamaConfig", "LlamaModel", {}, "LlamaRMSNorm"),
    "qwen2": ("Qwen2Config", "Qwen2Model", {}, "Qwen2RMSNorm"),
    "gemma": ("GemmaConfig", "GemmaModel", {"head_dim": 16}, "GemmaRMSNorm"),
}


def build(name: str) -> nn.Module:
    """A tiny model from its config, its norms' weights trained-looking (a kernel that ignores
    the weight, or Gemma's offset, fails)."""
    config_class, model_class, fields, _ = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **fields)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.add_(0.3 * torch.randn_like(module.weight))
    return model


def batch(lengths=LENGTHS, seed=1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 50, (len(lengths), max(lengths)), generator=generator)
    positions = torch.arange(max(lengths))
    return input_ids, (positions[None, :] < torch.tensor(lengths)[:, None]).long()


# --- each kind against its class's own forward ---------------------------------------------------


RMS_KINDS = [kind for kind in KINDS if not kind.masked and kind.norm is RMS]


def stock_module(kind):
    """A module of the kind's class with a perturbed weight (built in the test: importing
    transformers' model files at collection would cost every worker seconds)."""
    if isinstance(kind.match, type):
        module = kind.match(16, eps=1e-5)
    else:
        module_name, class_name = kind.match.rsplit(".", 1)
        module = getattr(importlib.import_module(module_name), class_name)(16, eps=1e-5)
    with torch.no_grad():
        module.weight.add_(0.3 * torch.randn(16, generator=torch.Generator().manual_seed(3)))
    return module


@pytest.mark.parametrize("kind", RMS_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kind_computes_as_its_class_does(kind, dtype):
    """The kind's norm, eps and offset: the swapped module equals the class's own forward on
    valid rows (float32: to float32 rounding; bfloat16: to a bfloat16 ulp, the stock module
    rounding twice where maskln rounds once), and zeroes the padded ones."""
    module = stock_module(kind)
    assert kind_of(module) is kind
    module = module.to(dtype)
    x = (3 * torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(4))).to(dtype)
    mask = torch.tensor([[1, 1, 1, 0, 0]] * 4)
    holder = nn.Module()
    holder.norm = copy.deepcopy(module)
    swapped = SwappedRMSNorm.replacing(holder.norm, kind, None, "norm")
    with torch.no_grad():
        want = module(x)
        got = swapped(x, mask)
    valid = mask.bool()
    assert got.dtype == dtype and torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    tolerance = {"rtol": 1e-6, "atol": 1e-6}
    if dtype == torch.bfloat16:
        tolerance = {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got[valid].float(), want[valid].float(), **tolerance)
    wrong_offset = 1.0 - kind.offset_of(module)  # the other gain: far off, so the test can fail
    with torch.no_grad():
        wrong = reference_masked_rms_norm(x, valid, module.weight.float(), 1e-5, wrong_offset)
    assert not torch.allclose(wrong[valid].float(), want[valid].float(), **tolerance)


# --- tiny models: capture, swap, train ------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_capture_records_every_rms_norm_call_as_the_model_ran_it(tmp_path, name, caplog):
    model = build(name)
    input_ids, attention_mask = batch()
    with caplog.at_level(logging.INFO, logger="maskln_cli.models.capture"):
        run = capture(model, tmp_path / "dumps", valid=attention_mask)
    kind = MODELS[name][3]
    assert run.found == {kind: 5}  # two per layer and the final norm
    assert f"recording 5 {kind}" in caplog.text
    with run:
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
        (hidden * weights * attention_mask[..., None]).sum().backward()
    assert len(run.files) == 5
    valid = attention_mask.bool()
    offset = 1.0 if name == "gemma" else 0.0
    for path in run.files:
        dump = load_file(path)
        assert set(dump) == {"x", "valid", "scale", "out", "grad_out", "grad_x", "grad_scale"}
        from safetensors import safe_open

        with safe_open(path, "pt") as opened:
            metadata = opened.metadata()
        assert metadata["norm"] == "rms" and float(metadata["offset"]) == offset
        assert metadata["padding"] == "normalized" and float(metadata["eps"]) == 1e-6
        assert torch.equal(dump["valid"], valid)
        leaves = [dump[k].double().requires_grad_() for k in ("x", "scale")]
        out = reference_masked_rms_norm(leaves[0], valid, leaves[1], 1e-6, offset)
        grads = torch.autograd.grad(out, leaves, dump["grad_out"].double())
        torch.testing.assert_close(dump["out"][valid].double(), out[valid].detach(),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        torch.testing.assert_close(dump["grad_x"][valid].double(), grads[0][valid],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        # The stock norm normalizes the padding too: its grad_scale sums over every row
        assert dump["grad_scale"].shape == dump["scale"].shape


@pytest.mark.parametrize("name", list(MODELS))
def test_swapped_models_zero_the_padding_and_keep_the_stock_valid_outputs(name, caplog):
    stock = build(name)
    model = copy.deepcopy(stock)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="maskln_cli.models.swap"):
        assert swap_layer_norms(model) is model
    kind = MODELS[name][3]
    assert f"swapped 5 {kind}" in caplog.text
    swapped = [m for m in model.modules() if isinstance(m, SwappedRMSNorm)]
    assert len(swapped) == 5 and not any(type(m).__name__ == kind for m in model.modules())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    offset = swapped[0].offset
    assert offset == (1.0 if name == "gemma" else 0.0)
    input_ids, attention_mask = batch()
    valid = attention_mask.bool()
    with torch.no_grad():
        hidden = model(input_ids, attention_mask=attention_mask).last_hidden_state
        want = stock(input_ids, attention_mask=attention_mask).last_hidden_state
    assert torch.equal(hidden[~valid], torch.zeros_like(hidden[~valid]))
    assert not hidden[~valid].signbit().any()
    torch.testing.assert_close(hidden[valid], want[valid], rtol=1e-5, atol=1e-5)


def poison_padding(model: nn.Module, attention_mask: torch.Tensor):
    """A hook putting NaN into the padded positions' embeddings."""
    embeddings = model.get_input_embeddings()

    def hook(module, args, out):  # type: ignore[no-untyped-def]
        return out.masked_fill(attention_mask[..., None] == 0, math.nan)

    return embeddings.register_forward_hook(hook)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_training_steps_match_the_stock_model_and_nan_padding_reaches_nothing(name):
    """Three AdamW steps on batches of different padding: the swapped model's parameters are
    the stock model's (the loss reads valid positions only, which padding cannot reach in
    either); with NaN in the padded embeddings the stock model's valid outputs turn NaN (through
    attention: a masked key's weight is 0, and 0 * NaN is NaN), the swapped model's do not
    change at all."""
    stock = build(name)
    model = swap_layer_norms(copy.deepcopy(stock))
    stock.train()
    model.train()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (stock, model)]
    for step, lengths in enumerate([(9, 5, 2), (3, 9, 7), (6, 6, 1)]):
        input_ids, attention_mask = batch(lengths, seed=step)
        weights = torch.randn(3, max(lengths), 32, generator=torch.Generator().manual_seed(step))
        for each, optimizer in zip((stock, model), optimizers, strict=True):
            hidden = each(input_ids, attention_mask=attention_mask).last_hidden_state
            (hidden * weights * attention_mask[..., None]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for (key, ours), theirs in zip(model.state_dict().items(), stock.state_dict().values(),
                                   strict=True):  # fmt: skip
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5, msg=key)
    model.eval()
    stock.eval()
    input_ids, attention_mask = batch()
    valid = attention_mask.bool()
    with torch.no_grad():
        clean = model(input_ids, attention_mask=attention_mask).last_hidden_state
        handles = [poison_padding(m, attention_mask) for m in (model, stock)]
        poisoned = model(input_ids, attention_mask=attention_mask).last_hidden_state
        stock_poisoned = stock(input_ids, attention_mask=attention_mask).last_hidden_state
    for handle in handles:
        handle.remove()
    assert torch.equal(poisoned, clean)
    assert torch.equal(poisoned[~valid], torch.zeros_like(poisoned[~valid]))
    assert stock_poisoned[valid].isnan().any()  # what the swap prevents


# --- a model with neither norm, lookalikes, nn.RMSNorm ------------------------------------------


class FancyRMSNorm(nn.Module):
    """A norm maskln does not know."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Tagger(nn.Module):
    def __init__(self, norm: nn.Module | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.norm = norm if norm is not None else nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.norm(self.embed(input_ids))


@pytest.mark.parametrize("norm", [None, FancyRMSNorm(8)], ids=["no norm", "a lookalike"])
def test_a_model_with_no_norm_maskln_knows_is_an_error_for_capture_and_a_warning_for_swap(
    tmp_path, norm
):
    model = Tagger(norm)
    lookalike = r".*look like norms.*1 FancyRMSNorm: 'norm'" if norm is not None else ""
    with pytest.raises(ValueError, match="Tagger has no layer norm maskln knows" + lookalike):
        capture(model, tmp_path / "dumps")
    with pytest.warns(UserWarning) as warned:
        swap_layer_norms(model)
    messages = [str(warning.message) for warning in warned]
    assert any("Tagger has no layer norm maskln knows" in m for m in messages), messages
    said = any("1 FancyRMSNorm: 'norm'); they were not swapped" in m for m in messages)
    assert said == (norm is not None), messages


def test_nn_rms_norm_is_swapped_with_the_mask_from_the_attention_mask(tmp_path):
    model = Tagger(nn.RMSNorm(8))  # eps None: float32's machine epsilon, as nn.RMSNorm's
    input_ids, attention_mask = batch((4, 2), seed=3)
    with torch.no_grad():
        want = model(input_ids, attention_mask)
    with capture(model, tmp_path / "dumps", valid=attention_mask) as run:
        model(input_ids, attention_mask)
    assert run.found == {"RMSNorm": 1}
    dump = load_file(run.files[0])
    assert "bias" not in dump and torch.equal(dump["out"], want)
    swap_layer_norms(model)
    assert isinstance(model.norm, SwappedRMSNorm) and model.norm.eps is None
    with torch.no_grad():
        got = model(input_ids, attention_mask)
    valid = attention_mask.bool()
    torch.testing.assert_close(got[valid], want[valid])
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
    assert repr(model.norm) == (
        "SwappedRMSNorm((8,), eps=None, elementwise_affine=True, mask=attention_mask)"
    )
