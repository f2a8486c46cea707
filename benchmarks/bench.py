"""Benchmarks of maskln against the torch one-liner a user would otherwise write.

Run from the repository root with the project's interpreter::

    .venv/bin/python benchmarks/bench.py               # everything (several minutes)
    .venv/bin/python benchmarks/bench.py --quick       # few repetitions: a smoke test
    .venv/bin/python benchmarks/bench.py --only core   # groups: core, memory, cli; or figures: 1,3
    .venv/bin/python benchmarks/bench.py --markdown    # the table, for docs/performance.md

Every figure but 12 is a ratio "ours / peer" measured side by side in one run, the two contenders
interleaved run by run (alternating which goes first; in figures 1 and 2, call by call within
each repetition) so that machine noise hits both alike; the table gives the min, median and
max of the per-repetition ratios. "peer" is
``F.layer_norm(x, (C,), scale, bias, eps).masked_fill(~valid[..., None], 0)``.

1. Forward time without grad (``torch.no_grad()``), 8 cases (4 shapes x float32, float64).
2. Forward + backward time, x, scale and bias requiring grad, a random upstream gradient.
3. Peak extra memory of ONE no-grad forward, in a fresh subprocess per case and contender,
   as a multiple of the output's bytes (see memory_probe.py).
4. Bytes autograd saves for backward beyond the inputs' own storage, ours / peer.
5. ``maskln --help`` wall time / ``python -c "import torch"`` wall time.
6. ``maskln normalize`` of a 512 MiB x / a load_file, one-liner, save_file script
   (peer_normalize.py): wall time and peak RSS of each process (see run_measured.py).
7. ``maskln normalize`` of 40 small files in one ``--out-dir`` call / of one small file.
8. ``maskln inspect`` of a bert-base-sized checkpoint (418 MiB, 199 float32 tensors) / a
   load_file and per-tensor min/max/mean/std script (peer_inspect.py): wall time.
9. The op under ``torch.compile(fullgraph=True)`` / the op eager, forward + backward: the
   compiled graph holds the op as one custom-op node, so this is the cost of that path.
10. ``maskln diff a b`` of two one-key 512 MiB float32 files that match (every element about
    2 ulps apart) / a load_file both, assert_close per key script (peer_diff.py): wall, RSS.
11. ``maskln verify in res`` on a 512 MiB x (res: F.layer_norm's float32 output, which passes)
    / a load_file, one-liner, assert_close script (peer_verify.py): wall time and peak RSS.
12. ``maskln grade`` of a correct solution, ``--strict``: absolute wall seconds, each run
    interleaved with a ``python -c "import torch"`` run, whose seconds are shown beside it.
13. The op compiled / the peer compiled (both ``torch.compile``, inductor, fullgraph), forward
    without grad and forward + backward; targets: at most 1.00 on the tiny calls, 0.80 on the
    rest (issue 30).
14. torch.func on [64, 128, 768] float32: ``vmap`` of the op over the leading axis, and
    ``grad`` of a weighted sum of its output w.r.t. x / the same computation eager.
15. ``maskln verify in res`` with gradients (in: a 512 MiB x with grad_out, ``generate
    --invalid 0.3 --poison --grad``; res: ``maskln normalize``'s, which passes) / the same
    ``verify --check out`` (the forward alone), and / a load_file, autograd in float64,
    assert_close script (peer_verify_grad.py; it fails falsely, as assert_close does on
    float32 gradient sums): wall time and peak RSS. Then with a 1 GiB x: / ``--check out``
    only (the peer would need some 20 GiB).
16. ``maskln_cli.testing.assert_close`` judging a passing ``out`` (the peer's float32 output)
    on [8192, 1024] float32 / a float64 reference by ``F.layer_norm`` and
    ``torch.testing.assert_close(out, reference, check_dtype=False)``: wall time, in process;
    then out and its three gradients (autograd's, for a random upstream gradient) / the float64
    reference's by autograd and ``torch.testing.assert_close`` on each (issue 37: at most 1.0
    and 1.3).
17. ``maskln verify in res`` of a failing result / of a passing one, on ``[2048, 768]`` with
    gradients (``generate --invalid 0.3 --poison --grad``; passing: ``maskln normalize``'s),
    one row per kind of failure (kernels of tests/kernels.py): eps outside the sqrt (within
    the budget: the systematic test alone), an unbiased variance (failing rows: the
    catalogue's diagnosis), row sums accumulated in float16 (a coarser dtype's rounding) and
    the NaN-leaking one-liner (NaN in the gradients: the general comparison path): wall time.

Figures 1, 2 and 13 run on the bench shapes plus issue 21's extra float32 shapes, among them
two tiny calls ([4096, 16], [8, 16, 64]) whose target is per-call overhead. ``--threads``
sets torch's thread count (2 by default; issue 21's targets hold at 1 and 2).

Progress goes to stderr; the header, table and notes go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from rich.console import Console
from rich.table import Table
from workloads import (
    CASES,
    CONTENDERS,
    EPS,
    OP_CASES,
    RMS_PEERS,
    THREADS,
    TINY_SHAPES,
    Case,
    Contender,
    Inputs,
    make_inputs,
    ours,
    ours_rms,
    peer,
)

import maskln_cli
from maskln_cli import masked_layer_normalization
from maskln_cli.op.backend import active_backend

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
MASKLN = shutil.which("maskln", path=str(Path(PYTHON).parent)) or "maskln"
GROUPS = {
    "core": (1, 2, 9, 13, 14, 18, 19),
    "memory": (3, 4),
    "cli": (5, 6, 7, 8, 10, 11, 12, 15, 17),
    "testing": (16,),
}
FIGURES = 19
LARGE_FLOAT32 = (Case((131072, 128), "float32"), Case((524288, 16), "float32"))
BIG_SHAPE = "1048576,128"
HUGE_SHAPE = "2097152,128"  # a 1 GiB x (figure 15)
SMALL_SHAPE = "4,64,128"
SMALL_FILES = 40

T = TypeVar("T")
progress = Console(stderr=True, highlight=False)


@dataclass(frozen=True)
class Settings:
    """How hard to measure: repetitions per figure, and the length of a core repetition."""

    core_reps: int
    core_warmup_pairs: int
    core_budget_s: float  # one repetition runs (ours, peer) pairs for about this long...
    core_min_pairs: int  # ...and at least this many pairs
    memory_reps: int
    memory_cases: tuple[Case, ...]
    help_reps: int
    big_reps: int
    small_reps: int
    inspect_reps: int
    grade_reps: int
    cli_warmup: bool  # run each command once, unmeasured, before the figures 5 to 7


FULL = Settings(
    core_reps=11,
    core_warmup_pairs=2,
    core_budget_s=0.4,
    core_min_pairs=2,
    memory_reps=2,
    memory_cases=CASES,
    help_reps=11,
    big_reps=5,
    small_reps=7,
    inspect_reps=9,
    grade_reps=5,
    cli_warmup=True,
)
QUICK = Settings(
    core_reps=3,
    core_warmup_pairs=1,
    core_budget_s=0.05,
    core_min_pairs=1,
    memory_reps=1,
    memory_cases=LARGE_FLOAT32,
    help_reps=3,
    big_reps=1,
    small_reps=2,
    inspect_reps=2,
    grade_reps=1,
    cli_warmup=False,
)


@dataclass(frozen=True)
class Row:
    """One line of the table: a figure's per-repetition values for one case."""

    figure: str
    case: str
    values: list[float]
    target: str = "-"
    met: bool | None = None  # None: no target

    @property
    def median(self) -> float:
        return statistics.median(self.values)


