"""maskln_cli.capture (issue 26, item 1): every layer norm call of a model run, a dump each.

Tiny BERT, RoBERTa, GPT-2 and ESM models built from configs run a padded batch with an int64
attention mask, forward and backward (a loss over the valid positions). Each dump must hold
exactly what the module saw and computed, told apart from the capture's own machinery by
hooks of a different kind (forward hooks, full backward hooks, the parameters' ``.grad``), and
agree with the float64 reference; ``maskln verify`` must pass on it, and fail on the dump of a
deliberately wrong layer norm.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
from torch import nn

import maskln_cli
from maskln_cli import MaskedLayerNorm, capture
from tests.clitools import ROOT, invoke, metadata, read
from tests.models.tiny import batch, build, reference, run

BERT_LIKE = ["embeddings.LayerNorm"] + [
    f"encoder.layer.{i}.{part}LayerNorm"
    for i in (0, 1)
    for part in ("attention.output.", "output.")
]
EXPECTED_MODULES = {
    "bert": BERT_LIKE,
    "roberta": BERT_LIKE,
    "gpt2": ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"],
    # ESM is pre-LN: each layer's attention LayerNorm, then its output one; emb_layer_norm_after
    "esm": [f"encoder.layer.{i}.{part}LayerNorm" for i in (0, 1) for part in ("attention.", "")]
    + ["encoder.emb_layer_norm_after"],
}


def independent_record(model):
    """What each layer norm saw, computed and was sent back, by hooks of other kinds."""
    seen = []

    def forward_hook(module, args, out):
        seen.append({"module": module, "x": args[0].detach().clone(), "out": out.detach().clone()})

    def backward_hook(module, grad_input, grad_output):
        entry = next(e for e in reversed(seen) if e["module"] is module and "grad_out" not in e)
        entry["grad_x"], entry["grad_out"] = grad_input[0], grad_output[0]

    handles = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm | MaskedLayerNorm):
            handles += [
                module.register_forward_hook(forward_hook),
                module.register_full_backward_hook(backward_hook),
            ]
    return seen, handles


def relative_error(ours, expected):
    return float((ours.double() - expected).norm() / expected.norm().clamp_min(1e-30))


MODES = {"float32-eval": (False, "eval"), "bf16-autocast-train": (True, "train")}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", sorted(EXPECTED_MODULES))
def test_every_layer_norm_call_is_recorded_as_the_module_ran_it(tmp_path, name, mode):
    autocast, training = MODES[mode]
    model, _ = build(name)
    model.train(training == "train")
    input_ids, attention_mask = batch()
    hooks_before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    seen, handles = independent_record(model)
    with (
        capture(model, tmp_path / "dumps", valid=attention_mask) as recording,
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        run(model, input_ids, attention_mask)
    for handle in handles:
        handle.remove()

    files = recording.files
    assert [f.name for f in files] == sorted(f.name for f in (tmp_path / "dumps").iterdir())
    paths = [metadata(f)["module"] for f in files]
    assert paths == EXPECTED_MODULES[name]
    assert [f.name for f in files] == [f"{i:05d}-{p}.safetensors" for i, p in enumerate(paths)]
    assert recording.calls == len(seen) == len(files) and recording.skipped == 0
    modules = dict(model.named_modules())
    valid = attention_mask.bool()
    for index, (file, entry) in enumerate(zip(files, seen, strict=True)):
        dump, meta, module = read(file), metadata(file), modules[paths[index]]
        assert entry["module"] is module
        assert meta["call"] == str(index) and meta["eps"] == repr(module.eps)
        assert meta["dtype"] == "float32" and meta["padding"] == "normalized"
        assert meta["autocast"] == ("bfloat16" if autocast else "off")
        assert meta["training"] == str(model.training).lower()
        assert meta["maskln_version"] == maskln_cli.__version__
        assert meta["torch_version"] == torch.__version__
        assert torch.equal(dump["valid"], valid)
        assert meta["valid_source"] == "capture(valid=) [3, 9]"
        # Exactly what the module saw, computed and was sent back; its own gradients.
        for key in ("x", "out", "grad_out", "grad_x"):
            assert torch.equal(dump[key], entry[key]), key
        assert torch.equal(dump["scale"], module.weight.detach())
        assert torch.equal(dump["bias"], module.bias.detach())
        assert torch.equal(dump["grad_scale"], module.weight.grad)  # each is called once
        assert torch.equal(dump["grad_bias"], module.bias.grad)
        # And the formula in float64, from the dump alone, on the valid rows.
        expected = reference(dump, float(meta["eps"]))
        for key in ("out", "grad_x"):
            assert relative_error(dump[key][valid], expected[key][valid]) < 1e-6, key
        for key in ("grad_scale", "grad_bias"):
            assert relative_error(dump[key], expected[key]) < 1e-6, key
    # The hooks are gone, and the parameters are the model's own again.
    assert hooks_before == [
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    ]
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_a_bfloat16_model_is_recorded_in_bfloat16(tmp_path):
    model, _ = build("bert")
    model.to(torch.bfloat16)
    input_ids, attention_mask = batch()
    with capture(model, tmp_path, valid=attention_mask) as recording:
        run(model, input_ids, attention_mask)
    dump, meta = read(recording.files[2]), metadata(recording.files[2])
    assert meta["dtype"] == "bfloat16"
    assert {k: t.dtype for k, t in dump.items() if k != "valid"} == dict.fromkeys(
        ("x", "scale", "bias", "out", "grad_out", "grad_x", "grad_scale", "grad_bias"),
        torch.bfloat16,
    )
    valid = dump["valid"]
    expected = reference(dump, float(meta["eps"]))
    assert relative_error(dump["out"][valid], expected["out"][valid]) < 2**-7  # bf16's epsilon


def verify(dump, *options):
    result = invoke("verify", dump, dump, *options, "--json")
    assert result.exit_code in (0, 1), result.stderr
    return result.exit_code


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_maskln_verify_passes_on_the_dumps_and_fails_on_a_wrong_layer_norm(tmp_path, name):
    model, _ = build(name)
    input_ids, attention_mask = batch()
    wrong_path = EXPECTED_MODULES[name][2]
    wrong = model.get_submodule(wrong_path)

    def unbiased_variance(x):  # a known mistake: var with C - 1
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=True)
        return (x - mean) / torch.sqrt(var + wrong.eps) * wrong.weight + wrong.bias

    with capture(model, tmp_path / "right", valid=attention_mask) as right:
        run(model, input_ids, attention_mask)
    wrong.forward = unbiased_variance  # an instance attribute: hooks still run
    model.zero_grad()
    with capture(model, tmp_path / "wrong", valid=attention_mask) as wrong_run:
        run(model, input_ids, attention_mask)
    for file in right.files:  # an nn.LayerNorm's padding is its own: compare valid rows only
        assert verify(file, "--valid", f"{file}:valid") == 0, file.name
        assert verify(file) == 1  # compared whole, its padding is not zeroed
    for file in wrong_run.files:
        expected = 1 if metadata(file)["module"] == wrong_path else 0
        assert verify(file, "--valid", f"{file}:valid") == expected, file.name
    # The folders in one command each: every layer norm passes; the wrong one alone fails.
    assert verified_folder(tmp_path / "right") == {}
    assert verified_folder(tmp_path / "wrong") == {wrong_path: False}


def verified_folder(folder) -> dict[str, bool]:
    """``maskln verify FOLDER/ --json``: each file judged on its valid rows, by its metadata;
    the modules whose file failed (and the exit code agrees)."""
    result = invoke("verify", folder, "--json")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == len(list(folder.glob("*.safetensors"))), result.stdout
    assert all(row["status"] == "checked" for row in rows), result.stdout
    failed = {row["module"]: row["passed"] for row in rows if not row["passed"]}
    assert result.exit_code == (1 if failed else 0), result.stderr
    return failed


def test_a_swapped_models_dumps_zero_the_padding_and_pass_whole(tmp_path):
    model, _ = build("bert")
    maskln_cli.swap_layer_norms(model)
    input_ids, attention_mask = batch()
    with capture(model, tmp_path) as recording:  # no valid=: the model's own mask is recorded
        run(model, input_ids, attention_mask)
    for file in recording.files:
        meta = metadata(file)
        assert meta["padding"] == "zeroed"
        assert meta["valid_source"] == "the model's mask (swap_layer_norms)"
        assert torch.equal(read(file)["valid"], attention_mask.bool())
        assert verify(file) == 0, file.name


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_a_model_loaded_from_a_sharded_checkpoint_gives_the_same_dumps(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    model, _ = build(name)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "sharded").eval()
    input_ids, attention_mask = batch()
    recordings = []
    for label, each in (("built", model), ("loaded", loaded)):
        with capture(each, tmp_path / label, valid=attention_mask) as recording:
            run(each, input_ids, attention_mask)
        recordings.append(recording.files)
    for built, from_shards in zip(*recordings, strict=True):
        assert built.name == from_shards.name
        ours, theirs = read(built), read(from_shards)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), built.name


# --- hooks, errors and options -------------------------------------------------------------------


def hook_counts(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_an_exception_removes_the_hooks_and_leaves_only_whole_files(tmp_path):
    model, _ = build("bert")
    parameters = {name: p for name, p in model.named_parameters()}
    input_ids, attention_mask = batch()
    with pytest.raises(ValueError, match="mask"), capture(model, tmp_path, valid=attention_mask):
        run(model, input_ids, attention_mask)
        model(input_ids=input_ids[:, :5], attention_mask=attention_mask[:, :5])  # too short
    assert hook_counts(model) == 0
    assert dict(model.named_parameters()) == parameters  # the very same objects
    assert all(type(p) is nn.Parameter for p in parameters.values())
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files if f.name.startswith(".")] == []
    assert all(read(f)["x"].shape == (3, 9, 32) for f in files)  # whole, and the first batch's


def test_an_interruption_inside_a_layer_norm_puts_the_parameters_back(tmp_path):
    """KeyboardInterrupt is not an Exception: the module's always-called hook does not run,
    and the capture's exit puts the aliased parameters back."""
    model, _ = build("gpt2")
    input_ids, attention_mask = batch()
    norm = model.get_submodule("h.1.ln_1")

    def interrupt(module, args):
        raise KeyboardInterrupt

    norm.register_forward_pre_hook(interrupt)  # runs after the capture's own pre-hook
    with pytest.raises(KeyboardInterrupt), capture(model, tmp_path, valid=attention_mask):
        run(model, input_ids, attention_mask)
    assert type(norm._parameters["weight"]) is nn.Parameter
    assert type(norm._parameters["bias"]) is nn.Parameter
    assert hook_counts(model) == 1  # only the test's own


