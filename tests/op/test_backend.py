"""Choosing the op's kernels (maskln_cli.op.backend): MASKLN_BACKEND, set_backend, what
``active_backend()`` and ``maskln --version`` say, and the fallback to the raw-op kernels, with
one warning, where the native ones cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from maskln_cli import masked_layer_normalization
from maskln_cli.errors import MasklnError
from maskln_cli.op import backend, blocked
from tests.op.test_core import make_inputs

ROOT = Path(__file__).resolve().parents[2]


def test_environment_variable_chooses_and_a_wrong_value_is_named(monkeypatch):
    monkeypatch.setattr(backend, "_chosen", None)
    monkeypatch.setenv("MASKLN_BACKEND", "raw")
    assert backend.active_backend().name == "raw"
    assert backend.active_backend().reason == "chosen by MASKLN_BACKEND=raw"
    monkeypatch.setenv("MASKLN_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"^MASKLN_BACKEND must be 'native' or 'raw', got 'fast'$"):
        backend.requested()
    assert issubclass(backend.BackendChoiceError, MasklnError)  # the CLI: one line, exit 2
    with pytest.raises(ValueError, match="got 'gpu'"):
        backend.set_backend("gpu")


def test_both_backends_compute_the_same_op(on_backend):
    """set_backend switches the kernels (the registered op's too): raw gives the raw-op
    kernels' bits, native its own, both the op."""
    x, valid, scale, bias = make_inputs((6, 40), 33, torch.float32, poison=True, offset=3.0)
    on_backend("raw")
    raw = masked_layer_normalization(x, valid, scale, bias)
    assert torch.equal(raw, blocked.forward(x, valid, scale, bias, 1e-5)[0])
    assert torch.equal(torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, 1e-5)[0], raw)
    on_backend("native")
    assert backend.active_backend().name == "native"
    native = masked_layer_normalization(x, valid, scale, bias)
    assert torch.equal(torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, 1e-5)[0], native)
    torch.testing.assert_close(native, raw, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # real processes, tens of seconds: make test-slow
def test_without_a_compiler_the_op_falls_back_with_one_warning(tmp_path):
    """An empty kernel cache and no C++ compiler: the first call warns once, saying why, and
    every call (eager, autograd, the registered op) gives the raw-op kernels' results;
    ``maskln --version`` says so too."""
    script = textwrap.dedent(
        """
        import json, warnings
        import torch
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            from maskln_cli import masked_layer_normalization
            from maskln_cli.op import backend, blocked
            from tests.op.test_core import make_inputs
            x, valid, scale, bias = make_inputs((5, 7), 16, torch.float32, poison=True)
            outs = [masked_layer_normalization(x, valid, scale, bias) for _ in range(3)]
            leaf = x.clone().requires_grad_()
            (dx,) = torch.autograd.grad(masked_layer_normalization(leaf, valid, scale, bias),
                                        leaf, torch.ones_like(x))
            outs.append(torch.ops.maskln.masked_layer_norm(x, valid, scale, bias, 1e-5)[0])
        raw_y, mean, rstd = blocked.forward(x, valid, scale, bias, 1e-5)
        raw_dx = blocked.backward_in_place(torch.ones_like(x), x, valid, scale, mean, rstd, 1e-5)[0]
        print(json.dumps({
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, backend.NativeFallbackWarning)],
            "equal": all(torch.equal(out, raw_y) for out in outs) and torch.equal(dx, raw_dx),
            "backend": str(backend.active_backend()),
        }))
        """
    )
    env = dict(os.environ, MASKLN_NATIVE_CACHE=str(tmp_path / "cache"), CXX="/nonexistent/c++")
    env.pop("MASKLN_BACKEND", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "native CPU kernels are unavailable (no C++ compiler" in report["warnings"][0]
    assert report["equal"]
    assert report["backend"].startswith("raw (native kernels unavailable: no C++ compiler")
    version = subprocess.run([sys.executable, "-m", "maskln_cli", "--version"],
                             capture_output=True, text=True, cwd=ROOT, env=env)  # fmt: skip
    assert version.stdout.splitlines()[1].startswith(
        "op backend: raw (native kernels unavailable: no C++ compiler: '/nonexistent/c++'"
    ), version.stdout


def test_an_unbuilt_cache_says_it_builds_on_first_use(monkeypatch, tmp_path):
    """With a compiler but nothing built yet, the native backend is still the one chosen."""
    monkeypatch.setenv("MASKLN_NATIVE_CACHE", str(tmp_path))
    state = backend.cached_state()
    if state.name == "raw":
        pytest.skip(f"no toolchain here: {state.reason}")
    assert state.name == "native" and state.reason is not None
    assert state.reason.startswith("not built yet: compiled on first use")
    assert str(tmp_path) in str(state)


def test_a_wrong_backend_name_is_one_line_and_exit_2_in_the_cli(tmp_path):
    """MASKLN_BACKEND=fast made the ops' definition fail half-way at torch's import, and the
    next use defined them twice: an internal error. Now the command names the variable."""
    out = tmp_path / "out.safetensors"
    env = dict(os.environ, MASKLN_BACKEND="fast")
    source = ROOT / "sample_data" / "pair_features.safetensors"
    done = subprocess.run([sys.executable, "-m", "maskln_cli", "normalize", str(source), str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip() == "maskln: error: MASKLN_BACKEND must be 'native' or 'raw', got 'fast'"
    )
    assert not out.exists()


def test_an_empty_expanded_x_gives_empty_like_strides(on_backend):
    """The native kernel gave an empty x of strides (0, 1, 1) (an expanded x) contiguous
    strides; torch.empty_like keeps the 0 (hypothesis found it, now and then)."""
    x = torch.empty(1, 0, 1).expand(2, 0, 1)
    valid = torch.ones(1, 0, dtype=torch.bool).expand(2, 0)
    for name in ("raw", "native"):
        on_backend(name)
        out = masked_layer_normalization(x, valid, torch.ones(1), torch.zeros(1))
        assert out.stride() == torch.empty_like(x).stride() == (0, 1, 1), name
