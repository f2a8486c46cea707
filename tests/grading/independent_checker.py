"""An independent float64 checker of masked layer normalization, written for issue 32's class run:
it decides whether a solution is right or wrong without maskln's grader, its reference, its
cases or its tolerances, so that "wrong" is established apart from what is being tested.

The reference is the formula in plain Python floats, row by row (math.fsum), and its gradients
the analytic ones written out, row by row; second derivatives are checked by torch's own
gradgradcheck (finite differences). The data is its own (numpy's generator), the tolerances
deliberately looser than the grader's (a result this checker calls wrong is far off).

It checks what the class's rules count (the specification's required clauses, +0.0 in invalid
rows and second derivatives): values on every shape, dtype, eps, layout and grad mode, with
constant rows, exact zeros, C = 1, prime C, poisoned padding; the output's dtype and float64
precision; gradients (with strided upstream gradients, and poisoned padding); gradgradcheck;
no mutation, no reseeding, no change of torch's global state, nothing left on the inputs, no
ready-made normalization; the same bits twice and on another thread count; results not shared
between calls; a stable variance on float32 rows far from zero. ``check(fn)`` lists what ``fn``
gets wrong (tests/grading/test_class_round_three.py runs it on the whole class: slow).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

Fn = Callable[..., torch.Tensor]


# --- the reference, in Python floats --------------------------------------------------------


def reference(x: np.ndarray, valid: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float):
    """The output, float64, row by row (``x`` [..., C] as float64 numbers)."""
    c = x.shape[-1]
    rows = x.reshape(-1, c)
    keep = valid.reshape(-1)
    out = np.zeros_like(rows, dtype=np.float64)
    for r in range(rows.shape[0]):
        if not keep[r]:
            continue
        row = [float(v) for v in rows[r]]
        mean = math.fsum(row) / c
        var = math.fsum((v - mean) ** 2 for v in row) / c
        inv = 1.0 / math.sqrt(var + eps)
        out[r] = [
            (v - mean) * inv * float(s) + float(b) for v, s, b in zip(row, scale, bias, strict=True)
        ]
    return out.reshape(x.shape)


def reference_gradients(x, valid, scale, bias, eps, grad_out):
    """d sum(out * grad_out) / d(x, scale, bias), float64, written out row by row."""
    c = x.shape[-1]
    rows, ups = x.reshape(-1, c), grad_out.reshape(-1, c)
    keep = valid.reshape(-1)
    dx = np.zeros_like(rows, dtype=np.float64)
    dscale = np.zeros(c)
    dbias = np.zeros(c)
    for r in range(rows.shape[0]):
        if not keep[r]:
            continue
        row = [float(v) for v in rows[r]]
        mean = math.fsum(row) / c
        var = math.fsum((v - mean) ** 2 for v in row) / c
        inv = 1.0 / math.sqrt(var + eps)
        xhat = [(v - mean) * inv for v in row]
        g = [float(u) for u in ups[r]]
        gs = [gi * float(s) for gi, s in zip(g, scale, strict=True)]
        mean_gs = math.fsum(gs) / c
        mean_gx = math.fsum(a * b for a, b in zip(gs, xhat, strict=True)) / c
        dx[r] = [inv * (a - mean_gs - h * mean_gx) for a, h in zip(gs, xhat, strict=True)]
        dscale += np.array([gi * h for gi, h in zip(g, xhat, strict=True)])
        dbias += np.array(g)
    return dx.reshape(x.shape), dscale, dbias


# --- data -----------------------------------------------------------------------------------------


class Data:
    """Inputs drawn from numpy's generator, float64, with the layouts and poison asked for."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def rows(self, leading, c, spread=1.0, kind="random"):
        shape = (*leading, c)
        n = int(np.prod(leading)) if leading else 1
        means = self.rng.uniform(-2, 2, size=(n, 1)) * spread
        x = means + spread * self.rng.standard_normal((n, c))
        if kind == "constant":
            x[::2] = self.rng.choice([-1.5, 0.75, 2.0, -0.125], size=(x[::2].shape[0], 1))
        elif kind == "zeros":
            x = np.maximum(x, 0.0)
            if n > 1:
                x[1] = 0.0
        elif kind == "ties":  # elements equal to the mean, equal elements (exact sums)
            steps = np.array([0.0, 0.0] + [0.5, -0.5, 1.5, -1.5, 0.5, -0.5] * c)[:c]
            steps[-1] -= steps.sum()
            x = np.stack([self.rng.permutation(steps) for _ in range(n)])
            x += self.rng.choice([-1.25, 0.5, 2.0], size=(n, 1))
        return x.reshape(shape)

    def mask(self, leading):
        if not leading:
            return np.array(bool(self.rng.random() < 0.7))
        m = self.rng.random(leading) < 0.65
        flat = m.reshape(-1)
        if flat.size >= 2:
            flat[0], flat[-1] = True, False
        return m

    def params(self, c, negative_bias=False):
        scale = 1.0 + 0.5 * self.rng.standard_normal(c)
        bias = self.rng.uniform(0.5, 1.5, c) * (
            -1 if negative_bias else self.rng.choice([-1, 1], c)
        )
        return scale, bias


