"""The registered ops, ``torch.ops.maskln.masked_layer_norm`` and its backward (and
``masked_rms_norm`` and its backward), as PyTorch's own tools see them: opcheck, inductor,
export and load in a fresh process, jit.trace, autocast under torch.compile, input checks,
forward-mode AD, second order, and torch.func on the kernels.

Values are checked against the float64 reference (maskln_cli.op.reference, and autograd through
it) or against the eager op; each test runs on whichever backend the suite runs (native by
default, raw with MASKLN_BACKEND=raw).
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jacfwd, jacrev, jvp, vmap

from maskln_cli import (
    MaskedLayerNorm,
    MaskedRMSNorm,
    masked_layer_normalization,
    masked_rms_normalization,
)
from maskln_cli.op import functional
from maskln_cli.op.norms import LAYER, RMS
from maskln_cli.op.reference import reference_masked_layer_norm, reference_masked_rms_norm
from tests.op.test_core import make_inputs

ROOT = Path(__file__).resolve().parents[2]
OP = torch.ops.maskln.masked_layer_norm.default
BACKWARD_OP = torch.ops.maskln.masked_layer_norm_backward.default
RMS_OP = torch.ops.maskln.masked_rms_norm.default
RMS_BACKWARD_OP = torch.ops.maskln.masked_rms_norm_backward.default
CHEAP_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def arguments(shape, dtype=torch.float32, layout=None, grads=(True, True, True), *,
              params=None, valid_fraction=0.6, poison=True, seed=0):  # fmt: skip
    """(x, valid, scale, bias, eps) for the op: x of ``shape`` laid out by the permutation
    ``layout`` (a channels-strided x: the same values, other strides), NaN and inf in its
    invalid rows, each of x, scale, bias requiring grad as ``grads`` says."""
    x, valid, scale, bias = make_inputs(shape[:-1], shape[-1], torch.float64, seed=seed,
                                        valid_fraction=valid_fraction, poison=poison)  # fmt: skip
    if layout is not None:
        inverse = [layout.index(axis) for axis in range(len(layout))]
        x = x.permute(*layout).contiguous().permute(*inverse)
    x = x.to(dtype)
    scale, bias = (t.to(params or dtype) for t in (scale, bias))
    for tensor, wanted in zip((x, scale, bias), grads, strict=True):
        tensor.requires_grad_(wanted)
    return x, valid, scale, bias, 1e-5


SAMPLES = {
    "2-d float32": arguments((4, 6)),
    "1-d one row": arguments((7,)),
    "3-d float64 permuted": arguments((2, 3, 5), torch.float64, layout=(2, 0, 1)),
    "transposed x.t()": arguments((5, 4), layout=(1, 0)),
    "bfloat16, float32 parameters": arguments((3, 4), torch.bfloat16, params=torch.float32),
    "float16": arguments((2, 3, 4), torch.float16),
    "x alone requires grad": arguments((3, 5), grads=(True, False, False)),
    "scale alone requires grad": arguments((3, 5), grads=(False, True, False)),
    "bias alone requires grad": arguments((3, 5), grads=(False, False, True)),
    "no grad": arguments((3, 5), grads=(False, False, False)),
    "all rows invalid": arguments((3, 4), valid_fraction=0.0),
    "one channel": arguments((4, 1)),
    "empty": arguments((0, 4)),
}


def rms_arguments(name: str, offset: float = 1.0):
    """(x, valid, scale, eps, offset) for the RMSNorm op, from a sample of the LayerNorm op."""
    x, valid, scale, _, eps = SAMPLES[name]
    return x, valid, scale, eps, offset


RMS_SAMPLES = ["2-d float32", "1-d one row", "3-d float64 permuted", "transposed x.t()",
               "bfloat16, float32 parameters", "float16", "scale alone requires grad", "no grad",
               "all rows invalid", "one channel", "empty"]  # fmt: skip


def rms_backward_arguments(name: str, mask=(True, True)):
    """(dy, x, valid, scale, rstd, eps, offset, output_mask) from the forward of a sample."""
    x, valid, scale, eps, offset = rms_arguments(name)
    with torch.no_grad():
        _, rstd = RMS_OP(x, valid, scale, eps, offset)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype)
    dy = torch.empty_like(x).copy_(dy).requires_grad_()
    leaves = (x.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_())
    return dy, leaves[0], valid, leaves[1], rstd, eps, offset, list(mask)


def backward_arguments(name: str, mask=(True, True, True)):
    """(dy, x, valid, scale, mean, rstd, eps, output_mask) from the forward of a sample."""
    x, valid, scale, bias, eps = SAMPLES[name]
    with torch.no_grad():
        _, mean, rstd = OP(x, valid, scale, bias, eps)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(x.dtype)
    dy = torch.empty_like(x).copy_(dy).requires_grad_()
    leaves = (x.detach().clone().requires_grad_(), scale.detach().clone().requires_grad_())
    return dy, leaves[0], valid, leaves[1], mean, rstd, eps, list(mask)


# --- opcheck ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES)
def test_opcheck_forward_op(name):
    torch.library.opcheck(OP, SAMPLES[name], test_utils=CHEAP_CHECKS)


@pytest.mark.parametrize(
    ("name", "mask"),
    [("3-d float64 permuted", (True, True, True)), ("transposed x.t()", (True, False, True)),
     ("bfloat16, float32 parameters", (False, True, True)), ("all rows invalid", (True,) * 3),
     ("one channel", (True, True, False)), ("empty", (True, True, True))],
)  # fmt: skip
def test_opcheck_backward_op(name, mask):
    """The fake backward gave contiguous dx where the real one has x's strides."""
    torch.library.opcheck(BACKWARD_OP, backward_arguments(name, mask), test_utils=CHEAP_CHECKS)