@dataclass
class Report:
    """The rows of the table and the notes printed below it."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# Measuring ------------------------------------------------------------------------------------


def time_call(call: Callable[[], object]) -> float:
    """Wall time of one fresh call; its result is dropped (and freed) inside the timing."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def pairs_per_rep(
    ours_call: Callable[[], object], peer_call: Callable[[], object], settings: Settings
) -> int:
    """Warm both calls up, then size one repetition from the last warm-up pair's time."""
    pair = math.inf
    for _ in range(settings.core_warmup_pairs):
        pair = time_call(ours_call) + time_call(peer_call)
    return max(settings.core_min_pairs, math.ceil(settings.core_budget_s / max(pair, 1e-9)))


def paired_time_ratios(
    ours_call: Callable[[], object], peer_call: Callable[[], object], settings: Settings
) -> list[float]:
    """Per-repetition ratios of the mean time per call, ours / peer.

    Within a repetition the two alternate call by call (ours, peer, peer, ours, ...), so a
    burst of machine noise lands on both rather than on one contender's whole repetition.
    """
    pairs = pairs_per_rep(ours_call, peer_call, settings)
    values: list[float] = []
    for _ in range(settings.core_reps):
        gc.collect()
        ours_total = peer_total = 0.0
        for pair in range(pairs):
            if pair % 2 == 0:
                ours_total += time_call(ours_call)
                peer_total += time_call(peer_call)
            else:
                peer_total += time_call(peer_call)
                ours_total += time_call(ours_call)
        values.append(ours_total / peer_total)
    return values


def interleaved(
    ours_run: Callable[[], T], peer_run: Callable[[], T], reps: int, warmup: bool = False
) -> tuple[list[T], list[T]]:
    """Run both ``reps`` times, alternating which goes first; return ours' and peer's results.
    With ``warmup``, each runs once first, unmeasured (page cache, .pyc files)."""
    if warmup:
        ours_run(), peer_run()
    ours_results: list[T] = []
    peer_results: list[T] = []
    for rep in range(reps):
        gc.collect()
        if rep % 2 == 0:
            ours_results.append(ours_run())
            peer_results.append(peer_run())
        else:
            peer_results.append(peer_run())
            ours_results.append(ours_run())
    return ours_results, peer_results


def ratios(ours_values: Iterable[float], peer_values: Iterable[float]) -> list[float]:
    """Per-repetition ratios ours / peer."""
    return [o / p for o, p in zip(ours_values, peer_values, strict=True)]


@dataclass(frozen=True)
class Measured:
    """Wall time and peak RSS of one child process."""

    wall_s: float
    max_rss_bytes: int


