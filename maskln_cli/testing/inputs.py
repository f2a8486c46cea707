"""Tensors in memory as ``maskln verify`` reads files: a problem (the inputs) and a result.

:func:`problem_and_result` checks the arguments of :func:`maskln_cli.testing.assert_close`
(a TypeError or ValueError naming the argument) and makes of them what
:func:`maskln_cli.verify.job.verify_problem` judges: a :class:`~maskln_cli.files.problem.Problem`
as :func:`~maskln_cli.files.problem.load_problem` makes of INPUT for verify (x and grad_out in
their own dtype, scale and bias in float64), and a :class:`TensorResult` that reads as an open
RESULT file does. Everything is copied to the CPU, contiguous, once: the truth is computed in
float64 on the CPU whatever device the kernel ran on.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from maskln_cli.files.problem import CHUNK_BYTES, GRADIENT_KEYS, Problem
from maskln_cli.files.tensorfile import TensorInfo, dtype_name

if TYPE_CHECKING:
    import torch

INPUTS_NAME = "the inputs given"
"""How the report names the inputs (verify: INPUT's path)."""
RESULT_NAME = "the kernel's tensors"
"""How the report names the tensors judged (verify: RESULT's path)."""
EPS_SOURCE = "the eps argument"
"""Where eps came from, as the report's header says it (``eps 1e-05, from the eps argument``)."""


class TensorResult:
    """The tensors a kernel computed, by the names verify uses (``out``, ``grad_x``, ...),
    read as :class:`~maskln_cli.files.tensorfile.TensorFile` reads a RESULT file."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], name: str = RESULT_NAME) -> None:
        self.name = name
        self._tensors = dict(tensors)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def info(self, key: str) -> TensorInfo:
        tensor = self._tensors[key]
        return TensorInfo(key, dtype_name(tensor.dtype), tuple(tensor.shape))

    def tensor(self, key: str) -> torch.Tensor:
        return self._tensors[key]


def problem_and_result(
    out: object,
    x: object,
    valid: object,
    scale: object,
    bias: object,
    eps: object,
    gradients: Mapping[str, object],
    grad_out: object,
    norm: object = "layer",
    offset: object = 0.0,
) -> tuple[Problem, TensorResult]:
    """Check the arguments and make the problem and the result verify judges; ``gradients``
    holds ``grad_x``, ``grad_scale`` and ``grad_bias`` (None: not checked); ``norm`` is
    ``"layer"`` or ``"rms"`` (no bias, and ``offset`` + scale its gain)."""
    problem = problem_of(x, valid, scale, bias, eps, grad_out, norm, offset)
    return problem, result_of(out, gradients, problem)


def problem_of(
    x: object,
    valid: object,
    scale: object,
    bias: object,
    eps: object,
    grad_out: object,
    norm: object = "layer",
    offset: object = 0.0,
) -> Problem:
    """Check the inputs (a TypeError or ValueError naming the argument) and make the problem:
    x and grad_out in their own dtype, scale and bias in float64, all on the CPU (eps None:
    the norm's default)."""
    import torch

    from maskln_cli.op.checks import SUPPORTED_DTYPES, as_valid_mask
    from maskln_cli.op.norms import NORMS

    if not isinstance(norm, str) or norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(map(repr, NORMS))}, got {norm!r}")
    chosen = NORMS[norm]
    gain_offset = _offset(offset, chosen.centered)
    if not chosen.centered and bias is not None:
        raise ValueError("bias must be None for norm='rms': RMSNorm has no bias")
    eps = chosen.default_eps if eps is None else eps

    x = plain_tensor(x, "x")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"x must be a float32, float64, float16 or bfloat16 tensor, got {dtype_name(x.dtype)}"
        )
    if x.dim() == 0:
        raise ValueError("x must have a channel axis (shape [..., C]), got a 0-d tensor")
    channels = x.shape[-1]
    if channels == 0:
        raise ValueError(f"x must have at least one channel, got shape {list(x.shape)}")
    leading = tuple(x.shape[:-1])
    if valid is None:
        mask = torch.ones(leading, dtype=torch.bool)
    else:
        mask = as_valid_mask(plain_tensor(valid, "valid"), "valid")
        if tuple(mask.shape) != leading:
            raise ValueError(
                f"valid must have x's leading shape {list(leading)}, got {list(mask.shape)}"
            )
    params = {name: _parameter(value, name, channels) for name, value in (
        ("scale", scale), ("bias", bias),
    )}  # fmt: skip
    stored = [p.dtype for p in params.values() if p is not None]
    param_dtype = min(stored, key=lambda d: torch.finfo(d).eps) if stored else None
    eps = _eps(eps, x.dtype)

    upstream = None
    if grad_out is not None:
        upstream = plain_tensor(grad_out, "grad_out")
        if not upstream.is_floating_point():
            raise TypeError(f"grad_out must be a floating tensor, got {dtype_name(upstream.dtype)}")
        if upstream.shape != x.shape:
            raise ValueError(
                f"grad_out must have x's shape {list(x.shape)}, got {list(upstream.shape)}"
            )

    ones, zeros = torch.ones(channels), torch.zeros(channels)
    scale64 = (ones if params["scale"] is None else _cpu(params["scale"])).double()
    bias64 = (zeros if params["bias"] is None else _cpu(params["bias"])).double()
    if not chosen.centered:
        bias64 = None
    return Problem(
        source=INPUTS_NAME,
        shape=tuple(x.shape),
        x=_cpu(x).reshape(-1, channels),
        valid=_cpu(mask).reshape(-1),
        scale=scale64,
        bias=bias64,
        grad_out=None if upstream is None else _cpu(upstream).reshape(-1, channels),
        eps=eps,
        dtype=torch.float64,
        chunk_rows=max(2, CHUNK_BYTES // (channels * x.element_size())),
        eps_source=EPS_SOURCE,
        param_dtype=param_dtype,
        norm=chosen,
        offset=gain_offset,
        norm_source="the norm argument",
    )


def _offset(offset: object, centered: bool) -> float:
    """RMSNorm's gain offset, a finite number (0 for LayerNorm, which has none)."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real):
        raise TypeError(f"offset must be a finite number, got {type(offset).__name__}")
    value = float(offset)
    if not math.isfinite(value):
        raise ValueError(f"offset must be a finite number, got {offset!r}")
    if centered and value != 0:
        raise ValueError(f"offset {value!r}: only norm='rms' has a gain offset")
    return value


def result_of(out: object, gradients: Mapping[str, object], problem: Problem) -> TensorResult:
    """The kernel's tensors as verify reads a RESULT file (each a plain tensor, copied to the
    CPU); a gradient needs the problem's grad_out."""
    given = {name: value for name, value in gradients.items() if value is not None}
    if "grad_bias" in given and problem.bias is None:
        raise ValueError("grad_bias must be None for norm='rms': RMSNorm has no bias")
    if given and problem.grad_out is None:
        raise ValueError(
            f"{', '.join(given)} given without grad_out: the gradients are those of"
            " sum(out * grad_out); give grad_out"
        )
    results = {} if out is None else {"out": out}
    results.update(given)
    if not results:
        raise ValueError("nothing to judge: give out, or grad_out and a gradient")
    return TensorResult({name: _cpu(plain_tensor(value, name)) for name, value in results.items()})


