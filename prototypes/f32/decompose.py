"""Would a decomposition inductor can fuse beat the opaque custom op under torch.compile (issue 40)?

    python -m prototypes.f32.decompose [--threads N] [--repeats R] [--shapes small|all]

Compiled (inductor, fullgraph, dynamic=False), float32, interleaved in one process, per call
median (min) of R repeats of ~2 ms each, forward without grad and forward + backward:

- op:        maskln_cli.masked_layer_normalization (the registered op: one opaque node)
- f64 decomp: the float64 two-pass composite of plain ops inductor fuses (x.double() stats,
             cast back once): ``where(valid, x, 0).double()``, mean, deviations, mean square,
             rsqrt, affine in float64, ``where(valid, ., 0).float()``; its backward is
             AOTAutograd's derivative of it, in float64 inside the generated kernels
- f64 composite: maskln_cli.op.functional.masked_layer_norm_functional (the op's own float64
             composite, with its power-of-two row scalings), what a CompositeImplicit path
             under compile would run
- f32 2-pass: a float32 decomposition (two-pass, the mean's rounding error removed), to show
             what float32 statistics cost in accuracy
- one-liner: F.layer_norm(...).masked_fill(~valid[..., None], 0)

and the accuracy of each (compiled) on hard rows against float64 (ulp of float32 at the
float64-rounded truth): y, and dx, dscale, dbias for a random grad_out.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.op.functional import gradients, masked_layer_norm_functional

EPS = 1e-5
SMALL = ((8, 16, 64), (4096, 16), (16, 128, 384))
LARGE = ((131072, 128), (524288, 16), (32, 65536))


def decomposed(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    keep = valid.unsqueeze(-1)
    xd = torch.where(keep, x, 0.0).double()
    mean = xd.mean(dim=-1, keepdim=True)
    xc = xd - mean
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + EPS)
    y = xc * rstd * scale.double() + bias.double()
    return torch.where(keep, y, 0.0).to(x.dtype)


def two_pass_f32(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    keep = valid.unsqueeze(-1)
    xz = torch.where(keep, x, 0.0)
    deviations = xz - xz.mean(dim=-1, keepdim=True)
    xc = deviations - deviations.mean(dim=-1, keepdim=True)  # the mean's rounding error removed
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True) + EPS)
    return torch.where(keep, xc * rstd * scale + bias, 0.0)


def composite(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    return masked_layer_norm_functional(x, valid, scale, bias, EPS)


def ours(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    return masked_layer_normalization(x, valid, scale, bias, EPS)


def peer(x, valid, scale, bias):  # type: ignore[no-untyped-def]
    return F.layer_norm(x, (x.shape[-1],), scale, bias, EPS).masked_fill(~valid[..., None], 0)


CONTENDERS = {
    "op": ours,
    "f64 decomp": decomposed,
    "f64 composite": composite,
    "f32 2-pass": two_pass_f32,
    "one-liner": peer,
}


def inputs(shape, seed=0):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    valid = torch.rand(shape[:-1], generator=generator) >= 0.25
    scale = torch.randn(shape[-1], generator=generator)
    bias = torch.randn(shape[-1], generator=generator)
    return x, valid, scale, bias


def timed(calls, repeats):  # type: ignore[no-untyped-def]
    for call in calls.values():
        call(), call()
    counts = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        counts[name] = max(1, round(2e-3 / (time.perf_counter() - start)))
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(counts[name]):
                call()
            times[name].append((time.perf_counter() - start) / counts[name])
    return times


def speed(shapes, repeats):  # type: ignore[no-untyped-def]
    compiled = {n: torch.compile(f, fullgraph=True, dynamic=False) for n, f in CONTENDERS.items()}
    for shape in shapes:
        args = inputs(shape)
        leaves = tuple(t.clone().requires_grad_() for t in (args[0], args[2], args[3]))
        grad_out = torch.randn(shape)
        with torch.no_grad():
            times = timed({n: functools.partial(f, *args) for n, f in compiled.items()}, repeats)
        report(shape, "fwd, no grad", times)
        calls = {n: functools.partial(training, f, args[1], leaves, grad_out)
                 for n, f in compiled.items()}  # fmt: skip
        report(shape, "fwd+bwd", timed(calls, repeats))


def training(function, valid, leaves, grad_out):  # type: ignore[no-untyped-def]
    x, scale, bias = leaves
    return torch.autograd.grad(function(x, valid, scale, bias), leaves, grad_out)


def report(shape, what, times):  # type: ignore[no-untyped-def]
    peer_median = statistics.median(times["one-liner"])
    cells = []
    for name, values in times.items():
        median = statistics.median(values)
        cells.append(f"{name} {median * 1e6:.1f} ({min(values) * 1e6:.1f}) us"
                     f" x{median / peer_median:.2f}")  # fmt: skip
    print(f"{list(shape)!s:16} {what:13} " + " | ".join(cells), flush=True)


def hard_rows(channels, generator):  # type: ignore[no-untyped-def]
    rows = [
        1e4 + 0.1 * torch.randn(channels, generator=generator, dtype=torch.float64),
        torch.randn(channels, generator=generator, dtype=torch.float64).exp() * 3,
        torch.randn(channels, generator=generator, dtype=torch.float64),
        torch.randn(channels, generator=generator, dtype=torch.float64) * 1e-30,
        torch.randn(channels, generator=generator, dtype=torch.float64) * 1e30,
    ]
    outlier = torch.randn(channels, generator=generator, dtype=torch.float64)
    outlier[0] = 1e5
    rows.append(outlier)
    return torch.stack(rows).float()


def ulps(approx, exact):  # type: ignore[no-untyped-def]
    rounded = exact.float()
    spacing = torch.where(
        rounded == 0,
        torch.finfo(torch.float32).tiny,
        (rounded.abs().nextafter(torch.tensor(float("inf"))) - rounded.abs()).double(),
    )
    return ((approx.double() - exact).abs() / spacing).max().item()


def accuracy():  # type: ignore[no-untyped-def]
    compiled = {n: torch.compile(f, fullgraph=True, dynamic=False) for n, f in CONTENDERS.items()}
    generator = torch.Generator().manual_seed(1)
    for channels in (1, 3, 16, 17, 127, 768, 65537):
        x = hard_rows(channels, generator)
        x = torch.cat([x, torch.full((1, channels), float("nan"))])
        valid = torch.ones(x.shape[0], dtype=torch.bool)
        valid[-1] = False
        scale = torch.randn(channels, generator=generator)
        bias = torch.randn(channels, generator=generator)
        grad_out = torch.randn(x.shape, generator=generator)
        exact_y = masked_layer_norm_functional(x.double(), valid, scale.double(), bias.double(),
                                               EPS)  # fmt: skip
        exact = gradients(grad_out.double(), x.double(), valid, scale.double(), EPS)
        cells = []
        for name, function in compiled.items():
            wrt = [t.clone().requires_grad_() for t in (x, scale, bias)]
            y = function(wrt[0], valid, wrt[1], wrt[2])
            grads = torch.autograd.grad(y, wrt, grad_out)
            padding = (y[-1], grads[0][-1])
            clean = all(t.eq(0).all() and not t.signbit().any() for t in padding) and all(
                g.isfinite().all() for g in grads
            )
            errors = [ulps(y[:-1], exact_y[:-1]), ulps(grads[0][:-1], exact[0][:-1]),
                      ulps(grads[1], exact[1]), ulps(grads[2], exact[2])]  # fmt: skip
            cells.append(f"{name}: " + "/".join(f"{e:.3g}" for e in errors)
                         + ("" if clean else " PADDING LEAK"))  # fmt: skip
        print(f"C={channels:6} max ulp y/dx/dscale/dbias  " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--shapes", choices=("small", "all", "none"), default="small")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64  # each shape compiles each contender once
    accuracy()
    if args.shapes != "none":
        shapes = SMALL if args.shapes == "small" else SMALL + LARGE
        print(f"float32, {args.threads} thread(s), median (min) of {args.repeats}, x = / one-liner")
        speed(shapes, args.repeats)


if __name__ == "__main__":
    main()