@pytest.mark.parametrize("name", RMS_SAMPLES)
def test_opcheck_rms_ops(name):
    """The RMSNorm op and its backward, with every output_mask, on the LayerNorm op's samples."""
    torch.library.opcheck(RMS_OP, rms_arguments(name), test_utils=CHEAP_CHECKS)
    for mask in ((True, True), (True, False), (False, True)):
        arguments = rms_backward_arguments(name, mask)
        torch.library.opcheck(RMS_BACKWARD_OP, arguments, test_utils=CHEAP_CHECKS)


@pytest.mark.parametrize("name", ["3-d float64 permuted", "bfloat16, float32 parameters"])
def test_opcheck_aot_dispatch_of_both_ops(name):
    """torch.compile's view of the ops (AOTAutograd with dynamic shapes): the slow check, on
    the layouts and dtypes that broke it."""
    torch.library.opcheck(OP, SAMPLES[name], test_utils="test_aot_dispatch_dynamic")
    torch.library.opcheck(BACKWARD_OP, backward_arguments(name),
                          test_utils="test_aot_dispatch_dynamic")  # fmt: skip


TEST_NAMESPACE = "maskln_tests"
"""The suite's own ops (tests/solutions/broken.py: submissions that define a custom op), which
a pytest worker may have registered before this test runs."""


def maskln_ops() -> list[str]:
    """Every op the dispatcher has in a namespace of maskln's ("maskln", "maskln_native"...)."""
    names = torch._C._dispatch_get_all_op_names()
    namespaces = (name.split("::")[0] for name in names)
    return sorted(
        name
        for name, space in zip(names, namespaces, strict=True)
        if space.startswith("maskln") and space != TEST_NAMESPACE
    )


FULL_OPCHECK = {
    "maskln::masked_layer_norm": lambda: (OP, SAMPLES["3-d float64 permuted"]),
    "maskln::masked_layer_norm_backward": lambda: (BACKWARD_OP,
                                                   backward_arguments("transposed x.t()")),
    "maskln::masked_rms_norm": lambda: (RMS_OP, rms_arguments("3-d float64 permuted")),
    "maskln::masked_rms_norm_backward": lambda: (RMS_BACKWARD_OP,
                                                 rms_backward_arguments("transposed x.t()")),
}  # fmt: skip