def run_checked(command: list[str]) -> str:
    """Run ``command``; return its stdout, or raise with its stderr if it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def run_measured(command: list[str], exit_codes: tuple[int, ...] = (0,)) -> Measured:
    """Run ``command`` through run_measured.py; fail loudly if it exits otherwise than with
    one of ``exit_codes``."""
    launcher = [PYTHON, "-S", "-I", str(HERE / "run_measured.py")]
    done = subprocess.run([*launcher, *command], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {}
    if result.get("exit_code") not in exit_codes:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr}")
    return Measured(result["wall_s"], result["max_rss_bytes"])


# Figures 1 and 2: core timing -----------------------------------------------------------------


def check_same_result(inputs: Inputs) -> None:
    """Both contenders must compute the same thing, or the comparison means nothing."""
    with torch.no_grad():
        expected, actual = peer(inputs), ours(inputs)
    tolerance = 1e-4 if inputs.x.dtype == torch.float32 else 1e-10
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def forward_call(contender: Contender, inputs: Inputs) -> Callable[[], object]:
    """One no-grad forward, as a user calls it (the output is allocated afresh)."""

    def call() -> object:
        with torch.no_grad():
            return contender(inputs)

    return call


def forward_backward_call(
    contender: Contender, inputs: Inputs, grad_out: torch.Tensor, with_bias: bool = True
) -> Callable[[], object]:
    """One forward and backward, returning the gradients of x, scale and bias (RMSNorm: of x
    and scale, its op having no bias)."""
    wrt = (inputs.x, inputs.scale, inputs.bias) if with_bias else (inputs.x, inputs.scale)

    def call() -> object:
        return torch.autograd.grad(contender(inputs), wrt, grad_out)

    return call


CaseTarget = Callable[[Case], tuple[str, float]]
"""A case's target: its text and the bound on the case's median ratio."""


def op_target(limit: float) -> CaseTarget:
    """``<= limit``, or ``<= 1.50`` on the tiny calls (per-call overhead, issue 21)."""

    def target(case: Case) -> tuple[str, float]:
        bound = 1.50 if case.shape in TINY_SHAPES else limit
        return f"<= {bound:.2f}", bound

    return target


def training_calls(
    first: Contender, second: Contender, with_bias: bool = True
) -> Callable[[Case], tuple[Callable[[], object], Callable[[], object]]]:
    """``make_calls`` for timing_rows: forward + backward of each on the same inputs and
    upstream gradient."""

    def make_calls(case: Case) -> tuple[Callable[[], object], Callable[[], object]]:
        inputs = make_inputs(case, requires_grad=True)
        generator = torch.Generator().manual_seed(1)
        grad_out = torch.randn(case.shape, dtype=inputs.x.dtype, generator=generator)
        return (
            forward_backward_call(first, inputs, grad_out, with_bias),
            forward_backward_call(second, inputs, grad_out, with_bias),
        )

    return make_calls


def timing_rows(
    figure: str,
    make_calls: Callable[[Case], tuple[Callable[[], object], Callable[[], object]]],
    settings: Settings,
    case_target: CaseTarget | None,
    cases: Iterable[Case] = CASES,
) -> list[Row]:
    """Per-case rows of ours/peer time; ``case_target`` (if any) applies to the case median."""
    rows: list[Row] = []
    for case in cases:
        progress.print(f"  {figure}: {case.label}")
        ours_call, peer_call = make_calls(case)
        values = paired_time_ratios(ours_call, peer_call, settings)
        target, met = "-", None
        if case_target is not None:
            target, bound = case_target(case)
            met = statistics.median(values) <= bound
        rows.append(Row(figure, case.label, values, target, met))
        del ours_call, peer_call
        gc.collect()
    return rows


def summary_row(figure: str, rows: list[Row], target: str, met: bool) -> Row:
    """A row over all cases: min, median and max of the per-case medians."""
    medians = [row.median for row in rows]
    return Row(figure, f"all {len(rows)} cases (per-case medians)", medians, target, met)


def figure_1(settings: Settings, report: Report) -> None:
    """Forward time without grad, ours / peer."""
    figure = "1 fwd time, no grad"

    def make_calls(case: Case) -> tuple[Callable[[], object], Callable[[], object]]:
        inputs = make_inputs(case)
        check_same_result(inputs)
        return forward_call(ours, inputs), forward_call(peer, inputs)

    rows = timing_rows(figure, make_calls, settings, op_target(0.80), OP_CASES)
    medians = [r.median for r in rows if not r.case.startswith(tiny_labels())]
    met = statistics.median(medians) <= 0.60 and all(r.met for r in rows)
    report.rows += [*rows, summary_row(figure, rows, "median <= 0.60, each its target", met)]


def tiny_labels() -> tuple[str, ...]:
    return tuple(str(list(shape)) for shape in TINY_SHAPES)


def figure_2(settings: Settings, report: Report) -> None:
    """Forward + backward time, ours / peer."""
    figure = "2 fwd+bwd time"

    make_calls = training_calls(ours, peer)

    rows = timing_rows(figure, make_calls, settings, op_target(0.80), OP_CASES)
    met = all(r.met for r in rows)
    report.rows += [*rows, summary_row(figure, rows, "each its target", met)]


def figure_18(settings: Settings, report: Report) -> None:
    """RMSNorm forward time without grad, ours / each peer (issue 39: <= 0.60)."""
    for peer_name, rms_peer in RMS_PEERS.items():
        figure = f"18 RMSNorm fwd, no grad / {peer_name}"

        def make_calls(
            case: Case, rms_peer: Contender = rms_peer
        ) -> tuple[Callable[[], object], Callable[[], object]]:
            inputs = make_inputs(case)
            with torch.no_grad():
                expected, actual = rms_peer(inputs), ours_rms(inputs)
            tolerance = 1e-4 if inputs.x.dtype == torch.float32 else 1e-10
            torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
            return forward_call(ours_rms, inputs), forward_call(rms_peer, inputs)

        rows = timing_rows(figure, make_calls, settings, op_target(0.60), OP_CASES)
        met = all(r.met for r in rows)
        report.rows += [*rows, summary_row(figure, rows, "each its target", met)]


def figure_19(settings: Settings, report: Report) -> None:
    """RMSNorm forward + backward time (gradients of x and scale), ours / each peer."""
    for peer_name, rms_peer in RMS_PEERS.items():
        figure = f"19 RMSNorm fwd+bwd / {peer_name}"
        make_calls = training_calls(ours_rms, rms_peer, with_bias=False)
        rows = timing_rows(figure, make_calls, settings, op_target(0.60), OP_CASES)
        met = all(r.met for r in rows)
        report.rows += [*rows, summary_row(figure, rows, "each its target", met)]


def figure_9(settings: Settings, report: Report) -> None:
    """Forward + backward time, the op compiled (fullgraph) / the op eager."""
    figure = "9 compiled / eager, fwd+bwd"
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, dynamic=False)

    make_calls = training_calls(compiled, ours)

    rows = timing_rows(figure, make_calls, settings, None)
    medians = [row.median for row in rows]
    report.rows += [*rows, Row(figure, f"all {len(rows)} cases (per-case medians)", medians)]
    report.notes.append("9: ratios are compiled / eager (both ours); compile time excluded")


def figure_13(settings: Settings, report: Report) -> None:
    """The op compiled / the peer compiled (inductor), forward and forward + backward."""
    torch._dynamo.reset()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    ours_compiled = torch.compile(ours, fullgraph=True, dynamic=False)
    peer_compiled = torch.compile(peer, fullgraph=True, dynamic=False)

    def forward_calls(case: Case) -> tuple[Callable[[], object], Callable[[], object]]:
        inputs = make_inputs(case)
        return forward_call(ours_compiled, inputs), forward_call(peer_compiled, inputs)

    backward_calls = training_calls(ours_compiled, peer_compiled)

    def compiled_target(case: Case) -> tuple[str, float]:
        """<= 1.00 on every shape, <= 0.80 on all but the tiny calls (issue 30)."""
        bound = 1.00 if case.shape in TINY_SHAPES else 0.80
        return f"<= {bound:.2f}", bound

    for figure, make_calls in (
        ("13 compiled fwd, no grad", forward_calls),
        ("13 compiled fwd+bwd", backward_calls),
    ):
        rows = timing_rows(figure, make_calls, settings, compiled_target, OP_CASES)
        met = all(r.met for r in rows)
        report.rows += [*rows, summary_row(figure, rows, "each its target", met)]
    report.notes.append("13: both compiled by inductor (fullgraph); compile time excluded")


def figure_14(settings: Settings, report: Report) -> None:
    """torch.func's vmap and grad of the op / the same computation eager, [64, 128, 768]."""
    from torch.func import grad, vmap

    case = Case((64, 128, 768), "float32")
    inputs = make_inputs(case)
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(case.shape, generator=generator)
    x, valid, scale, bias = inputs.x, inputs.valid, inputs.scale, inputs.bias

    def op(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return masked_layer_normalization(a, v, scale, bias)

    def loss(a: torch.Tensor) -> torch.Tensor:
        return (op(a, valid) * weights).sum()

    def eager_grad() -> object:
        leaf = x.detach().requires_grad_()
        return torch.autograd.grad(loss(leaf), leaf)

    pairs = {
        "vmap over axis 0 / eager": (lambda: vmap(op)(x, valid), lambda: op(x, valid)),
        "grad w.r.t. x / eager autograd": (lambda: grad(loss)(x), eager_grad),
    }
    for label, (func_call, eager_call) in pairs.items():
        progress.print(f"  14 torch.func: {label}")
        values = paired_time_ratios(func_call, eager_call, settings)
        met = statistics.median(values) <= 2.0
        report.rows.append(Row("14 torch.func", f"{case.label} {label}", values, "<= 2.00", met))


def figure_16(settings: Settings, report: Report) -> None:
    """maskln_cli.testing.assert_close on out, then on out and its three gradients / a float64
    reference (F.layer_norm, autograd for the gradients) and torch's assert_close."""
    import torch.nn.functional as F

    from maskln_cli import testing

    case = Case((8192, 1024), "float32")
    inputs = make_inputs(case)
    x, valid, scale, bias = inputs.x, inputs.valid, inputs.scale, inputs.bias
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.detach().requires_grad_() for t in (x, scale, bias)]
    # A correct float32 kernel's results: both checks pass out (torch's assert_close fails
    # float32 gradient sums falsely; its time is counted all the same).
    out = peer(Inputs(leaves[0], valid, leaves[1], leaves[2]))
    grads = torch.autograd.grad(out, leaves, grad_out)
    out = out.detach()

    def judged() -> None:
        testing.assert_close(out, x, valid, scale, bias, EPS)

    def peer_check() -> None:
        reference = F.layer_norm(x.double(), (1024,), scale.double(), bias.double(), EPS)
        reference = reference.masked_fill(~valid[..., None], 0)
        torch.testing.assert_close(out, reference, check_dtype=False)

    def judged_gradients() -> None:
        testing.assert_close(
            out, x, valid, scale, bias, EPS, grad_out=grad_out, grad_x=grads[0],
            grad_scale=grads[1], grad_bias=grads[2],
        )  # fmt: skip

    def peer_gradients() -> None:
        wrt = [t.detach().double().requires_grad_() for t in (x, scale, bias)]
        reference = F.layer_norm(wrt[0], (1024,), wrt[1], wrt[2], EPS)
        reference = reference.masked_fill(~valid[..., None], 0)
        truths = torch.autograd.grad(reference, wrt, grad_out.double())
        for result, truth in zip((out, *grads), (reference.detach(), *truths), strict=True):
            with contextlib.suppress(AssertionError):
                torch.testing.assert_close(result, truth, check_dtype=False)

    figure = "16 testing.assert_close"
    times = {}
    for label, ours_call, peer_call, target in (
        ("out", judged, peer_check, 1.0),
        ("out and gradients", judged_gradients, peer_gradients, 1.3),
    ):
        progress.print(f"  16 assert_close: {case.label} {label}")
        values = paired_time_ratios(ours_call, peer_call, settings)
        met = statistics.median(values) <= target
        report.rows.append(Row(figure, f"{case.label} {label}", values, f"<= {target:.2f}", met))
        times[label] = (
            [time_call(ours_call) for _ in range(3)],
            [time_call(peer_call) for _ in range(3)],
        )
    report.notes.append(
        "16: medians: "
        + "; ".join(
            f"{label}: assert_close {statistics.median(ours) * 1e3:.0f} ms, peer (float64"
            f" F.layer_norm + torch.testing.assert_close) {statistics.median(peer_) * 1e3:.0f} ms"
            for label, (ours, peer_) in times.items()
        )
    )


