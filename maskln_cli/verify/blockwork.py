"""One block of rows of ``maskln verify``'s streaming pass, measured on a worker thread.

A block (about :data:`~maskln_cli.compare.comparison.BLOCK_ELEMENTS` elements of whole rows)
gets its float64 truth from the op's own blocked kernels (the forward, and with an upstream
gradient the first-order backward, without autograd: the same kernels autograd would call, row
by row the same bits), PyTorch's yardstick in each judged dtype, and its elements' allowances
made on demand (:mod:`maskln_cli.verify.allowance`). out and grad_x are measured against them
(:meth:`Comparison.measure`); the block's shares of the sums over rows (grad_scale, grad_bias,
their yardsticks and budgets, and the systematic-error regressions of out) are returned, to be
added in block order by the calling thread (:mod:`maskln_cli.verify.measure`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from maskln_cli.compare.blocks import float64_minus
from maskln_cli.compare.judging import any_true
from maskln_cli.compare.rows import leave_out
from maskln_cli.verify.options import ROW_TENSORS
from maskln_cli.verify.systematic import FitSums, fit_rows
from maskln_cli.verify.terms import TermSums, fit_terms, stacked_products

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.data import BlockFigures
    from maskln_cli.files.masks import RowMask
    from maskln_cli.files.problem import Problem
    from maskln_cli.files.tensorfile import TensorFile
    from maskln_cli.verify.allowance import Allowance
    from maskln_cli.verify.budget import Precision, RowBudget, SumBudget
    from maskln_cli.verify.plan import Checked
    from maskln_cli.verify.yardstick import Yardstick


FIT_ROWS = 1 << 17
"""At most about this many rows are regressed for a systematic error (a sample of blocks,
spread over the input, the same whatever the thread count)."""


ALIKE_RETRY = 8
"""Blocks whose rows are not tested for being the yardstick's bit for bit after a block's were
not (:func:`yardstick_alike`)."""


class StreamingSettings(Protocol):
    """What a block needs of its streaming pass (:class:`maskln_cli.verify.measure.StreamingPass`,
    which imports this module)."""

    problem: Problem
    result: TensorFile
    judge: torch.dtype
    mode: str
    mask: RowMask | None
    allowance: Allowance
    precisions: dict[torch.dtype, Precision]


@dataclass
class SumShare:
    """A block's (or a chunk's) share of the sums over rows: the truth's grad_scale and
    grad_bias, the yardstick's (by name, in float64) and the budgets' (by judged dtype)."""

    scale: torch.Tensor
    bias: torch.Tensor
    judged: dict[str, torch.Tensor] = field(default_factory=dict)
    budgets: dict[torch.dtype, SumBudget] = field(default_factory=dict)


@dataclass
class Measured:
    """What a block gives its chunk: each row tensor's figures, and its shares of the sums."""

    figures: dict[str, BlockFigures]
    fits: dict[str, FitSums]
    sums: SumShare | None = None


