"""The port's native kernels against main's, both libraries loaded in one process (issue 40).

    MASKLN_NATIVE_ISA=avx512 python prototypes/f32/port_vs_main.py PORT.so MAIN.so \
        [--rounds 7] [--shapes 262144,16 65536,64 ...]

Each library is loaded from its cached ``.so`` under its own module name (the libraries define
no torch ops, so two builds live side by side). One torch thread; float32 inputs with about a
quarter of the rows invalid (seed 0, as benchmarks/native_kernel.py makes them). Per shape and
round, each library's ``forward(x, valid, scale, bias, eps, False)`` and ``backward(dy, x, valid,
scale, mean, rstd, eps, [True, True, True])`` (its own forward's statistics) run ``calls`` times
in turn, the order alternating round by round; a call's time is thread CPU time
(time.thread_time) summed over the calls. Printed: each one's min over rounds (ns per element)
and port / main of the mins, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.machinery
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

EPS = 1e-5


def load(path: str):
    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def inputs(shape):
    g = torch.Generator().manual_seed(0)
    c = shape[-1]
    return dict(
        x=torch.randn(shape, generator=g),
        valid=torch.rand(shape[:-1], generator=g) >= 0.25,
        scale=1 + 0.1 * torch.randn(c, generator=g),
        bias=0.1 * torch.randn(c, generator=g),
        dy=torch.randn(shape, generator=g),
    )


def timed(call, calls):
    start = time.thread_time()
    for _ in range(calls):
        call()
    return (time.thread_time() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port")
    parser.add_argument("main")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--isas",
        nargs=2,
        metavar=("A", "B"),
        help="instead: PORT's library under ISA A against itself under ISA B (set_isa before"
        " each batch); MAIN's likewise, printed after",
    )
    parser.add_argument("--target", type=float, default=0.05, help="seconds per timed batch")
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=[
            "262144,16",
            "65536,64",
            "32768,128",
            "10922,384",
            "4096,1024",
            "524288,16",
            "8192,1024",
            "2048,128",
        ],
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = {"port": load(args.port), "main": load(args.main)}
    if args.isas:
        for which in ("port", "main"):
            a, b = args.isas
            print(f"{which}: {a} (as 'port') against {b} (as 'main')")
            run(args, {"port": (loaded[which], a), "main": (loaded[which], b)})
        return
    run(args, {k: (v, None) for k, v in loaded.items()})


def run(args, contenders) -> None:
    libs = {k: m for k, (m, _) in contenders.items()}
    isas = {k: i for k, (_, i) in contenders.items()}

    def on(k, call):
        if isas[k] is None:
            return call

        def switched():
            libs[k].set_isa(isas[k])
            return call()

        return switched

    print(
        f"MASKLN_NATIVE_ISA={os.environ.get('MASKLN_NATIVE_ISA')!r}; isa:",
        {k: isas[k] or v.isa() for k, v in libs.items()},
        "threads",
        torch.get_num_threads(),
    )
    print(
        f"{'shape':>14} {'MiB':>5} | {'fwd port':>8} {'fwd main':>8} {'ratio':>6} {'med':>6}"
        f" | {'bwd port':>8} {'bwd main':>8} {'ratio':>6} {'med':>6}   (ns/element, min of"
        f" {args.rounds} rounds)"
    )
    for text in args.shapes:
        shape = tuple(int(s) for s in text.split(","))
        t = inputs(shape)
        n = t["x"].numel()
        args5 = (t["x"], t["valid"], t["scale"], t["bias"], EPS)
        fwd = {k: functools.partial(m.forward, *args5, False) for k, m in libs.items()}
        stats = {k: on(k, functools.partial(m.forward, *args5, True))() for k, m in libs.items()}
        bwd = {
            k: functools.partial(
                m.backward,
                t["dy"],
                t["x"],
                t["valid"],
                t["scale"],
                stats[k][1],
                stats[k][2],
                EPS,
                [True, True, True],
            )
            for k, m in libs.items()
        }
        results = {}
        for kind, calls_by in (("fwd", fwd), ("bwd", bwd)):
            for k, call in calls_by.items():  # warm-up, and the batch size
                on(k, call)()
            one = max(timed(on(k, c), 1) for k, c in calls_by.items())
            calls = max(1, round(args.target / max(one, 1e-9)))
            times = {k: [] for k in calls_by}
            order = list(calls_by)
            for r in range(args.rounds):
                gc.collect()
                for k in order if r % 2 == 0 else order[::-1]:
                    if isas[k] is not None:
                        libs[k].set_isa(isas[k])
                    times[k].append(timed(calls_by[k], calls))
            results[kind] = times
        line = f"{text:>14} {n * 4 / 2**20:5.1f} |"
        for kind in ("fwd", "bwd"):
            p, m = results[kind]["port"], results[kind]["main"]
            ratio = min(p) / min(m)
            med = statistics.median(a / b for a, b in zip(p, m, strict=True))
            line += f" {min(p) / n * 1e9:8.3f} {min(m) / n * 1e9:8.3f} {ratio:6.3f} {med:6.3f} |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
