"""What kind of wrong, beyond the catalogue of wrong formulas: findings about RESULT itself.

- :func:`exact_in_coarser_dtype`: every value of a RESULT tensor is exactly a float32 (or a
  bfloat16, a float16) although it is stored in a finer dtype: a coarser kernel's output,
  widened, judged by the finer dtype's budget.
- :func:`other_module`: out matches the reference computed with another layer norm's weights
  from the same ``--params`` checkpoint: a wrong ``--module``.
- :func:`plain_padding`: out's invalid rows are not zero but a plain LayerNorm of the padding:
  a model's own output (``--plain-layer-norm``).

Each reads a bounded amount (a chunk of rows at a time, or the sample a diagnosis re-reads).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError

if TYPE_CHECKING:
    import torch

    from maskln_cli.files.problem import Problem
    from maskln_cli.files.tensorfile import TensorFile

COARSER = {
    "float64": (("float32",), ("float16", "bfloat16")),
    "float32": (("bfloat16", "float16"),),
}
"""Dtypes whose values a tensor stored in the key's dtype may all be, finer first (of two
alike, the one with fewer significant bits first: a bfloat16 value is a float16 too, within
float16's range)."""
CHUNK_ELEMENTS = 1 << 22
FIRST_ELEMENTS = 1 << 14
MATCH = 1e-4
"""A result matches another module's reference within this relative L2 distance (or three
times a correct kernel's, when that is greater), and ten times closer to it than to the truth's."""


DISTINCT = 16
"""Distinct values a tensor must hold to be called a coarser dtype's: a constant (ones, a
bias) or a few round numbers are exactly a float16 by nature, not as a kernel's output."""


def exact_in_coarser_dtype(values: torch.Tensor, stored: str) -> str | None:
    """The coarsest dtype every one of ``values`` (stored as ``stored``) is exactly a value
    of (None: none; nor when they hold fewer than :data:`DISTINCT` distinct finite values).

    Example:
        >>> import torch
        >>> values = torch.linspace(-2, 2, 100)
        >>> exact_in_coarser_dtype(values.double(), "float64")
        'float32'
        >>> exact_in_coarser_dtype(torch.linspace(-2, 2, 100, dtype=torch.float64), "float64")
        >>> exact_in_coarser_dtype(torch.ones(100), "float32")  # a constant says nothing
    """
    import torch

    flat = values.reshape(-1)
    if not flat.numel():
        return None
    found = None
    # float16 and bfloat16 hold different values: each is tried when the finer one held.
    for names in COARSER.get(stored, ()):
        exact = [name for name in names if _exactly(flat, getattr(torch, name))]
        if not exact:
            break
        # Of two that both hold, the one whose grid is the coarser on these values: values
        # of 8 significant bits are bfloat16's, float16's subnormals (a float16 kernel's
        # gradients of 1e-6) float16's, though each is a number of the other dtype too.
        found = max(exact, key=lambda name: _coarseness(flat, getattr(torch, name)))
    return found


def _coarseness(flat: torch.Tensor, dtype: torch.dtype) -> float:
    """How coarse ``dtype``'s grid is on the finite nonzero values of ``flat`` (a sample of
    them): the mean log2 of its spacing relative to each value."""

    values = flat[:FIRST_ELEMENTS].double()
    values = values[values.isfinite() & (values != 0)].abs()
    if not values.numel():
        return -math.inf
    from maskln_cli.verify.granularity import grid_spacing

    return float((grid_spacing(values, dtype) / values).log2().mean())


def _exactly(flat: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every finite value of ``flat`` is exactly a ``dtype``, with at least
    :data:`DISTINCT` distinct ones."""
    import torch

    distinct = torch.empty(0, dtype=flat.dtype)
    # A small first chunk: a result that is not (most are not) is told at once.
    starts = [0, *range(FIRST_ELEMENTS, flat.numel(), CHUNK_ELEMENTS)]
    for start, stop in zip(starts, [*starts[1:], flat.numel()], strict=True):
        part = flat[start:stop]
        finite = part[part.isfinite()]
        if not torch.equal(finite.to(dtype).to(finite.dtype), finite):
            return False
        if len(distinct) < DISTINCT:
            distinct = torch.cat([distinct, finite[:4096]]).unique()
    return len(distinct) >= DISTINCT


def other_module(
    problem: Problem,
    params: str,
    module: str,
    actual: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    noise: float,
) -> str | None:
    """The layer norm of checkpoint ``params`` (other than ``module``, with as many channels)
    whose weights give a reference that ``actual`` (rows of RESULT's out for rows ``x``)
    matches; None when none does."""
    import torch

    from maskln_cli.files.checkpoint import module_keys, norm_modules, open_checkpoint
    from maskln_cli.op.mistakes import correct, relative_distance

    x64 = x.double()
    result = actual.double()
    with open_checkpoint(params) as tensors:
        truth = correct(x64, valid, problem.scale, problem.bias, problem.eps)
        to_truth = relative_distance(result, truth)
        limit = max(MATCH, 3 * noise)
        for name in norm_modules(tensors.keys()):
            if name == module:
                continue
            try:
                scale_key, bias_key = module_keys(tensors, name)
                scale = tensors.tensor(scale_key)
                bias = tensors.tensor(bias_key) if bias_key else torch.zeros_like(scale)
            except MasklnError:
                continue
            if scale.shape != (problem.channels,) or bias.shape != scale.shape:
                continue
            reference = correct(x64, valid, scale.double(), bias.double(), problem.eps)
            distance = relative_distance(result, reference)
            if distance <= limit and distance * 10 <= to_truth:
                return name
    return None


def plain_padding(problem: Problem, result: TensorFile, key: str, rows: list[int]) -> bool:
    """Whether RESULT's ``key`` holds, at the invalid ``rows`` (some of those not zeroed), a
    plain LayerNorm of x there (within float32's rounding of a normalized value)."""
    import torch
    import torch.nn.functional as F

    if not rows:
        return False
    index = torch.tensor(rows[:4096], dtype=torch.long)
    x = problem.x[index].double()
    if not bool(x.isfinite().all()):
        return False
    actual = result.tensor(key).reshape(-1, problem.channels)[index].double()
    plain = F.layer_norm(x, (problem.channels,), problem.scale, problem.bias, problem.eps)
    from maskln_cli.op.mistakes import relative_distance

    return relative_distance(actual, plain) <= 1e-2
