"""Comparing tensors, chunk by chunk, into plain data (``maskln diff`` and ``maskln verify``).

An element passes when ``|actual - expected| <= atol + rtol * |expected|`` (computed in float64);
NaN matches NaN only at the same position, and inf matches only the same inf. A
:class:`Comparison` is fed consecutive chunks of whole rows and keeps only running figures
(:mod:`maskln_cli.compare.figures`), so multi-GB tensors compare in bounded memory: a chunk of
finite floating values in blocks measured on worker threads, then merged
(:mod:`maskln_cli.compare.blocks`), any other in float64 as a whole
(:mod:`maskln_cli.compare.general`). Integers and bool are compared exactly instead
(:mod:`maskln_cli.compare.integers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from maskln_cli.compare import general
from maskln_cli.compare.blocks import BlockMeasurer, merge_blocks
from maskln_cli.compare.data import (
    BlockFigures,
    PerElement,
    TensorComparison,
    converts_to_float64,
    default_tolerance,
)
from maskln_cli.compare.figures import RunningFigures
from maskln_cli.files.tensorfile import torch_dtype
from maskln_cli.op.threads import map_blocks

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.judging import Allowances


CHUNK_ELEMENTS = 1 << 22
"""Elements compared at a time (rounded to whole rows): a few float64 temporaries of 32 MiB."""
BLOCK_ELEMENTS = 1 << 18
"""Elements of a block of the fast path (whole rows, at least two). Its float64 temporaries of
2 MiB stay in cache (32 MiB ones stream through memory on every pass), and a block is large
enough that the Python between its torch calls, about a millisecond a block and run holding
the GIL, leaves two workers time to compute side by side. ``maskln verify`` of a 512 MiB x on
2 cores took 7.2 s with blocks of 2**16 elements (as long as on one thread), 5.4 s with 2**17,
4.7 s with 2**18, 5.3 s with 2**19. The figures are the same bits whatever the block size."""


class Comparison(RunningFigures):
    """Running comparison of one tensor, fed consecutive chunks of whole rows: its running
    figures (:class:`RunningFigures`), and how chunks feed them.

    By default an element passes within ``atol + rtol * |expected|`` (``maskln diff``);
    :meth:`update` can instead be given each element's allowance (``maskln verify``'s error
    budget), a yardstick to measure against the same expected values, and the rows whose
    actual values must be exactly 0.

    Example:
        >>> import torch
        >>> comparison = Comparison("out", [2, 2], "float32", [2, 2], "float32")
        >>> comparison.update(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 2.0]]))
        >>> comparison.update(torch.tensor([[3.0, 4.5]]), torch.tensor([[3.0, 4.0]]))
        >>> result = comparison.result()
        >>> result.passed, result.mismatched, result.max_abs_diff, result.max_abs_index
        (False, 1, 0.5, [1, 1])
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str,
        expected_shape: Sequence[int],
        expected_dtype: str,
        rtol: float | None = None,
        atol: float | None = None,
        rank_by_ratio: bool = False,
        same_dtype: bool = True,
    ) -> None:
        super().__init__(shape, rank_by_ratio)
        default_rtol, default_atol = default_tolerance(dtype, expected_dtype)
        self.name = name
        self.expected_shape = list(expected_shape)
        self.dtype = dtype
        self.expected_dtype = expected_dtype
        self._float64_forms = all(
            converts_to_float64(torch_dtype(d)) for d in (dtype, expected_dtype)
        )
        # Floating dtypes on both sides take the fast path of measure() and merge().
        self._fast = all(
            (t := torch_dtype(d)) is not None and t.is_floating_point
            for d in (dtype, expected_dtype)
        )
        self.rtol = default_rtol if rtol is None else rtol
        self.atol = default_atol if atol is None else atol
        # A dtype difference is a problem (diff), or by design (verify: float64 reference).
        self.same_dtype = same_dtype
        # The fast path's measurer holds the tolerance too: it is fixed once made.
        self._blocks = BlockMeasurer(self.row_length, self.rtol, self.atol, rank_by_ratio)

    @property
    def same_shape(self) -> bool:
        return self.shape == self.expected_shape

    @property
    def comparable(self) -> bool:
        """Values can be compared (fed to :meth:`update`) when the shapes agree and both dtypes
        have a float64 form (see :func:`converts_to_float64`)."""
        return self.same_shape and self._float64_forms

    def chunk_rows(self) -> int:
        """Rows per chunk for :meth:`update`, about :data:`CHUNK_ELEMENTS` elements."""
        return max(1, CHUNK_ELEMENTS // max(1, self.row_length))

    def update(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
        allowance: torch.Tensor | None = None,
        yardstick: torch.Tensor | None = None,
        budget_unit: torch.Tensor | None = None,
        always: torch.Tensor | None = None,
    ) -> None:
        """Compare the next chunk of rows.

        ``invalid_rows`` (bool, one per row) marks rows whose actual values must be exactly 0
        (masked layer-norm outputs); they are counted apart, and so are the -0.0 in them.
        ``allowance`` (one per element) replaces ``atol + rtol * |expected|``; ``yardstick``
        (one per element) is another result measured against the same expected values. With
        either, an actual inf where expected is beyond the actual dtype's range (so rounds to
        that inf) passes. ``budget_unit`` and ``always`` (one per element) are how the
        allowance was made, ``max(factor * unit, always)``: the factor each element needed is
        tracked (see :meth:`factor_needed`).
        """
        a = actual.detach().reshape(-1)
        e = expected.detach().reshape(-1)
        if a.numel() != e.numel() or a.numel() % self.row_length:
            raise ValueError("chunks must hold the same whole rows of both tensors")
        per_element = PerElement(allowance, yardstick, budget_unit, always)
        blocks = self._block_ranges(a.numel())
        if blocks:
            flat = [None if t is None else t.detach().reshape(-1) for t in per_element]
            invalid = None if invalid_rows is None else invalid_rows.reshape(-1)
            length = self.row_length

            def one(block: tuple[int, int]) -> BlockFigures | None:
                start, stop = block[0] * length, block[1] * length
                part = [None if t is None else t[start:stop] for t in flat]
                rows = None if invalid is None else invalid[block[0] : block[1]]
                return self.measure(a[start:stop], e[start:stop], rows, *part)

            measured = map_blocks(one, blocks)
            if all(b is not None for b in measured):
                self.merge(measured, invalid)  # type: ignore[arg-type]
                return
        self._update_general(actual, expected, invalid_rows, per_element)

    def _update_general(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None,
        per_element: PerElement,
    ) -> None:
        """:meth:`update` for any values, NaN and inf included, on the whole chunk in float64
        (the definition the fast path of :meth:`measure` and :meth:`merge` reproduces)."""
        general.update_general(
            self, actual, expected, invalid_rows, per_element, self.rtol, self.atol,
            self.dtype,
        )  # fmt: skip

    def _block_ranges(self, numel: int) -> list[tuple[int, int]]:
        """Blocks of whole rows (two or more, see :func:`maskln_cli.op.blocked.row_blocks`) of about
        :data:`BLOCK_ELEMENTS`; none when the chunk is empty or a dtype has no fast path."""
        if not numel or not self._fast:
            return []
        from maskln_cli.op.blocked import row_blocks

        rows = numel // self.row_length
        return list(row_blocks(rows, max(2, BLOCK_ELEMENTS // self.row_length)))

    def measure(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        invalid_rows: torch.Tensor | None = None,
        allowance: torch.Tensor | None = None,
        yardstick: torch.Tensor | None = None,
        budget_unit: torch.Tensor | None = None,
        always: torch.Tensor | None = None,
        yardstick_error: torch.Tensor | None = None,
        allowance_of: Allowances | None = None,
        lower: float = 0.0,
        floors: Callable[[], torch.Tensor | None] | None = None,
        keep_error: bool | torch.Tensor = False,
        bounds: Callable[..., torch.Tensor | None] | None = None,
        alike: bool = False,
    ) -> BlockFigures | None:
        """The figures of one block of whole rows, as :meth:`update` takes it, for
        :meth:`merge`; None when a value is NaN or inf (the general path then compares the
        chunk). Reads no running figure but the greatest ratio merged so far, so blocks of a
        chunk can be measured on several threads before it is merged.

        The float64 values and operations are those of the general path, element by element
        and row by row, so every figure is the same bit for bit; only work whose outcome is
        known is skipped (no NaN or inf to mask, no element beyond when no ratio reaches 1).
        ``yardstick_error`` is ``|yardstick - expected|`` in float64 when the caller has it.

        ``allowance_of`` (instead of ``allowance``, ``budget_unit`` and ``always``) makes
        those pieces for the rows it is given (None: every row), as :meth:`update` takes them;
        ``lower`` is at most every allowance and every ``always`` of a valid row (invalid rows
        are allowed nothing). Then only rows where an element could be beyond its allowance,
        or beyond what is always allowed, or could hold the greatest ratio, get their
        allowances: see :class:`~maskln_cli.compare.judging.AllowancesOnDemand`. ``floors``
        (with ``allowance_of``) makes each element's ``always`` on valid rows, for finer
        bounds than ``lower``'s. ``keep_error``: the figures hold ``actual - expected`` in
        float64 too (:attr:`BlockFigures.error`), made in ``keep_error`` itself when it is a
        tensor (float64, contiguous, of ``actual``'s size). ``bounds`` (with ``floors``) makes
        a lower bound of each element's allowance on valid rows from ``|expected|``
        (``bounds(finite_abs=...)``; None: none): finer bounds still. ``alike``: ``actual`` is
        ``yardstick`` bit for bit, and ``yardstick_error`` (then the caller's to give: squared
        in place) is so the differences, not made again; ``keep_error``, if kept, is a tensor
        holding them signed already.
        """
        per_element = PerElement(allowance, yardstick, budget_unit, always)
        return self._blocks.measure(
            actual, expected, invalid_rows, per_element, yardstick_error, allowance_of, lower,
            self.max_ratio, floors, keep_error, bounds, alike,
        )  # fmt: skip

    def merge(
        self, blocks: Sequence[BlockFigures], invalid_rows: torch.Tensor | None = None
    ) -> None:
        """Add the figures of consecutive blocks making up one chunk (``invalid_rows``: one flag
        per row of the chunk), as :meth:`update` of the whole chunk would: sums over rows are
        taken over the whole chunk's rows, in one call, as the general path takes them."""
        merge_blocks(self, blocks, invalid_rows)

    @staticmethod
    def update_many(
        comparisons: Sequence[Comparison], actual: torch.Tensor, expected: torch.Tensor
    ) -> list[bool]:
        """Feed many small tensors at once, row ``k`` of ``actual`` and ``expected`` (2-d,
        ``[len(comparisons), numel]``) being the whole of comparison ``k``'s tensors; return
        which were fed: those whose every element is finite and within tolerance, whose
        figures take a few torch calls for all. Each other comparison is fed nothing, and
        must go through :meth:`update`.

        A tiny tensor's comparison is some 45 torch calls on a handful of elements, 180 us in
        all; ``diff`` of 10,000 such tensors spent most of its time there. Each figure here is
        the one :meth:`update` computes, by the same operations, row by row (a test checks
        them against it); the comparisons must all have the same shape, dtypes, rtol and
        atol, and be fresh.

        Example:
            >>> import torch
            >>> made = [Comparison(n, [2], "float32", [2], "float32") for n in "ab"]
            >>> Comparison.update_many(made, torch.tensor([[1.0, 2.0], [3.0, 4.5]]),
            ...                        torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
            [True, False]
            >>> made[0].result().passed  # made[1] (4.5 against 4.0) must go through update
            True
        """
        first = comparisons[0]
        return general.update_many(comparisons, actual, expected, first.rtol, first.atol)

    def result(self, extra_problems: Iterable[str] = (), compared: bool = True) -> TensorComparison:
        """The outcome, once every chunk has been fed.

        With ``compared=False`` (or shapes that differ) no values were fed, and the outcome
        holds the shapes, dtypes and problems only.
        """
        problems = list(extra_problems)
        if self.shape != self.expected_shape:
            problem = f"shape {self.shape} vs expected {self.expected_shape}"
            if math.prod(self.expected_shape) == self.numel:
                problem += ": the same number of elements in another shape; values not compared"
            problems.append(problem)
        if self.same_dtype and self.dtype != self.expected_dtype:
            problems.append(f"dtype {self.dtype} vs expected {self.expected_dtype}")
        outcome = TensorComparison(
            name=self.name,
            passed=False,
            problems=problems,
            shape=self.shape,
            expected_shape=self.expected_shape,
            dtype=self.dtype,
            expected_dtype=self.expected_dtype,
            rtol=self.rtol,
            atol=self.atol,
        )
        if not (self.comparable and compared):
            outcome.passed = not problems
            return outcome
        if self.offset != self.numel:
            raise ValueError(f"compared {self.offset} of {self.numel} elements of {self.name!r}")
        self.fill(outcome)
        outcome.passed = not outcome.problems
        return outcome