# Figures 3 and 4: memory ----------------------------------------------------------------------


def probe_extra_memory(contender: str, case: Case) -> float:
    """Peak extra bytes / output bytes of one forward, in a fresh process (memory_probe.py)."""
    shape = ",".join(str(size) for size in case.shape)
    command = [PYTHON, str(HERE / "memory_probe.py"), contender, shape, case.dtype]
    result = json.loads(run_checked(command))
    return result["extra_bytes"] / result["output_bytes"]


def figure_3(settings: Settings, report: Report) -> None:
    """Peak extra memory of one no-grad forward, as a multiple of the output's bytes."""
    figure = "3 fwd peak extra mem / output bytes"
    for case in settings.memory_cases:
        progress.print(f"  {figure}: {case.label}")
        values: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for rep in range(settings.memory_reps):
            order = list(CONTENDERS) if rep % 2 == 0 else list(reversed(CONTENDERS))
            for name in order:
                values[name].append(probe_extra_memory(name, case))
        ours_values = values["ours"]
        met = statistics.median(ours_values) <= 1.25
        report.rows.append(Row(figure, f"{case.label}, ours", ours_values, "<= 1.25", met))
        report.rows.append(Row(figure, f"{case.label}, peer", values["peer"]))


def saved_bytes(contender: Contender, inputs: Inputs) -> int:
    """Bytes of the storages autograd saves in one forward, other than the inputs' own."""
    inputs_storage = {
        t.untyped_storage().data_ptr() for t in (inputs.x, inputs.valid, inputs.scale, inputs.bias)
    }
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in inputs_storage:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = contender(inputs)
    del out
    return sum(saved.values())


def figure_4(settings: Settings, report: Report) -> None:
    """Memory kept for backward beyond the inputs, ours / peer, and bytes per row."""
    figure = "4 saved for backward"
    for case in CASES:
        inputs = make_inputs(case, requires_grad=True)
        ours_bytes, peer_bytes = saved_bytes(ours, inputs), saved_bytes(peer, inputs)
        label = f"{case.label} ({ours_bytes / case.rows:g} vs {peer_bytes / case.rows:g} B/row)"
        ratio = ours_bytes / peer_bytes
        report.rows.append(Row(figure, label, [ratio], "<= 1.00", ratio <= 1.0))


# Figures 5 to 8: the command line -------------------------------------------------------------


