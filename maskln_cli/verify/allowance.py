"""How far each element of RESULT may be from the truth, in the form a comparison takes it.

With ``--tolerance budget`` (the default) an element's allowance is its error budget
(:mod:`maskln_cli.verify.budget`): the rounding model of a correct kernel, raised by the
yardstick's own error, times ``--factor``, never below what is always allowed; with
``--tolerance fixed``, ``atol + rtol * |truth|``. Invalid rows are allowed nothing: they must be
exactly 0. The pieces go to :meth:`Comparison.update` (a chunk, a gradient sum) or, a block's
rows at a time, to :meth:`Comparison.measure`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.comparison import Comparison
    from maskln_cli.verify.budget import RowBudget
    from maskln_cli.verify.plan import Plan


class Allowance:
    """The allowance of the elements a plan compares: its mode, factor and judged dtype."""

    def __init__(self, plan: Plan, yardstick_raises: bool) -> None:
        self.problem = plan.problem
        self.mode = plan.mode
        self.factor = plan.factor
        self.judge = plan.judge
        self.precisions = plan.precisions
        # Each tensor's own judged dtype (see Plan.judges), by the comparison's name.
        self.judges = plan.judges()
        # Whether the yardstick's error raises a budget (see job.YARDSTICK_RAISES).
        self.yardstick_raises = yardstick_raises
        # The default atol is in units of each tensor's size (budget.scaled_atol); one given
        # with --atol is taken as it is.
        self.scaled = plan.verify.atol is None
        problem = plan.problem
        # out's size: its terms xhat * scale (xhat of rms 1 at most) and bias.
        self.out_size = float(problem.scale.square().mean().sqrt()) + float(
            problem.bias.square().mean().sqrt()
        )

    def of_rows(
        self,
        comparison: Comparison,
        inputs: tuple[torch.Tensor, ...],
        rows: torch.Tensor | None,
        later: bool = False,
        budget: RowBudget | None = None,
        always: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]]:
        """The allowance pieces of some rows of a block (None: all of them) for
        :meth:`Comparison.measure`, from the block's ``inputs`` (x in float64, valid, the
        truth, the yardstick and its error, and for grad_x the upstream gradient in float64);
        ``later``, a function making them from copies of just those rows. ``budget``, the
        block's RowBudget when the caller has it: its rows' statistics are taken, not computed
        again from x. ``always``, with every row: their :meth:`floors`, when the caller made
        them (the bits ``always`` would be)."""
        if rows is None:
            return self.pieces(comparison, *inputs, budget=budget, always=always)
        if budget is not None:
            budget = budget.rows(rows)
        # x (the first input) only makes a budget: not gathered when the rows have theirs.
        some: list[torch.Tensor | None] = [
            t.index_select(0, rows) if k or budget is None else None for k, t in enumerate(inputs)
        ]
        if later:
            return functools.partial(self.pieces, comparison, *some, budget=budget)
        return self.pieces(comparison, *some, budget=budget)

    def pieces(
        self,
        comparison: Comparison,
        x64: torch.Tensor | None,
        valid: torch.Tensor,
        truth: torch.Tensor,
        guess: torch.Tensor,
        error: torch.Tensor,
        grad_out: torch.Tensor | None = None,
        budget: RowBudget | None = None,
        always: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The allowance pieces of rows of x (float64), as those of a whole chunk are made;
        those of grad_x with the upstream gradient ``grad_out`` (float64). ``budget``: these
        rows' RowBudget, if the caller has it (in any judged dtype); ``always``: these rows'
        :meth:`floors`, if the caller made them."""
        from maskln_cli.verify.budget import RowBudget

        problem = self.problem
        if self.mode == "budget":
            precision = self.precisions[self.judges.get(comparison.name, self.judge)]
            if budget is None:
                assert x64 is not None
                budget = RowBudget(
                    x64, valid, problem.scale, problem.bias, problem.eps, precision,
                    problem.norm.centered,
                )  # fmt: skip
            else:
                budget = budget.judged_in(precision)
            if grad_out is None:
                model, size = budget.out(truth), self.out_size
            else:
                model, size = budget.grad_x(grad_out), budget.grad_x_size(grad_out)
            return self.from_model(
                comparison, model, guess, truth, valid.unsqueeze(1), error, size, always=always
            )
        allowed = truth.abs().mul_(comparison.rtol).add_(comparison.atol)
        return {"allowance": allowed.masked_fill_(~valid.unsqueeze(1), 0.0)}

    def lower(
        self,
        comparison: Comparison,
        valid: torch.Tensor,
        grad_out: torch.Tensor | None = None,
        rstd: torch.Tensor | None = None,
        budget: RowBudget | None = None,
    ) -> float:
        """At most every element's allowance on the valid rows of a block (see
        :meth:`Comparison.measure`): the atol of its smallest row (grad_x, given the upstream
        ``grad_out`` and the rows' ``rstd``, both float64, or the block's ``budget``, whose
        sizes its allowances take) or out's."""
        import torch

        from maskln_cli.verify.budget import scaled_atol

        atol = comparison.atol
        if not self.scaled or self.mode != "budget":
            return atol
        if grad_out is None or (rstd is None and budget is None):
            return float(scaled_atol(atol, self.out_size))
        if budget is not None:
            sizes = budget.grad_x_size(grad_out).reshape(-1)[valid]
        else:
            assert rstd is not None
            wdy = torch.where(valid.unsqueeze(1), grad_out, 0.0).mul_(self.problem.scale)
            sizes = wdy.square_().mean(dim=1).sqrt_().mul_(rstd.reshape(-1))[valid]
        return float(scaled_atol(atol, float(sizes.min()) if sizes.numel() else 1.0))

    def floors(
        self,
        comparison: Comparison,
        truth: torch.Tensor,
        grad_out: torch.Tensor | None = None,
        budget: RowBudget | None = None,
        finite_abs: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """What each element of rows of a block is always allowed on a valid row, the bits
        :meth:`from_model` makes (``always``) from the same rows' ``truth``: at most each
        element's allowance there (for :class:`~maskln_cli.compare.judging.AllowancesOnDemand`).
        grad_x's (the upstream ``grad_out`` given) needs the block's ``budget``, whose sizes
        its atol takes; None without it, and with a fixed tolerance. ``finite_abs``:
        ``|truth|``, every value finite, when the caller has it (the comparison's)."""
        from maskln_cli.verify import budget as budgets

        if self.mode != "budget" or (grad_out is not None and budget is None):
            return None
        dtype = _torch_dtype(comparison.dtype) or self.judge
        size = self.out_size if grad_out is None else budget.grad_x_size(grad_out)  # type: ignore[union-attr]
        atol = budgets.scaled_atol(comparison.atol, size) if self.scaled else comparison.atol
        return budgets.floor(truth, dtype, comparison.rtol, atol, finite_abs)

    def bounds(
        self,
        comparison: Comparison,
        grad_out: torch.Tensor | None,
        budget: RowBudget | None,
        truth_rstd: torch.Tensor | None,
        keep: torch.Tensor | None,
        finite_abs: torch.Tensor,
    ) -> torch.Tensor | None:
        """At most each element's allowance on the valid rows of a block of grad_x (its other
        rows anything), from the block's ``budget``, the upstream gradient ``grad_out``
        (float64), the truth's rstd ``[R, 1]`` and ``|truth|`` (``finite_abs``, every value
        finite): ``factor`` times :func:`~maskln_cli.verify.budget.grad_x_lower` (the budget
        unit is the model or more). For rows that need no allowance, never a figure (see
        :class:`~maskln_cli.compare.judging.AllowancesOnDemand`); None: no bound (not grad_x,
        no budget, rows left out by ``keep`` (--valid), a fixed tolerance, RMSNorm, a model
        that could overflow)."""
        from maskln_cli.verify.budget import grad_x_lower

        if comparison.name != "grad_x" or grad_out is None or budget is None:
            return None
        if truth_rstd is None or keep is not None:
            return None
        if self.mode != "budget" or not self.problem.norm.centered:
            return None
        precision = self.precisions[self.judges.get(comparison.name, self.judge)]
        lower = grad_x_lower(budget.judged_in(precision), grad_out, finite_abs, truth_rstd)
        return None if lower is None else lower.mul_(self.factor).view(-1)

    def from_model(
        self,
        comparison: Comparison,
        model: torch.Tensor,
        guess: torch.Tensor,
        reference: torch.Tensor,
        valid: torch.Tensor | None,
        error: torch.Tensor | None = None,
        size: float | torch.Tensor | None = None,
        always: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Each element's budget (0 on invalid rows, ``valid`` being one flag per row) and the
        pieces it is made of, as :meth:`Comparison.update` takes them. ``model`` is taken
        over (written: it becomes ``budget_unit``). ``error`` is the yardstick's, ``|guess -
        reference|``, when the caller has it; ``size`` the tensor's own magnitude (per row,
        per channel), which the default atol is in units of; ``always`` what is always allowed
        (:meth:`floors`), when the caller made it: taken over likewise (set to inf on invalid
        rows)."""
        import torch

        from maskln_cli.verify import budget

        dtype = _torch_dtype(comparison.dtype) or self.judge
        if error is None and self.yardstick_raises:
            error = (guess.double() - reference).abs_()
        unit = budget.unit(model, error if self.yardstick_raises else None, in_place=True)
        if always is None:
            atol = budget.scaled_atol(comparison.atol, size) if self.scaled else comparison.atol
            always = budget.floor(reference, dtype, comparison.rtol, atol)
        allowed = unit.mul(self.factor)
        torch.maximum(allowed, always, out=allowed)  # in place: a buffer fewer
        if valid is not None and not bool(valid.all()):  # else masking changes nothing
            # By index, not by a broadcast mask: the same bits, at a third of the cost.
            invalid = (~valid).reshape(-1).nonzero().squeeze(1)
            rows = valid.shape[0]
            allowed.view(rows, -1).index_fill_(0, invalid, 0.0)
            always.view(rows, -1).index_fill_(0, invalid, math.inf)
        return {"allowance": allowed, "budget_unit": unit, "always": always}


def _torch_dtype(name: str | None) -> torch.dtype | None:
    from maskln_cli.files.tensorfile import torch_dtype

    return torch_dtype(name) if name else None