def test_every_op_in_maskln_namespaces_has_a_full_opcheck():
    """The native library defined two more dispatcher ops (maskln_native::forward and
    ::backward) with no fake or autograd kernel: opcheck failed on them, and so did a compiled
    graph calling them. Any op in a namespace of ours must be listed here, and pass."""
    assert maskln_ops() == sorted(FULL_OPCHECK)


@pytest.mark.parametrize("name", sorted(FULL_OPCHECK))
def test_full_opcheck_of_each_op(name):
    """Every test of opcheck (schema, autograd registration, fake tensors, AOT dispatch with
    static and dynamic shapes)."""
    op, sample = FULL_OPCHECK[name]()
    torch.library.opcheck(op, sample)


@pytest.fixture
def python_autograd_calls(monkeypatch):
    """Calls of the registered ops' Python autograd kernels, which the native library's C++
    autograd kernels call back (native backend only), of both norms."""
    from maskln_cli.op import backend, library

    if backend.active_backend().name != "native":
        pytest.skip("the C++ autograd kernels come with the native kernels")
    calls: list[str] = []

    def spying(name, kernel):  # type: ignore[no-untyped-def]
        def spy(*args):  # type: ignore[no-untyped-def]
            calls.append(name)
            return kernel(*args)

        return spy

    for norm, prefix in ((LAYER, ""), (RMS, "rms ")):
        forward, backward = library.AUTOGRAD_KERNELS[norm.name]
        backend.use_python_autograd(
            norm, spying(f"{prefix}forward", forward), spying(f"{prefix}backward", backward)
        )
    yield calls
    for norm in (LAYER, RMS):
        backend.use_python_autograd(norm, *library.AUTOGRAD_KERNELS[norm.name])


def test_no_python_runs_per_call_where_no_derivative_can_be_taken(python_autograd_calls):
    """The ops' autograd kernel was Python, and ran on every call of a CPU tensor: in compiled
    graphs (inputs requiring grad, called under no_grad), 10-15 us a call."""
    x, valid, scale, bias, eps = arguments((6, 32), grads=(False, False, False))
    y, mean, rstd = OP(x, valid, scale, bias, eps)
    BACKWARD_OP(torch.ones_like(y), x, valid, scale, mean, rstd, eps, [True, True, True])
    leaves = tuple(t.clone().requires_grad_() for t in (x, scale, bias))
    with torch.no_grad():
        OP(leaves[0], valid, leaves[1], leaves[2], eps)
    assert python_autograd_calls == []
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, s, b: masked_layer_normalization(a, valid, s, b),
                             backend="inductor", fullgraph=True)  # fmt: skip
    torch.autograd.grad(compiled(*leaves).square().sum(), leaves)  # traced: Python autograd
    python_autograd_calls.clear()
    got = torch.autograd.grad(compiled(*leaves).square().sum(), leaves)
    assert python_autograd_calls == []  # the compiled graphs' calls at run time
    want = torch.autograd.grad(masked_layer_normalization(leaves[0], valid, *leaves[1:])
                               .square().sum(), leaves)  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_no_python_runs_per_call_of_the_rms_op_either(python_autograd_calls):
    x, valid, scale, eps, offset = rms_arguments("2-d float32")
    x, scale = x.detach(), scale.detach()
    y, rstd = RMS_OP(x, valid, scale, eps, offset)
    RMS_BACKWARD_OP(torch.ones_like(y), x, valid, scale, rstd, eps, offset, [True, True])
    leaves = tuple(t.clone().requires_grad_() for t in (x, scale))
    with torch.no_grad():
        RMS_OP(leaves[0], valid, leaves[1], eps, offset)
    assert python_autograd_calls == []
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, s: masked_rms_normalization(a, valid, s, offset=1.0),
                             backend="inductor", fullgraph=True)  # fmt: skip
    torch.autograd.grad(compiled(*leaves).square().sum(), leaves)
    python_autograd_calls.clear()
    got = torch.autograd.grad(compiled(*leaves).square().sum(), leaves)
    assert python_autograd_calls == []
    want = torch.autograd.grad(masked_rms_normalization(leaves[0], valid, leaves[1], offset=1.0)
                               .square().sum(), leaves)  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    y = RMS_OP(leaves[0], valid, leaves[1], eps, offset)[0]
    torch.autograd.grad(y.sum(), leaves)
    assert python_autograd_calls == ["rms forward"]