def figure_5(settings: Settings, report: Report) -> None:
    """``maskln --help`` wall time / ``python -c "import torch"`` wall time."""
    figure = "5 maskln --help / import torch"
    progress.print(f"  {figure}")
    help_command = [MASKLN, "--help"]
    import_command = [PYTHON, "-c", "import torch"]
    helps, imports = interleaved(
        lambda: run_measured(help_command).wall_s,
        lambda: run_measured(import_command).wall_s,
        settings.help_reps,
        warmup=settings.cli_warmup,
    )
    values = ratios(helps, imports)
    met = statistics.median(values) <= 0.25
    report.rows.append(Row(figure, "wall time", values, "<= 0.25", met))
    report.notes.append(
        f"5: medians: maskln --help {statistics.median(helps):.3f} s,"
        f" import torch {statistics.median(imports):.3f} s"
    )


def generate(path: Path, shape: str) -> None:
    """Write a random input file with ``maskln generate``."""
    command = [MASKLN, "generate", str(path), "--shape", shape, "--seed", "0", "--quiet"]
    run_checked(command)


def settle_writes() -> None:
    """Flush the inputs just written (safetensors' save_file does not fsync) to disk, so that
    their writeback, which the kernel starts within about 30 s, lands in no measured run."""
    os.sync()


def measure_fresh(command: list[str], output: Path) -> Measured:
    """Run ``command`` after deleting its ``output`` (outside the timing)."""
    if output.is_dir():
        for child in output.iterdir():
            child.unlink()
    else:
        output.unlink(missing_ok=True)
    return run_measured(command)


def big_input(workdir: Path) -> Path:
    """The 512 MiB input of figures 6 and 11 (x of shape BIG_SHAPE, float32), made once."""
    source = workdir / "big.safetensors"
    if not source.exists():
        progress.print("  generating the 512 MiB input")
        generate(source, BIG_SHAPE)
    return source


def big_case() -> str:
    return f"[{BIG_SHAPE.replace(',', ', ')}] float32"


def big_rows(
    figure: str,
    ours_runs: list[Measured],
    peer_runs: list[Measured],
    targets: tuple[float, float],
    report: Report,
) -> None:
    """The wall and peak RSS rows (ours / peer) of a 512 MiB figure, and a note of medians."""
    walls = ratios((r.wall_s for r in ours_runs), (r.wall_s for r in peer_runs))
    rss = ratios((r.max_rss_bytes for r in ours_runs), (r.max_rss_bytes for r in peer_runs))
    wall_target, rss_target = targets
    report.rows.append(
        Row(
            figure,
            f"{big_case()}: wall",
            walls,
            f"<= {wall_target:.2f}",
            statistics.median(walls) <= wall_target,
        )
    )
    report.rows.append(
        Row(
            figure,
            f"{big_case()}: peak RSS",
            rss,
            f"<= {rss_target:.2f}",
            statistics.median(rss) <= rss_target,
        )
    )
    number = figure.split()[0]
    report.notes.append(
        f"{number}: medians (n = {len(ours_runs)}): maskln"
        f" {statistics.median(r.wall_s for r in ours_runs):.2f} s,"
        f" {mib(statistics.median(r.max_rss_bytes for r in ours_runs))};"
        f" peer script {statistics.median(r.wall_s for r in peer_runs):.2f} s,"
        f" {mib(statistics.median(r.max_rss_bytes for r in peer_runs))}"
    )