def poisoned(x: np.ndarray, valid: np.ndarray, rng) -> np.ndarray:
    out = x.copy()
    invalid = ~np.broadcast_to(valid[..., None], x.shape)
    picks = rng.choice([np.nan, np.inf, -np.inf, 1e30], size=x.shape)
    out[invalid] = picks[invalid]
    return out


def tensors(x, valid, scale, bias, dtype, layout="contiguous"):
    """torch inputs in ``dtype``; ``layout``: contiguous, permuted (x a transposed view),
    strided (valid, scale and bias non-contiguous), expanded (x a stride-0 view)."""
    # np.array, not np.ascontiguousarray: that makes a 0-d valid 1-d
    tx = torch.from_numpy(np.array(x, dtype=np.float64)).to(dtype)
    tv = torch.from_numpy(np.array(valid, dtype=bool))
    ts = torch.from_numpy(np.array(scale, dtype=np.float64)).to(dtype)
    tb = torch.from_numpy(np.array(bias, dtype=np.float64)).to(dtype)
    if layout == "permuted" and tx.dim() == 3:
        tx = tx.transpose(0, 1).contiguous().transpose(0, 1)
        tv = tv.t().contiguous().t()
    elif layout == "strided":
        ts = torch.stack([ts, ts], -1)[..., 0]
        tb = torch.stack([tb, tb], -1)[..., 0]
    return tx, tv, ts, tb


# --- the check ------------------------------------------------------------------------------------


class Wrong(Exception):
    """What the solution got wrong, in words."""


def _close(actual: torch.Tensor, expected: np.ndarray, dtype: torch.dtype, what: str) -> None:
    got = actual.detach().double().numpy()
    if got.shape != expected.shape:
        raise Wrong(f"{what}: shape {got.shape}, expected {expected.shape}")
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    bad = ~(np.abs(got - expected) <= tol * (1 + np.abs(expected)))
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise Wrong(f"{what}: at {i} gave {got[i]!r}, expected {expected[i]!r}")


def _zeros_positive(out: torch.Tensor, valid: np.ndarray, what: str) -> None:
    invalid = ~np.broadcast_to(valid[..., None], tuple(out.shape))
    values = out.detach().double().numpy()[invalid]
    if values.size and (values != 0).any():
        raise Wrong(f"{what}: an invalid row is not zero")
    if values.size and np.signbit(values).any():
        raise Wrong(f"{what}: -0.0 in an invalid row")


def _call(fn: Fn, x, v, s, b, eps, mode="plain", keyword=False):
    args = {"x": x, "valid": v, "scale": s, "bias": b}
    if eps is not None:
        args["eps"] = eps
    context: Any = {"no_grad": torch.no_grad, "inference": torch.inference_mode}.get(mode)
    if context is not None:
        with context():
            return fn(**args) if keyword else fn(*args.values())
    return fn(**args) if keyword else fn(*args.values())


