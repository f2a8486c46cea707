"""Which way each call takes: the rule of maskln_cli.op.autograd (FORWARD_WAYS, BACKWARD_WAYS),
enumerated over the contexts a call can be made in, each row of the tables reached.

That each way computes the right values is for the other tests (test_transform_matrix.py,
test_torch_features.py); this one holds the rule itself, so that a change to a condition shows
up as a change of way in a named context. The rule is one for both norms: the RMSNorm function
takes the same way as the LayerNorm function in every context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import grad, jacfwd, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from maskln_cli import masked_layer_normalization, masked_rms_normalization
from maskln_cli.op import api, autograd
from maskln_cli.op.autograd import BACKWARD_WAYS, FORWARD_WAYS, Way


def inputs(requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64, generator=generator)
    valid = torch.tensor([True, False, True])
    scale, bias = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for t in (x, scale, bias):
        t.requires_grad_(requires_grad)
    return x, valid, scale, bias


@pytest.fixture
def forward_ways(monkeypatch) -> list[Way]:
    """The way each call of the public function took, in order."""
    taken: list[Way] = []
    chosen = autograd.forward_way

    def spy(*args):  # type: ignore[no-untyped-def]
        taken.append(chosen(*args))
        return taken[-1]

    monkeypatch.setattr(api, "forward_way", spy)
    return taken


@pytest.fixture
def backward_ways(monkeypatch) -> list[Way]:
    """The way each derivative of the Function took, in order."""
    taken: list[Way] = []
    chosen = autograd.backward_way

    def spy(incoming):  # type: ignore[no-untyped-def]
        taken.append(chosen(incoming))
        return taken[-1]

    monkeypatch.setattr(autograd, "backward_way", spy)
    return taken


class Watching(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def call(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    return masked_layer_normalization(x, valid, scale, bias)


def rms_call(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    return masked_rms_normalization(x, valid, scale, offset=1.0)


@pytest.fixture(params=["layer", "rms"])
def norm(request, monkeypatch) -> str:
    """Each context run with the norm's public function (``call`` is looked up at run time)."""
    if request.param == "rms":
        monkeypatch.setattr(__import__(__name__, fromlist=["call"]), "call", rms_call)
    return request.param


def loss(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    return (call(x, valid, scale, bias) ** 3).sum()


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


def fake_call() -> None:
    with FakeTensorMode() as mode:
        x, valid, scale, bias = (mode.from_tensor(t) for t in inputs())
        call(x, valid, scale, bias)


def dual_call() -> None:
    x, valid, scale, bias = inputs()
    with fwAD.dual_level():
        call(fwAD.make_dual(x, torch.ones_like(x)), valid, scale, bias)


def compiled_call() -> None:
    torch._dynamo.reset()
    torch.compile(call, backend="eager")(*inputs())


def under(context: Callable[[], contextlib.AbstractContextManager[object]], grad: bool = False):
    def run() -> None:
        with context():
            call(*inputs(grad))

    return run


def one_level(transform: Callable[..., Callable[..., torch.Tensor]]) -> Callable[[], None]:
    def run() -> None:
        x, valid, scale, bias = inputs()
        transform(lambda a: loss(a, valid, scale, bias))(x)

    return run


def jvp_of(f: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda a: jvp(f, (a,), (torch.ones_like(a),))[1]


def jvp_of_jvp() -> None:
    x, valid, scale, bias = inputs()
    jvp_of(jvp_of(lambda a: call(a, valid, scale, bias)))(x)


FORWARD_CONTEXTS: dict[str, tuple[Callable[[], None], Way]] = {
    "eager, nothing requires grad": (under(nothing), Way.KERNELS),
    "eager, inputs require grad": (under(nothing, grad=True), Way.AUTOGRAD),
    "torch.no_grad, inputs require grad": (under(torch.no_grad, grad=True), Way.KERNELS),
    "torch.inference_mode": (under(torch.inference_mode, grad=True), Way.KERNELS),
    "torch.func.grad": (one_level(grad), Way.FUNCTION),
    "torch.func.vmap": (one_level(lambda f: lambda a: vmap(f)(a[None])), Way.FUNCTION),
    "torch.func.jvp": (one_level(jvp_of), Way.FUNCTION),
    "torch.func.jacfwd": (one_level(jacfwd), Way.FUNCTION),
    "jvp of jvp": (jvp_of_jvp, Way.COMPOSITE),
    "jacfwd of jacfwd": (one_level(lambda f: jacfwd(jacfwd(f))), Way.COMPOSITE),
    "forward-mode AD, a dual x": (dual_call, Way.FUNCTION),
    "a fake tensor": (fake_call, Way.OP),
    "a TorchDispatchMode": (under(Watching), Way.OP),
    "the profiler": (under(torch.profiler.profile), Way.OP),
    "torch.jit.trace": (lambda: torch.jit.trace(call, inputs(), check_trace=False), Way.OP),
    "torch.compile": (compiled_call, Way.OP),
}


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("context", list(FORWARD_CONTEXTS))
def test_the_public_function_takes_its_way(context: str, forward_ways: list[Way], norm: str):
    run, expected = FORWARD_CONTEXTS[context]
    run()
    assert forward_ways, "the op was not called"
    assert forward_ways[0] is expected


def test_every_row_of_the_forward_table_is_reached():
    assert {way for _, way in FORWARD_CONTEXTS.values()} == {way for *_, way in FORWARD_WAYS}


def backward_plain() -> None:
    x, valid, scale, bias = inputs(True)
    loss(x, valid, scale, bias).backward()


def backward_create_graph() -> None:
    x, valid, scale, bias = inputs(True)
    torch.autograd.grad(loss(x, valid, scale, bias), x, create_graph=True)


def backward_batched() -> None:
    x, valid, scale, bias = inputs(True)
    y = call(x, valid, scale, bias)
    torch.autograd.grad(y, x, torch.ones(2, *y.shape, dtype=y.dtype), is_grads_batched=True)


def backward_under_grad() -> None:
    x, valid, scale, bias = inputs()
    grad(lambda a: loss(a, valid, scale, bias))(x)


def backward_under_jvp_of_grad() -> None:
    x, valid, scale, bias = inputs()
    jvp_of(grad(lambda a: loss(a, valid, scale, bias)))(x)


BACKWARD_CONTEXTS: dict[str, tuple[Callable[[], None], Way]] = {
    ".backward()": (backward_plain, Way.KERNELS),
    "autograd.grad(create_graph=True)": (backward_create_graph, Way.DIFFERENTIABLE),
    "autograd.grad(is_grads_batched=True)": (backward_batched, Way.COMPOSITE),
    "torch.func.grad": (backward_under_grad, Way.DIFFERENTIABLE),
    "jvp of grad": (backward_under_jvp_of_grad, Way.DIFFERENTIABLE),
}


@pytest.mark.parametrize("context", list(BACKWARD_CONTEXTS))
def test_the_backward_takes_its_way(context: str, backward_ways: list[Way], norm: str):
    run, expected = BACKWARD_CONTEXTS[context]
    run()
    assert backward_ways, "no backward ran"
    assert backward_ways[0] is expected


def test_every_row_of_the_backward_table_is_reached():
    assert {way for _, way in BACKWARD_CONTEXTS.values()} == {way for *_, way in BACKWARD_WAYS}