def figure_6(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln normalize`` of a 512 MiB x vs a load/one-liner/save script: wall and peak RSS."""
    figure = "6 normalize 512 MiB x"
    source = big_input(workdir)
    ours_out, peer_out = workdir / "big_ours.safetensors", workdir / "big_peer.safetensors"
    ours_command = [MASKLN, "normalize", str(source), str(ours_out)]
    peer_command = [PYTHON, str(HERE / "peer_normalize.py"), str(source), str(peer_out)]
    progress.print(f"  {figure}: measuring")
    ours_runs, peer_runs = interleaved(
        lambda: measure_fresh(ours_command, ours_out),
        lambda: measure_fresh(peer_command, peer_out),
        settings.big_reps,
        warmup=settings.cli_warmup,
    )
    big_rows(figure, ours_runs, peer_runs, (0.90, 1.10), report)
    for path in (ours_out, peer_out):
        path.unlink(missing_ok=True)


def figure_7(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln normalize`` of 40 small files with --out-dir / of one small file."""
    figure = f"7 normalize {SMALL_FILES} files / 1 file"
    progress.print(f"  {figure}")
    single = workdir / "small.safetensors"
    generate(single, SMALL_SHAPE)
    inputs_dir, out_dir = workdir / "small_inputs", workdir / "small_outputs"
    inputs_dir.mkdir()
    out_dir.mkdir()
    many = [inputs_dir / f"part{i:02d}.safetensors" for i in range(SMALL_FILES)]
    for path in many:
        shutil.copyfile(single, path)
    single_out = workdir / "small_out.safetensors"
    many_command = [MASKLN, "normalize", *map(str, many), "--out-dir", str(out_dir)]
    single_command = [MASKLN, "normalize", str(single), str(single_out)]
    manys, singles = interleaved(
        lambda: measure_fresh(many_command, out_dir).wall_s,
        lambda: measure_fresh(single_command, single_out).wall_s,
        settings.small_reps,
        warmup=settings.cli_warmup,
    )
    values = ratios(manys, singles)
    case = f"[{SMALL_SHAPE.replace(',', ', ')}] float32: wall"
    report.rows.append(Row(figure, case, values, "<= 2.00", statistics.median(values) <= 2.0))
    report.notes.append(
        f"7: medians: {SMALL_FILES} files {statistics.median(manys):.2f} s,"
        f" 1 file {statistics.median(singles):.2f} s"
    )


def bert_base_shapes() -> dict[str, tuple[int, ...]]:
    """The tensors of a bert-base checkpoint (110M float32 parameters): embeddings, 12 layers
    of [768, 768] and [3072, 768] weights with their biases and layer norms, the pooler."""
    hidden, intermediate = 768, 3072
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (30522, hidden),
        "embeddings.position_embeddings.weight": (512, hidden),
        "embeddings.token_type_embeddings.weight": (2, hidden),
        "embeddings.LayerNorm.weight": (hidden,),
        "embeddings.LayerNorm.bias": (hidden,),
    }
    for layer in range(12):
        prefix = f"encoder.layer.{layer}."
        for name in ("self.query", "self.key", "self.value", "output.dense"):
            shapes[f"{prefix}attention.{name}.weight"] = (hidden, hidden)
            shapes[f"{prefix}attention.{name}.bias"] = (hidden,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{prefix}{norm}.weight"] = (hidden,)
            shapes[f"{prefix}{norm}.bias"] = (hidden,)
        shapes[f"{prefix}intermediate.dense.weight"] = (intermediate, hidden)
        shapes[f"{prefix}intermediate.dense.bias"] = (intermediate,)
        shapes[f"{prefix}output.dense.weight"] = (hidden, intermediate)
        shapes[f"{prefix}output.dense.bias"] = (hidden,)
    shapes["pooler.dense.weight"] = (hidden, hidden)
    shapes["pooler.dense.bias"] = (hidden,)
    return shapes


def write_checkpoint(path: Path) -> None:
    """A bert-base-sized checkpoint of random weights (std 0.02, as initialized)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) * 0.02
        for name, shape in bert_base_shapes().items()
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def figure_8(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln inspect`` of a bert-base-sized checkpoint / load_file and torch statistics."""
    figure = "8 inspect a checkpoint"
    progress.print(f"  {figure}: writing the checkpoint")
    checkpoint = workdir / "bert-base.safetensors"
    write_checkpoint(checkpoint)
    settle_writes()
    size = checkpoint.stat().st_size
    ours_command = [MASKLN, "inspect", str(checkpoint)]
    peer_command = [PYTHON, str(HERE / "peer_inspect.py"), str(checkpoint)]
    keys_command = [MASKLN, "inspect", "--keys", str(checkpoint)]
    progress.print(f"  {figure}: measuring")
    if settings.cli_warmup:  # page cache, .pyc files
        run_measured(ours_command), run_measured(peer_command), run_measured(keys_command)
    ours_runs, peer_runs = interleaved(
        lambda: run_measured(ours_command).wall_s,
        lambda: run_measured(peer_command).wall_s,
        settings.inspect_reps,
    )
    keys_runs = [run_measured(keys_command).wall_s for _ in range(settings.inspect_reps)]
    values = ratios(ours_runs, peer_runs)
    case = f"{size / 2**20:,.0f} MiB, {len(bert_base_shapes())} float32 tensors: wall"
    report.rows.append(Row(figure, case, values, "<= 1.00", statistics.median(values) <= 1.0))
    report.notes.append(
        f"8: medians: maskln inspect {statistics.median(ours_runs):.2f} s, peer script"
        f" {statistics.median(peer_runs):.2f} s, maskln inspect --keys"
        f" {statistics.median(keys_runs):.2f} s (the file in the page cache, output to /dev/null)"
    )
    checkpoint.unlink()


# Figures 10 to 12: the comparisons and the grader ---------------------------------------------


def write_diff_pair(actual: Path, expected: Path) -> None:
    """Two one-key files of 512 MiB (``out``, BIG_SHAPE float32) that ``diff`` passes.

    ``expected`` is random normal; ``actual`` is it times (1 + 2**-22): every element differs
    (by about 2 ulps, no zeros), all well within float32's default rtol 1.3e-6, so both
    contenders read and compare every element and pass (exit 0).
    """
    from safetensors.torch import save_file

    shape = tuple(int(size) for size in BIG_SHAPE.split(","))
    out = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    save_file({"out": out}, str(expected))
    out.mul_(1 + 2**-22)
    save_file({"out": out}, str(actual))
    del out
    gc.collect()


def measure_big_commands(
    figure: str,
    settings: Settings,
    ours_command: list[str],
    peer_command: list[str],
    targets: tuple[float, float],
    report: Report,
) -> None:
    """Run both commands ``settings.big_reps`` times, interleaved; add their :func:`big_rows`."""
    progress.print(f"  {figure}: measuring")
    ours_runs, peer_runs = interleaved(
        lambda: run_measured(ours_command),
        lambda: run_measured(peer_command),
        settings.big_reps,
        warmup=settings.cli_warmup,
    )
    big_rows(figure, ours_runs, peer_runs, targets, report)


def figure_10(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln diff a b`` of two 512 MiB files / load_file both and assert_close: wall, RSS."""
    figure = "10 diff 512 MiB, passing"
    progress.print(f"  {figure}: writing the two files")
    actual, expected = workdir / "diff_actual.safetensors", workdir / "diff_expected.safetensors"
    write_diff_pair(actual, expected)
    settle_writes()
    ours_command = [MASKLN, "diff", str(actual), str(expected)]
    peer_command = [PYTHON, str(HERE / "peer_diff.py"), str(actual), str(expected)]
    measure_big_commands(figure, settings, ours_command, peer_command, (1.0, 0.6), report)
    for path in (actual, expected):
        path.unlink()


def figure_11(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln verify in res`` on a 512 MiB x / load_file, the one-liner and assert_close."""
    figure = "11 verify 512 MiB x, passing"
    source = big_input(workdir)
    result = workdir / "verify_result.safetensors"
    progress.print(f"  {figure}: writing RESULT (peer_normalize.py: F.layer_norm in float32)")
    run_checked([PYTHON, str(HERE / "peer_normalize.py"), str(source), str(result)])
    settle_writes()
    ours_command = [MASKLN, "verify", str(source), str(result)]
    peer_command = [PYTHON, str(HERE / "peer_verify.py"), str(source), str(result)]
    measure_big_commands(figure, settings, ours_command, peer_command, (1.0, 0.5), report)
    result.unlink()


def gradient_input(workdir: Path, shape: str, name: str) -> tuple[Path, Path]:
    """An input with grad_out (x of ``shape``, float32) and maskln normalize's result."""
    source, result = workdir / f"{name}.safetensors", workdir / f"{name}_result.safetensors"
    if not source.exists():
        progress.print(f"  generating {name} ({shape}, with grad_out) and its result")
        command = [MASKLN, "generate", str(source), "--shape", shape, "--seed", "3"]
        run_checked([*command, "--invalid", "0.3", "--poison", "--grad", "--quiet"])
        run_checked([MASKLN, "normalize", str(source), str(result), "--quiet"])
        settle_writes()
    return source, result


def figure_15(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln verify`` with gradients / ``--check out`` and / a peer script with autograd."""
    figure = "15 verify with gradients"
    source, result = gradient_input(workdir, BIG_SHAPE, "grad_big")
    with_grads = [MASKLN, "verify", str(source), str(result), "--quiet"]
    forward = [*with_grads, "--check", "out"]
    peer_command = [PYTHON, str(HERE / "peer_verify_grad.py"), str(source), str(result)]
    progress.print(f"  {figure}: measuring against --check out")
    ours_runs, forward_runs = interleaved(
        lambda: run_measured(with_grads),
        lambda: run_measured(forward),
        settings.big_reps,
        warmup=settings.cli_warmup,
    )
    walls = ratios((r.wall_s for r in ours_runs), (r.wall_s for r in forward_runs))
    label = f"{big_case()} + grad_out: wall / --check out"
    report.rows.append(Row(figure, label, walls, "<= 2.00", statistics.median(walls) <= 2.0))
    progress.print(f"  {figure}: measuring against peer_verify_grad.py")
    # The peer takes minutes and 10 GiB: two runs, interleaved with two more of ours.
    ours_runs, peer_runs = interleaved(
        lambda: run_measured(with_grads),
        lambda: run_measured(peer_command, exit_codes=(0, 1)),
        2,
    )
    big_rows(figure, ours_runs, peer_runs, (0.5, 0.3), report)
    report.notes.append(
        f"15: --check out median {statistics.median(r.wall_s for r in forward_runs):.2f} s"
    )
    for path in (source, result):
        path.unlink()
    source, result = gradient_input(workdir, HUGE_SHAPE, "grad_huge")
    with_grads = [MASKLN, "verify", str(source), str(result), "--quiet"]
    forward = [*with_grads, "--check", "out"]
    progress.print(f"  {figure}: 1 GiB x, measuring against --check out")
    reps = max(2, settings.big_reps // 2)
    ours_runs, forward_runs = interleaved(
        lambda: run_measured(with_grads), lambda: run_measured(forward), reps
    )
    walls = ratios((r.wall_s for r in ours_runs), (r.wall_s for r in forward_runs))
    label = "[2097152, 128] float32 + grad_out: wall / --check out"
    report.rows.append(Row(figure, label, walls, "<= 2.00", statistics.median(walls) <= 2.0))
    report.notes.append(
        f"15 (1 GiB x): medians: with gradients"
        f" {statistics.median(r.wall_s for r in ours_runs):.2f} s, --check out"
        f" {statistics.median(r.wall_s for r in forward_runs):.2f} s"
    )
    for path in (source, result):
        path.unlink()


FAILING_SHAPE = "2048,768"
FAILING = {
    "eps outside the sqrt": "eps outside sqrt",
    "unbiased variance": "unbiased variance",
    "row sums in float16": "float16 accumulation",
    "NaN-leaking one-liner": "NaN-leaking one-liner",
}
"""Figure 17's failing results: a label, and the kernel of tests/kernels.py that makes it."""


def write_failing_results(source: Path, workdir: Path) -> dict[str, Path]:
    """Each kernel of :data:`FAILING` run on ``source`` (out and its three gradients, by
    autograd through its own ops), written beside it."""
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT))
    from tests import kernels

    every = {
        **kernels.WRONG,
        "float16 accumulation": kernels.accumulate_in(torch.float16),
    }
    inputs = load_file(str(source))
    written = {}
    for label, name in FAILING.items():
        target = workdir / f"failing_{len(written)}.safetensors"
        result = kernels.run(every[name], inputs)
        save_file({k: v.contiguous() for k, v in result.items()}, str(target))
        written[label] = target
    return written


def figure_17(settings: Settings, report: Report, workdir: Path) -> None:
    """``maskln verify`` of a failing result / of a passing one, ``[2048, 768]`` with
    gradients: what a diagnosis costs."""
    figure = "17 verify failing / passing"
    source, passing = gradient_input(workdir, FAILING_SHAPE, "failing")
    progress.print(f"  {figure}: writing the failing results")
    failing = write_failing_results(source, workdir)
    settle_writes()
    passed = [MASKLN, "verify", str(source), str(passing), "--quiet"]
    medians = []
    for label, result in failing.items():
        progress.print(f"  {figure}: {label}")
        failed = [MASKLN, "verify", str(source), str(result), "--quiet"]
        fails, passes = interleaved(
            lambda failed=failed: run_measured(failed, exit_codes=(1,)).wall_s,
            lambda: run_measured(passed).wall_s,
            settings.small_reps,
            warmup=settings.cli_warmup,
        )
        values = ratios(fails, passes)
        case = f"[{FAILING_SHAPE.replace(',', ', ')}] + grad_out, {label}: wall"
        report.rows.append(Row(figure, case, values, "<= 1.50", statistics.median(values) <= 1.5))
        medians.append(f"{label} {statistics.median(fails):.2f} s")
    report.notes.append(
        f"17: medians: passing {statistics.median(passes):.2f} s; failing: {', '.join(medians)}"
    )
    for path in (source, passing, *failing.values()):
        path.unlink()


# A correct solution, as docs/guides/grading.md says: every clause passes, strict too.
GRADE_CORRECT = {
    "maskln's op": ["maskln_cli:masked_layer_normalization", "--strict"],
    "tests/solutions/correct.py": [str(ROOT / "tests" / "solutions" / "correct.py"), "--strict"],
}


def figure_12(settings: Settings, report: Report) -> None:
    """``maskln grade`` of a correct solution, wall seconds, beside ``import torch``'s."""
    figure = "12 grade a correct solution (s)"
    import_command = [PYTHON, "-c", "import torch"]
    imports: list[float] = []
    if settings.cli_warmup:
        run_measured(import_command)
    for name, arguments in GRADE_CORRECT.items():
        progress.print(f"  {figure}: {name}")
        command = [MASKLN, "grade", *arguments, "--quiet"]  # exit 0 (pass) or bench fails
        if settings.cli_warmup:
            run_measured(command)
        grades, these_imports = interleaved(
            lambda command=command: run_measured(command).wall_s,
            lambda: run_measured(import_command).wall_s,
            settings.grade_reps,
        )
        imports += these_imports
        label = f"{name}, --strict: wall s"
        report.rows.append(Row(figure, label, grades, "<= 20 s", statistics.median(grades) <= 20))
    report.rows.append(Row(figure, "python -c 'import torch': wall s (context)", imports))
    report.notes.append(
        "12: absolute seconds, not ratios; each grade run is interleaved with an"
        " `import torch` run (the grader and its child each import torch)"
    )


@dataclass(frozen=True)
class CpuSnapshot:
    """Busy CPU seconds of the whole machine, and of this process and its children."""

    wall_s: float
    machine_busy_s: float
    own_s: float


def cpu_snapshot() -> CpuSnapshot:
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    ticks = os.sysconf("SC_CLK_TCK")
    own = sum(os.times()[:4])  # user and system, self and (waited-for) children
    busy = (user + nice + system + irq + softirq) / ticks
    return CpuSnapshot(time.perf_counter(), busy, own)


def background_load(start: CpuSnapshot, end: CpuSnapshot) -> float:
    """Cores kept busy by other processes on average between two snapshots."""
    others = (end.machine_busy_s - start.machine_busy_s) - (end.own_s - start.own_s)
    return max(0.0, others) / (end.wall_s - start.wall_s)


def launcher_floor() -> int:
    """Peak RSS run_measured.py reports for ``true``, a command that uses next to no memory."""
    return run_measured([shutil.which("true") or "/bin/true"]).max_rss_bytes


def mib(count: float) -> str:
    return f"{count / 2**20:,.0f} MiB"


# Output ---------------------------------------------------------------------------------------


def header_lines(settings_name: str, threads: int) -> list[str]:
    """Date, machine and versions."""
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0))
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"machine: {cpu}, {cores} cores available ({os.cpu_count()} online),"
        f" {platform.system()} {platform.release()}",
        f"versions: maskln {maskln_cli.__version__} ({source_state()}), torch {torch.__version__},"
        f" Python {platform.python_version()}; torch threads {threads}; op backend"
        f" {active_backend()}",
        f"mode: {settings_name}",
    ]


