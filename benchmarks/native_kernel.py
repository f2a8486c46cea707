"""The native CPU kernel (maskln_cli.op.native) against the torch one-liner and maskln today.

Run from the repository root with the project's interpreter::

    .venv/bin/python benchmarks/native_kernel.py            # everything (10 to 30 minutes)
    .venv/bin/python benchmarks/native_kernel.py --quick    # few repetitions: a smoke test
    .venv/bin/python benchmarks/native_kernel.py --threads 1 --shapes 4096,16 8,16,64
    .venv/bin/python benchmarks/native_kernel.py --overhead  # each way in, tiny inputs

Contenders, each timed call by call, interleaved (the order rotates every round, so machine
noise lands on all of them alike); a table cell is the median (and the range) of the
per-repetition ratios of summed call times, contender / peer:

- peer: ``F.layer_norm(x, (C,), scale, bias, eps).masked_fill(~valid[..., None], 0)``;
- native: the kernel's plain functions, ``forward(..., keep_statistics=False)`` without grad
  and ``forward_autograd`` (a C++ autograd node) with grad;
- native-py: with grad, a Python ``torch.autograd.Function`` calling the kernel's ``forward``
  and ``backward`` (what the eager path's Function would do);
- maskln: ``maskln_cli.masked_layer_normalization`` as it is today.

"forward" is one call under ``torch.no_grad()``; "fwd+bwd" is the forward with x, scale and
bias requiring grad, then ``torch.autograd.grad`` of all three with a random upstream gradient.
About a quarter of the rows are invalid. The memory column is the peak extra memory of one
no-grad native forward, measured in a fresh subprocess (as benchmarks/memory_probe.py does), as
a multiple of the output's bytes.

Targets (the issue's): forward <= 0.6x the peer at the median over shapes and <= 0.8x at every
shape; fwd+bwd <= 0.8x at every shape; the tiny calls ([4096, 16], [8, 16, 64]) <= 1.5x; the
forward's peak extra memory <= 1.25x the output.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from maskln_cli import masked_layer_normalization
from maskln_cli.op import native

HERE = Path(__file__).resolve().parent
EPS = 1e-5
INVALID_FRACTION = 0.25
FLOAT32_SHAPES = (
    (131072, 128),
    (8192, 1024),
    (16, 128, 384),
    (524288, 16),
    (4096, 16),
    (8, 16, 64),
    (64, 512, 768),
    (32, 65536),
)
FLOAT64_SHAPES = FLOAT32_SHAPES[:4]
TINY = ((4096, 16), (8, 16, 64))

Call = Callable[[], object]


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype, grad: bool) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    channels = shape[-1]
    tensors = {
        "x": torch.randn(shape, dtype=dtype, generator=generator),
        "valid": torch.rand(shape[:-1], generator=generator) >= INVALID_FRACTION,
        "scale": 1 + 0.1 * torch.randn(channels, dtype=dtype, generator=generator),
        "bias": 0.1 * torch.randn(channels, dtype=dtype, generator=generator),
        "dy": torch.randn(shape, dtype=dtype, generator=generator),
    }
    for name in ("x", "scale", "bias"):
        tensors[name].requires_grad_(grad)
    return tensors


def peer(x, valid, scale, bias):
    return F.layer_norm(x, (x.shape[-1],), scale, bias, EPS).masked_fill(~valid[..., None], 0)


class _NativeFunction(torch.autograd.Function):
    """The kernel's forward and backward under a Python autograd.Function."""

    @staticmethod
    def forward(ctx, x, valid, scale, bias):  # type: ignore[override]
        y, mean, rstd = native.load().forward(x, valid, scale, bias, EPS)
        ctx.save_for_backward(x, valid, scale, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, valid, scale, mean, rstd = ctx.saved_tensors
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        grads = iter(native.load().backward(dy, x, valid, scale, mean, rstd, EPS, needs))
        dx, dscale, dbias = (next(grads) if need else None for need in needs)
        return dx, None, dscale, dbias


def forward_calls(t: dict[str, Any]) -> dict[str, Call]:
    lib = native.load()
    args = (t["x"], t["valid"], t["scale"], t["bias"])

    def no_grad(function: Callable[[], object]) -> Call:
        def call() -> object:
            with torch.no_grad():
                return function()

        return call

    return {
        "peer": no_grad(lambda: peer(*args)),
        "native": no_grad(lambda: lib.forward(*args, EPS, False)[0]),
        "maskln": no_grad(lambda: masked_layer_normalization(*args, EPS)),
    }


def training_calls(t: dict[str, Any]) -> dict[str, Call]:
    lib = native.load()
    args = (t["x"], t["valid"], t["scale"], t["bias"])
    leaves = (t["x"], t["scale"], t["bias"])
    dy = t["dy"]

    def with_grad(function: Callable[[], torch.Tensor]) -> Call:
        return lambda: torch.autograd.grad(function(), leaves, dy)

    return {
        "peer": with_grad(lambda: peer(*args)),
        "native": with_grad(lambda: lib.forward_autograd(*args, EPS)),
        "native-py": with_grad(lambda: _NativeFunction.apply(*args)),
        "maskln": with_grad(lambda: masked_layer_normalization(*args, EPS)),
    }


def time_call(call: Call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def interleaved_ratios(calls: dict[str, Call], reps: int, budget: float) -> dict[str, list[float]]:
    """Per repetition, each contender's summed call time over the peer's."""
    names = list(calls)
    for _ in range(2):  # warm-up, and a round's time to size the repetitions
        round_time = sum(time_call(calls[name]) for name in names)
    rounds = max(3, min(2000, round(budget / max(round_time, 1e-9))))
    ratios: dict[str, list[float]] = {name: [] for name in names if name != "peer"}
    for _ in range(reps):
        gc.collect()
        totals = dict.fromkeys(names, 0.0)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:  # a different contender first each round
                totals[name] += time_call(calls[name])
        for name in ratios:
            ratios[name].append(totals[name] / totals["peer"])
    return ratios


def overhead_calls(t: dict[str, Any], grad: bool) -> dict[str, Call]:
    """The ways to call the kernel, for --overhead (the caller registers the kernel as the CPU
    implementation of maskln's op for the whole run)."""
    lib = native.load()
    args = (t["x"], t["valid"], t["scale"], t["bias"])
    if grad:
        leaves, dy = (t["x"], t["scale"], t["bias"]), t["dy"]
        op = torch.ops.maskln.masked_layer_norm
        return {
            "peer": lambda: torch.autograd.grad(peer(*args), leaves, dy),
            "C++ autograd node (pybind)": lambda: torch.autograd.grad(
                lib.forward_autograd(*args, EPS), leaves, dy
            ),
            "Python Function + pybind": lambda: torch.autograd.grad(
                _NativeFunction.apply(*args), leaves, dy
            ),
            "maskln op, C++ kernel registered": lambda: torch.autograd.grad(
                op(*args, EPS)[0], leaves, dy
            ),
            "maskln today": lambda: torch.autograd.grad(
                masked_layer_normalization(*args, EPS), leaves, dy
            ),
        }
    return {
        "peer": lambda: peer(*args),
        "pybind forward": lambda: lib.forward(*args, EPS),
        "pybind forward, no statistics": lambda: lib.forward(*args, EPS, False),
        "torch.ops...default": lambda: torch.ops.maskln.masked_layer_norm.default(*args, EPS),
        "Python custom_op + pybind": lambda: _python_custom_op()(*args, EPS),
        "maskln op, C++ kernel registered": lambda: torch.ops.maskln.masked_layer_norm(*args, EPS),
        "maskln today": lambda: masked_layer_normalization(*args, EPS),
    }


_CUSTOM_OP: list[Any] = []


def _python_custom_op() -> Any:
    """A torch.library.custom_op whose body calls the kernel (defined once)."""
    if not _CUSTOM_OP:

        @torch.library.custom_op("maskln_bench::forward", mutates_args=())
        def forward(
            x: torch.Tensor,
            valid: torch.Tensor,
            scale: torch.Tensor,
            bias: torch.Tensor,
            eps: float,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return native.load().forward(x, valid, scale, bias, eps)

        _CUSTOM_OP.append(forward)
    return _CUSTOM_OP[0]


def overhead(threads: int, reps: int) -> None:
    """Median microseconds per call of each way in, interleaved call by call, one thread."""
    torch.set_num_threads(threads)
    native.load().register_maskln_kernels(True)
    for grad in (False, True):
        for shape in ((1, 1), *TINY):
            t = make_inputs(shape, torch.float32, grad)
            calls = overhead_calls(t, grad)
            names = list(calls)
            times: dict[str, list[float]] = {name: [] for name in names}
            context = torch.enable_grad() if grad else torch.no_grad()
            with context:
                for name in names:  # warm-up
                    time_call(calls[name])
                for _ in range(reps):
                    gc.collect()
                    totals = dict.fromkeys(names, 0.0)
                    for round_index in range(200):
                        shift = round_index % len(names)
                        for name in names[shift:] + names[:shift]:
                            totals[name] += time_call(calls[name])
                    for name in names:
                        times[name].append(totals[name] / 200 * 1e6)
            print(f"{list(shape)} float32, {'forward + backward' if grad else 'forward'}:")
            peer_median = statistics.median(times["peer"])
            for name in names:
                median = statistics.median(times[name])
                print(f"    {name:36s} {median:8.1f} us  {median / peer_median:5.2f} x peer")


def summary(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def cell(values: list[float]) -> str:
    median, low, high = summary(values)
    return f"{median:.2f} ({low:.2f}-{high:.2f})"


def memory_ratio(shape: tuple[int, ...], dtype: str) -> float:
    """Peak extra memory of one no-grad native forward over the output's bytes (subprocess)."""
    command = [sys.executable, str(Path(__file__)), "--memory-probe", _shape_text(shape), dtype]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout)
    return result["extra_bytes"] / result["output_bytes"]


def memory_probe(shape_text: str, dtype: str) -> None:
    """In this (fresh) process: the extra peak bytes of one forward, as memory_probe.py."""
    sys.path.insert(0, str(HERE))
    from memory_probe import reset_peak, status_bytes

    torch.set_num_threads(2)
    lib = native.load()
    t = make_inputs(_parse_shape(shape_text), getattr(torch, dtype), grad=False)
    args = (t["x"], t["valid"], t["scale"], t["bias"])
    del t["dy"]
    with torch.no_grad():
        lib.forward(*args, EPS, False)  # warm-up: the result is freed at once
        reset_peak()
        before = status_bytes("VmRSS")
        out = lib.forward(*args, EPS, False)[0]
        peak = status_bytes("VmHWM")
    output_bytes = out.numel() * out.element_size()
    print(json.dumps({"extra_bytes": peak - before, "output_bytes": output_bytes}))


def _shape_text(shape: tuple[int, ...]) -> str:
    return ",".join(str(size) for size in shape)


def _parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions of 0.1 s")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per repetition")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", help="e.g. 4096,16 (float32 and float64 cases)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--overhead", action="store_true", help="per-call time of each way in, tiny inputs"
    )
    parser.add_argument(
        "--memory-probe", nargs=2, metavar=("SHAPE", "DTYPE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(*args.memory_probe)
        return
    if args.overhead:
        overhead(1, args.reps)
        return
    if args.quick:
        args.reps, args.budget = 3, 0.1
    cases = [(shape, "float32") for shape in FLOAT32_SHAPES]
    cases += [(shape, "float64") for shape in FLOAT64_SHAPES]
    if args.shapes:
        wanted = {_parse_shape(text) for text in args.shapes}
        cases = [case for case in cases if case[0] in wanted]
    lib = native.load()
    print(f"torch {torch.__version__}, native isa {lib.isa()}, {args.reps} reps of {args.budget} s")
    print()
    header = "| case | threads | forward native | forward maskln | fwd+bwd native | "
    header += "fwd+bwd native-py | fwd+bwd maskln | memory |"
    print(header)
    print("|" + "---|" * 8)
    results = []
    for shape, dtype in cases:
        memory = "" if args.no_memory else f"{memory_ratio(shape, dtype):.2f}"
        for threads in args.threads:
            torch.set_num_threads(threads)
            forward = interleaved_ratios(
                forward_calls(make_inputs(shape, getattr(torch, dtype), grad=False)),
                args.reps,
                args.budget,
            )
            training = interleaved_ratios(
                training_calls(make_inputs(shape, getattr(torch, dtype), grad=True)),
                args.reps,
                args.budget,
            )
            results.append((shape, dtype, threads, forward, training, memory))
            print(
                f"| {list(shape)} {dtype} | {threads} | {cell(forward['native'])} |"
                f" {cell(forward['maskln'])} | {cell(training['native'])} |"
                f" {cell(training['native-py'])} | {cell(training['maskln'])} | {memory} |",
                flush=True,
            )
            memory = ""
    print()
    report_targets(results)


def report_targets(results: list[tuple]) -> None:
    for threads in sorted({r[2] for r in results}):
        rows = [r for r in results if r[2] == threads]
        forward = [statistics.median(r[3]["native"]) for r in rows]
        training = [statistics.median(r[4]["native"]) for r in rows]
        training_py = [statistics.median(r[4]["native-py"]) for r in rows]
        tiny = [r for r in rows if r[0] in TINY]
        tiny_worst = max(
            (
                max(statistics.median(r[3]["native"]), statistics.median(r[4]["native"]))
                for r in tiny
            ),
            default=float("nan"),
        )
        print(
            f"{threads} thread(s): forward median over shapes {statistics.median(forward):.2f}"
            f" (target 0.6), worst {max(forward):.2f} (0.8); fwd+bwd worst {max(training):.2f}"
            f" (0.8), native-py worst {max(training_py):.2f}; tiny calls worst"
            f" {tiny_worst:.2f} (1.5)"
        )


if __name__ == "__main__":
    main()
