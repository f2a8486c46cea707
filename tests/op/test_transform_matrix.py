"""Every composition of two torch.func transforms of the op, of both norms, against an oracle.

The same composition is applied to the op and to an oracle written here in plain torch ops
(sanitize x, two-pass mean and population variance, affine, zero the invalid rows), which every
transform differentiates and batches natively; the two must agree in float64 to 1e-8. The
matrix is generated: an outer transform of ``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``,
``vmap`` applied to an inner one of the same six (and ``hessian``, and each transform alone),
each with respect to x, scale and bias, the invalid rows of x holding NaN and inf; for the
public function and for the registered op ``torch.ops.maskln.masked_layer_norm``.

The RMSNorm op goes through the same matrix, each composition with respect to x and scale,
with Gemma's offset of 1, against an oracle of its own (no centering, no bias): a slice of it
in ``make test`` (each transform alone, ``hessian`` and a few compositions that take each way
of the op: nested forward mode, batched gradients, forward over reverse), the whole of it
marked slow.

Each level ends in a loss that is not linear in what the level below returns: a loss linear in
the op's output has a second derivative that does not depend on the first derivative of the
output, and hides a transform that treats the op's output as a constant (issue 30).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from maskln_cli import masked_layer_normalization, masked_rms_normalization

Fn = Callable[[torch.Tensor], torch.Tensor]
EPS = 1e-3
ARGUMENTS = ("x", "scale", "bias")


def oracle(x, valid, scale, bias, eps):
    """The op in plain differentiable torch ops (float64 in, float64 out)."""
    keep = valid.unsqueeze(-1)
    clean = torch.where(keep, x, 0.0)
    mean = clean.mean(dim=-1, keepdim=True)
    centered = clean - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    y = centered / torch.sqrt(variance + eps) * scale + bias
    return torch.where(keep, y, 0.0)


def rms_oracle(x, valid, scale, eps, offset):
    """The RMSNorm op in plain differentiable torch ops (float64 in, float64 out)."""
    keep = valid.unsqueeze(-1)
    clean = torch.where(keep, x, 0.0)
    mean_square = (clean * clean).mean(dim=-1, keepdim=True)
    y = clean / torch.sqrt(mean_square + eps) * (offset + scale)
    return torch.where(keep, y, 0.0)


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(30)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator) * 2 + 0.5
    valid = torch.tensor([[True, False, True], [True, True, False]])
    x[0, 1] = torch.nan  # the padding: nothing of it may reach a value or a derivative
    x[1, 2, 1:] = torch.inf
    scale = 1 + 0.5 * torch.randn(5, dtype=torch.float64, generator=generator)
    bias = 0.3 * torch.randn(5, dtype=torch.float64, generator=generator)
    weights = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator)
    return {"x": x, "valid": valid, "scale": scale, "bias": bias, "weights": weights}


def nonlinear(t: torch.Tensor) -> torch.Tensor:
    """A scalar loss of any tensor whose gradient depends on the tensor (cubes and sines)."""
    flat = t.reshape(-1)
    weights = torch.linspace(-1.0, 1.3, flat.numel(), dtype=flat.dtype, device=flat.device)
    return ((flat * weights) ** 3).sum() + flat.sin().sum()


def direction(like: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed tangent or cotangent of ``like``'s shape (finite where ``like`` is not; no random
    draw, which vmap would refuse)."""
    steps = torch.arange(like.numel(), dtype=torch.float64, device=like.device)
    return torch.sin(steps * 1.7 + seed).reshape(like.shape)


# Each transform turns a function of one tensor into another function of that tensor, whose
# output depends non-linearly on everything the transform computed (primal outputs included).
def t_grad(f: Fn) -> Fn:
    return grad(lambda a: nonlinear(f(a)))


def t_vjp(f: Fn) -> Fn:
    def g(a: torch.Tensor) -> torch.Tensor:
        out, pullback = vjp(f, a)
        (back,) = pullback(direction(out, 1))
        return torch.cat([out.reshape(-1).sin(), back.reshape(-1)])

    return g


def t_jvp(f: Fn) -> Fn:
    def g(a: torch.Tensor) -> torch.Tensor:
        out, tangent = jvp(f, (a,), (direction(a, 2),))
        return torch.cat([out.reshape(-1).sin(), tangent.reshape(-1)])

    return g


def t_jacrev(f: Fn) -> Fn:
    return jacrev(f)


def t_jacfwd(f: Fn) -> Fn:
    return jacfwd(f)


def t_vmap(f: Fn) -> Fn:
    """f on a batch of three scaled copies of its argument, batched by vmap."""

    def g(a: torch.Tensor) -> torch.Tensor:
        factors = torch.tensor([1.0, -0.5, 2.0], dtype=a.dtype).reshape(3, *([1] * a.dim()))
        return vmap(f)(a.unsqueeze(0) * factors)

    return g


def t_hessian(f: Fn) -> Fn:
    return hessian(lambda a: nonlinear(f(a)))


