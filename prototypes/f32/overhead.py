"""Where a compiled call's time goes at a float32 shape, [8, 16, 64] by default (issue 40).

    python -m prototypes.f32.overhead [--profile] [--shape 4096,16]

Interleaved timings (median of 31 repeats of 2 ms each, 1 thread) of layers peeled off one by
one: the compiled op (forward no grad; forward + backward), the op through the dispatcher
(torch.ops.maskln.masked_layer_norm, eager), the native kernel through pybind, an empty compiled
graph (inductor's own call), the op called as torch.ops.maskln in a compiled function (the
same graph as the public function's, without its Python checks traced, so fewer guards), the
op compiled with guard_filter_fn=torch.compiler.skip_guard_on_globals_unsafe (no guards on
maskln's module globals), and the compiled one-liner. --profile adds torch.profiler's table
of the compiled op's calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.op import backend

EPS = 1e-5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--shape", default="8,16,64", help="comma-separated, last = C")
    args = parser.parse_args()
    shape = tuple(int(size) for size in args.shape.split(","))
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator)
    valid = torch.rand(shape[:-1], generator=generator) > 0.25
    scale, bias = torch.ones(shape[-1]), torch.zeros(shape[-1])
    xg, sg, bg = (t.clone().requires_grad_() for t in (x, scale, bias))
    grad_out = torch.randn(shape, generator=generator)
    native = backend.native_kernels(build=False)
    op = torch.ops.maskln.masked_layer_norm.default

    def ours(x, valid, scale, bias):
        return masked_layer_normalization(x, valid, scale, bias, EPS)

    def peer(x, valid, scale, bias):
        out = F.layer_norm(x, (x.shape[-1],), scale, bias, EPS)
        return out.masked_fill(~valid[..., None], 0)

    def direct(x, valid, scale, bias):
        return op(x, valid, scale, bias, EPS)[0]

    def empty(x, valid, scale, bias):
        return x + 1

    ours_c = torch.compile(ours, fullgraph=True, dynamic=False)
    peer_c = torch.compile(peer, fullgraph=True, dynamic=False)
    empty_c = torch.compile(empty, fullgraph=True, dynamic=False)
    direct_c = torch.compile(direct, fullgraph=True, dynamic=False)
    unguarded = {"guard_filter_fn": torch.compiler.skip_guard_on_globals_unsafe}
    unguarded_c = torch.compile(ours, fullgraph=True, dynamic=False, options=unguarded)

    def training(function):
        return lambda: torch.autograd.grad(function(xg, valid, sg, bg), (xg, sg, bg), grad_out)

    no_grad = {
        "op compiled": lambda: ours_c(x, valid, scale, bias),
        "torch.ops.maskln compiled": lambda: direct_c(x, valid, scale, bias),
        "op compiled, no global guards": lambda: unguarded_c(x, valid, scale, bias),
        "op eager (public function)": lambda: ours(x, valid, scale, bias),
        "torch.ops.maskln (dispatcher)": lambda: op(x, valid, scale, bias, EPS),
        "native kernel (pybind)": lambda: native.forward(x, valid, scale, bias, EPS, False),
        "compiled x + 1 (inductor call)": lambda: empty_c(x, valid, scale, bias),
        "one-liner compiled": lambda: peer_c(x, valid, scale, bias),
        "one-liner eager": lambda: peer(x, valid, scale, bias),
    }
    with_grad = {
        "op compiled fwd+bwd": training(ours_c),
        "torch.ops.maskln compiled fwd+bwd": training(direct_c),
        "op compiled, no global guards fwd+bwd": training(unguarded_c),
        "op eager fwd+bwd": training(ours),
        "one-liner compiled fwd+bwd": training(peer_c),
    }
    for group, calls in (("no grad", no_grad), ("grad", with_grad)):
        context = torch.no_grad() if group == "no grad" else torch.enable_grad()
        with context:
            for call in calls.values():
                call()
                call()
            counts = {}
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(20):
                    call()
                counts[name] = max(1, round(2e-3 / ((time.perf_counter() - start) / 20)))
            times = {name: [] for name in calls}
            for _ in range(31):
                for name, call in calls.items():
                    start = time.perf_counter()
                    for _ in range(counts[name]):
                        call()
                    times[name].append((time.perf_counter() - start) / counts[name])
        print(f"{list(shape)} float32, {group}, 1 thread, median of 31 (min):")
        for name, values in times.items():
            print(f"  {name:38} {statistics.median(values) * 1e6:7.2f} us"
                  f"  ({min(values) * 1e6:7.2f})")  # fmt: skip
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for label, call, context in (
            ("op compiled, no grad", no_grad["op compiled"], torch.no_grad()),
            ("one-liner compiled, no grad", no_grad["one-liner compiled"], torch.no_grad()),
            ("op compiled fwd+bwd", with_grad["op compiled fwd+bwd"], torch.enable_grad()),
        ):
            with context, profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(200):
                    call()
            print(f"\n{label}: torch.profiler, 200 calls")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                            max_name_column_width=60))  # fmt: skip


if __name__ == "__main__":
    main()
