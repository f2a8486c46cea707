"""The error budget of ``maskln verify``: how far from the float64 truth a correct kernel may be.

A correct kernel in float32 or bfloat16 cannot match float64; it can be about as accurate as a
straightforward correct implementation in its own dtype. The budget of each element is

    allowed = max(factor * max(model, yardstick error), ULPS ulps, atol + rtol * |truth|)

- ``model`` is a first-order model of the rounding such an implementation makes, from the
  dtype's unit roundoff u, the row's ``A = mean|x| / std`` (the condition of subtracting the
  mean: rows with a large common offset lose digits there), C, and the magnitudes of scale,
  bias and the upstream gradient. Reductions are modelled by the probabilistic bound of
  recursive summation, ``sqrt(n) * u`` per unit summed (Higham & Mary, 2019), which covers a
  plain sequential sum as well as torch's pairwise ones; on rows whose values repeat (a half
  dtype at an offset) a running mean's roundings add up alike, and its drift is modelled too
  (:func:`~maskln_cli.verify.drift.running_mean_drift`). half dtypes are modelled as torch
  computes them on CPU: row reductions in float32, everything stored (the output, the row
  statistics saved for backward, the sums over rows) in the half dtype.
- The **yardstick** (:mod:`maskln_cli.verify.yardstick`) is PyTorch's own ``F.layer_norm``
  and its autograd gradients, run in the kernel's dtype on the same data (padding zeroed
  first), measured against the same truth.
  It can only raise a budget, where the model is too optimistic; it never lowers one, so a
  yardstick that is exact on some element by luck does not make that element's budget tight.
- Whatever the model says, a few units in the last place are allowed (:data:`ULPS`), and so is
  the fixed tolerance of ``torch.testing.assert_close``: :func:`floor`. Invalid rows must be
  exactly 0.

All of it is computed a chunk of rows at a time; only the gradient sums over rows keep
channel-sized accumulators (:class:`SumBudget`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from maskln_cli.verify.drift import running_mean_drift

__all__ = [
    "DEFAULT_FACTOR",
    "ULPS",
    "Precision",
    "RowBudget",
    "SumBudget",
    "allowance",
    "factor_needed",
    "floor",
    "grad_x_terms",
    "scaled_atol",
    "unit",
    "unit_roundoff",
]

DEFAULT_FACTOR = 3.0
"""How many times the modelled rounding a kernel may err by default (``--factor``). Measured
(docs/verify-budget.md, "Choosing --factor"): correct kernels reach at most about 1.0 of the
model (a plain sequential float32 sum at offset 1e4; torch's own stays below 0.5), the wrong
kernels of the suite at least about 6; 3 leaves a margin of about 2 to 3 each way."""

ULPS = 2
"""Units in the last place of the result's dtype that are always allowed."""

_HALF = (torch.float16, torch.bfloat16)


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number: 2**-24 for float32.

    Example:
        >>> unit_roundoff(torch.float32) == 2**-24, unit_roundoff(torch.bfloat16) == 2**-8
        (True, True)
    """
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Precision:
    """The unit roundoffs of a kernel judged in ``dtype``.

    ``reduce`` is that of row reductions (float32's for the half dtypes, which every sensible
    kernel, torch's included, accumulates in float32), ``store`` that of anything stored in
    ``dtype``. ``x``, ``params`` and ``grad_out`` are the rounding of inputs stored in a finer
    dtype than ``dtype`` (0 when they are stored no finer, and so reach the kernel exactly).
    ``held`` is the unit roundoff of the dtype x is held in, the coarser of x's and ``dtype``
    (0: ``store``): a float32 kernel given bfloat16 x works on bfloat16's values.
    """

    dtype: torch.dtype
    reduce: float
    store: float
    x: float = 0.0
    params: float = 0.0
    grad_out: float = 0.0
    held: float = 0.0

    @classmethod
    def of(
        cls,
        dtype: torch.dtype,
        x_dtype: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
        grad_out_dtype: torch.dtype | None = None,
    ) -> Precision:
        """The precision of a kernel in ``dtype`` fed inputs stored in the given dtypes.

        Example:
            >>> p = Precision.of(torch.bfloat16, x_dtype=torch.float32)
            >>> p.reduce == 2**-24, p.store == 2**-8, p.x == 2**-7
            (True, True, True)
        """
        store = unit_roundoff(dtype)
        reduce = unit_roundoff(torch.float32) if dtype in _HALF else store

        def rounding(source: torch.dtype | None) -> float:
            finer = source is not None and source.is_floating_point
            return store if finer and unit_roundoff(source) < store else 0.0

        held = store
        if x_dtype is not None and x_dtype.is_floating_point:
            held = max(store, unit_roundoff(x_dtype))
        # x rounded to dtype moves x_i and the row mean: twice the rounding of one value.
        return cls(
            dtype, reduce, store, 2 * rounding(x_dtype), rounding(param_dtype),
            rounding(grad_out_dtype), held,
        )  # fmt: skip

    @property
    def subnormal(self) -> float:
        """The spacing of the subnormals of the dtype a correct kernel computes in (float32 for
        the half dtypes): each of its operations on values below that dtype's smallest normal
        rounds by half of it, absolutely (float32's 7e-46), however far that is from its
        relative rounding. Whole, not halved: float64's half spacing is not a float64.

        Example:
            >>> Precision.of(torch.float16).subnormal == Precision.of(torch.float32).subnormal
            True
        """
        info = torch.finfo(torch.float32 if self.dtype in _HALF else self.dtype)
        return info.tiny * info.eps


class RowBudget:
    """The modelled rounding error of a correct kernel on a chunk of rows.

    ``x`` is ``[R, C]`` in float64 (invalid rows may hold anything: they are zeroed, in ``x``
    itself when it is the caller's to give, ``own_x``), ``scale`` and ``bias`` ``[C]`` in
    float64. The models are float64 ``[R, C]``, 0 on invalid rows. ``own_grad_out``: the upstream
    gradients given are the caller's to give too (:meth:`upstream`).

    ``centered=False`` models RMSNorm (``scale`` its whole gain, offset included; ``bias``
    zeros): nothing is subtracted, so there is no mean to round (A is 0: no shift, no second
    order) and its backward has no ``c2``; calibrated in tests/verify/test_rms_budget.py.

    Example:
        >>> x = torch.tensor([[1000.0, 1001.0, 1002.0, 1003.0]], dtype=torch.float64)
        >>> one, zero = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        >>> rows = RowBudget(x, torch.tensor([True]), one, zero, 1e-5, Precision.of(torch.float32))
        >>> round(float(rows.offset[0, 0]), 1)  # mean|x| / std: the row loses about 3 digits
        895.8
    """

    def __init__(
        self,
        x: torch.Tensor,
        valid: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        precision: Precision,
        centered: bool = True,
        keep_deviations: bool = False,
        own_x: bool = False,
        own_grad_out: bool = False,
    ) -> None:
        self.valid = valid.unsqueeze(1)
        self._invalid: torch.Tensor | None = None  # the invalid rows' indices, once found
        self.own_grad_out = own_grad_out  # see upstream()
        self.centered = centered
        self.scale, self.bias = scale, bias
        # The padding zeroed first (torch.where's bits, faster; in x itself if ours), then
        # NaN and inf anywhere else (see _finite_rows).
        given = x
        if not bool(self.valid.all()):
            invalid = self.invalid_rows()
            x = x.index_fill_(0, invalid, 0.0) if own_x else x.index_fill(0, invalid, 0.0)
        x, mean = _finite_rows(x, given, self.valid, centered)
        self.channels = x.shape[-1]
        rows = x - mean if mean is not None else x.clone()
        self.rstd = (rows.square().mean(dim=-1, keepdim=True) + eps).rsqrt()
        # x - mean, kept beside xhat when asked (``keep_deviations``; LayerNorm's only):
        # grad_x's fits normalize it by the truth's rstd.
        keep_deviations = keep_deviations and centered
        self.deviations: torch.Tensor | None = rows if keep_deviations else None
        self.xhat = rows * self.rstd if keep_deviations else rows.mul_(self.rstd)
        # Each row's mean |x| (None for RMSNorm), kept for whoever needs it with another rstd.
        self.mean_abs: torch.Tensor | None = None
        if centered:
            self.mean_abs = x.abs().mean(dim=-1, keepdim=True)
            self.offset = self.mean_abs.mul(self.rstd)  # A
        else:  # RMSNorm: no mean is rounded, nothing shifts xhat
            self.offset = torch.zeros_like(self.rstd)
        # The upstream gradient as these rows take it, and its rows' rms times scale, for the
        # grad_out last given: the models of grad_x and the sums all start from them.
        self._upstream: tuple[torch.Tensor, torch.Tensor] | None = None
        self._wdy_rms: tuple[torch.Tensor, torch.Tensor] | None = None
        # ``scale * upstream`` as wdy_rms made it, for grad_x's model (never written), and
        # |xhat|, which grad_x's model and the sums' both take: each made once.
        self._wdy: tuple[torch.Tensor, torch.Tensor] | None = None
        # Where wdy_rms makes that product, when the caller gives a buffer (x's shape).
        self.wdy_into: torch.Tensor | None = None
        self._xhat_abs: torch.Tensor | None = None
        self._judged_in(precision)

    def _judged_in(self, precision: Precision) -> None:
        """What depends on the judged dtype (the rest is the rows' statistics, in float64)."""
        self.precision = precision
        # Relative perturbation of the normalization per unit of A: the mean's rounding in a
        # sum of C terms, and x's own rounding to the kernel's dtype.
        self.e0 = math.sqrt(self.channels) * precision.reduce + precision.x
        self.shift_offset, self.sum_offset, self.back_offset = _shifts(self, precision)
        perturbation = self.e0 * self.shift_offset
        # out's shift per unit of |scale|: the mean's rounding, and a running mean's drift
        self.out_shift = perturbation
        if self.centered:
            drift = running_mean_drift(
                self.offset, self.mean_abs, precision, self.channels, self.xhat, self.valid
            )
            if drift is not None:
                self.out_shift = perturbation + drift
        # Once the shift is not small (x rounded to bfloat16 at an offset of 1e3 moves
        # each value by a good part of the row's spread), the variance itself moves: second
        # order, and a growth of the first-order terms.
        self.e2 = self.out_shift.square()
        self.growth = (1 + self.out_shift).square()

    def judged_in(self, precision: Precision) -> RowBudget:
        """The same rows judged in another dtype: their statistics are not computed again."""
        if precision == self.precision:
            return self
        other = copy.copy(self)
        other._judged_in(precision)
        return other

    def rows(self, index: torch.Tensor) -> RowBudget:
        """The budget of rows ``index`` alone, the same bits as a RowBudget made from them:
        every statistic is a row's own (its reductions run along the row, whatever the rows
        beside it), so it is taken from these rows' instead of being computed again."""
        some = copy.copy(self)
        for name in ("valid", "rstd", "xhat", "offset"):
            setattr(some, name, getattr(self, name).index_select(0, index))
        some.mean_abs = None if self.mean_abs is None else self.mean_abs.index_select(0, index)
        some._judged_in(self.precision)  # the rows' e2, growth and shifts: the same bits
        some._upstream = some._wdy_rms = some._wdy = some.deviations = some._invalid = None
        some.wdy_into = some._xhat_abs = None
        some.own_grad_out = False  # the rows' gradients are gathered by whoever gives them
        return some

    def invalid_rows(self) -> torch.Tensor:
        """The indices of the invalid rows ``[K]``, found once: setting them by index
        (``index_fill``) gives the bits of a broadcast mask (``torch.where``, ``masked_fill``
        of ``[R, 1]``), which torch does not vectorize, at a third to a quarter of the cost."""
        if self._invalid is None:
            self._invalid = (~self.valid).reshape(-1).nonzero().squeeze(1)
        return self._invalid

    def upstream(self, grad_out: torch.Tensor, tested: bool = False) -> torch.Tensor:
        """``grad_out`` (float64) with 0 on invalid rows and for NaN and inf: made once for
        the same ``grad_out``, and not to be written; in ``grad_out`` itself when it is the
        caller's to give (``own_grad_out``: its invalid rows zeroed, its valid rows as they are;
        ``tested``: NaN and inf left for the caller to find, :meth:`wdy_rms`)."""
        if self._upstream is not None and self._upstream[0] is grad_out:
            return self._upstream[1]
        invalid = self.invalid_rows()
        if self.own_grad_out:  # torch.where(valid, ...)'s bits
            dy = grad_out.index_fill_(0, invalid, 0.0)
        else:
            dy = grad_out.index_fill(0, invalid, 0.0)
        # A finite float64 sum means every value is finite (float32 and half values cannot
        # overflow it): then isfinite, a pass over the rows, is not needed.
        if not tested and not math.isfinite(float(dy.sum())):
            dy = _finite_only(grad_out, self.valid)
        self._upstream = (grad_out, dy)
        return dy

    def wdy_rms(self, grad_out: torch.Tensor, wdy: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's rms of ``scale * grad_out`` ``[R, 1]`` (from ``wdy``, that product, when
        the caller has it), made once for the same ``grad_out``."""
        if self._wdy_rms is not None and self._wdy_rms[0] is grad_out:
            return self._wdy_rms[1]
        if wdy is None:  # in the caller's buffer if it gave one (wdy_into)
            # upstream()'s test of its sum, from the rms (a pass fewer, the same bits): NaN
            # and inf carry into it (times a scale of 0 too), a finite overflow changes nothing.
            tested = self._upstream is None or self._upstream[0] is not grad_out
            wdy, rms = _scaled_rms(self.upstream(grad_out, tested), self.scale, self.wdy_into)
            if tested and not bool(rms.isfinite().all()):
                self._upstream = (grad_out, _finite_only(grad_out, self.valid))
                wdy, rms = _scaled_rms(self._upstream[1], self.scale, self.wdy_into)
            self._wdy = (grad_out, wdy)
        else:
            rms = wdy.square().mean(dim=-1, keepdim=True).sqrt_()
        self._wdy_rms = (grad_out, rms)
        return rms

    def scaled_upstream_made(self, grad_out: torch.Tensor) -> torch.Tensor | None:
        """``scale * upstream(grad_out)`` as :meth:`wdy_rms` made it (None: not made), not to
        be written."""
        return self._wdy[1] if self._wdy is not None and self._wdy[0] is grad_out else None

    def _scaled_upstream(self, grad_out: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``scale * upstream(grad_out)``, and whether it is this budget's own (to be
        written): :meth:`wdy_rms`'s when it made it for the same ``grad_out`` (shared with
        copies of this budget in other dtypes: not to be written)."""
        if self._wdy is not None and self._wdy[0] is grad_out:
            return self._wdy[1], False
        return self.upstream(grad_out) * self.scale, True

    def xhat_abs(self) -> torch.Tensor:
        """``|xhat|``, made once (not to be written)."""
        if self._xhat_abs is None:
            self._xhat_abs = self.xhat.abs()
        return self._xhat_abs

    def out(self, truth: torch.Tensor | None = None) -> torch.Tensor:
        """The model of ``out``'s error: ``A |scale| e0 + |xhat scale| (e0 + e2 + u_reduce +
        u_params) + |bias| (u_reduce + u_params) + |out| u_store``, with ``out`` the rows'
        true output, ``truth`` when the caller has it (else made from xhat). In place, a
        pass over the rows per term: this is most of what a passing check computes."""
        p = self.precision
        abs_scale = self.scale.abs()
        model = self.xhat.abs().mul_(abs_scale).mul_(self.e2 + (self.e0 + p.reduce + p.params))
        model.addcmul_(self.out_shift, abs_scale)
        model.add_(self.bias.abs() * (p.reduce + p.params))
        if truth is None:
            truth = torch.mul(self.xhat, self.scale).add_(self.bias)
        model.add_(truth.abs(), alpha=p.store)
        if not bool(self.valid.all()):
            model.index_fill_(0, self.invalid_rows(), 0.0)  # masked_fill_'s bits
        return model

    def grad_x(self, grad_out: torch.Tensor) -> torch.Tensor:
        """The model of ``grad_x``'s error for the upstream gradient ``grad_out`` (float64):
        the sum of :func:`grad_x_terms`, grown by the rows' second-order rounding. Each term
        is, row by row, a multiple of ``|xhat|``, of 1, of ``|wdy|`` or of ``|dx|``: the sum is
        made as that one combination (a few passes over the rows, not a few per term)."""
        p = self.precision
        e1 = self.e0 + p.store
        wdy, own = self._scaled_upstream(grad_out)
        c1, c2, n1, n2 = self._backward_sums(grad_out, wdy)
        rstd_e1 = self.rstd * e1
        rstd_ed = self.rstd * self._ed()
        moved = rstd_e1 * self.back_offset  # the shift's, per unit of n1 and n2
        # shift: moved (n2 |xhat| + n2 + n1); factor: 2 rstd e1 n1 |xhat|; sums: rstd ed
        # (n1 |xhat| + n2 + |wdy|); stored: rstd (e2 + e1 + u_store) |wdy - xhat c1 - c2|;
        # subnormal: rstd u_sub (6 + 2 |xhat|), u_sub half the spacing (multiplied last: below
        # float64's smallest normal, a float64 budget is itself made of its subnormals).
        on_xhat = (moved * n2).add_(rstd_e1 * n1 * 2).add_(rstd_ed * n1)
        on_xhat.add_(self.rstd * p.subnormal).mul_(self.growth)
        constant = (moved * (n2 + n1)).add_(rstd_ed * n2)
        constant.add_((self.rstd * 3).mul_(p.subnormal)).mul_(self.growth)
        on_dx = (self.rstd * (self.e2 + (e1 + p.store))).mul_(self.growth)
        dx = torch.addcmul(wdy, self.xhat, c1, value=-1).sub_(c2).abs_()
        model = torch.addcmul(constant, self.xhat_abs(), on_xhat)
        wdy_abs = wdy.abs_() if own else wdy.abs()  # wdy is done with: in place if ours
        model.addcmul_(wdy_abs, rstd_ed * self.growth)
        model.addcmul_(dx, on_dx)
        if not bool(self.valid.all()):
            model.index_fill_(0, self.invalid_rows(), 0.0)  # masked_fill_'s bits
        return model

    def _ed(self) -> float:
        """The relative rounding of the backward's own sums and of wdy (see
        :func:`grad_x_terms`)."""
        p = self.precision
        return math.sqrt(self.channels) * p.reduce + p.grad_out + p.params + p.store

    def _backward_sums(
        self, grad_out: torch.Tensor, wdy: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """c1 = mean(xhat * wdy), c2 = mean(wdy), and what each errs by per unit of a sum's
        relative rounding (n1, n2; see :func:`grad_x_terms`), each ``[R, 1]``."""
        root = math.sqrt(self.channels)
        products = self.xhat * wdy
        c1 = products.mean(dim=-1, keepdim=True)
        n1 = products.square_().mean(dim=-1, keepdim=True).sqrt_().div_(root).add_(c1.abs())
        if not self.centered:  # RMSNorm's dx = rstd (wdy - xhat c1): no c2 to sum or round
            zero = torch.zeros_like(c1)
            return c1, zero, n1, zero
        c2 = wdy.mean(dim=-1, keepdim=True)
        n2 = self.wdy_rms(grad_out, wdy).div(root).add_(c2.abs())
        return c1, c2, n1, n2

    def grad_x_size(self, grad_out: torch.Tensor) -> torch.Tensor:
        """Each row's magnitude of grad_x's terms, ``rstd * rms(scale * grad_out)`` ``[R, 1]``:
        what its atol is in units of (:func:`scaled_atol`)."""
        return self.wdy_rms(grad_out) * self.rstd

    def share_of_sums(self, grad_out: torch.Tensor) -> SumBudget:
        """This chunk's (or block's) share of the grad_scale and grad_bias models, to be
        added to the whole one in order (:meth:`SumBudget.add`)."""
        share = SumBudget(self.channels, self.precision)
        self.add_to(share, grad_out)
        return share

    def add_to(self, sums: SumBudget, grad_out: torch.Tensor) -> None:
        """Add this chunk's share of the grad_scale and grad_bias models to ``sums``."""
        dy = self.upstream(grad_out)
        term = dy * self.xhat  # grad_scale sums these over rows
        sums.rows += int(self.valid.sum())
        squares = term.square_()
        sums.scale_squares += squares.sum(dim=0)
        # Each row's second-order rounding moves its terms of grad_scale by that much.
        energy = squares.sum(dim=1)
        sums.second_order_sum += float(energy.dot(self.e2.reshape(-1)))
        sums.energy += float(energy.sum())
        sums.bias_squares += torch.square(dy, out=term).sum(dim=0)
        # (|xhat| + A) |dy| growth, squared, in the buffer again: dy's sign changes no bit of
        # the square (a product rounds alike whatever its sign), so dy is taken as it is.
        made = self._xhat_abs
        if made is not None:
            moved = torch.add(made, self.sum_offset, out=term)
        else:
            moved = torch.abs(self.xhat, out=term).add_(self.sum_offset)
        moved.mul_(dy).mul_(self.growth)
        sums.moved_squares += moved.square_().sum(dim=0)


def grad_x_terms(rows: RowBudget, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The terms of the model of grad_x of ``rows`` (:meth:`RowBudget.grad_x` makes their sum),
    each what one source of a correct kernel's rounding moves dx by (docs/verify-budget.md,
    "The gradients' budget", measures each).

    dx = rstd * (wdy - xhat * c1 - c2) with wdy = scale * dy, c1 = mean(xhat * wdy) and
    c2 = mean(wdy). xhat errs by a shift of its row, up to ``e1 * A`` (the mean's rounding:
    a sequential sum's), and by a factor, up to ``e1`` (rstd's), both the same along the
    row: they reach dx through c1 and c2 themselves, signed. A mean ``m`` of C terms
    ``t`` (c1 and c2; in torch's own backward the sums of wdy * x and wdy they are made
    of, which lose A times more) errs as a sum does, ``sqrt(C) * u * (|m| + rms(t) /
    sqrt(C))``: not by the mean of ``|t|``, since an upstream gradient of random signs
    makes c1 and c2 sqrt(C) times smaller than their terms.

    - ``shift``: the shift s through c1 and c2, ``rstd * s * (|c1| + |xhat| * |c2|)``, and
      through c2 alone (a running mean, Welford's, drifts along the row: each element's
      own shift);
    - ``factor``: the factor through c1, ``2 * rstd * e1 * |xhat| * |c1|``;
    - ``sums``: the backward's own rounding, of c1, c2 and wdy;
    - ``stored``: rstd's rounding scaling dx, and dx stored in the dtype;
    - ``subnormal``: below the smallest normal of the dtype the kernel computes in (an
      upstream gradient of 1e-40 in float32), each operation rounds at half a subnormal
      spacing ``u_sub``, absolutely: wdy, c2 (its sum's and wdy's rounding), xhat * c1 and
      the two subtractions on every element, c1 (its products' and sum's) along xhat:
      ``rstd * u_sub * (6 + 2 * |xhat|)``.
    """
    p = rows.precision
    e1 = rows.e0 + p.store
    ed = rows._ed()
    wdy = rows.upstream(grad_out) * rows.scale
    xhat_abs = rows.xhat.abs()
    # c1, c2, and what they err by per unit of a sum's relative rounding (see above).
    c1, c2, n1, n2 = rows._backward_sums(grad_out, wdy)
    dx = (wdy - rows.xhat * c1).sub_(c2).mul_(rows.rstd).abs_()
    rstd_e1 = rows.rstd * e1
    shift = (xhat_abs + 1).mul_(n2).add_(n1).mul_(rows.back_offset).mul_(rstd_e1)
    factor = (xhat_abs * n1).mul_(rstd_e1).mul_(2)
    sums = (xhat_abs * n1).add_(n2).add_(wdy.abs_()).mul_(rows.rstd).mul_(ed)
    stored = dx.mul_(rows.e2 + (e1 + p.store))
    subnormal = (xhat_abs + 3).mul_(rows.rstd).mul_(p.subnormal)
    return {
        "shift": shift, "factor": factor, "sums": sums, "stored": stored,
        "subnormal": subnormal,
    }  # fmt: skip


LOWER_SAFETY = 0.999
"""What :func:`grad_x_lower` keeps of its bound: room for the rounding of both sums."""


def grad_x_lower(
    rows: RowBudget, grad_out: torch.Tensor, truth_abs: torch.Tensor, truth_rstd: torch.Tensor
) -> torch.Tensor | None:
    """At most :meth:`RowBudget.grad_x` on every element of the valid rows ``[R, C]`` (its
    other rows anything), in three passes where the model takes a dozen: for rows that need
    no allowance (:class:`~maskln_cli.compare.judging.AllowancesOnDemand`), never a figure.
    ``truth_abs``: the true grad_x's magnitude, ``truth_rstd`` ``[R, 1]`` the truth's rstd
    (0 on invalid rows). None where the model could overflow (no bound is then sure).

    The model's terms are all >= 0: ``rstd ed growth |wdy|``, its constant (at least ``rstd
    (ed + e1 A) growth rms(wdy) / sqrt(C)``) and ``on_dx |dx|`` are kept, ``dx = wdy - xhat
    c1 - c2`` taken as ``|truth| / rstd`` (the truth's grad_x, made from the same wdy and c2
    with its own xhat and c1): the two differ by float64 rounding, amplified by the rows'
    offset A, bounded generously (1000 u64 C (1 + A), per unit of ``|wdy| + (sqrt(C) + 2)
    rms(wdy)``: |xhat| is at most sqrt(C), |c1| and |c2| at most rms(wdy)) and taken off.
    Checked against the model in tests/verify/test_grad_x_bounds.py."""
    p = rows.precision
    channels = rows.channels
    root = math.sqrt(channels)
    rms = rows.wdy_rms(grad_out)  # makes scale * upstream once, for the model too
    wdy, _ = rows._scaled_upstream(grad_out)
    e1 = rows.e0 + p.store
    rstd, growth, offset = rows.rstd, rows.growth, rows.offset
    # The model's terms are products of these (and of |xhat| <= sqrt(C)): finite below this.
    size = (offset + 1).square_().mul_(rstd).mul_(growth).mul_(rows.e2 + 1)
    if not float(size.mul_(rms * channels + 1).max()) < 1e250:
        return None
    on_wdy = rstd * growth * rows._ed()
    on_dx = (rstd * (rows.e2 + (e1 + p.store))).mul_(growth)
    apart = (offset + 1).mul_(1e3 * unit_roundoff(torch.float64) * channels).mul_(on_dx)
    on_truth = torch.where(truth_rstd > 0, on_dx / truth_rstd, 0.0).mul_(LOWER_SAFETY)
    # The constant: (rstd e1 A' (n1 + n2) + rstd ed n2) growth, n1 >= 0, n2 >= rms / sqrt(C).
    shift = rows.back_offset * (rstd * e1).mul_(growth)
    constant = (on_wdy + shift).div_(root).sub_(apart * (root + 2))
    constant.mul_(rms).mul_(LOWER_SAFETY)
    lower = torch.abs(wdy).mul_((on_wdy - apart).mul_(LOWER_SAFETY))
    return lower.addcmul_(truth_abs.view(lower.shape), on_truth).add_(constant)


def _shifts(rows: RowBudget, precision: Precision) -> tuple[torch.Tensor, ...]:
    """Each row's A as the mean's shift takes it: out's and the rows' second order (times e0),
    grad_scale's and grad_x's (times e1 = e0 + u_store): A itself, but on LayerNorm's valid rows
    of one value c (xhat 0) in a half dtype reaching the kernel exactly (issue 37), float32 sums
    of C < 2**13 of it are exact, the mean is c up to the division's rounding u_reduce (xhat
    shifts u_reduce A, not e0 A), stored exactly (no u_store); torch's backward form b x + c, b
    from its sums (erring e0 A), rounds at u_reduce |b x|: e0 A times more, grad_x's. Measured:
    tests/verify/test_constant_half_rows.py."""
    offset, e0 = rows.offset, rows.e0
    if not rows.centered or not _exact_sums(precision, rows.channels):
        return offset, offset, offset
    constant = rows.xhat.eq(0).all(dim=-1, keepdim=True).logical_and_(rows.valid)
    exact, e1 = offset * precision.reduce, e0 + precision.store
    return (
        torch.where(constant, exact / e0, offset),
        torch.where(constant, exact / e1, offset),
        torch.where(constant, exact * (1 + e0 * offset) / e1, offset),
    )


def _exact_sums(precision: Precision, channels: int) -> bool:
    """Whether float32 sums of ``channels`` values alike of the judged half dtype are exact
    (their multiples need at most 24 bits), and x reached the kernel unrounded."""
    digits = 1 - round(math.log2(torch.finfo(precision.dtype).eps))  # 11 and 8
    return precision.dtype in _HALF and precision.x == 0 and channels < 2 ** (24 - digits)


def _finite_rows(
    x: torch.Tensor, given: torch.Tensor, valid: torch.Tensor, centered: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``x`` (``given``, their padding zeroed) with 0 for NaN and inf too, and their
    means (LayerNorm's; None for RMSNorm). Finite sums (LayerNorm's: its row means, needed
    anyway, a pass fewer) mean no NaN or inf is left (a sum keeps them), as where only the
    padding held them (--poison); else every one is zeroed, as torch.where does (a finite
    value overflowing a sum too: torch.where changes no finite value)."""
    mean = x.mean(dim=-1, keepdim=True) if centered else None
    if bool(mean.isfinite().all()) if mean is not None else bool(x.sum().isfinite()):
        return x, mean
    x = _finite_only(given, valid)
    return x, x.mean(dim=-1, keepdim=True) if centered else None


def _finite_only(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values`` with 0 on invalid rows (``valid`` ``[R, 1]``) and for NaN and inf."""
    return torch.where(valid & values.isfinite(), values, 0.0)


def _scaled_rms(
    dy: torch.Tensor, scale: torch.Tensor, into: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale * dy`` (in ``into``, if given) and each row's rms of it ``[R, 1]``."""
    wdy = torch.mul(dy, scale, out=into)
    return wdy, wdy.square().mean(dim=-1, keepdim=True).sqrt_()


STAGNATION = 0.2
"""A sequential sum's shrinking as a whole, in units of ``(u * sqrt(N))**2``
(:meth:`SumBudget.stagnation`)."""


class SumBudget:
    """The models of grad_scale and grad_bias, sums over all valid rows, accumulated a chunk of
    rows at a time (:meth:`RowBudget.add_to`).

    A sum of N terms t in the dtype errs by about ``u * sqrt(N) * (|sum t| + ||t||_2)`` (the
    partial sums of a sequential sum drift towards the total and wander by about ``||t||``);
    each row's xhat errs independently, so those errors add in quadrature.

    Example:
        >>> sums = SumBudget(4, Precision.of(torch.float32))
        >>> sums.grad_bias(torch.zeros(4, dtype=torch.float64)).tolist()
        [0.0, 0.0, 0.0, 0.0]
    """

    def __init__(self, channels: int, precision: Precision) -> None:
        self.precision = precision
        self.e0 = math.sqrt(channels) * precision.reduce + precision.x  # as RowBudget's
        self.rows = 0
        zeros = torch.zeros(channels, dtype=torch.float64)
        self.scale_squares = zeros.clone()
        self.bias_squares = zeros.clone()
        self.moved_squares = zeros.clone()
        self.second_order_sum = 0.0  # the rows' second-order rounding, weighted by energy
        self.energy = 0.0  # the sum of squares of grad_scale's terms

    @property
    def second_order(self) -> float:
        """The rows' second-order rounding (see :class:`RowBudget`), averaged as grad_scale
        weighs them: how much a correct kernel's grad_scale may be scaled by it."""
        return self.second_order_sum / self.energy if self.energy > 0 else 0.0

    def add(self, share: SumBudget) -> None:
        """Add a share of rows (:meth:`RowBudget.share_of_sums`)."""
        self.rows += share.rows
        self.second_order_sum += share.second_order_sum
        self.energy += share.energy
        self.scale_squares += share.scale_squares
        self.bias_squares += share.bias_squares
        self.moved_squares += share.moved_squares

    def size(self, name: str) -> torch.Tensor:
        """The rms of the terms grad_scale (``name``) or grad_bias sums, per channel: what its
        atol is in units of (:func:`scaled_atol`)."""
        squares = self.scale_squares if name == "grad_scale" else self.bias_squares
        return squares.div(max(self.rows, 1)).sqrt_()

    def accumulation(self, name: str, total: torch.Tensor) -> torch.Tensor:
        """The sum's own rounding in the model of grad_scale (``name``) or grad_bias, each
        element's: ``u * sqrt(N) * (|sum t| + ||t||_2)``, its partial sums' drift and wander;
        ``total`` is the true sum (float64)."""
        squares = self.scale_squares if name == "grad_scale" else self.bias_squares
        return (total.abs() + squares.sqrt()) * (self.precision.store * math.sqrt(self.rows))

    def stagnation(self) -> float:
        """How far a correct kernel's sequential sum may shrink as a whole, relative: once its
        partial sums dwarf the terms, a term under half their spacing is lost, and one towards
        0 is kept more often than one away from it (bfloat16, N(0, 1) terms, pooled over 512
        channels: -4 % at 30,000 rows, -19 % at 100,000, -45 % at 200,000, that is 0.09 to 0.15
        times ``(u * sqrt(N))**2``; 0.2 times it allowed)."""
        return STAGNATION * (self.precision.store * math.sqrt(self.rows)) ** 2

    def grad_scale(self, total: torch.Tensor) -> torch.Tensor:
        """The model of grad_scale's error; ``total`` is the true grad_scale (float64)."""
        p = self.precision
        e1 = self.e0 + p.store
        spread = self.scale_squares.sqrt()
        # Below the smallest normal (see grad_x_terms, "subnormal"): each row's
        # product and each addition round at u_sub (half the spacing), over the rows a random
        # walk, as the relative rounding above.
        return (
            self.moved_squares.sqrt() * e1
            + self.accumulation("grad_scale", total)
            + spread * p.grad_out
            + total.abs() * p.store
            + math.sqrt(self.rows) * p.subnormal
        )

    def grad_bias(self, total: torch.Tensor) -> torch.Tensor:
        """The model of grad_bias's error; ``total`` is the true grad_bias (float64)."""
        p = self.precision
        spread = self.bias_squares.sqrt()
        return (
            self.accumulation("grad_bias", total)
            + spread * p.grad_out
            + total.abs() * p.store
            + math.sqrt(self.rows) / 2 * p.subnormal
        )


def unit(
    model: torch.Tensor, yardstick_error: torch.Tensor | None, in_place: bool = False
) -> torch.Tensor:
    """The budget before ``--factor``: the model, raised where the yardstick errs more (a
    non-finite model or yardstick error, from NaN or inf in the data, raises nothing);
    ``in_place``: ``model`` is the caller's to give, made in itself (the same bits, a buffer
    fewer) or dropped."""
    if in_place and yardstick_error is not None:
        # Where every value is finite (a finite sum: NaN and inf carry into it) nan_to_num
        # changes nothing: the greater of the two alone, in a buffer of its own (two passes
        # fewer; the model is the caller's to drop).
        raised = torch.maximum(model, yardstick_error)
        if math.isfinite(float(raised.sum())):
            return raised
    if in_place:
        budget = model.nan_to_num_(nan=0.0, posinf=0.0)
    else:
        budget = model.nan_to_num(nan=0.0, posinf=0.0)
    if yardstick_error is not None:
        raised = yardstick_error.nan_to_num(nan=0.0, posinf=0.0)
        torch.maximum(budget, raised, out=budget)  # in place: a buffer fewer
    return budget


def floor(
    truth: torch.Tensor,
    dtype: torch.dtype,
    rtol: float,
    atol: float | torch.Tensor,
    finite_abs: torch.Tensor | None = None,
) -> torch.Tensor:
    """What is always allowed: ``atol + max(rtol, ULPS * eps) * |truth|``, so at least ULPS
    ulps of dtype (an ulp at |t| is at most eps * |t|, and at least the spacing of its
    subnormals, ``tiny * eps``: a float16 gradient of 1e-6 is stored to within 3e-8) and
    assert_close's tolerance. ``atol`` may be a tensor (per row, per channel): see
    :func:`scaled_atol`. ``finite_abs``: ``|truth|`` when the caller has it and every value of
    it is finite (not written; the same bits, two passes fewer)."""
    info = torch.finfo(dtype)
    relative = max(rtol, ULPS * info.eps)
    if finite_abs is not None:  # nothing for nan_to_num to change
        always = torch.mul(finite_abs.view(truth.shape), relative)
    else:
        always = truth.abs().nan_to_num_(nan=0.0, posinf=0.0).mul_(relative)
    subnormal = ULPS * info.tiny * info.eps
    if isinstance(atol, torch.Tensor):
        # One pass, as with a float atol, where adding the subnormal first rounds alike: an
        # atol of 0 (then both add the subnormal alone), or one so far above it that neither
        # sum moves (2**54 times it: below a quarter of the atol's ulp).
        if bool(((atol == 0) | (atol >= subnormal * 2.0**54)).all()):
            return always.add_(atol + subnormal)
        return always.add_(atol).add_(subnormal)
    return always.add_(atol + subnormal)


def scaled_atol(atol: float, size: float | torch.Tensor | None) -> float | torch.Tensor:
    """``atol`` in units of a tensor's own ``size`` (the magnitude of the terms its values are
    made of), up to ``atol`` itself: assert_close's atol is meant for values of about 1, and a
    gradient a millionth that size gets a millionth of it (else it swallows whole terms of
    it). None: ``atol`` as it is.

    Example:
        >>> scaled_atol(1e-5, torch.tensor([2.0, 0.5], dtype=torch.float64)).tolist()
        [1e-05, 5e-06]
    """
    if size is None:
        return atol
    if isinstance(size, torch.Tensor):
        return size.clamp(max=1.0).nan_to_num_(nan=1.0).mul_(atol)
    return atol * min(1.0, size) if math.isfinite(size) else atol


def allowance(
    model: torch.Tensor,
    yardstick_error: torch.Tensor | None,
    truth: torch.Tensor,
    dtype: torch.dtype,
    factor: float,
    rtol: float,
    atol: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """What each element may err by: ``max(factor * max(model, yardstick error), ULPS ulps,
    atol + rtol * |truth|)``, and exactly 0 on invalid rows (``valid`` is one flag per row).

    Example:
        >>> truth = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
        >>> model = torch.tensor([[1e-6, 1e-3]], dtype=torch.float64)
        >>> allowance(model, None, truth, torch.float32, 3.0, 1.3e-6, 1e-5).tolist()
        [[1.13e-05, 0.003]]
    """
    budget = torch.maximum(
        unit(model, yardstick_error).mul_(factor), floor(truth, dtype, rtol, atol)
    )
    if valid is not None:
        budget.masked_fill_(~valid.reshape(-1, 1), 0.0)
    return budget


def factor_needed(error: torch.Tensor, budget_unit: torch.Tensor, always: torch.Tensor) -> float:
    """The smallest factor that would let every element of ``error`` pass: over the elements
    beyond what is ``always`` allowed, the greatest error / budget unit (0 when none is).

    Example:
        >>> error, unit = torch.tensor([5.0, 1.0]), torch.tensor([1.0, 1.0])
        >>> factor_needed(error, unit, always=torch.tensor([2.0, 2.0]))  # 1.0 is always allowed
        5.0
    """
    beyond = error.isfinite() & (error > always)
    if not bool(beyond.any()):
        return 0.0
    return float((error[beyond] / budget_unit[beyond]).max())