def source_state() -> str:
    """The git commit measured, and whether maskln_cli/ had uncommitted changes."""
    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "maskln_cli")
    except (OSError, subprocess.CalledProcessError):
        return "git state unknown"
    return f"git {commit}" + (", maskln_cli/ with uncommitted changes" if dirty else "")


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def cells(row: Row) -> list[str]:
    met = "-" if row.met is None else ("yes" if row.met else "no")
    numbers = (min(row.values), row.median, max(row.values))
    return [row.figure, row.case, *(f"{n:.2f}" for n in numbers), row.target, met]


COLUMNS = ("figure", "case", "min", "median", "max", "target", "met")


def print_rich(report: Report, header: Iterable[str]) -> None:
    console = Console(highlight=False, width=max(150, Console().width))
    for line in header:
        console.print(line)
    table = Table(title="ours / peer (per-repetition ratios; figure 12: seconds)")
    for name in COLUMNS:
        table.add_column(name, justify="right" if name in ("min", "median", "max") else "left")
    for row in report.rows:
        style = "red" if row.met is False else None
        table.add_row(*cells(row), style=style)
    console.print(table)
    for note in report.notes:
        console.print(note)


def print_markdown(report: Report, header: Iterable[str]) -> None:
    for line in header:
        print(f"- {line}")
    print()
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "|".join("---:" if c in ("min", "median", "max") else "---" for c in COLUMNS) + "|")
    for row in report.rows:
        print("| " + " | ".join(cells(row)) + " |")
    print()
    for note in report.notes:
        print(f"- {note}")