def test_a_derivative_through_the_op_takes_the_python_autograd(python_autograd_calls):
    x, valid, scale, bias, eps = arguments((6, 32), torch.float64)
    y = OP(x, valid, scale, bias, eps)[0]
    got = torch.autograd.grad(y.square().sum(), (x, scale, bias), create_graph=True)
    assert python_autograd_calls == ["forward"]
    clean = torch.where(valid[..., None], x, 0.0)
    want = torch.autograd.grad(reference_masked_layer_norm(clean, valid, scale, bias)
                               .square().sum(), (x, scale, bias))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    _, mean, rstd = OP(x.detach(), valid, scale.detach(), bias.detach(), eps)
    dy = torch.ones_like(x, requires_grad=True)
    BACKWARD_OP(dy, x, valid, scale, mean, rstd, eps, [True, True, True])
    assert python_autograd_calls[-1] == "backward"
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.detach(), torch.ones_like(x))
        OP(dual, valid, scale.detach(), bias.detach(), eps)
    assert python_autograd_calls[-1] == "forward"


def test_inductor_trains_on_transposed_inputs():
    """Conv1d -> transpose(1, 2) -> norm, compiled with inductor, forward and backward: this
    crashed on the backward op's strides (expected size 50==50, stride 1==32)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    conv, norm = nn.Conv1d(8, 32, 3, padding=1), MaskedLayerNorm(32)
    valid = torch.rand(4, 50) < 0.8

    def step(x: torch.Tensor) -> torch.Tensor:
        return norm(conv(x).transpose(1, 2), valid)

    x = torch.randn(4, 8, 50)
    results = []
    for fn in (torch.compile(step, backend="inductor"), step):
        out = fn(x)
        results.append((out, torch.autograd.grad(out.square().sum(), [conv.weight, norm.weight])))
    (out, grads), (want, want_grads) = results
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# --- the op checks its inputs, with the public function's messages ---------------------------

BAD = {
    "mask of the wrong shape": {"valid": torch.ones(4, 3, dtype=torch.bool)},
    "negative eps": {"eps": -1e-5},
    "nan eps": {"eps": math.nan},
    "eps rounding to 0 in float32": {"eps": 1e-46},
    "scale of another dtype": {"scale": torch.ones(5, dtype=torch.float64)},
    "bias of another size": {"bias": torch.zeros(4)},
    "integer x": {"x": torch.ones(3, 4, 5, dtype=torch.int32)},
    "0-d x": {"x": torch.tensor(1.0), "valid": torch.tensor(True)},
}


@pytest.mark.parametrize("name", BAD)
def test_registered_op_checks_inputs_with_the_public_messages(name):
    """Through torch.ops (and so in exported graphs) a mask of the wrong shape was accepted and a
    negative eps gave NaN (an int64 mask returned zeros: the test below)."""
    args = {"x": torch.randn(3, 4, 5), "valid": torch.ones(3, 4, dtype=torch.bool),
            "scale": torch.ones(5), "bias": torch.zeros(5), "eps": 1e-5}  # fmt: skip
    args.update(BAD[name])
    with pytest.raises((TypeError, ValueError)) as public:
        masked_layer_normalization(**args)
    for requires_grad in (False, True):  # the dispatcher's kernels, and the op's autograd
        values = dict(args)
        if requires_grad and values["x"].is_floating_point():
            values["x"] = values["x"].clone().requires_grad_()
        with pytest.raises(type(public.value)) as through_op:
            OP(*values.values())
        assert str(through_op.value) == str(public.value)


def test_an_integer_mask_is_converted_by_the_function_and_refused_by_the_op():
    """The one mask rule lives in the public function (a 0/1 attention_mask is a mask); the
    registered op's schema takes a bool mask, so an int64 one is refused there, not zeroed."""
    x, scale, bias = torch.randn(3, 4, 5), torch.ones(5), torch.zeros(5)
    ones = torch.tensor([[1, 0, 1, 1]] * 3)
    torch.testing.assert_close(
        masked_layer_normalization(x, ones, scale, bias), OP(x, ones.bool(), scale, bias, 1e-5)[0]
    )
    with pytest.raises(TypeError, match="valid must be a bool tensor, got int64"):
        OP(x, ones, scale, bias, 1e-5)