def test_a_mask_that_does_not_fit_names_the_layer_norm(tmp_path):
    model, _ = build("bert")
    input_ids, attention_mask = batch()
    with (
        pytest.raises(ValueError) as raised,
        capture(model, tmp_path, valid=attention_mask[:, :8]),
    ):
        run(model, input_ids, attention_mask)
    assert str(raised.value).startswith(
        "capture: layer norm 'embeddings.LayerNorm': its input's rows [3, 9] do not fit the"
        " mask [3, 8]"
    )


class Tokens(nn.Module):
    """Layer norms over flattened tokens, per head, and a shared one called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.LayerNorm(8)
        self.heads = nn.LayerNorm(4)
        self.shared = nn.LayerNorm(8)

    def forward(self, x):
        batch_size, length, channels = x.shape
        flat = self.flat(x.reshape(-1, channels)).reshape(x.shape)
        heads = self.heads(flat.reshape(batch_size, length, 2, 4)).reshape(x.shape)
        return self.shared(self.shared(heads) * 2)


def test_flattened_tokens_heads_and_a_module_called_twice(tmp_path):
    torch.manual_seed(0)
    model = Tokens()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1, 0.3)
                module.bias.normal_(0, 0.3)
    x = torch.randn(2, 3, 8, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    with capture(model, tmp_path, valid=mask) as recording:
        out = model(x)
        (out * torch.randn(out.shape) * mask[..., None]).sum().backward()
    names = [f.name for f in recording.files]
    assert names == ["00000-flat.safetensors", "00001-heads.safetensors",
                     "00002-shared.safetensors", "00003-shared.safetensors"]  # fmt: skip
    dumps = [read(f) for f in recording.files]
    assert torch.equal(dumps[0]["valid"], mask.bool().reshape(-1))
    assert torch.equal(dumps[1]["valid"], mask.bool()[..., None].expand(2, 3, 2))
    for dump in dumps:
        expected = reference(dump, 1e-5)
        valid = dump["valid"]
        for key in ("out", "grad_x"):
            assert relative_error(dump[key][valid], expected[key][valid]) < 1e-6
        for key in ("grad_scale", "grad_bias"):
            assert relative_error(dump[key], expected[key]) < 1e-6
    # Each call's own contribution; the parameter's .grad is their sum.
    for name in ("scale", "bias"):
        total = dumps[2][f"grad_{name}"] + dumps[3][f"grad_{name}"]
        parameter = model.shared.weight if name == "scale" else model.shared.bias
        torch.testing.assert_close(total, parameter.grad)
        assert not torch.allclose(dumps[2][f"grad_{name}"], parameter.grad)


def test_options_modules_max_calls_and_forward_only(tmp_path):
    model, _ = build("bert")
    input_ids, attention_mask = batch()
    patterns = ["embeddings.*", "*.1.output.LayerNorm"]  # fnmatch: * matches dots too
    with capture(model, tmp_path / "some", attention_mask, modules=patterns) as some:
        run(model, input_ids, attention_mask)
    assert [metadata(f)["module"] for f in some.files] == [
        "embeddings.LayerNorm",
        "encoder.layer.1.output.LayerNorm",
    ]
    with capture(model, tmp_path / "first", attention_mask, max_calls=2) as first:
        run(model, input_ids, attention_mask)
    assert len(first.files) == 2 and first.calls == 2 and first.skipped == 3

    inside = []
    norm = model.get_submodule("encoder.layer.0.output.LayerNorm")
    handle = norm.register_forward_pre_hook(lambda m, a: inside.append(type(m.weight)))
    with capture(model, tmp_path / "forward", attention_mask, backward=False) as forward:
        run(model, input_ids, attention_mask)
    handle.remove()
    assert inside == [nn.Parameter]  # no alias in the graph
    assert all("grad_x" not in read(f) for f in forward.files)
    assert all({"x", "valid", "scale", "bias", "out"} == read(f).keys() for f in forward.files)

    with torch.no_grad(), capture(model, tmp_path / "no_grad", attention_mask) as no_grad:
        run(model, input_ids, attention_mask, backward=False)
    assert len(no_grad.files) == 5


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"modules": "decoder.*"},
            ValueError,
            "modules: 'decoder.*' matches none of the model's 5",
        ),
        ({"max_calls": 0}, ValueError, "max_calls must be a positive int or None, got 0"),
        ({"valid": torch.tensor([[1, 2]])}, ValueError, "valid must hold only 0 and 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, error, message):
    model, _ = build("bert")
    with pytest.raises(error, match=message):
        capture(model, tmp_path, **kwargs)


def test_a_folder_holding_dumps_is_refused(tmp_path):
    model, _ = build("gpt2")
    input_ids, attention_mask = batch()
    with capture(model, tmp_path, valid=attention_mask):
        run(model, input_ids, attention_mask, backward=False)
    before = {f.name: f.stat().st_mtime_ns for f in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"already holds 5 \.safetensors files"):
        capture(model, tmp_path).__enter__()
    assert before == {f.name: f.stat().st_mtime_ns for f in tmp_path.iterdir()}
    assert hook_counts(model) == 0
    with pytest.raises(ValueError, match="is a file"):
        capture(model, next(tmp_path.iterdir())).__enter__()


def test_a_backward_after_the_block_warns_and_changes_nothing(tmp_path):
    model, _ = build("gpt2")
    input_ids, attention_mask = batch()
    with capture(model, tmp_path, valid=attention_mask) as recording:
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    before = {f.name: f.read_bytes() for f in recording.files}
    with pytest.warns(UserWarning, match="backward pass ran after the with block ended"):
        hidden.sum().backward()
    assert before == {f.name: f.read_bytes() for f in recording.files}


def test_nothing_of_an_earlier_call_is_held(tmp_path):
    """Written as it goes: once a call's dump is written, the capture keeps none of its
    tensors (a forward pass with no autograd graph to keep them alive)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(6)])
    outputs = []
    for block in model:
        block[1].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    with torch.no_grad(), capture(model, tmp_path, torch.ones(4, 5)) as recording:
        kept = model(torch.randn(4, 5, 16))
        gc.collect()
        alive = [ref() is not None for ref in outputs]
    assert len(recording.files) == 6
    assert alive == [False] * 5 + [True]  # the last one is the model's output, held here
    del kept


