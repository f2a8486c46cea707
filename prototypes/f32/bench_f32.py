"""The float32 prototype's time against the compiled one-liner and maskln's op (issue 40).

    python -m prototypes.f32.bench_f32 [--repeats 15] [--shapes 8,16,64 4096,16]

Every contender runs once per repeat, in turn (interleaved, so machine noise hits all alike),
each call timed over enough inner iterations to take about 2 ms; printed: the median and min of
each contender's time per call, and each one's median per-repeat ratio to the compiled
one-liner (torch.compile of F.layer_norm + masked_fill, inductor, fullgraph). Shapes: figure 13's
float32 cases (benchmarks/workloads.py's OP_CASES), 2 threads (--threads), 25% invalid rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.workloads import EPS, OP_CASES, Case, make_inputs, ours, peer
from maskln_cli.op import backend
from prototypes import f32


def per_call(call: Callable[[], object], iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return (time.perf_counter() - start) / iterations


def contenders(case: Case, training: bool) -> dict[str, Callable[[], object]]:
    inputs = make_inputs(case, requires_grad=training)
    x, valid, scale, bias = inputs.x, inputs.valid, inputs.scale, inputs.bias
    proto, native = f32.load(), backend.native_kernels(build=False)
    grad_out = torch.randn(case.shape, generator=torch.Generator().manual_seed(1))
    ours_compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    peer_compiled = torch.compile(peer, fullgraph=True, dynamic=False)
    if not training:
        return {
            "prototype kernel": lambda: proto.forward(x, valid, scale, bias, EPS, True),
            "native kernel": lambda: native.forward(x, valid, scale, bias, EPS, False),
            "op eager": lambda: ours(inputs),
            "op compiled": lambda: ours_compiled(inputs),
            "one-liner eager": lambda: peer(inputs),
            "one-liner compiled": lambda: peer_compiled(inputs),
        }
    xd, sd, bd = x.detach(), scale.detach(), bias.detach()
    mask = [True, True, True]

    def proto_both() -> object:
        _, mean, _ = proto.forward(xd, valid, sd, bd, EPS, True)
        return proto.backward(grad_out, xd, valid, sd, mean, EPS, mask, True)

    def native_both() -> object:
        _, mean, rstd = native.forward(xd, valid, sd, bd, EPS, True)
        return native.backward(grad_out, xd, valid, sd, mean, rstd, EPS, mask)

    def autograd(function: Callable) -> Callable[[], object]:
        return lambda: torch.autograd.grad(function(inputs), (x, scale, bias), grad_out)

    return {
        "prototype kernels": proto_both,
        "native kernels": native_both,
        "op eager": autograd(ours),
        "op compiled": autograd(ours_compiled),
        "one-liner eager": autograd(peer),
        "one-liner compiled": autograd(peer_compiled),
    }


def run(case: Case, training: bool, repeats: int) -> None:
    torch._dynamo.reset()
    calls = contenders(case, training)
    with torch.no_grad() if not training else torch.enable_grad():
        for call in calls.values():  # compile and warm up
            call()
            call()
        iterations = {name: max(1, round(2e-3 / per_call(call, 3))) for name, call in
                      calls.items()}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats):
            for name, call in calls.items():
                times[name].append(per_call(call, iterations[name]))
    base = times["one-liner compiled"]
    print(f"{list(case.shape)} float32, {'forward + backward' if training else 'forward'}:")
    for name, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"  {name:20} median {statistics.median(values) * 1e6:10.1f} us"
              f"  min {min(values) * 1e6:10.1f} us  / one-liner compiled {ratio:5.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--shapes", nargs="*", help="e.g. 8,16,64 (default: figure 13's)")
    parser.add_argument("--training", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    cases = [c for c in OP_CASES if c.dtype == "float32"]
    if args.shapes:
        cases = [Case(tuple(int(s) for s in shape.split(",")), "float32") for shape in args.shapes]
    print(f"prototype isa {f32.load().isa()}, native {backend.native_kernels(build=False).isa()}, "
          f"{torch.get_num_threads()} threads, {args.repeats} repeats")  # fmt: skip
    for case in cases:
        for training in {"no": (False,), "yes": (True,), "both": (False, True)}[args.training]:
            run(case, training, args.repeats)


if __name__ == "__main__":
    main()