def test_registered_op_takes_half_x_with_float32_parameters():
    """bfloat16 x raised KeyError through the op."""
    x, valid, scale, bias, eps = (t.detach() if isinstance(t, torch.Tensor) else t
                                  for t in SAMPLES["bfloat16, float32 parameters"])  # fmt: skip
    y, mean, rstd = OP(x, valid, scale, bias, eps)
    assert y.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32
    assert torch.equal(y, masked_layer_normalization(x, valid, scale, bias, eps))
    want = reference_masked_layer_norm(x, valid, scale, bias, eps)
    torch.testing.assert_close(y.double(), want, rtol=1.6e-2, atol=3e-2)


# --- derivatives through the op itself ---------------------------------------------------------


def test_op_under_jvp_gives_the_tangent():
    """Called directly under torch.func.jvp, the op returned zero tangents."""
    x, valid, scale, bias = make_inputs((3, 4), 6, poison=True)
    tangent = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(2))
    _, got = jvp(lambda a: OP(a, valid, scale, bias, 1e-5)[0], (x,), (tangent,))
    clean = torch.where(valid[..., None], x, 0.0)
    _, want = jvp(lambda a: reference_masked_layer_norm(a, valid, scale, bias), (clean,),
                  (tangent,))  # fmt: skip
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_op_and_its_backward_op_are_differentiable_twice():
    """The backward op had no autograd formula (opcheck's aot_dispatch said so)."""
    x, valid, scale, bias = make_inputs((2, 3), 4, poison=True)
    leaves = tuple(t.clone().requires_grad_() for t in (x, scale, bias))
    assert torch.autograd.gradgradcheck(lambda a, s, b: OP(a, valid, s, b, 1e-5)[0], leaves)
    dy = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(4))
    inputs = tuple(t.clone().requires_grad_() for t in (dy, x, scale))

    def backward(d, a, s):
        with torch.no_grad():  # the statistics of x: functions of it, never differentiated
            _, mean, rstd = OP(a, valid, s, bias, 1e-5)
        return tuple(BACKWARD_OP(d, a, valid, s, mean, rstd, 1e-5, [True, True, True]))

    assert torch.autograd.gradcheck(backward, inputs, check_forward_ad=True)


# --- torch.func runs the kernels, not the float64 composite -----------------------------------


