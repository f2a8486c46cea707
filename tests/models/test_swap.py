"""maskln_cli.swap_layer_norms (issue 26, item 3): MaskedLayerNorm in a model, fed the batch's
mask in a way that survives copies, cannot be called wrongly without an error, and compiles.

The yardstick is the float64 reference: each swapped layer norm's output, on the mask of the
batch being run (never an earlier one's), against ``reference_masked_layer_norm`` of what it
was given; and a whole model against the same model in float64 with its ``nn.LayerNorm``
modules, on the valid positions (padding cannot reach them).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from maskln_cli import swap_layer_norms
from maskln_cli.models.swap import SwappedLayerNorm
from maskln_cli.op.reference import reference_masked_layer_norm
from tests.models.tiny import batch, build

BATCHES = [(9, 5, 2), (4, 9, 9), (1, 3, 7)]
"""Different padding each time: a stale mask zeroes valid positions or keeps padded ones."""


def check_every_layer_norm(model, input_ids, attention_mask):
    """Run ``model``; each swapped layer norm's output must be the float64 reference of what
    it was given, on this batch's mask: +0.0 on padding, the formula elsewhere."""
    calls = []

    def record(module, args, out):
        calls.append((module, args[0].detach(), out.detach()))

    norms = [m for m in model.modules() if isinstance(m, SwappedLayerNorm)]
    handles = [norm.register_forward_hook(record) for norm in norms]
    try:
        hidden = model(input_ids, attention_mask=attention_mask).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
    valid = attention_mask.bool()
    assert len(calls) == len(norms) > 0
    for norm, x, out in calls:
        expected = reference_masked_layer_norm(x, valid, norm.weight, norm.bias, norm.eps)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))
        assert not out[~valid].signbit().any()
    return hidden


def float64_twin(name, state_dict):
    """The same architecture with plain nn.LayerNorm, in float64, holding ``state_dict``."""
    twin, _ = build(name)
    twin.load_state_dict(state_dict)  # the swapped model's keys: unchanged
    return twin.double()