# Main -----------------------------------------------------------------------------------------


def parse_only(text: str | None) -> set[int]:
    """``core,cli`` or ``1,3`` -> figure numbers; None -> all."""
    if text is None:
        return {n for figures in GROUPS.values() for n in figures}
    chosen: set[int] = set()
    for token in filter(None, (t.strip() for t in text.split(","))):
        if token in GROUPS:
            chosen.update(GROUPS[token])
        elif token.isdigit() and 1 <= int(token) <= FIGURES:
            chosen.add(int(token))
        else:
            raise SystemExit(
                f"--only: unknown group or figure {token!r} (core, memory, cli, testing,"
                f" 1-{FIGURES})"
            )
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (a smoke test)")
    parser.add_argument(
        "--only",
        metavar="WHAT",
        help=f"comma-separated groups (core, memory, cli, testing) or figures 1-{FIGURES}",
    )
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS})"
    )
    args = parser.parse_args()
    figures = parse_only(args.only)
    settings = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    header = header_lines("quick" if args.quick else "full", args.threads)
    report = Report()
    start = cpu_snapshot()
    with tempfile.TemporaryDirectory(prefix="maskln-bench-") as tmp:
        steps: dict[int, Callable[[], None]] = {
            1: lambda: figure_1(settings, report),
            2: lambda: figure_2(settings, report),
            3: lambda: figure_3(settings, report),
            4: lambda: figure_4(settings, report),
            5: lambda: figure_5(settings, report),
            6: lambda: figure_6(settings, report, Path(tmp)),
            7: lambda: figure_7(settings, report, Path(tmp)),
            8: lambda: figure_8(settings, report, Path(tmp)),
            9: lambda: figure_9(settings, report),
            10: lambda: figure_10(settings, report, Path(tmp)),
            11: lambda: figure_11(settings, report, Path(tmp)),
            12: lambda: figure_12(settings, report),
            13: lambda: figure_13(settings, report),
            14: lambda: figure_14(settings, report),
            15: lambda: figure_15(settings, report, Path(tmp)),
            16: lambda: figure_16(settings, report),
            17: lambda: figure_17(settings, report, Path(tmp)),
            18: lambda: figure_18(settings, report),
            19: lambda: figure_19(settings, report),
        }
        for number in sorted(figures):
            progress.print(f"figure {number}")
            figure_start = time.perf_counter()
            steps[number]()
            progress.print(f"figure {number}: {time.perf_counter() - figure_start:.0f} s")
        if figures & {6, 10, 11}:
            report.notes.append(
                f"6, 10, 11: each peak RSS includes up to {mib(launcher_floor())} inherited from"
                " the launcher (run_measured.py running `true`)"
            )
    end = cpu_snapshot()
    report.notes.append(
        f"ran in {end.wall_s - start.wall_s:.0f} s; other processes kept"
        f" {background_load(start, end):.1f} of {os.cpu_count()} cores busy meanwhile"
        " (on average; much above 0 makes timings noisy)"
    )
    if args.markdown:
        print_markdown(report, header)
    else:
        print_rich(report, header)


if __name__ == "__main__":
    main()