def checked_names(out: object, gradients: Mapping[str, object]) -> tuple[str, ...]:
    """The tensors judged, in verify's order: out, then each gradient given."""
    names = ("out",) if out is not None else ()
    return names + tuple(name for name in GRADIENT_KEYS if gradients.get(name) is not None)


def plain_tensor(value: object, name: str) -> torch.Tensor:
    """``value``, checked to be a plain dense tensor holding values: a ``torch.Tensor`` or an
    ``nn.Parameter``, strided, not nested, not on the meta device (a TypeError or ValueError
    naming ``name`` otherwise).

    Any other Tensor subclass is refused: its ``__torch_function__``, ``__torch_dispatch__``
    or methods decide what each operation the judge runs on it returns, so what the judge would
    read need not be what it holds (a wrong result could show the truth)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    kind = type(value)
    if kind not in (torch.Tensor, torch.nn.Parameter):
        if _is_nested(value):  # torch.nested's jagged layout is a subclass
            raise TypeError(f"{name} must be a dense tensor, got a nested tensor")
        raise TypeError(
            f"{name} must be a plain torch.Tensor (or nn.Parameter), got {kind.__name__}: a"
            " Tensor subclass decides what reading it returns, so it is not judged; pass its"
            f" values as a plain tensor ({name}.as_subclass(torch.Tensor), or the subclass's"
            " own conversion)"
        )
    if value.is_nested:
        raise TypeError(f"{name} must be a dense tensor, got a nested tensor")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it holds no values to judge")
    return value


def _is_nested(value: torch.Tensor) -> bool:
    try:
        return value.is_nested is True
    except Exception:  # a subclass's own property: whatever it raises, it is no nested tensor
        return False


def _parameter(value: object, name: str, channels: int) -> torch.Tensor | None:
    if value is None:  # verify's default for a file without it: ones, zeros
        return None
    tensor = plain_tensor(value, name)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {dtype_name(tensor.dtype)}")
    if tuple(tensor.shape) != (channels,):
        raise ValueError(
            f"{name} must have shape [{channels}] (x's channels), got {list(tensor.shape)}"
        )
    return tensor


def _eps(eps: object, dtype: torch.dtype) -> float:
    from maskln_cli.op.checks import compute_dtype, eps_rounds_to_zero

    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a finite positive number, got {type(eps).__name__}")
    try:
        value = float(eps)
    except OverflowError:  # an int beyond float's range
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"eps must be a finite positive number, got {eps!r}")
    compute = compute_dtype(dtype)
    if eps_rounds_to_zero(value, compute):
        raise ValueError(f"eps {value!r} rounds to 0 in {dtype_name(compute)}, x's compute dtype")
    return value


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor``, out of autograd (no copy when it is one already):
    verify reads a result's rows by slices, as it reads a file's."""
    return tensor.detach().to("cpu").contiguous()