def _value_cases(data: Data) -> Iterator[tuple[str, tuple, torch.dtype, float, str, bool]]:
    """(what, (x, valid, scale, bias), dtype, eps, layout, poisoned) of every value case."""
    shapes = [(), (5,), (2, 3), (2, 2, 2), (0,), (1,), (40,)]
    for dtype in (torch.float64, torch.float32):
        for leading in shapes:
            for c in (1, 2, 7, 16, 31):
                eps = 1e-5 if (dtype == torch.float64 or c > 1) else 0.1
                x = data.rows(leading, c)
                yield ("random", (x, data.mask(leading), *data.params(c)), dtype, eps,
                       "contiguous", False)  # fmt: skip
        for eps in (1e-12, 1e-8, 1e-5, 0.1, 3.0, 10.0):
            x = data.rows((4, 6), 16, spread=math.sqrt(eps) * data.rng.choice([0.1, 1, 10]))
            yield ("eps", (x, data.mask((4, 6)), *data.params(16)), dtype, eps, "contiguous", False)
        for kind in ("constant", "zeros"):
            eps = 0.1 if dtype == torch.float32 else 1e-5
            x = data.rows((3, 5), 8, kind=kind)
            yield (kind, (x, data.mask((3, 5)), *data.params(8)), dtype, eps, "contiguous", False)
        for layout in ("permuted", "strided"):
            x = data.rows((3, 4), 6)
            yield (layout, (x, data.mask((3, 4)), *data.params(6)), dtype, 1e-5, layout, False)
        for leading, c in (((3, 6), 8), ((), 5), ((4,), 1), ((2, 3), 13)):
            x = data.rows(leading, c)
            valid = data.mask(leading) if leading else np.array(False)
            eps = 0.1 if c == 1 and dtype == torch.float32 else 1e-5
            yield ("poisoned", (x, valid, *data.params(c)), dtype, eps, "contiguous", True)
    big = data.rows((2,), 3000)
    yield ("wide", (big, np.array([True, False]), *data.params(3000)), torch.float32, 1e-5,
           "contiguous", False)  # fmt: skip
    many = data.rows((1500,), 9)
    yield ("many rows", (many, data.mask((1500,)), *data.params(9)), torch.float64, 1e-5,
           "contiguous", False)  # fmt: skip


def check_values(fn: Fn, data: Data) -> None:
    for what, (x, valid, scale, bias), dtype, eps, layout, poison in _value_cases(data):
        given = poisoned(x, valid, data.rng) if poison else x
        clean_valid = valid
        expected = reference(np.where(np.broadcast_to(valid[..., None], x.shape), x, 0.0),
                             clean_valid, scale, bias, eps)  # fmt: skip
        expected = expected.astype(np.float64)
        for mode in ("plain", "grad", "no_grad", "inference"):
            tx, tv, ts, tb = tensors(given, valid, scale, bias, dtype, layout)
            if mode != "plain":
                for t in (tx, ts, tb):
                    t.requires_grad_()
            out = _call(fn, tx, tv, ts, tb, eps, "plain" if mode == "grad" else mode)
            label = f"{what} {tuple(x.shape)} {dtype} eps {eps:g} {layout} {mode}"
            if not isinstance(out, torch.Tensor) or out.dtype != dtype:
                raise Wrong(f"{label}: returned {getattr(out, 'dtype', type(out))}")
            if expected.size:
                expected_cast = expected
                _close(out, expected_cast, dtype, label)
                _zeros_positive(out, valid, label)
            if mode == "grad" and not out.requires_grad and expected.size:
                raise Wrong(f"{label}: the output does not require grad")


def check_signature(fn: Fn, data: Data) -> None:
    x = data.rows((2, 5), 12, spread=3e-3)  # variance near 1e-5: eps matters
    valid, (scale, bias) = data.mask((2, 5)), data.params(12)
    expected = reference(np.where(valid[..., None], x, 0.0), valid, scale, bias, 1e-5)
    tx, tv, ts, tb = tensors(x, valid, scale, bias, torch.float64)
    _close(_call(fn, tx, tv, ts, tb, None), expected, torch.float64, "eps left out")
    _close(_call(fn, tx, tv, ts, tb, None, keyword=True), expected, torch.float64, "by keyword")
    worked = fn(x=torch.tensor([[[1.0, 3.0], [99.0, -99.0]]], dtype=torch.float64),
                valid=torch.tensor([[True, False]]), scale=torch.tensor([2.0, -1.0],
                dtype=torch.float64), bias=torch.tensor([0.5, 1.0], dtype=torch.float64),
                eps=3.0)  # fmt: skip
    if worked.tolist() != [[[-0.5, 0.5], [0.0, 0.0]]]:
        raise Wrong(f"the worked example gave {worked.tolist()}")