def test_torch_func_first_derivatives_run_the_kernels(monkeypatch):
    """grad, vmap, jvp, jacrev, jacfwd and vmap(grad) compute with the op's kernels: the
    composite (which they all ran before, in float64, 15-20x slower than eager) is never
    called; second derivatives still use it (hessian: tests/op/test_torch_features.py)."""
    x, valid, scale, bias = make_inputs((3, 4), 6, poison=True)
    dy = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(3))
    clean = torch.where(valid[..., None], x, 0.0)

    def loss(fn, a, s):
        return (fn(a, valid, s, bias) * dy).sum()

    def ours(a, s):
        return loss(masked_layer_normalization, a, s)

    def reference(a, s):
        return loss(reference_masked_layer_norm, a, s)

    want_grad = grad(reference, argnums=(0, 1))(clean, scale)
    want_jacfwd = jacrev(reference, argnums=1)(clean, scale)

    def refuse(*args, **kwargs):
        raise AssertionError("the float64 composite ran")

    monkeypatch.setattr(functional, "normalized_rows", refuse)
    got = grad(ours, argnums=(0, 1))(x, scale)
    for g, w in zip(got, want_grad, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(jacfwd(ours, argnums=1)(x, scale), want_jacfwd)
    torch.testing.assert_close(jacrev(ours, argnums=1)(x, scale), want_jacfwd)
    batched = vmap(grad(ours), in_dims=(0, None))(torch.stack([x, x]), scale)
    torch.testing.assert_close(batched[1], want_grad[0], rtol=1e-9, atol=1e-10)
    out = vmap(lambda a: masked_layer_normalization(a, valid, scale, bias))(x[None])
    torch.testing.assert_close(out[0], reference_masked_layer_norm(clean, valid, scale, bias))


# --- graphs: autocast under torch.compile, eps, export, jit.trace -----------------------------


def test_autocast_compiles_to_one_graph_with_fullgraph():
    """Under autocast the hand-written autocast_off broke fullgraph, and one norm made 9 or 10
    graphs; a swapped BERT made 18 where stock BERT makes 1."""
    from tests.op.hand_written_swap import use_masked_layer_norms
    from tests.test_transformers_checkpoints import LENGTHS, build

    x, valid = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    norm = MaskedLayerNorm(8)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(norm)(x, valid)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
        torch.testing.assert_close(torch.compile(norm, fullgraph=True)(x, valid), norm(x, valid))
    model, _ = build("bert")
    ids = torch.randint(2, 40, (len(LENGTHS), max(LENGTHS)))
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    swapped = use_masked_layer_norms(model)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(swapped)(input_ids=ids, attention_mask=mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def test_a_new_eps_recompiles_as_for_torch_layer_norm():
    """Documented, not avoided: torch.compile specializes a float argument of an op (F.layer_norm
    alike), so each new eps compiles anew; a module's eps is fixed, and shapes do not."""
    x, valid, scale, bias = make_inputs((2, 5), 16, torch.float32)
    counts = []
    for fn in (masked_layer_normalization, lambda a, v, s, b, e: F.layer_norm(a, (16,), s, b, e)):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        compiled = torch.compile(fn, backend=counter, dynamic=True)
        for eps in (1e-5, 1e-6, 1e-5):
            compiled(x, valid, scale, bias, eps)
        counts.append(counter.frame_count)
    assert counts == [2, 2]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    module = torch.compile(MaskedLayerNorm(16), backend=counter, dynamic=True)
    for length in (5, 9, 3):
        module(*make_inputs((2, length), 16, torch.float32)[:2])
    assert counter.frame_count == 1


@pytest.mark.slow  # real processes, tens of seconds: make test-slow
def test_exported_graph_loads_in_a_fresh_process_after_import_maskln(tmp_path):
    """torch.export.load could not resolve maskln::masked_layer_norm in a fresh process; the
    ops are now defined when torch is imported after maskln_cli, or at once if it already is,
    and ``import maskln_cli`` alone still does not import torch."""
    x, valid = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    norm = MaskedLayerNorm(8)
    torch.save({"x": x, "valid": valid, "want": norm(x, valid)}, tmp_path / "io.pt")
    torch.export.save(torch.export.export(norm, (x, valid)), tmp_path / "norm.pt2")
    for imports in ("import maskln_cli\nimport torch", "import torch\nimport maskln_cli"):
        script = textwrap.dedent(
            f"""
            import sys
            {imports.splitlines()[0]}
            torch_first = "torch" in sys.modules
            {imports.splitlines()[1]}
            import torch
            program = torch.export.load({str(tmp_path / "norm.pt2")!r})
            io = torch.load({str(tmp_path / "io.pt")!r})
            assert torch.equal(program.module()(io["x"], io["valid"]), io["want"])
            print("ok", torch_first)
            """
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)  # fmt: skip
        assert done.returncode == 0 and done.stdout.split()[0] == "ok", done.stderr
    probe = "import sys, maskln_cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr


class _LayerThenRMS(nn.Module):
    """Both of maskln's norms in one module, as a model holds them."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.layer = MaskedLayerNorm(channels)
        self.rms = MaskedRMSNorm(channels)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.rms(self.layer(x, valid) * 3.0 - 1.0, valid)


@pytest.mark.slow  # AOTInductor compiles C++: about 25 s on two cores
def test_aoti_package_loads_in_a_fresh_process_after_import_maskln(tmp_path):
    """A module using the ops, packaged by torch._inductor.aoti_compile_and_package and loaded
    by aoti_load_package in a fresh process: without maskln's ops defined the load fails
    ("Could not find schema for maskln::masked_layer_norm"); after ``import maskln_cli`` (either
    order with torch) the package gives eager's values, NaN padding included, and those are
    the float64 reference's to float32 rounding."""
    torch.manual_seed(0)
    module = _LayerThenRMS(64).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    x, valid = make_inputs((8, 16), 64, torch.float32, poison=True)[:2]
    with torch.no_grad():
        want = module(x, valid)
        layer = reference_masked_layer_norm(
            x.double(), valid, module.layer.weight.double(), module.layer.bias.double()
        )
        rms = module.rms
        reference = reference_masked_rms_norm(
            layer.float().double() * 3.0 - 1.0, valid, rms.weight.double(), rms.eps, rms.offset
        )
    torch.testing.assert_close(want.double(), reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(want[~valid], torch.zeros_like(want[~valid]))
    package = torch._inductor.aoti_compile_and_package(
        torch.export.export(module, (x, valid)), package_path=str(tmp_path / "norms.pt2")
    )
    torch.save({"x": x, "valid": valid, "want": want}, tmp_path / "io.pt")
    load = textwrap.dedent(f"""
        loaded = torch._inductor.aoti_load_package({package!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        got = loaded(io["x"], io["valid"])
        assert torch.equal(got, io["want"]), (got - io["want"]).abs().max()
        print("ok")
    """)
    for imports in ("import maskln_cli\nimport torch", "import torch\nimport maskln_cli"):
        script = imports + load
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)  # fmt: skip
        assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr
    done = subprocess.run([sys.executable, "-c", "import torch" + load],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode != 0
    assert "Could not find schema for maskln::masked_layer_norm" in done.stderr, done.stderr


@pytest.mark.slow  # AOTInductor compiles C++: about 30 s on two cores
def test_aoti_example_of_the_docs_runs(tmp_path):
    """docs/op/torch.md's AOTInductor example packages and loads in a fresh process."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "aoti_package.py"), str(tmp_path / "norm.pt2")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded in a fresh process: the same values as eager"


def test_jit_trace_records_the_op_and_keeps_the_overflow_rescue():
    """jit.trace froze the raw-op path's branches: a valid row at |x| ~ 1e20, traced on
    ordinary data, came out 1.82 off, and another shape failed."""
    torch.manual_seed(0)
    norm = MaskedLayerNorm(16)
    x, valid = torch.randn(3, 4, 16), torch.rand(3, 4) < 0.7
    traced = torch.jit.trace(norm, (x, valid))
    assert "maskln::masked_layer_norm" in str(traced.graph)
    huge = torch.randn(2, 5, 16) * 1e20
    huge_valid = torch.ones(2, 5, dtype=torch.bool)
    got = traced(huge, huge_valid)
    want = reference_masked_layer_norm(huge, huge_valid, norm.weight, norm.bias)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