def test_gradient_checkpointing_recomputation_is_not_recorded_twice(tmp_path):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    x = torch.randn(2, 3, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, capture(block, tmp_path) as recording:
        warnings.simplefilter("always")
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        out.sum().backward()
    assert len(recording.files) == 1
    assert any("gradient checkpointing" in str(w.message) for w in caught)
    assert math.isfinite(float(read(recording.files[0])["x"].sum()))


def test_a_compiled_model_runs_eagerly_in_the_block_and_compiled_after_it(tmp_path):
    """Compiled code calls no hooks: without the eager stance, nothing would be recorded."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    compiled = torch.compile(model, backend="eager")
    x, mask = torch.randn(2, 3, 8), torch.tensor([[1, 1, 0], [1, 0, 0]])
    compiled(x)  # compiled before the capture, as a trained model is
    with capture(compiled, tmp_path / "compiled", valid=mask) as recording:
        compiled(x)
    with capture(model, tmp_path / "eager", valid=mask) as eager:
        model(x)
    assert [f.name for f in recording.files] == ["00000-1.safetensors"]
    ours, theirs = read(recording.files[0]), read(eager.files[0])
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    calls = []
    handle = model[1].register_forward_hook(lambda *args: calls.append(1))
    compiled(x)  # compiled again after the block: the hook is not called
    handle.remove()
    assert calls == []


def test_a_block_that_runs_no_layer_norm_warns(tmp_path):
    model, _ = build("gpt2")
    with (
        pytest.warns(UserWarning, match="no layer norm of the model was called"),
        capture(model, tmp_path),
    ):
        pass
    assert list(tmp_path.iterdir()) == []


class ByName(nn.Module):
    """Layer norms called with their input by name, the mask first."""

    def __init__(self) -> None:
        super().__init__()
        self.plain, self.masked = nn.LayerNorm(8), MaskedLayerNorm(8)

    def forward(self, x, mask):
        return self.masked(valid=mask, x=self.plain(input=x))


def test_an_input_given_by_name_is_recorded_as_x(tmp_path):
    torch.manual_seed(0)
    model = ByName()
    x, mask = torch.randn(2, 3, 8, requires_grad=True), torch.tensor([[1, 1, 0], [1, 0, 0]])
    with capture(model, tmp_path, valid=mask) as recording:
        (model(x, mask) * torch.randn(2, 3, 8)).sum().backward()
    plain, masked = (read(f) for f in recording.files)
    assert torch.equal(plain["x"], x.detach())
    assert torch.equal(masked["x"], plain["out"]) and torch.equal(masked["valid"], mask.bool())
    for dump in (plain, masked):
        expected = reference(dump, 1e-5)
        valid = dump["valid"]
        for key in ("out", "grad_x"):
            assert relative_error(dump[key][valid], expected[key][valid]) < 1e-6, key


# --- nested, concurrent, long names, the call limit --------------------------------------------


def test_nested_captures_leave_the_parameters_the_models_own_leaves(tmp_path):
    """A capture inside another (of the model, or of a block of it) records the same calls,
    each with this call's gradients, and leaves every parameter the model's own leaf: an
    optimizer takes them and steps."""
    model, _ = build("gpt2")
    parameters = dict(model.named_parameters())
    input_ids, attention_mask = batch()
    block = model.get_submodule("h.1")
    with capture(model, tmp_path / "outer", valid=attention_mask) as outer:
        with (
            capture(model, tmp_path / "inner", valid=attention_mask) as inner,
            capture(block, tmp_path / "block", valid=attention_mask),
        ):
            run(model, input_ids, attention_mask)
        run(model, input_ids, attention_mask)  # the outer one alone again
    now = dict(model.named_parameters())
    assert now.keys() == parameters.keys()
    assert all(now[name] is parameters[name] for name in now)  # the very same objects
    assert all(type(p) is nn.Parameter and p.is_leaf for p in model.parameters())
    for norm in (m for m in model.modules() if isinstance(m, nn.LayerNorm)):
        assert norm.weight is norm._parameters["weight"] and norm.weight.is_leaf
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert len(outer.files) == 10 and len(inner.files) == 5
    for ours, theirs in zip(outer.files[:5], inner.files, strict=True):
        ours, theirs = read(ours), read(theirs)
        assert ours.keys() == theirs.keys() >= {"grad_x", "grad_scale", "grad_bias"}
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    for file in outer.files:
        dump = read(file)
        expected = reference(dump, float(metadata(file)["eps"]))
        for key in ("grad_scale", "grad_bias"):  # this call's alone, as the reference's
            assert relative_error(dump[key], expected[key]) < 1e-5, (file.name, key)


def test_a_folder_another_capture_holds_is_refused(tmp_path):
    """Two captures into one empty folder would write the same names: the second is refused
    while the first holds the folder (and after it, by the dumps it wrote)."""
    model, _ = build("gpt2")
    other, _ = build("gpt2")
    input_ids, attention_mask = batch()
    with capture(model, tmp_path, valid=attention_mask) as first:
        with pytest.raises(ValueError, match=r"another capture is writing into it \(process"):
            capture(other, tmp_path).__enter__()
        assert hook_counts(other) == 0
        run(model, input_ids, attention_mask)
    assert len(first.files) == 5 and sorted(tmp_path.iterdir()) == first.files
    with pytest.raises(ValueError, match="already holds 5"):
        capture(other, tmp_path).__enter__()


@pytest.mark.slow
def test_two_processes_capturing_into_one_folder_never_both_write(tmp_path):
    """The first process holds the folder until its block ends; the second, started while it
    holds it, is refused with the first's pid; the dumps are the first's, none overwritten."""
    script = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from maskln_cli import capture\n"
        "model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))\n"
        "try:\n"
        "    with capture(model, sys.argv[1]) as run:\n"
        "        print('holding', flush=True)\n"
        "        sys.stdin.readline()\n"
        "        model(torch.full((2, 8), float(sys.argv[2])).cumsum(-1))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
        "    sys.exit(3)\n"
        "print(len(run.files))\n"
    )
    folder = tmp_path / "dumps"

    def start(seed: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", script, str(folder), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    first = start(1)
    assert first.stdout.readline().strip() == "holding"
    second = start(2)
    refused, _ = second.communicate("\n", timeout=120)
    written, _ = first.communicate("\n", timeout=120)
    assert second.returncode == 3, refused
    assert f"another capture is writing into it (process {first.pid})" in refused
    assert first.returncode == 0 and written.strip() == "2"
    dumps = sorted(folder.glob("*.safetensors"))
    assert len(dumps) == 2  # the first's input, not the second's
    assert torch.equal(read(dumps[0])["x"], torch.full((2, 8), 1.0).cumsum(-1))


class Deep(nn.Module):
    """Two layer norms at module paths of about 300 characters that differ in the middle."""

    def __init__(self) -> None:
        super().__init__()
        inner = nn.Module()
        inner.add_module("norm", nn.LayerNorm(4))
        inner.add_module("twin", nn.LayerNorm(4))
        module = inner
        for depth in range(12):
            outer = nn.Module()
            outer.add_module(f"block_with_a_rather_long_name_{depth:02d}", module)
            module = outer
        self.body = module
        self.paths = [p for p, m in self.named_modules() if isinstance(m, nn.LayerNorm)]

    def forward(self, x):
        return sum(self.get_submodule(path)(x) for path in self.paths)


def test_a_module_path_too_long_for_a_file_name_gets_a_short_one(tmp_path):
    """A 300-character module path: the file name is shortened, the same each time and
    distinct per path; the dump's metadata keeps the whole path."""
    model = Deep()
    assert all(len(path) > 300 for path in model.paths)
    names = []
    for run_folder in ("first", "second"):
        x = torch.randn(3, 4, requires_grad=True)
        with capture(model, tmp_path / run_folder) as recording:
            model(x).sum().backward()
        names.append([f.name for f in recording.files])
        assert [metadata(f)["module"] for f in recording.files] == model.paths
        assert all("grad_x" in read(f) for f in recording.files)
    assert names[0] == names[1] and len(set(names[0])) == 2
    assert all(len(name.encode()) <= 200 and name.startswith("0000") for name in names[0])


def test_calls_past_the_call_limit_are_said(tmp_path, monkeypatch):
    """Past the limit (100,000 calls: the five digits of a dump's name; 3 here) the calls are
    counted and a warning says how many were not recorded. A max_calls asked for is quiet."""
    monkeypatch.setattr(importlib.import_module("maskln_cli.models.capture"), "MAX_CALLS", 3)
    model, _ = build("gpt2")
    input_ids, attention_mask = batch()
    with (
        pytest.warns(UserWarning, match="2 layer norm calls past the limit of 3 calls"),
        capture(model, tmp_path / "all", valid=attention_mask) as recording,
    ):
        run(model, input_ids, attention_mask, backward=False)
    assert len(recording.files) == 3 and recording.skipped == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture(model, tmp_path / "some", valid=attention_mask, max_calls=2) as some:
            run(model, input_ids, attention_mask, backward=False)
    assert some.skipped == 3