def check_precision(fn: Fn, data: Data) -> None:
    x = data.rows((4, 6), 24, spread=1e4)
    valid, (scale, bias) = data.mask((4, 6)), data.params(24)
    expected = reference(np.where(valid[..., None], x, 0.0), valid, scale, bias, 1e-5)
    out = fn(*tensors(x, valid, scale, bias, torch.float64), 1e-5)
    error = np.abs(out.detach().numpy() - expected).max() / np.abs(expected).max()
    if not error < 1e-12:
        raise Wrong(f"float64 rows of std 1e4: relative error {error:.2g}, not float64's")


def _upstream(shape, kind, rng, dtype):
    b, n, c = shape
    if kind == "transposed":
        return torch.from_numpy(rng.standard_normal((n, b, c))).to(dtype).transpose(0, 1)
    if kind == "expanded":
        return torch.from_numpy(rng.standard_normal((1, n, c))).to(dtype).expand(b, n, c)
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def check_gradients(fn: Fn, data: Data) -> None:
    cases = []
    for dtype in (torch.float64, torch.float32):
        for kind, c, eps in (
            ("random", 8, 1e-5),
            ("random", 1, 1e-5),
            ("random", 13, 0.1),
            ("constant", 6, 1e-5),
            ("zeros", 8, 1e-5),
            ("random", 5, 1e-10),
            ("ties", 8, 1e-5),
            ("identity affine", 8, 1e-5),
        ):
            cases.append((kind, c, eps, dtype, "contiguous", False))  # fmt: skip
        for upstream in ("transposed", "expanded"):
            cases.append(("random", 6, 1e-5, dtype, upstream, False))
        cases.append(("random", 8, 1e-5, dtype, "contiguous", True))
    for kind, c, eps, dtype, upstream, poison in cases:
        if dtype == torch.float32 and (kind == "constant" or c == 1):
            eps = 0.1
        x = data.rows((3, 4), c, kind="random" if kind == "identity affine" else kind)
        valid, (scale, bias) = data.mask((3, 4)), data.params(c)
        if kind == "identity affine":  # as a module initializes them
            scale, bias = np.ones(c), np.zeros(c)
        given = poisoned(x, valid, data.rng) if poison else x
        tx, tv, ts, tb = tensors(given, valid, scale, bias, dtype)
        for t in (tx, ts, tb):
            t.requires_grad_()
        g = _upstream(tuple(x.shape), upstream, data.rng, dtype)
        out = fn(tx, tv, ts, tb, eps)
        label = f"gradients {kind} C {c} {dtype} eps {eps:g} upstream {upstream}"
        if poison:
            label += " poisoned"
        got = torch.autograd.grad(out, (tx, ts, tb), g, allow_unused=True)
        expected = reference_gradients(np.where(valid[..., None], x, 0.0), valid, scale, bias,
                                       eps, g.double().numpy())  # fmt: skip
        for name, actual, want in zip(("dx", "dscale", "dbias"), got, expected, strict=True):
            if actual is None:
                raise Wrong(f"{label}: no {name}")
            values = actual.double().numpy()
            if not np.isfinite(values).all():
                raise Wrong(f"{label}: {name} not finite")
            tol = (1e-7 if dtype == torch.float64 else 2e-3) * max(1.0, np.abs(want).max())
            if np.abs(values - want).max() > tol:
                raise Wrong(f"{label}: {name} off by {np.abs(values - want).max():.3g}")


