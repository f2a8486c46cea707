"""Hypothesis strategies for the inputs that break layer-norm kernels.

:func:`layer_norm_inputs` draws ``(x, valid, scale, bias, eps)`` (and ``grad_out`` when asked)
from the families where kernels go wrong: constant rows, exact zeros, huge common offsets
(where a one-pass variance cancels), heavy tails, variances far below eps, NaN and inf in the
padding, every row invalid, one channel, widths around SIMD and warp sizes (primes and powers
of two, and one either side), layouts that are not contiguous, and half-precision x with scale
and bias in float32 (as mixed-precision models keep their weights) or in x's dtype. Hypothesis
decides the structure (each row's family and validity, the widths, the layout, the parameters
and their dtype) and shrinks it: a failing case shrinks to a few rows of few channels in the
simplest family that still fails. The values within a row come from a seeded torch generator.

:func:`rms_norm_inputs` draws RMSNorm's ``(x, valid, scale, eps)`` (no bias) the same way, from
RMSNorm's own hard families too: magnitudes whose squares overflow or underflow the dtype (no
mean is subtracted, so a common offset is no harder than any row).

Hypothesis is an optional dependency of maskln: ``pip install 'maskln[testing]'``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

try:
    from hypothesis import strategies as st
except ImportError as error:  # an optional extra: say how to get it
    raise ImportError(
        "maskln_cli.testing.strategies needs Hypothesis, an optional dependency of maskln:"
        " pip install 'maskln[testing]' (or pip install hypothesis)"
    ) from error

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = [
    "CHANNELS",
    "LayerNormInputs",
    "LayerNormInputsWithGrad",
    "RMSNormInputs",
    "RMSNormInputsWithGrad",
    "layer_norm_inputs",
    "rms_norm_inputs",
]

CHANNELS = (
    1, 2, 3, 4, 5, 7, 8, 9, 11, 13, 15, 16, 17, 31, 32, 33, 37, 61, 63, 64, 65, 127, 128, 129,
    131, 251, 255, 256, 257, 509, 511, 512, 513, 1021, 1023, 1024, 1025,
)  # fmt: skip
"""Row widths drawn, smallest first (the one a failure shrinks to): powers of two (the vector
widths of SSE, AVX2 and AVX-512 in float32, a GPU warp, common block sizes), one either side
of each, and primes that divide into no vector width."""

ROW_FAMILIES = (
    "normal", "constant", "zeros", "sparse zeros", "offset", "heavy tail", "tiny variance",
)  # fmt: skip
"""What a valid row holds (:func:`_row`), simplest first."""
RMS_ROW_FAMILIES = (
    "normal", "constant", "zeros", "sparse zeros", "heavy tail", "huge", "tiny",
)  # fmt: skip
"""What a valid row of an RMSNorm draw holds, simplest first: LayerNorm's families but its
offsets (no mean is subtracted), and magnitudes whose squares overflow (``huge``) or underflow
(``tiny``) the dtype, where a kernel squaring x in it goes wrong."""
_SQUARES_OUT_OF_RANGE = {"float16": (3, -6), "float64": (200, -200)}
"""The decades of ``huge`` and ``tiny`` rows per dtype (else 30 and -30: float32's and
bfloat16's squares overflow above about 1.8e19 and underflow below about 1e-23)."""
PADDING = ("values", "NaN", "inf", "-inf", "NaN and inf", "huge")
"""What an invalid row holds: anything, which a kernel must never let through."""
LAYOUTS = ("contiguous", "every other channel", "channels first", "leading axes swapped")
"""How x (and grad_out) is laid out in memory: all but the first are not contiguous."""
EPS = (1e-5, 1e-6, 1e-12, 1e-3, 0.1)
HALF_WEIGHTS = (None, "float32")
"""The dtypes of scale and bias drawn for float16 or bfloat16 x by default, None standing for
x's own: mixed-precision models keep their weights (and a kernel reads them) in float32."""

_OFFSETS = {"float16": 3, "bfloat16": 5}
"""The largest decade of a common offset per dtype (else 5: 1e5 + N(0, 1))."""
_MAGNITUDES = {"float16": 3}
"""The largest decade of a heavy tail's values per dtype (else 6)."""


class LayerNormInputs(NamedTuple):
    """One draw: ``x`` ``[..., C]``, ``valid`` ``[...]`` (bool), ``scale`` and ``bias``
    ``[C]`` (in one dtype: x's, or another of ``param_dtypes``), and ``eps``."""

    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    eps: float


class LayerNormInputsWithGrad(NamedTuple):
    """One draw with an upstream gradient ``grad_out`` of x's shape and dtype (NaN and inf
    in its padding too, when the draw puts them in x's)."""

    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    eps: float
    grad_out: torch.Tensor


class RMSNormInputs(NamedTuple):
    """One RMSNorm draw: ``x`` ``[..., C]``, ``valid`` ``[...]`` (bool), ``scale`` ``[C]``
    and ``eps`` (RMSNorm has no bias)."""

    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    eps: float


class RMSNormInputsWithGrad(NamedTuple):
    """One RMSNorm draw with an upstream gradient ``grad_out`` of x's shape and dtype."""

    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    eps: float
    grad_out: torch.Tensor


def rms_norm_inputs(
    dtypes: Sequence[torch.dtype] | None = None,
    **options: object,
) -> st.SearchStrategy[RMSNormInputs] | st.SearchStrategy[RMSNormInputsWithGrad]:
    """A strategy drawing masked RMS normalization's inputs ``(x, valid, scale, eps)`` (and
    ``grad_out``): :func:`layer_norm_inputs` with ``norm="rms"``, whose options it takes.

    Example:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from maskln_cli import masked_rms_normalization
        >>> @settings(max_examples=10)
        ... @given(rms_norm_inputs([torch.float32, torch.bfloat16]))
        ... def test_my_kernel(inputs):
        ...     out = masked_rms_normalization(*inputs)  # your kernel here
        ...     assert bool((out[~inputs.valid] == 0).all())
        >>> test_my_kernel()
    """
    return layer_norm_inputs(dtypes, norm="rms", **options)  # type: ignore[arg-type]


def layer_norm_inputs(
    dtypes: Sequence[torch.dtype] | None = None,
    *,
    max_rows: int = 12,
    channels: Sequence[int] = CHANNELS,
    eps: Sequence[float] = EPS,
    grad_out: bool = False,
    device: str | torch.device = "cpu",
    param_dtypes: Sequence[torch.dtype | None] | None = None,
    norm: str = "layer",
) -> st.SearchStrategy[Any]:
    """A strategy drawing masked layer normalization's inputs from the families that break
    kernels.

    Args:
        dtypes: x's dtypes to draw from (default: float32); grad_out has x's dtype.
        max_rows: at most this many rows (x's leading shape is ``[rows]`` or
            ``[batch, rows // batch]``).
        channels: the row widths to draw from, smallest first (:data:`CHANNELS`).
        eps: the eps values to draw from (:data:`EPS`).
        grad_out: also draw an upstream gradient (a :class:`LayerNormInputsWithGrad`).
        device: where the tensors are put (drawn on the CPU).
        param_dtypes: the dtypes scale and bias are drawn in (both in one), None standing
            for x's dtype. Default: x's dtype, and for float16 or bfloat16 x float32 too
            (:data:`HALF_WEIGHTS`), as mixed-precision models have them; ``[None]``: x's
            dtype only (a kernel that takes one dtype); ``[torch.float32]``: always float32.
        norm: ``"layer"``, or ``"rms"``: RMSNorm's inputs, without bias, its rows drawn from
            :data:`RMS_ROW_FAMILIES` (as :func:`rms_norm_inputs` does).

    Each valid row is one of :data:`ROW_FAMILIES`; each invalid row holds one of
    :data:`PADDING` (NaN, inf, huge values...); x is laid out one of :data:`LAYOUTS`. Every
    draw is finite in its valid rows, and within x's dtype's range.

    Example:
        >>> import torch
        >>> from hypothesis import given, settings
        >>> from maskln_cli.testing import check_kernel
        >>> from maskln_cli import masked_layer_normalization
        >>> @settings(max_examples=20)
        ... @given(layer_norm_inputs([torch.float32, torch.float16], grad_out=True))
        ... def test_my_kernel(inputs):
        ...     check_kernel(masked_layer_normalization, *inputs)  # your kernel here
        >>> test_my_kernel()
    """
    import torch

    dtypes = list(dtypes) if dtypes is not None else [torch.float32]
    if not dtypes or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise ValueError(f"dtypes must be floating torch dtypes, got {dtypes!r}")
    if not (isinstance(max_rows, int) and max_rows >= 1):
        raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")
    widths = sorted(set(channels))
    if not widths or not all(isinstance(c, int) and c >= 1 for c in widths):
        raise ValueError(f"channels must be ints >= 1, got {channels!r}")
    if not eps or not all(e > 0 for e in eps):
        raise ValueError(f"eps must be positive numbers, got {eps!r}")
    weights = None if param_dtypes is None else tuple(param_dtypes)
    if weights is not None and not (
        weights
        and all(d is None or (isinstance(d, torch.dtype) and d.is_floating_point) for d in weights)
    ):
        raise ValueError(f"param_dtypes must be floating torch dtypes or None, got {weights!r}")
    if norm not in ("layer", "rms"):
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    return _inputs(
        tuple(dtypes), max_rows, tuple(widths), tuple(eps), grad_out, device, weights, norm
    )


def _row_spec(families: tuple[str, ...]) -> st.SearchStrategy[tuple[bool, str, str, int, int]]:
    """A row: valid (three times in four), its family, its padding, and two exponents (of
    the spread or offset, and of the mean), each shrinking to the simplest."""
    return st.tuples(
        st.sampled_from((True, True, True, False)),
        st.sampled_from(families),
        st.sampled_from(PADDING),
        st.integers(0, 6),
        st.integers(-3, 3),
    )


@st.composite
def _inputs(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...],
    max_rows: int,
    widths: tuple[int, ...],
    eps_values: tuple[float, ...],
    with_grad: bool,
    device: str | torch.device,
    param_dtypes: tuple[torch.dtype | None, ...] | None,
    norm: str = "layer",
) -> LayerNormInputs | LayerNormInputsWithGrad | RMSNormInputs | RMSNormInputsWithGrad:
    import torch

    dtype = draw(st.sampled_from(dtypes))
    name = str(dtype).removeprefix("torch.")
    weights = param_dtypes or (HALF_WEIGHTS if name in ("float16", "bfloat16") else (None,))
    # A name or None (x's dtype) drawn, the simplest (x's) first: it shrinks to one dtype.
    weight = draw(st.sampled_from(weights))
    param_dtype = dtype if weight is None else getattr(torch, str(weight).removeprefix("torch."))
    channels = draw(st.sampled_from(widths))
    families = ROW_FAMILIES if norm == "layer" else RMS_ROW_FAMILIES
    rows = draw(st.lists(_row_spec(families), min_size=1, max_size=max_rows))
    count = len(rows)
    batch = draw(st.sampled_from([b for b in range(1, count + 1) if count % b == 0]))
    layout = draw(st.sampled_from(LAYOUTS if batch > 1 else LAYOUTS[:3]))
    eps = draw(st.sampled_from(eps_values))
    scale_kind = draw(st.sampled_from(("ones", "normal", "some zeros", "large")))
    bias_kind = draw(st.sampled_from(("zeros", "normal", "large")))
    seed = draw(st.integers(0, 2**32 - 1))

    generator = torch.Generator().manual_seed(seed)
    x64 = torch.stack([_row(spec, channels, name, generator) for spec in rows])
    valid = torch.tensor([spec[0] for spec in rows])
    # Valid rows well within the dtype's range (float16's 65,504 is near a wide spread's).
    limit = torch.finfo(dtype).max / 16
    x64 = torch.where(valid[:, None], x64.clamp(-limit, limit), x64)
    leading = (count,) if batch == 1 else (batch, count // batch)
    x = _laid_out(x64.to(dtype).reshape(*leading, channels), layout)
    scale = _parameter(scale_kind, channels, generator).to(param_dtype)
    bias = _parameter(bias_kind, channels, generator).to(param_dtype)
    valid = valid.reshape(leading)
    put = {"device": device}
    if norm == "rms" and not with_grad:
        return RMSNormInputs(x.to(**put), valid.to(**put), scale.to(**put), eps)
    if not with_grad:
        return LayerNormInputs(x.to(**put), valid.to(**put), scale.to(**put), bias.to(**put), eps)
    upstream = torch.randn(count, channels, generator=generator, dtype=torch.float64)
    for index, spec in enumerate(rows):
        if not spec[0]:
            upstream[index] = _padding(spec[2], channels, name, generator)
    grad = _laid_out(upstream.to(dtype).reshape(*leading, channels), layout)
    if norm == "rms":
        return RMSNormInputsWithGrad(
            x.to(**put), valid.to(**put), scale.to(**put), eps, grad.to(**put)
        )
    return LayerNormInputsWithGrad(
        x.to(**put), valid.to(**put), scale.to(**put), bias.to(**put), eps, grad.to(**put)
    )


def _row(
    spec: tuple[bool, str, str, int, int], channels: int, dtype: str, generator: torch.Generator
) -> torch.Tensor:
    """One row of x in float64: a valid row of its family, or padding."""
    import torch

    valid, family, padding, power, shift = spec
    if not valid:
        return _padding(padding, channels, dtype, generator)
    noise = torch.randn(channels, generator=generator, dtype=torch.float64)
    mean = 10.0**shift * float(torch.randn((), generator=generator, dtype=torch.float64))
    if family == "normal":  # spread 1e-2 to 1e4, about a mean
        return mean + noise * 10.0 ** (power - 2)
    if family == "constant":
        return torch.full((channels,), mean, dtype=torch.float64)
    if family == "zeros":
        return torch.zeros(channels, dtype=torch.float64)
    if family == "sparse zeros":  # exact zeros among values
        keep = torch.rand(channels, generator=generator) < 0.3
        return torch.where(keep, noise * 10.0**shift, 0.0)
    if family == "offset":  # a common offset of 1e2 to 1e5 (by dtype) over a spread of 1
        decade = 2 + power % (_OFFSETS.get(dtype, 5) - 1)
        return noise + (1 if shift >= 0 else -1) * 10.0**decade
    if family in ("huge", "tiny"):  # squares beyond the dtype's range, spread over 2 decades
        decade = _SQUARES_OUT_OF_RANGE.get(dtype, (30, -30))[family == "tiny"]
        return noise * 10.0 ** (decade + (power % 3) * (-1 if family == "huge" else 1))
    if family == "heavy tail":  # magnitudes log-uniform over many decades, either sign
        top = _MAGNITUDES.get(dtype, 6)
        exponents = torch.rand(channels, generator=generator, dtype=torch.float64) * (top + 3) - 3
        return noise.sign() * 10.0**exponents
    # tiny variance: a spread of 1e-3 to 1e-6, variance far below any usual eps
    return mean + noise * 10.0 ** -(3 + power % 4)


def _padding(kind: str, channels: int, dtype: str, generator: torch.Generator) -> torch.Tensor:
    """An invalid row: what a kernel must never let reach an output or a gradient."""
    import torch

    if kind == "values":
        return torch.randn(channels, generator=generator, dtype=torch.float64) * 100
    if kind == "NaN":
        return torch.full((channels,), float("nan"), dtype=torch.float64)
    if kind in ("inf", "-inf"):
        return torch.full((channels,), float(kind), dtype=torch.float64)
    if kind == "huge":  # finite, and the largest the dtype holds
        return torch.full((channels,), torch.finfo(getattr(torch, dtype)).max, dtype=torch.float64)
    pick = torch.randint(0, 3, (channels,), generator=generator)
    return torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.float64)[pick]


def _parameter(kind: str, channels: int, generator: torch.Generator) -> torch.Tensor:
    import torch

    if kind == "ones":
        return torch.ones(channels, dtype=torch.float64)
    if kind == "zeros":
        return torch.zeros(channels, dtype=torch.float64)
    values = torch.randn(channels, generator=generator, dtype=torch.float64)
    if kind == "some zeros":
        return torch.where(torch.rand(channels, generator=generator) < 0.5, values, 0.0)
    return values * 10 if kind == "large" else values


def _laid_out(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values, laid out in memory as ``layout`` says."""
    import torch

    if layout == "every other channel":
        wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
        wide[..., ::2] = tensor
        return wide[..., ::2]
    if layout == "channels first":  # the channel axis outermost in memory
        return tensor.movedim(-1, 0).contiguous().movedim(0, -1)
    if layout == "leading axes swapped":
        return tensor.transpose(0, 1).contiguous().transpose(0, 1)
    return tensor.contiguous()