TRANSFORMS: dict[str, Callable[[Fn], Fn]] = {
    "grad": t_grad,
    "vjp": t_vjp,
    "jvp": t_jvp,
    "jacrev": t_jacrev,
    "jacfwd": t_jacfwd,
    "vmap": t_vmap,
}
COMPOSITIONS: dict[str, Callable[[Fn], Fn]] = {
    **{name: transform for name, transform in TRANSFORMS.items()},
    "hessian": t_hessian,
    **{
        f"{outer}({inner})": (lambda o, i: lambda f: o(i(f)))(TRANSFORMS[outer], TRANSFORMS[inner])
        for outer, inner in itertools.product(TRANSFORMS, TRANSFORMS)
    },
}


def of_argument(op: Callable[..., torch.Tensor], argument: str, given: dict) -> Fn:
    """The op as a function of one of x, scale and bias, the others fixed."""

    def f(a: torch.Tensor) -> torch.Tensor:
        arguments = {name: given[name] for name in ARGUMENTS}
        arguments[argument] = a
        return op(arguments["x"], given["valid"], arguments["scale"], arguments["bias"], EPS)

    return f


def registered_op(x, valid, scale, bias, eps):
    """The op as torch's dispatcher has it: ``torch.ops.maskln.masked_layer_norm``."""
    return torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, eps)[0]


WAYS_IN = {"function": masked_layer_normalization, "torch.ops": registered_op}


@pytest.mark.parametrize("argument", ARGUMENTS)
@pytest.mark.parametrize("composition", list(COMPOSITIONS))
@pytest.mark.parametrize("way_in", list(WAYS_IN))
def test_the_composition_equals_the_oracle(way_in: str, composition: str, argument: str):
    assert_composition_equals_oracle(WAYS_IN[way_in], oracle, composition, argument)


def assert_composition_equals_oracle(op, truth_op, composition: str, argument: str) -> None:
    given = inputs()
    transform = COMPOSITIONS[composition]
    start = given[argument]
    ours = transform(of_argument(op, argument, given))(start)
    truth = transform(of_argument(truth_op, argument, given))(start)
    assert truth.isfinite().all(), "the oracle itself must be finite"
    torch.testing.assert_close(ours, truth, rtol=1e-8, atol=1e-8)


OFFSET = 1.0
"""Gemma's: the gain is 1 + scale."""


def rms_function(x, valid, scale, bias, eps):
    """The RMSNorm function in the matrix's signature (bias, the LayerNorm op's, unused)."""
    return masked_rms_normalization(x, valid, scale, eps, offset=OFFSET)


def rms_registered_op(x, valid, scale, bias, eps):
    return torch.ops.maskln.masked_rms_norm(x, valid, scale, eps, OFFSET)[0]


def rms_truth(x, valid, scale, bias, eps):
    return rms_oracle(x, valid, scale, eps, OFFSET)


RMS_WAYS_IN = {"function": rms_function, "torch.ops": rms_registered_op}
RMS_SLICE = ("grad", "jvp", "vmap", "hessian", "jvp(jvp)", "vmap(grad)", "jacrev(jacfwd)",
             "grad(vjp)")  # fmt: skip
"""The compositions ``make test`` runs: each way of the op (the Function's backward and jvp,
its vmap rule, the composite under two forward-mode levels, second order)."""


@pytest.mark.parametrize(
    ("way_in", "composition", "argument"),
    [
        pytest.param(way, composition, argument,
                     marks=() if composition in RMS_SLICE else pytest.mark.slow)
        for way in RMS_WAYS_IN for composition in COMPOSITIONS for argument in ("x", "scale")
    ],
)  # fmt: skip
def test_the_rms_composition_equals_the_oracle(way_in: str, composition: str, argument: str):
    assert_composition_equals_oracle(RMS_WAYS_IN[way_in], rms_truth, composition, argument)


@pytest.mark.parametrize("truth", [oracle, rms_truth], ids=["layer", "rms"])
def test_the_oracle_agrees_with_autograd_and_finite_differences(truth):
    """The oracle's hessian by torch.func equals torch.autograd's, and finite differences of
    its gradient (so the matrix's truth is the truth)."""
    given = inputs()
    valid = given["valid"]
    x = torch.where(valid.unsqueeze(-1), given["x"], 0.0)

    def loss(a: torch.Tensor) -> torch.Tensor:
        return nonlinear(truth(a, valid, given["scale"], given["bias"], EPS))

    by_func = hessian(loss)(x)
    by_autograd = torch.autograd.functional.hessian(loss, x)
    torch.testing.assert_close(by_func, by_autograd, rtol=1e-12, atol=1e-12)
    step = 1e-6
    gradient = grad(loss)
    column = torch.zeros_like(x)
    column[0, 2, 3] = step
    finite = (gradient(x + column) - gradient(x - column)) / (2 * step)
    torch.testing.assert_close(by_func[..., 0, 2, 3], finite, rtol=1e-6, atol=1e-6)