class BlockWork:
    """Measures blocks of rows for a streaming pass (its live tensors, with or without
    gradients)."""

    def __init__(self, streaming: StreamingSettings, live: dict[str, Checked], gradients: bool):
        problem = streaming.problem
        self.streaming = streaming
        self.problem = problem
        self.live = live
        self.gradients = gradients
        self.results = {
            name: streaming.result.tensor(checked.key).reshape(-1, problem.channels)
            for name, checked in live.items()
            if name in ROW_TENSORS
        }
        judged = [c.judge or streaming.judge for n, c in live.items() if n in ROW_TENSORS]
        if gradients:
            judged += [streaming.judge if c is None else c.judge or streaming.judge for c in (
                live.get("grad_scale"), live.get("grad_bias"),
            )]  # fmt: skip
        self.dtypes = list(dict.fromkeys(judged))
        # out and grad_x, in budget mode, are regressed for a systematic error (see
        # .systematic; grad_scale and grad_bias are, once summed).
        self.fits = {n for n in ROW_TENSORS if n in live} if streaming.mode == "budget" else set()
        # Large inputs are regressed on a sample of their blocks, every fit_stride-th: about
        # FIT_ROWS rows tell a systematic error as well as a million (the gate decides, not
        # the standard error), at a fraction of the time (a third of a passing verify's).
        from maskln_cli.compare.comparison import BLOCK_ELEMENTS

        self.block_rows = max(2, BLOCK_ELEMENTS // problem.channels)
        self.fit_stride = max(1, -(-problem.rows // FIT_ROWS))
        # Blocks since RESULT's rows of each tensor were last the yardstick's bit for bit.
        self.alike_missed: dict[str, int] = {}

    def yardsticks(
        self, x: torch.Tensor, valid: torch.Tensor, grad_out: torch.Tensor | None
    ) -> dict[torch.dtype, Yardstick]:
        """PyTorch's result on rows ``x`` in each judged dtype (one, unless RESULT's tensors
        are stored in different dtypes)."""
        from maskln_cli.verify.yardstick import yardstick

        problem = self.problem
        upstream = grad_out if self.gradients else None
        params, centered = (problem.scale, problem.bias, problem.eps), problem.norm.centered
        return {
            dtype: yardstick(x, valid, *params, dtype, upstream, centered=centered)
            for dtype in self.dtypes
        }

    def measure(self, start: int, stop: int) -> Measured | None:
        """The figures of rows ``start:stop`` (None when a value is NaN or inf)."""

        import torch

        from maskln_cli.verify.budget import RowBudget

        streaming, problem = self.streaming, self.problem
        x = problem.x[start:stop]
        valid = problem.valid[start:stop]
        x64 = x.double()
        grad_out = problem.grad_out[start:stop] if self.gradients else None  # type: ignore[index]
        dy64 = grad_out.double() if grad_out is not None else None
        # grad_x's term fit takes the products of four rows (truth, xhat, error, wdy) from one
        # buffer: its truth and its error are made there, not copied in (see _terms).
        planes = None
        terms = problem.channels >= GRAD_X_CHANNELS and problem.norm.centered
        if dy64 is not None and terms and "grad_x" in self.fits and self.fitted(start):
            planes = x64.new_empty(4, *x64.shape)
        grad_x_out = planes[0] if planes is not None else None
        truth, rstd = float64_truth(problem, x64, valid, dy64, grad_x_out)
        sticks = self.yardsticks(x, valid, grad_out)
        # With gradients the block's rows' budget statistics are needed for the sums anyway:
        # made once, and taken by the allowances of out and grad_x too (else made from x
        # for just the rows that need them).
        # x64 and dy64 are this block's own copies (unless x or grad_out is float64 itself):
        # the budget zeroes their padding there. Nothing reads their invalid rows after the
        # truth (the fits and the allowances read valid rows, or take the budget's figures).
        own_x = x64 is not x
        own_grad_out = dy64 is not None and dy64 is not grad_out
        budget = None
        if dy64 is not None and streaming.mode == "budget":
            precision = streaming.precisions[streaming.judge]
            budget = RowBudget(
                x64, valid, problem.scale, problem.bias, problem.eps, precision,
                problem.norm.centered, keep_deviations=True, own_x=own_x,
                own_grad_out=own_grad_out,
            )  # fmt: skip
            if planes is not None:  # wdy made where the term fit takes it
                budget.wdy_into = planes[3]
        keep = streaming.mask.keep[start:stop] if streaming.mask is not None else None
        invalid = ~valid if keep is None else ~valid & keep
        figures: dict[str, BlockFigures] = {}
        fits: dict[str, FitSums] = {}
        offset = None
        for name in ROW_TENSORS:
            checked = self.live.get(name)
            if checked is None:
                continue
            comparison = checked.comparison
            assert comparison is not None
            stick = sticks[checked.judge or streaming.judge]
            guess = stick.out if name == "out" else stick.grad_x
            assert guess is not None
            actual, reference = self.results[name][start:stop], truth[name]
            if keep is not None:  # --valid: rows left out agree (0 on every side)
                actual, reference = leave_out(actual, reference, keep)
                guess, _ = leave_out(guess, reference, keep)
            fitting = name in self.fits and self.fitted(start)
            keep_error: bool | torch.Tensor = fitting
            if fitting and name == "grad_x" and planes is not None:
                keep_error = planes[2]  # made where the term fit takes it
            # |yardstick - truth|: for the budget and the comparison alike, computed once; the
            # comparison's differences too where RESULT is the yardstick bit for bit (PyTorch's
            # own kernel: then not made again, see yardstick_alike), the signed ones kept if asked.
            alike = yardstick_alike(self.alike_missed, name, actual, guess)
            if alike and keep_error is not False:
                into = None if isinstance(keep_error, bool) else keep_error
                keep_error = float64_minus(guess, reference, into)
                error = torch.abs(keep_error)
            else:
                error = float64_minus(guess, reference).abs_()  # float64: the truth's dtype
            inputs = (x64, valid, reference, guess, error)
            if name == "grad_x":
                inputs += (dy64,)  # type: ignore[assignment]
            allowance_of = functools.partial(
                streaming.allowance.of_rows, comparison, inputs, budget=budget
            )
            # Every element of a valid row is allowed its row's atol or more: what is always
            # allowed (budget.floor) adds it, and the allowance is at least that.
            lower = streaming.allowance.lower(
                comparison, valid, dy64 if name == "grad_x" else None, rstd, budget
            )
            floors = functools.partial(
                streaming.allowance.floors, comparison, reference,
                dy64 if name == "grad_x" else None, budget,
            )  # fmt: skip
            bounds = None if name != "grad_x" else functools.partial(  # finer than its floors
                streaming.allowance.bounds, comparison, dy64, budget, rstd, keep)  # fmt: skip
            measured = comparison.measure(
                actual, reference, invalid, yardstick=guess, yardstick_error=error, bounds=bounds,
                allowance_of=allowance_of, lower=lower, floors=floors, keep_error=keep_error,
                alike=alike,
            )  # fmt: skip
            if measured is None:
                return None
            figures[name] = measured
            signed, measured.error = measured.error, None  # the fit's, not the chunk's to hold
            if fitting:
                assert rstd is not None
                if offset is None:  # each row's A (as RowBudget's), for out's fit and grad_x's
                    # Without gradients out's fit is the last to read x64: |x| made in it if ours.
                    offset = _offset(x64, rstd.reshape(-1), budget, own_x and dy64 is None)
                fits[name] = self.fit(
                    actual, reference, valid, keep, rstd.reshape(-1), x64, checked, dy64, start,
                    offset, budget.deviations if budget is not None else None,
                    measured.row_norms, signed, planes,
                    None if budget is None or dy64 is None else budget.scaled_upstream_made(dy64),
                )  # fmt: skip
        sums = None
        if dy64 is not None:
            sums = SumShare(truth["grad_scale"], truth["grad_bias"])
            for name in ("grad_scale", "grad_bias"):
                checked = self.live.get(name)
                dtype = (checked.judge if checked else None) or streaming.judge
                sums.judged[name] = getattr(sticks[dtype], name).double()
                if dtype not in sums.budgets:
                    if budget is None:
                        budget = RowBudget(
                            x64, valid, problem.scale, problem.bias, problem.eps,
                            streaming.precisions[dtype], problem.norm.centered, own_x=own_x,
                            own_grad_out=own_grad_out,
                        )  # fmt: skip
                    rows = budget.judged_in(streaming.precisions[dtype])
                    sums.budgets[dtype] = rows.share_of_sums(dy64)
        return Measured(figures, fits, sums)

    def fitted(self, start: int) -> bool:
        """Whether the block starting at row ``start`` is regressed (see :data:`FIT_ROWS`)."""
        return (start // self.block_rows) % self.fit_stride == 0

    def fit(
        self,
        actual: torch.Tensor,
        reference: torch.Tensor,
        valid: torch.Tensor,
        keep: torch.Tensor | None,
        rstd: torch.Tensor,
        x64: torch.Tensor,
        checked: Checked,
        dy64: torch.Tensor | None = None,
        first_row: int = 0,
        offset: torch.Tensor | None = None,
        deviations: torch.Tensor | None = None,
        row_norms: torch.Tensor | None = None,
        error: torch.Tensor | None = None,
        planes: torch.Tensor | None = None,
        wdy_made: torch.Tensor | None = None,
    ) -> FitSums:
        """The systematic-error regressions of out or grad_x (``checked``) on rows that are
        valid (and kept by ``--valid``), from their truth's rstd and x (float64): out's error
        on ``xhat * scale``, grad_x's on the true grad_x (given the upstream ``dy64``).
        ``offset``: each row's ``mean |x| * rstd`` (RowBudget's A), and ``deviations``, x
        minus its row's mean (RowBudget's, read on valid rows), and ``row_norms``, each
        row's sum of the truth's squares (the comparison's), and ``error``, ``actual -
        reference`` in float64 (the comparison's, flat), when the caller has them; ``planes``,
        the term fit's buffer, and ``wdy_made``, ``scale * dy64`` as the block's budget made
        it (see :meth:`_terms`)."""

        problem = self.problem
        gradient = checked.name == "grad_x"
        if gradient and (problem.channels < GRAD_X_CHANNELS or dy64 is None):
            return FitSums()
        rows = valid if keep is None else valid & keep
        if error is None or error.numel() != reference.numel():
            error = float64_minus(actual, reference)  # in float64 (the truth's)
        else:
            error = error.view(reference.shape)
        if offset is None:
            offset = x64.abs().mean(dim=1).mul_(rstd)  # A, as RowBudget's
        # Each row's sum of the truth's squares (grad_x's, below), and its rms: torch's mean
        # is the sum divided by C, the same bits.
        if row_norms is None or len(row_norms) != len(reference):
            row_norms = reference.square().sum(dim=1)
        rms = row_norms.div(problem.channels).sqrt_()
        terms = z_squares = row_sums = None
        if gradient:
            assert dy64 is not None
            precision = self.streaming.precisions[checked.judge or self.streaming.judge]
            terms, wdy_squares, row_sums = _terms(
                problem, error, reference, rows, rstd, x64, dy64, precision, offset, rms,
                deviations, planes, wdy_made,
            )  # fmt: skip
            z_squares = row_norms
            rows = rows & _grad_x_resolved(z_squares, wdy_squares, rstd)
            # Rows of one value (xhat 0): a factor's noise unbounded (issue 37), no evidence.
            rows &= _not_one_value(x64)
        if not bool(rows.any()):
            return FitSums(terms=terms)
        # Row sums over the whole block, then the rows kept: cheaper than gathering them.
        z = reference - problem.bias if checked.name == "out" else reference
        precision = self.streaming.precisions[checked.judge or self.streaming.judge]
        drift = None  # a running mean's, beside the mean's rounding (x64 may hold |x| now:
        if problem.norm.centered:  # the rows it asks are of one sign)
            from maskln_cli.verify.drift import running_mean_drift

            magnitude = offset / rstd  # mean |x|
            drift = running_mean_drift(offset, magnitude, precision, problem.channels, x64, rows)
        moved, second_order, stored = _row_rounding(
            checked.name, precision, problem.channels, offset, rms, drift
        )
        shifted = problem.scale.double() if checked.name == "out" else None
        # A half dtype's stored rounding could hide a factor (systematic_gate): how systematic
        # is the truth's own rounding on these rows?
        rounding = None
        if precision.store > precision.reduce:
            rounding = reference.to(precision.dtype).double().sub_(reference)
        # out's z is made here, its error the comparison's own: both written in the fit.
        sums = fit_rows(
            error, z, rstd, problem.eps, second_order, rows, offset, moved, stored, first_row,
            shifted, z_squares, rounding, row_sums, writable=checked.name == "out",
            drift=drift if checked.name == "out" else None,
        )  # fmt: skip
        if checked.name == "grad_x":  # a shift of grad_x has no scale to be judged against
            sums.v = sums.vg = sums.vgg = sums.v2 = sums.v2g = sums.v2gg = 0.0
        sums.terms = terms
        return sums


def yardstick_alike(
    missed: dict[str, int], name: str, actual: torch.Tensor, guess: torch.Tensor
) -> bool:
    """Whether RESULT's rows ``actual`` of ``name`` are the yardstick's ``guess`` bit for bit
    (PyTorch's own kernel, or one doing as it does): one pass over both, where it spares the
    comparison its differences (two passes) and the yardstick's squares and greatest (three).
    Once a block's were not, tried again only every :data:`ALIKE_RETRY` blocks (``missed``:
    blocks since each tensor's last were, shared by the blocks on several threads: which work
    a block does depends on it, never a figure)."""
    import torch

    count = missed.get(name, 0)
    if count % ALIKE_RETRY:
        missed[name] = count + 1
        return False
    same = actual.dtype == guess.dtype and actual.shape == guess.shape
    if same and actual.numel():
        # Their bits xor'ed, read as bytes whose greatest is taken: half the time of
        # torch.equal (of the values or of their bits alike).
        sizes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        bits = sizes.get(actual.element_size())
        same = bits is not None and not any_true(
            torch.bitwise_xor(actual.reshape(-1).view(bits), guess.reshape(-1).view(bits))
        )
    missed[name] = 0 if same else count + 1
    return same


def _terms(
    problem: Problem,
    error: torch.Tensor,
    truth: torch.Tensor,
    rows: torch.Tensor,
    rstd: torch.Tensor,
    x64: torch.Tensor,
    dy64: torch.Tensor,
    precision: Precision,
    offset: torch.Tensor,
    rms: torch.Tensor,
    deviations: torch.Tensor | None = None,
    planes: torch.Tensor | None = None,
    wdy_made: torch.Tensor | None = None,
) -> tuple[TermSums, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """grad_x's error regressed on its backward's terms (:mod:`.terms`), on ``rows``,
    with each row's rounding as the budget's model has it, in rms: grad_x's own (stored,
    and its rstd's), the upstream terms' (the backward's sums, the statistics' shift).
    ``offset`` and ``rms`` are each row's A and rms of the truth, ``deviations`` (or None)
    its x minus its mean (all three read on ``rows`` only);
    also returned, each row's sum of the squares of ``scale * dy64``, and its sums of the
    truth, of ``error`` and of their product, for :func:`fit_rows` (read on ``rows``
    only): all from the rows' :func:`~maskln_cli.verify.terms.row_products`. ``planes``
    (or None): the buffer [4, R, C] they are taken from, truth and error already in it when
    made there; ``wdy_made``: ``scale * dy64`` as the budget made it (in ``planes[3]``, if
    there: not made again)."""
    import math

    import torch

    channels = problem.channels
    # Every figure below is a row's own (its reductions run along the row), read on
    # ``rows`` only: other rows (the padding, NaN and inf included) need not be zeroed.
    if deviations is None:
        deviations = x64 - x64.mean(dim=1, keepdim=True)
    made = (truth, error, wdy_made)
    xhat, wdy, products, plain = _term_products(planes, made, deviations, rstd, dy64, problem.scale)
    p = precision
    e1 = math.sqrt(channels) * p.reduce + p.x + p.store
    ed = math.sqrt(channels) * p.reduce + p.grad_out + p.params + p.store
    info = torch.finfo(p.dtype)
    wdy_squares = products[:, 3, 3]  # [R]
    terms = wdy_squares.div(channels).sqrt_().mul_(rstd)
    rounding = rms.mul(e1 + p.store).add_(terms.mul_((offset + 1).mul_(e1).add_(ed)))
    # Below the smallest normal the backward's operations round at u_sub, absolutely (the
    # budget's "subnormal" term, rstd u_sub (6 + 2 |xhat|): 8 rstd u_sub in rms at most),
    # c2's alike on every element of a row (its sum's and wdy's: 2 rstd u_sub).
    floor = info.tiny * info.eps / 2  # half an ulp of the stored dtype's subnormals
    rounding += floor
    rounding.add_(rstd.mul(4).mul_(p.subnormal))  # u_sub: half the spacing
    alike = rstd.mul(p.subnormal).add_(floor)
    sums = fit_terms(error, truth, xhat, wdy, rstd, rows, rounding, (products, plain), alike)
    return sums, wdy_squares, (plain[:, 0], plain[:, 2], products[:, 0, 2])


def _term_products(
    planes: torch.Tensor | None,
    made: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    deviations: torch.Tensor,
    rstd: torch.Tensor,
    dy64: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """xhat and wdy as written in the planes of one buffer [4, R, C] (``planes``, the caller's,
    or a new one), and the :func:`~maskln_cli.verify.terms.stacked_products` of the four rows
    there: truth, xhat, error and wdy (the same bits as made apart). truth and error
    (``made``) are copied in unless they were made there; xhat is ``deviations * rstd``; wdy
    is the budget's (``made[2]``) where it made it there (its bits on the valid rows read),
    else ``scale * dy64`` made there."""
    import torch

    truth, error, wdy = made
    if planes is None:
        planes = torch.empty(4, *truth.shape, dtype=torch.float64)
    for k, row in ((0, truth), (2, error)):
        if row.data_ptr() != planes[k].data_ptr():
            planes[k].copy_(row)
    xhat = torch.mul(deviations, rstd.reshape(-1, 1), out=planes[1])
    if wdy is None or wdy.data_ptr() != planes[3].data_ptr():
        wdy = torch.mul(dy64, scale, out=planes[3])
    # [R, 4, C] as the products take it: the same bits as rows stacked so.
    products, plain = stacked_products(planes.permute(1, 0, 2))
    return xhat, wdy, products, plain


GRAD_X_CHANNELS = 4
"""grad_x is regressed from this many channels: with 2 a normalized row is +-1 whatever x, and
grad_x is all but 0 (with 3, two of its degrees of freedom are gone)."""
CANCELLED = 0.1
"""A row's true grad_x is regressed on only when its energy is at least this share of its
terms' (``rstd * scale * dy``): where they cancel, rounding relative to it is unbounded (an
upstream gradient of ones through a LayerNorm of unit scale gives a grad_x of 0 exactly, and
rounding noise either side: regressed, a factor of -1)."""


def _row_rounding(
    name: str,
    precision: Precision,
    channels: int,
    offset: torch.Tensor,
    rms: torch.Tensor,
    drift: torch.Tensor | None = None,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """What a correct kernel's rounding gives each row's factor, for the fit of ``name``: the
    relative shift of xhat per unit of A (a row's mean rounded: e0; grad_x's backward, torch's
    b x + c form, rounds that shift in the stored dtype too, e0 + u_store, as the budget's
    backward has it), the second-order rounding (A e0 + drift)**2 (``drift``: a running mean's,
    :func:`~maskln_cli.verify.drift.running_mean_drift`), and the stored rounding of each row
    of rms ``rms``: relative, and absolute below the dtype's smallest normal (a float16 grad_x
    of 1e-6 rounds by 3e-8, a twentieth of it)."""
    import math

    import torch

    e0 = math.sqrt(channels) * precision.reduce + precision.x
    second_order = offset * e0
    if drift is not None:
        second_order += drift
    second_order.square_()
    info = torch.finfo(precision.dtype)
    stored = rms.mul(precision.store)
    stored += info.tiny * info.eps / 2
    moved = e0 + precision.store if name == "grad_x" else e0
    return moved, second_order, stored


def _offset(
    x64: torch.Tensor, rstd: torch.Tensor, budget: RowBudget | None, writable: bool = False
) -> torch.Tensor:
    """Each row's ``mean |x| * rstd`` ``[R]``, its mean |x| taken from the block's ``budget``
    when it has it (the same bits on valid rows, where the fits read it: the budget zeroes
    only invalid rows, and non-finite values, which stop a block before its fits);
    ``writable``: else made in ``x64`` itself (the caller's, not read again: a pass in place
    where a new buffer costs about three times as much)."""
    if budget is not None and budget.mean_abs is not None:
        return budget.mean_abs.reshape(-1).mul(rstd)
    magnitude = x64.abs_() if writable else x64.abs()
    return magnitude.mean(dim=1).mul_(rstd)


def _not_one_value(x64: torch.Tensor) -> torch.Tensor:
    """The rows ``[R]`` of ``x64`` ``[R, C]`` not all one value: ``~x64.eq(x64[:, :1]).all(1)``
    (NaN equal to nothing, -0.0 to +0.0), from each row's greatest and least (NaN if it holds
    one): two vectorized reductions, a quarter of the time of the comparison and torch's
    aminmax alike."""
    return x64.amax(dim=1) != x64.amin(dim=1)


def _grad_x_resolved(
    energy: torch.Tensor, wdy_squares: torch.Tensor, rstd: torch.Tensor
) -> torch.Tensor:
    """The rows whose true grad_x is not the near-cancellation of its terms (see
    :data:`CANCELLED`), from each row's sum of the true grad_x's squares ``[R]`` and of the
    squares of ``scale * grad_out`` ``[R]``."""
    terms = wdy_squares.mul(rstd.square())
    return energy >= terms.mul_(CANCELLED)


def float64_truth(
    problem: Problem,
    x64: torch.Tensor,
    valid: torch.Tensor,
    dy64: torch.Tensor | None,
    grad_x_out: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The truth of some rows (``out``, and the gradients given ``dy64``) and their rstd, by the
    op's raw-op kernels in float64, without autograd. Every path of verify takes it from here,
    whichever backend the op runs on: a verdict's figures never depend on the backend.
    ``grad_x_out``: where LayerNorm's grad_x is made (contiguous, x's shape; the same bits)."""
    import torch

    from maskln_cli.op.blocked import backward_in_place, forward, forward_keeping_xhat

    with torch.no_grad():
        if not problem.norm.centered:  # RMSNorm (scale its whole gain: see job._as_rms_view)
            return _rms_truth(problem, x64, valid, dy64)
        params = (problem.scale, problem.bias, problem.eps)
        if dy64 is None:
            out, mean, rstd = forward(x64, valid, *params)
        else:  # the backward takes the forward's xhat (the same bits) rather than make it
            xhat = torch.empty_like(x64)
            out, mean, rstd, kept = forward_keeping_xhat(x64, valid, *params, xhat)
        truth = {"out": out}
        if dy64 is not None:
            assert mean is not None and rstd is not None
            grads = backward_in_place(
                dy64, x64, valid, problem.scale, mean, rstd, problem.eps,
                xhat=xhat if kept else None, dx_out=grad_x_out,
            )  # fmt: skip
            truth.update(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True))
    return truth, rstd


def _rms_truth(
    problem: Problem, x64: torch.Tensor, valid: torch.Tensor, dy64: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """:func:`float64_truth` of RMSNorm; its grad_bias is that of a zero bias (the upstream
    gradient summed over valid rows), computed for the sums' bookkeeping, never judged."""
    import torch

    from maskln_cli.op.blocked import backward_in_place, forward
    from maskln_cli.op.norms import RMS

    out, _, rstd = forward(x64, valid, problem.scale, None, problem.eps, norm=RMS)
    truth = {"out": out}
    if dy64 is not None:
        assert rstd is not None
        dx, dscale, _ = backward_in_place(
            dy64, x64, valid, problem.scale, None, rstd, problem.eps, need_dbias=False, norm=RMS
        )
        truth["grad_x"], truth["grad_scale"] = dx, dscale
        dy = torch.where(valid.unsqueeze(1) & dy64.isfinite(), dy64, 0.0)
        truth["grad_bias"] = dy.sum(dim=0)
    return truth, rstd
