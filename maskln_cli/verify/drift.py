"""A running mean's drift: the rounding of Welford's update on rows whose values repeat, which
adds up alike where the budget's model of a sum has it add up at random
(docs/verify-budget.md, "A running mean on rows whose values repeat")."""

from __future__ import annotations

import math
from typing import Protocol

import torch

__all__ = ["DRIFT_SEEN", "RUNNING_MEAN", "running_mean_drift"]


class Roundings(Protocol):
    """What the drift needs of the budget's ``Precision`` (which imports this module): the
    unit roundoffs of results stored, of row reductions, of x's own rounding, and of the dtype x
    is held in."""

    store: float
    reduce: float
    x: float
    held: float


RUNNING_MEAN = 0.22
"""A running mean's (Welford's) drift on rows whose values repeat, in units of ``C * u * A``
(the bound of a sum's rounding errors all alike): the worst measured (float16 rows of
``1e4 + N(0, 3)``, C = 1,024), so that it needs 1.0 of the model, as a plain sequential sum
does of the rest (:func:`running_mean_drift`). Not more: a kernel keeping its row statistics
in bfloat16 errs by a row mean's distance to the value next to it, which is what a running
mean drifts by at most, and on such rows it then passes."""
DRIFT_SEEN = 0.01
"""A drift below this share of the mean's modelled rounding is left out (float32 rows but for
offsets of 1e4 and more): whether a row is of one value (no drift) is asked of the others only."""


def running_mean_drift(
    offset: torch.Tensor,
    magnitude: torch.Tensor,
    precision: Roundings,
    channels: int,
    values: torch.Tensor,
    seen: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Each row's shift of xhat, per unit of |scale|, by a running mean's rounding on rows whose
    values repeat: ``RUNNING_MEAN * min(1, lattice / 2) * C * u_reduce * A``, from each row's A
    (``offset``, any shape with a row per element) and mean |x| (``magnitude``, the same
    shape), where ``lattice`` is the spacing of the dtype x is held in at that magnitude (its
    binade's) over the row's spread. Rows of one value are exact (every update is 0):
    ``values`` ``[R, C]`` (x or xhat) tells them, asked only of the rows whose drift is not
    left out (:data:`DRIFT_SEEN`) and that are ``seen`` (``offset``'s shape; None: all).
    None: no row drifts (most inputs: a reduction and a comparison).

    Welford's update ``m += (x - m) / n`` rounds at ``u |m|``. On rows of distinct values the
    roundings are independent (``sqrt(C) u A``, the model's); on rows that hold a few values
    (bfloat16 at an offset of 1e3: spacing 4 for a spread of 1) the ``x`` that sit on the value
    next to ``m`` update it by less than half its spacing, and the update is lost, each time to
    the same side: those errors add up as errors all alike do (``C u A`` bounds them), and their
    share of the row grows with the lattice. Measured (float32 Welford on bfloat16 and float16
    rows at offsets 100 to 1e4, lattices 0.03 to 5, C 1,024 to 16,384; docs/verify-budget.md):
    the mean errs by up to 20 times ``sqrt(C) u A`` where the lattice is 1 or more, 2.3 times
    where it is a quarter, and alike on rows about one offset (a pooled shift)."""
    held = max(precision.held, precision.store)
    modelled = math.sqrt(channels) * precision.reduce + precision.x
    # A row drifts (beyond DRIFT_SEEN) once min(1, lattice / 2) passes this; lattice / 2 is at
    # most u A (below): float32 rows but at offsets of 1e4 and more are done with at once.
    least = modelled * DRIFT_SEEN / (RUNNING_MEAN * channels * precision.reduce)
    if not held * float(offset.max()) > least:
        return None
    # lattice / 2 = 2 u 2**floor(log2 |x|) rstd / 2 = u A / (2 mantissa), mantissa in [0.5, 1)
    mantissa = torch.frexp(magnitude).mantissa.clamp_(min=0.5)  # 0 for rows of zeros
    lattice = offset.mul(held / 2).div_(mantissa).clamp_(max=1.0)
    drift = lattice.mul_(RUNNING_MEAN * channels * precision.reduce).mul_(offset)
    asked = drift > offset * (modelled * DRIFT_SEEN)
    if seen is not None:
        asked.logical_and_(seen)
    some = asked.reshape(-1).nonzero().squeeze(1)
    if some.numel():
        asked_rows = values.index_select(0, some)
        one_value = asked_rows.amax(dim=1) == asked_rows.amin(dim=1)
        asked.view(-1).index_put_((some,), one_value.logical_not_())
    return drift.mul_(asked)