def assert_valid_positions_match_the_twin(name, model, hidden, input_ids, attention_mask):
    twin = float64_twin(name, model.state_dict())
    with torch.no_grad():
        expected = twin(input_ids, attention_mask=attention_mask).last_hidden_state
    valid = attention_mask.bool()
    torch.testing.assert_close(hidden[valid].double(), expected[valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2", "esm"])
def test_swapped_models_zero_the_padding_and_keep_the_valid_positions(name):
    model, _ = build(name)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    assert swap_layer_norms(model) is model
    assert not any(type(m) is nn.LayerNorm for m in model.modules())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert dict(model.named_parameters()) == parameters  # the same Parameter objects
    input_ids, attention_mask = batch()
    with torch.no_grad():
        hidden = check_every_layer_norm(model, input_ids, attention_mask)
    assert_valid_positions_match_the_twin(name, model, hidden, input_ids, attention_mask)


def test_a_mask_passed_positionally_to_bert_zeroes_the_padding():
    model, _ = build("bert")
    swap_layer_norms(model)
    input_ids, attention_mask = batch()
    with torch.no_grad():
        by_name = model(input_ids, attention_mask=attention_mask).last_hidden_state
        by_position = model(input_ids, attention_mask).last_hidden_state  # BertModel's 2nd
    assert torch.equal(by_position, by_name)
    assert torch.equal(by_position[attention_mask == 0], torch.zeros(11, 32))


def test_deepcopy_and_averaged_models_use_each_batchs_own_mask():
    """The failure of the recipe swap_layer_norms replaced (docs/op/module.md had it): its mask
    lived in a hook's closure, so a deep copy kept feeding the original's norms and used the
    previous batch's mask in its own."""
    torch.manual_seed(0)
    model, _ = build("bert")
    model.train()  # dropout: the models' outputs differ, each is checked on its own
    swap_layer_norms(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # made after: the same parameters
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    swa = AveragedModel(model)
    for step, lengths in enumerate(BATCHES):
        input_ids, attention_mask = batch(lengths, seed=step)
        hidden = check_every_layer_norm(model, input_ids, attention_mask)
        (hidden * attention_mask[..., None]).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
        swa.update_parameters(model)
        copied = copy.deepcopy(model).eval()
        buffer = io.BytesIO()
        torch.save(copied, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        nxt_ids, nxt_mask = batch(BATCHES[(step + 1) % 3], seed=10 + step)
        with torch.no_grad():
            for each in (copied, loaded, ema.module.eval(), swa.module.eval()):
                hidden = check_every_layer_norm(each, nxt_ids, nxt_mask)
                assert_valid_positions_match_the_twin("bert", each, hidden, nxt_ids, nxt_mask)
            # The averaged models' own forward (AveragedModel passes the arguments on).
            averaged = ema(nxt_ids, attention_mask=nxt_mask).last_hidden_state
            torch.testing.assert_close(averaged, ema.module(nxt_ids, nxt_mask).last_hidden_state)
        ema.module.train()
        swa.module.train()


@pytest.mark.slow  # a BERT compiled whole, twice (about 10 s of a worker)
def test_torch_compile_fullgraph_with_masks_that_change():
    torch._dynamo.reset()
    model, _ = build("bert")
    swap_layer_norms(model)
    compiled = torch.compile(model, fullgraph=True)  # a graph break would raise
    with torch.no_grad():
        for step, lengths in enumerate(BATCHES[:2]):
            input_ids, attention_mask = batch(lengths, seed=step)
            eager = model(input_ids, attention_mask=attention_mask).last_hidden_state
            ours = compiled(input_ids, attention_mask=attention_mask).last_hidden_state
            torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
            assert torch.equal(
                ours[attention_mask == 0], torch.zeros_like(ours[attention_mask == 0])
            )


@pytest.mark.parametrize(
    "autocast",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the op's own: test_registered_op.py
    ids=["float32", "autocast bfloat16"],
)
def test_a_swapped_bert_compiles_to_one_graph(autocast):
    """The forward pre-hook converted the mask (a graph of its own, since torch.compile runs a
    module's hooks as frames apart): 2 graphs and a break, where the stock BERT has 1."""
    model, _ = build("bert")
    swap_layer_norms(model)
    input_ids, attention_mask = batch(BATCHES[0], seed=0)
    torch._dynamo.reset()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    with context:
        explained = torch._dynamo.explain(model)(input_ids, attention_mask=attention_mask)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        compiled = torch.compile(model)(input_ids, attention_mask=attention_mask)
        eager = model(input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(compiled.last_hidden_state, eager.last_hidden_state)


class Encoder(nn.Module):
    """A block that takes its mask by name, inside a model that compiles it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x, attention_mask):
        return self.norm(self.linear(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x, mask):
        return self.encoder(x, attention_mask=mask)


def test_the_mask_plumbing_traced_inside_a_compiled_graph_breaks_nothing():
    """Compiling a module that calls the swapped one traces its hooks into the graph: the
    mask's check is an assertion in the graph, not a graph break."""
    torch._dynamo.reset()
    outer = Outer()
    swap_layer_norms(outer.encoder)
    x, mask = torch.randn(2, 3, 8), torch.tensor([[1, 1, 0], [1, 0, 0]])
    explained = torch._dynamo.explain(outer)(x, mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(outer, fullgraph=True)
    assert torch.equal(compiled(x, mask), outer(x, mask))
    with pytest.raises(RuntimeError, match=r"attention_mask must hold only 0 and 1"):
        compiled(x, mask * 2)


# --- called wrongly: an error, never a silent "every row valid" --------------------------------


@pytest.fixture
def bert():
    model, _ = build("bert")
    return swap_layer_norms(model)


def test_a_forward_without_the_mask_raises(bert):
    input_ids, attention_mask = batch()
    for call in (
        lambda: bert(input_ids),
        lambda: bert(input_ids=input_ids, attention_mask=None),
    ):
        with pytest.raises(TypeError, match="BertModel was called without attention_mask"):
            call()
    # A failed call leaves nothing behind: the next one works, and so on.
    with torch.no_grad():
        check_every_layer_norm(bert, input_ids, attention_mask)


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (torch.full((3, 9), 2), ValueError, r"attention_mask must hold only 0 and 1.*found 2"),
        (torch.zeros(3, 9) - torch.inf, ValueError, "most likely additive"),
        (torch.ones(3, 8, dtype=torch.long), ValueError,
         r"'embeddings\.LayerNorm'.*\[3, 9\].*\[3, 8\]"),
    ],
)  # fmt: skip
def test_a_mask_that_breaks_the_rule_or_does_not_fit_raises(bert, mask, error, message):
    input_ids, _ = batch()
    with pytest.raises(error, match=message):
        bert(input_ids, attention_mask=mask)


def test_a_swapped_layer_norm_called_outside_the_model_raises(bert):
    norm = bert.get_submodule("encoder.layer.0.output.LayerNorm")
    with pytest.raises(RuntimeError, match=r"'encoder\.layer\.0\.output\.LayerNorm' was called"):
        norm(torch.randn(3, 9, 32))
    input_ids, attention_mask = batch()
    bert(input_ids, attention_mask=attention_mask)
    with pytest.raises(RuntimeError, match="called outside"):  # not the last batch's mask
        norm(torch.randn(3, 9, 32))
    given = norm(torch.randn(3, 9, 32), attention_mask)  # valid given: used as it is
    assert torch.equal(given[attention_mask == 0], torch.zeros(11, 32))


def test_swapping_twice_adds_nothing_and_modules_selects(bert):
    hooks = len(bert._forward_pre_hooks), len(bert._forward_hooks)
    assert swap_layer_norms(bert) is bert
    assert (len(bert._forward_pre_hooks), len(bert._forward_hooks)) == hooks == (1, 1)
    with pytest.raises(ValueError, match="'attention_mask'; they cannot take it from 'mask'"):
        swap_layer_norms(bert, mask_argument="mask")
    model, _ = build("gpt2")
    swap_layer_norms(model, modules=["h.*"])
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if "ln" in name}
    assert kinds == {"h.0.ln_1": "SwappedLayerNorm", "h.0.ln_2": "SwappedLayerNorm",
                     "h.1.ln_1": "SwappedLayerNorm", "h.1.ln_2": "SwappedLayerNorm",
                     "ln_f": "LayerNorm"}  # fmt: skip


class ChannelsFirst(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.transpose(1, -1)).transpose(1, -1)


def outer_with(name, module):
    outer = Outer()
    outer.add_module(name, module)
    return outer


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        (nn.Sequential(nn.LayerNorm(4)), TypeError,
         r"Sequential\.forward takes no argument 'attention_mask'"),
        (nn.LayerNorm(4), ValueError, "model is itself an nn.LayerNorm"),
        (outer_with("wide", nn.LayerNorm([2, 4])), ValueError, r"'wide' normalizes \[2, 4\]"),
        (outer_with("odd", ChannelsFirst(4)), ValueError, "'odd' is a ChannelsFirst"),
    ],
)  # fmt: skip
def test_a_model_the_swap_cannot_serve_is_refused_by_name(model, error, message):
    with pytest.raises(error, match=message):
        swap_layer_norms(model)
    assert not any(isinstance(m, SwappedLayerNorm) for m in model.modules())  # left as it was