def check_second_order(fn: Fn, data: Data) -> None:
    for kind, c in (("random", 4), ("random", 1), ("constant", 5), ("random", 7), ("ties", 8)):
        x = data.rows((2, 3), c, kind=kind)
        valid, (scale, bias) = data.mask((2, 3)), data.params(c)
        tx, tv, ts, tb = tensors(x, valid, scale, bias, torch.float64)
        inputs = tuple(t.requires_grad_() for t in (tx, ts, tb))
        try:
            ok = torch.autograd.gradgradcheck(
                lambda a, s, b, v=tv: fn(a, v.clone(), s, b, 0.1), inputs, raise_exception=False
            )
        except Exception as error:  # gradgradcheck itself raised: no second derivatives
            where = traceback.extract_tb(error.__traceback__)[-1]  # to tell a flake from a fault
            raise Wrong(
                f"second derivatives, {kind} C {c}: {type(error).__name__}: {error} "
                f"(at {where.filename}:{where.lineno})"
            ) from None
        if not ok:
            raise Wrong(f"second derivatives, {kind} C {c}: gradgradcheck fails")


STATE_READERS = {
    "default dtype": torch.get_default_dtype,
    "grad mode": torch.is_grad_enabled,
    "threads": torch.get_num_threads,
    "anomaly": torch.is_anomaly_enabled,
    "deterministic": torch.are_deterministic_algorithms_enabled,
    "print options": lambda: repr(vars(torch._tensor_str.PRINT_OPTS)),
    "random state": lambda: torch.get_rng_state().numpy().tobytes(),
    "inference mode": torch.is_inference_mode_enabled,
    "autocast": lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
    "float32 matmul precision": torch.get_float32_matmul_precision,
    "warn always": torch.is_warn_always_enabled,
    "flush denormal": lambda: (torch.tensor([1e-310], dtype=torch.float64) * 1.0).item() == 0.0,
}
FORBIDDEN = ("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm")


def check_behaviour(fn: Fn, data: Data) -> None:
    x = data.rows((3, 5), 8)
    valid, (scale, bias) = data.mask((3, 5)), data.params(8)
    for dtype in (torch.float32, torch.float64):
        inputs = tensors(x, valid, scale, bias, dtype)
        grad_out = torch.from_numpy(data.rng.standard_normal(x.shape)).to(dtype)
        saved = [t.clone() for t in (*inputs, grad_out)]
        versions = [t._version for t in (*inputs, grad_out)]
        leaves = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        state = {name: read() for name, read in STATE_READERS.items()}
        out = fn(*leaves, 1e-5)
        out.backward(grad_out)
        now = {name: read() for name, read in STATE_READERS.items()}
        changed = [name for name in state if state[name] != now[name]]
        if changed:
            raise Wrong(f"torch's global state changed: {', '.join(changed)}")
        _state_in_every_mode(fn, tensors(x, valid, scale, bias, dtype))
        for t, before, version in zip((*inputs, grad_out), saved, versions, strict=True):
            if not torch.equal(t.detach(), before) or t._version != version:
                raise Wrong("an input was modified")
        for t in inputs:
            if t._backward_hooks or vars(t):
                raise Wrong("a hook or an attribute left on an input")
        # the same bits call after call (rows long enough that the order of a sum shows), and
        # on another thread count. A race shows only when it happens: on a loaded machine a
        # thread pool may finish its jobs in the same order for a while, so many calls, on
        # short and on long rows (long jobs overlap more; there a library's matrix product may
        # block by thread count, so only the short rows change it)
        threads = torch.get_num_threads()
        for rows, channels, other_threads in ((48, 96, 3), (8, 4096, threads)):
            wide = data.rows((rows,), channels)
            inputs = (wide, data.mask((rows,)), *data.params(channels))
            first = fn(*tensors(*inputs, dtype), 1e-5).detach().clone()
            for call in range(40):
                torch.set_num_threads(other_threads if call % 4 == 3 else threads)
                try:
                    again = fn(*tensors(*inputs, dtype), 1e-5).detach().clone()
                finally:
                    torch.set_num_threads(threads)
                if not torch.equal(first, again):
                    raise Wrong("the same inputs gave other bits")
        # results not shared between calls, nor with the inputs
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                one_inputs = tensors(x, valid, scale, bias, dtype)
                one = fn(*one_inputs, 1e-5)
                kept = one.clone()
                fn(*tensors(x * 2 + 1, ~valid, scale, bias, dtype), 1e-5)
            if not torch.equal(one, kept):
                raise Wrong("a later call changed an earlier result")
            storages = {t.untyped_storage().data_ptr() for t in one_inputs}
            if one.untyped_storage().data_ptr() in storages:
                raise Wrong("the result shares storage with an input")


