"""Float32 masked LayerNorm and RMSNorm kernels with compensated (float-float) arithmetic.

Phase one of issue 40: the numerical core, built as its own torch extension and called from
Python, not yet the op's kernel. ``load()`` compiles ``extension.cpp`` (with ``ff.h`` and
``ff_rows.h``) once into ``prototypes/f32/build/<hash>/`` (about 10 minutes of one core: 72
flattened kernel instances) with the flags of maskln_cli/op/native (no FMA contraction,
OpenMP for torch's threads) and returns the module::

    forward(x, valid, scale, bias, eps, centered=True) -> (y, mean, rstd)
    backward(dy, x, valid, scale, mean, eps, output_mask, centered=True) -> [dx, dscale, dbias]
    isa() -> "avx512" | "avx2" | "base";  set_isa(name) -> the previous one

``centered=False`` is RMSNorm (no mean, no bias; ``bias`` may be None, dbias is None).

Tests: ``test_f32.py`` (accuracy against float64/mpmath, bits across threads and ISAs); times:
``bench_f32.py`` (against the compiled one-liner and maskln's op) and ``overhead.py`` (where a
compiled call's time goes at [8, 16, 64]).

Phase two, not merged: ``native_port.patch`` (21 commits; they apply to main as of 2026-12-07:
``git switch -c f32 && git am prototypes/f32/native_port.patch``)
makes these kernels the native op's float32 and half kernels (``kernels_f32.cpp``, and one unit
per instruction set, ``kernels_f32_{base,avx2,avx512}.cpp``, as main's float64 kernels have),
rows float-float cannot represent falling back to the float64 row kernel, with
``tests/op/test_float32_kernels.py`` (within 1.5 ulps of mpmath at C = 1 to 2**20, bits across
threads and ISAs) and ``test_float32_edges.py``. Green on AVX2 and the portable kernels (AVX-512
compiled, never run: no such CPU here). Its time against the float64-accumulating kernels it
would replace (one thread, AVX2, min of 5 interleaved rounds, load 0.4-1.4, measured on its
c28b468 base), before and after the code-generation fixes of its later commits (16-lane vectors
as two 8-lane halves, two_prod's error by one fused multiply-subtract again, the fold by
vertical adds, the row sums returned alone; the same output bits):

    [8192, 1024]   forward 1.84 -> 0.97   forward + backward 2.41 -> 1.15
    [524288, 16]   forward 5.93 -> 1.69   forward + backward 7.59 -> 2.23
    [2048, 128]    forward 4.21 -> 1.15   forward + backward 5.39 -> 1.63

Short rows still pay for closing each row's run into the float-float totals and its share of
the fold (at C = 16, backward: sums 5.4, folds 2, dx 1.7 ns per element); the next step is a
layout with rows across lanes for small C, and the backward's 8 running sums spill registers.
Main's kernels fail 57 of its 215 tests: dx of rows with C = 1 or 2 and of constant, huge and
outlier rows is far more than 1.5 ulps of its tiny true value (up to 6e8 ulps; the float-float
kernel takes a closed form there), though no worse than PyTorch's float32 layer_norm there: on
64 rows each of N(0, 1), 1e15-scaled, 1e4-offset, constant and outlier rows at C = 1, 2, 3, 16
and 768, main's largest error in ulps of the float64 truth was at most PyTorch's in every
output and gradient (checked 2026-12-06).

Why it is not merged (2026-12-07, AVX2, one thread, thread CPU time, the native functions called
directly, min of 5-9 interleaved rounds at a load of 4 to 7): after the patch's last fixes (the
backward's block sums added block by block; short-row batches of valid rows only), the port's
time over main's float64-accumulating kernels is, at C = 16 / 64 / 128 / 384 / 1024, forward
1.15 / 1.11 / 1.14 / 0.97 / 0.95 and backward 1.77 / 1.80 / 1.80 / 1.57 / 1.43. The time is the
kernels' own passes (the forward module call within 1% of its row kernels alone): float-float
statistics cost 37 AVX2 instructions per 8 elements, 20-30% of them spills. It would give up
accuracy (0.5 to 1.5 ulps) for no speed here. The compiled tiny calls are another matter: the
op's compiled call costs 64-73 us more than calling ``op.default`` directly, more than the
compiled one-liner's whole call at [8, 16, 64] (67 us), whatever the kernel.

On AVX-512 (2026-12-07, a 2-core Intel Xeon; ``port_vs_main.py``, both libraries in one
process, one thread, thread CPU time, min of 9 interleaved rounds, load 0.6-1.8): the port's 264
float32 tests and all of tests/op (1489) pass there, its first run on AVX-512; but port / main
is, at C = 16 / 64 / 128 / 384 / 1024 on 16 MiB inputs, forward 1.16-1.20 / 1.33-1.34 / 1.34 /
1.25 / 1.11-1.16 and backward 1.69-1.73 / 1.83-2.01 / 1.72 / 1.87-1.94 / 1.69-1.78 (1 MiB
inputs alike). The port's AVX-512 path is no faster than its own AVX2 path (0.92-1.15): its
16-lane vectors are two 8-lane halves, so it runs in ymm registers there too, while main's
float64 kernels gain about 20% from AVX-512 (0.72-0.98 of their AVX2 time). Figure 13 on that
machine (one thread, 0.4 cores busy elsewhere), float32 medians of the 12 cases: port 1.04
forward and 0.97 forward + backward, main 0.92 and 0.80. On neither ISA is the float-float
kernel faster than the float64-accumulating one it would replace.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCES = ("extension.cpp", "ff.h", "ff_rows.h")
CFLAGS = (
    "-O3",
    "-ffp-contract=off",  # no fused multiply-adds but the explicit ones: the same bits everywhere
    "-fno-math-errno",
    "-Wno-psabi",
    "-fopenmp",
)
LDFLAGS = ("-fopenmp",)

_module: ModuleType | None = None


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    digest.update("\0".join(CFLAGS + LDFLAGS).encode())
    return digest.hexdigest()[:12]


def load(verbose: bool = False) -> ModuleType:
    """The extension, compiled on first use (about a minute)."""
    global _module
    if _module is not None:
        return _module
    from torch.utils import cpp_extension

    name = f"maskln_f32_{source_hash()}"
    build = HERE / "build" / name
    build.mkdir(parents=True, exist_ok=True)
    old_path = os.environ.get("PATH", "")
    try:  # cpp_extension runs ninja from PATH: the venv's, when it is not activated
        import ninja  # type: ignore[import-not-found]

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old_path
    except ImportError:
        pass
    try:
        _module = cpp_extension.load(
            name,
            sources=[str(HERE / "extension.cpp")],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(HERE)],
            build_directory=str(build),
            verbose=verbose,
        )
    finally:
        os.environ["PATH"] = old_path
    return _module


def available() -> bool:
    """Whether a C++ compiler is there to build the extension."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None
