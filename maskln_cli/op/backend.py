"""Which kernels compute the op: the native CPU kernels (the default) or the raw-op kernels.

``MASKLN_BACKEND=native`` (the default) runs CPU tensors on the C++ kernels of
:mod:`maskln_cli.op.native`, compiled on first use into a per-user cache when the install step
did not build them; ``MASKLN_BACKEND=raw`` runs everything on the raw-op kernels of
:mod:`maskln_cli.op.blocked`, as do other devices than the CPU in any case. :func:`set_backend`
chooses from Python, :func:`active_backend` says which is active and why.

When the native kernels cannot be built (no C++ compiler, ninja or Python headers) the op falls
back to the raw-op kernels with one warning per process (:class:`NativeFallbackWarning`).

:func:`forward` and :func:`backward` are the op's two computations on plain tensors whose
inputs are already checked (:func:`maskln_cli.op.checks.check_inputs`), for either norm (the
calling convention of :mod:`maskln_cli.op.norms`): they return what the registered ops
(``maskln::masked_layer_norm``, ``maskln::masked_rms_norm`` and their backward ops) return,
in the same dtypes and layouts, whichever kernels run.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.op import native
from maskln_cli.op.norms import LAYER, Norm

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKEND_ENV",
    "Backend",
    "BackendChoiceError",
    "NativeFallbackWarning",
    "active_backend",
    "backward",
    "forward",
    "native_kernels",
    "set_backend",
    "spread",
    "within_contract",
]

BACKEND_ENV = "MASKLN_BACKEND"
BACKENDS = ("native", "raw")


class BackendChoiceError(MasklnError, ValueError):
    """``MASKLN_BACKEND`` (or :func:`set_backend`'s argument) names no backend."""


class NativeFallbackWarning(UserWarning):
    """The native kernels were asked for (the default) but cannot be built or loaded here."""


@dataclass(frozen=True)
class Backend:
    """The active backend: ``name`` is ``"native"`` or ``"raw"``; ``reason`` says why it is
    raw, or what is still to happen (a first build); ``detail`` what runs (instruction set,
    library)."""

    name: str
    reason: str | None = None
    detail: str | None = None

    def __str__(self) -> str:
        extra = "; ".join(part for part in (self.detail, self.reason) if part)
        return f"{self.name} ({extra})" if extra else self.name


_chosen: str | None = None
"""set_backend's choice, ahead of the environment variable."""
_lock = threading.Lock()
_native: ModuleType | None = None
_native_tried = False
_failure: str | None = None
"""Why loading the native kernels failed in this process."""
_PLAIN: tuple[type, ...] = ()
"""torch.Tensor and torch.nn.Parameter, and torch.compiler.is_compiling: set when the library
loads (torch imported then), for within_contract."""
_is_compiling: Callable[[], bool] = bool
_python_autograd: dict[str, tuple[object, object]] = {}
"""use_python_autograd's kernels, by norm."""


def use_python_autograd(norm: Norm, forward: object, backward: object) -> None:
    """A norm's registered ops' Python autograd kernels (:mod:`maskln_cli.op.library`), which
    the native library's C++ autograd kernels call back when a derivative may be taken; given
    before the native kernels load (they are registered with them)."""
    _python_autograd[norm.name] = (forward, backward)
    if _native is not None:
        _native.set_python_autograd(norm.name, forward, backward)


def requested() -> str:
    """The backend asked for: :func:`set_backend`'s choice, else ``$MASKLN_BACKEND``, else
    native.

    Raises:
        BackendChoiceError: ``MASKLN_BACKEND`` names neither (a ValueError).
    """
    if _chosen is not None:
        return _chosen
    value = os.environ.get(BACKEND_ENV, "").strip().lower() or "native"
    if value not in BACKENDS:
        raise BackendChoiceError(
            f"{BACKEND_ENV} must be 'native' or 'raw', got {os.environ[BACKEND_ENV]!r}"
        )
    return value


def set_backend(name: str) -> str:
    """Compute with ``name`` ("native" or "raw") from now on, in this process; returns the
    backend asked for before. (None of torch.compile's graphs compiled earlier change.)

    Example:
        >>> previous = set_backend("raw")
        >>> active_backend().name
        'raw'
        >>> _ = set_backend(previous)
    """
    global _chosen
    if name not in BACKENDS:
        raise BackendChoiceError(f"backend must be 'native' or 'raw', got {name!r}")
    previous = requested()
    _chosen = name
    if _native is not None:  # the registered op follows: its CPU kernel is C++ or Python
        _native.register_maskln_kernels(name == "native")
    return previous


def active_backend() -> Backend:
    """The backend the op computes CPU tensors with, and why; never builds anything.

    Example:
        >>> active_backend().name in ("native", "raw")
        True
    """
    choice = requested()
    if choice == "raw":
        how = "set_backend('raw')" if _chosen == "raw" else f"{BACKEND_ENV}=raw"
        return Backend("raw", f"chosen by {how}")
    if _native is not None:
        return Backend("native", None, f"{_native.isa()}, {_native.__file__}")
    if _failure is not None:
        return Backend("raw", f"native kernels unavailable: {first_line(_failure)}")
    return cached_state()


def cached_state() -> Backend:
    """What the native backend's cache holds, read from files alone (no torch import, no load):
    a whole, trusted build (what loads), buildable on first use, or unavailable with the
    reason (an untrusted or unusable cache, no compiler). For ``maskln --version``."""
    cache = native.state()
    if cache.library is not None:
        return Backend("native", None, str(cache.library))
    if cache.problem is not None:
        return Backend("raw", f"native kernels unavailable: {first_line(cache.problem)}")
    return Backend("native", cache.todo, str(cache.folder))


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def native_kernels(build: bool = True) -> ModuleType | None:
    """The native module when the native backend is asked for and loads (built first when
    ``build`` and the cache lacks it), else None; the first failure warns once."""
    if _native is not None:
        return _native if _chosen != "raw" else None
    if _native_tried or requested() != "native":
        return None
    return _load(build)


def _load(build: bool) -> ModuleType | None:
    global _native, _native_tried, _failure
    # torch before the lock: importing it defines maskln's ops, whose module asks for the
    # native kernels in turn (build=False), and would wait for this lock forever.
    import torch

    with _lock:
        if _native is not None or _native_tried:
            return _native
        try:
            module = native.load(build=build)
        except native.NativeUnavailable as error:
            if not build and isinstance(error, native.NotBuiltYet):
                return None  # not tried: a later call may build
            _native_tried = True  # never again in this process: one warning, at the first call
            _failure = str(error)
            warnings.warn(
                f"maskln: the native CPU kernels are unavailable ({first_line(str(error))});"
                " the op runs on its raw-op kernels, about twice as slow. Set"
                f" {BACKEND_ENV}=raw to choose them and silence this warning; python -m"
                " maskln_cli.op.native shows the whole reason.",
                NativeFallbackWarning,
                stacklevel=4,
            )
            return None
        from maskln_cli.op.checks import raise_contract_error

        module.set_contract_error(raise_contract_error)
        for name, (forward, backward) in _python_autograd.items():
            module.set_python_autograd(name, forward, backward)
        module.register_maskln_kernels(True)
        global _PLAIN, _is_compiling
        _PLAIN, _is_compiling = (torch.Tensor, torch.nn.Parameter), torch.compiler.is_compiling
        _native = module
        _native_tried = True
        return module


# --- the two computations -------------------------------------------------------------------


def forward(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    keep_statistics: bool = True,
    norm: Norm = LAYER,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y, mean, rstd)`` of checked plain tensors: y in x's dtype and layout, mean and rstd
    ``[..., 1]`` in the compute dtype (None without ``keep_statistics``; RMSNorm's mean None,
    as its bias)."""
    kernels = _native if _native is not None and _chosen != "raw" else native_kernels()
    if kernels is not None and x.is_cpu:
        if norm.centered:
            return kernels.forward(x, valid, scale, bias, eps, keep_statistics)
        y, rstd = kernels.rms_forward(x, valid, scale, eps, offset, keep_statistics)
        return y, None, rstd
    # The raw-op kernels: half dtypes computed in float32, autocast off.
    from maskln_cli.op import blocked
    from maskln_cli.op.checks import compute_dtype

    compute = compute_dtype(x.dtype)
    with _autocast_off(x.device.type):
        y, mean, rstd = blocked.forward(
            x.to(compute), valid, scale.to(compute), None if bias is None else bias.to(compute),
            eps, keep_statistics, norm, offset,
        )  # fmt: skip
    return (y if y.dtype == x.dtype else y.to(x.dtype)), mean, rstd


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    eps: float,
    needs: tuple[bool, bool, bool],
    norm: Norm = LAYER,
    offset: float = 0.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dscale, dbias)``, each None unless ``needs`` asks for it: dx in x's dtype and
    layout, dscale and dbias in scale's dtype; +0.0 from invalid rows. RMSNorm takes no mean
    and gives no dbias."""
    kernels = _native if _native is not None and _chosen != "raw" else native_kernels()
    if kernels is not None and x.is_cpu:
        if norm.centered:
            computed = kernels.backward(dy, x, valid, scale, mean, rstd, eps, list(needs))
            return spread(computed, needs)
        asked = [needs[0], needs[1]]
        computed = kernels.rms_backward(dy, x, valid, scale, rstd, eps, offset, asked)
        return spread(computed, (needs[0], needs[1], False))
    # The raw-op kernels, as forward's.
    import torch

    from maskln_cli.op import blocked
    from maskln_cli.op.checks import compute_dtype

    compute = compute_dtype(x.dtype)

    with _autocast_off(x.device.type):
        dx, dscale, dbias = blocked.backward_in_place(
            dy.to(compute), x.to(compute), valid, scale.to(compute),
            None if mean is None else mean.to(compute), rstd.to(compute), eps, *needs, norm,
            offset,
        )  # fmt: skip
    if dx is not None and not x.is_contiguous():
        dx = torch.empty_like(x).copy_(dx)  # in x's layout (and dtype), as the native kernel
    elif dx is not None and dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    dscale, dbias = (None if g is None else g.to(scale.dtype) for g in (dscale, dbias))
    return dx, dscale, dbias


def within_contract(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    eps: object,
    offset: object,
    norm: Norm = LAYER,
) -> bool:
    """True when the native library, loaded, vouches that these arguments meet the op's
    contract (``norm``'s; RMSNorm's bias is None), which it checks in a fraction of the time
    :mod:`maskln_cli.op.checks` takes; False when it says otherwise or cannot tell (not loaded,
    a graph being compiled, tensor subclasses, eps or offset not a float): then the checks
    there decide, and give the message."""
    if _native is None or _is_compiling():  # no library call in a graph being traced
        return False
    if type(eps) is not float or type(offset) is not float:
        return False
    plain = _PLAIN
    if type(x) not in plain or type(valid) not in plain or type(scale) not in plain:
        return False
    if norm.centered and type(bias) not in plain:  # RMSNorm's bias is None
        return False
    return _native.within_contract(x, valid, scale, bias if norm.centered else None, eps, offset)


def spread(
    computed: list[torch.Tensor], needs: tuple[bool, bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dscale, dbias)`` from the list a backward kernel or op returns (the requested
    ones, in that order), None where ``needs`` did not request one."""
    # indices, not a generator: every eager backward runs this
    dx = computed[0] if needs[0] else None
    dscale = computed[needs[0]] if needs[1] else None
    dbias = computed[needs[0] + needs[1]] if needs[2] else None
    return dx, dscale, dbias


class _autocast_off:
    """``torch.autocast(device, enabled=False)`` when autocast is on there, else nothing (an
    autocast context costs microseconds): the raw-op kernels' arithmetic must not be recast."""

    def __init__(self, device_type: str) -> None:
        import torch

        self._context = None
        if device_type in ("cpu", "cuda", "xpu") and torch.is_autocast_enabled(device_type):
            self._context = torch.autocast(device_type, enabled=False)

    def __enter__(self) -> None:
        if self._context is not None:
            self._context.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