def _state_in_every_mode(fn: Fn, inputs) -> None:
    """torch's state read inside the caller's context, right after the call (a no_grad block
    puts grad mode back on exit), on 1 and on 5 threads (a function that sets either is seen
    from the other), with deterministic algorithms and anomaly mode off and on (a function
    that sets them off "back" is seen from on)."""
    threads = torch.get_num_threads()
    try:
        for count, unusual in ((1, False), (5, False), (5, True)):
            for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
                torch.set_num_threads(count)
                torch.use_deterministic_algorithms(unusual)
                torch.autograd.set_detect_anomaly(unusual)
                with mode():
                    state = {name: read() for name, read in STATE_READERS.items()}
                    fn(*inputs, 1e-5)
                    now = {name: read() for name, read in STATE_READERS.items()}
                changed = [name for name in state if state[name] != now[name]]
                if changed:
                    raise Wrong(f"torch's global state changed under {mode.__name__} on"
                                f" {count} threads: {', '.join(changed)}")  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)


def check_raw_ops(fn: Fn, data: Data) -> None:
    """Torch's own normalizations replaced by traps while the function runs."""
    x = data.rows((2, 3), 8)
    valid, (scale, bias) = data.mask((2, 3)), data.params(8)
    inputs = tensors(x, valid, scale, bias, torch.float32)
    saved = {}

    def trap(*args, **kwargs):
        raise Wrong("a ready-made normalization ran")

    for module in (F, torch):
        for name in FORBIDDEN:
            if hasattr(module, name):
                saved[(module, name)] = getattr(module, name)
                setattr(module, name, trap)
    try:
        fn(*inputs, 1e-5)
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


def check_two_pass(fn: Fn, data: Data) -> None:
    x = 1e4 + 0.1 * data.rng.standard_normal((200, 64))
    valid, (scale, bias) = np.ones(200, dtype=bool), data.params(64)
    x32 = x.astype(np.float32).astype(np.float64)  # what the function sees
    expected = reference(x32, valid, scale.astype(np.float32), bias.astype(np.float32), 1e-5)
    out = fn(*tensors(x, valid, scale, bias, torch.float32), 1e-5).double().numpy()
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    if not error < 0.05:
        raise Wrong(f"float32 rows 1e4 ± 0.1: relative RMS error {error:.3g}")


CHECKS = (
    check_signature,
    check_values,
    check_precision,
    check_gradients,
    check_second_order,
    check_behaviour,
    check_raw_ops,
    check_two_pass,
)


_LEFT: list[Any] = []
"""The contexts that take the checker out of what a function left it in (kept: dropped, a
context's guard would put the function's state back)."""


def check(fn: Fn, seed: int = 2024) -> list[str]:
    """What ``fn`` gets wrong, one line per failing check (empty: right everywhere it looked).
    torch's global state is put back after each check, whatever ``fn`` did."""
    found = []
    for each in CHECKS:
        saved = (
            torch.get_default_dtype(),
            torch.get_num_threads(),
            torch.get_rng_state(),
            torch.is_anomaly_enabled(),
            torch.are_deterministic_algorithms_enabled(),
            torch.get_float32_matmul_precision(),
            torch.is_warn_always_enabled(),
        )
        try:
            each(fn, Data(seed))
        except Wrong as wrong:
            found.append(f"{each.__name__}: {wrong}")
        except Exception as error:  # an exception of the function's is a failure too
            found.append(f"{each.__name__}: {type(error).__name__}: {error}"[:300])
        finally:
            torch.set_default_dtype(saved[0])
            torch.set_num_threads(saved[1])
            torch.set_rng_state(saved[2])
            torch.autograd.set_detect_anomaly(saved[3])
            torch.use_deterministic_algorithms(saved[4])
            torch.set_float32_matmul_precision(saved[5])
            torch.set_warn_always(saved[6])
            torch.set_flush_denormal(False)
            torch.set_autocast_enabled("cpu", False)
            if torch.is_inference_mode_enabled():  # left entered: leave it, for good
                _LEFT.append(torch.inference_mode(False))
                _LEFT[-1].__enter__()
            torch.set_grad_enabled(True)
    return found
