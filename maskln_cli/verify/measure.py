"""The streaming pass of ``maskln verify``: RESULT measured against the truth, chunk by chunk.

Each chunk of rows of x gets its float64 truth, the yardstick (PyTorch in each tensor's judged
dtype) and each element's allowance (:mod:`maskln_cli.verify.allowance`); RESULT's rows are
compared with them and all three are dropped. A chunk's rows are measured in cache-sized blocks
on worker threads (:mod:`maskln_cli.verify.blockwork`), their figures merged: out and grad_x
the same figures, bit for bit, as the whole chunk's, as every step is row by row. Sums over
rows (grad_scale and grad_bias, their budgets, the systematic-error regressions) are kept per
block and added in block order, in float64, on the calling thread: their bits never depend on
the thread count; they depend on the block size, which depends on C alone. A chunk with a
block holding NaN or inf is compared whole, in float64, instead (:meth:`StreamingPass._chunk`).
Along the way a few invalid rows holding NaN or inf are remembered for the diagnosis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maskln_cli.compare.files import threads_for
from maskln_cli.compare.rows import leave_out
from maskln_cli.files.problem import GRADIENT_KEYS, Progress
from maskln_cli.op.threads import Blocks, one_thread
from maskln_cli.verify.allowance import Allowance
from maskln_cli.verify.blockwork import Measured, SumShare, float64_truth
from maskln_cli.verify.granularity import grid_spacing
from maskln_cli.verify.options import ROW_TENSORS
from maskln_cli.verify.systematic import FitSums, fit_elements

if TYPE_CHECKING:
    import torch

    from maskln_cli.files.masks import RowMask
    from maskln_cli.verify.budget import Precision
    from maskln_cli.verify.plan import Checked, Plan

CHUNK_ELEMENTS = 1 << 19
"""Elements of x per chunk: the truth, yardstick and budget of a chunk are float64 temporaries
of 4 MiB each."""
GROUP_ELEMENTS = 1 << 22
"""Elements of x whose blocks are measured by one pool of threads (whole chunks)."""
GROUP_ROWS = 1 << 16
"""At most this many rows of x in such a group, but for a single chunk."""
HEAP_BYTES = 31 << 20
"""glibc's malloc takes blocks of this size or less from its heap, and keeps up to twice it
freed there, once it has freed one (see :func:`keep_freed_blocks`)."""
_heap_kept = False


def keep_freed_blocks() -> None:
    """Have glibc's malloc keep the memory of a block's temporaries (float64 blocks of 2 MiB)
    for the next block's, by allocating and freeing (untouched) one block of
    :data:`HEAP_BYTES`, once per process: what glibc does on its own once a program frees a
    block of that size (its mmap threshold follows the largest block freed, up to 32 MiB, and
    its heap keeps up to twice that free). Until then each block of 2 MiB or more was mapped
    afresh, or its memory returned, then faulted in again, page by page: in a verify of
    float32 out [8192, 1024] on one thread, 140,000 page faults and 170-210 ms of system time
    beside 330 ms of computing (the figures and verdicts are the same either way). Nothing
    on another C library, nor once glibc's thresholds are set by hand (mallopt,
    MALLOC_MMAP_THRESHOLD_)."""
    global _heap_kept
    if _heap_kept:
        return
    _heap_kept = True
    import os

    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        libc = ""
    if libc.startswith("glibc"):
        import torch

        torch.empty(HEAP_BYTES, dtype=torch.uint8)  # allocated and freed: never touched


class StreamingPass:
    """One pass over INPUT's rows that feeds each live comparison of a plan, chunk by chunk."""

    def __init__(
        self, plan: Plan, mask: RowMask | None, chunk_rows: int | None, yardstick_raises: bool
    ) -> None:
        import torch

        problem = plan.problem
        self.problem = problem
        self.mask = mask
        self.result = plan.result
        self.mode = plan.mode
        self.judge = plan.judge
        self.precisions = plan.precisions
        self.allowance = Allowance(plan, yardstick_raises)
        self.chunk_rows = chunk_rows or max(2, CHUNK_ELEMENTS // problem.channels)
        self.poisoned: list[int] = []  # invalid rows with NaN or inf in x or grad_out
        # The systematic-error regressions of each tensor (out and grad_x: over their valid
        # rows; grad_scale and grad_bias: over their elements, once summed).
        self.fits: dict[str, FitSums] = {}
        self.torch = torch

    def run(self, live: dict[str, Checked], progress: Progress | None) -> None:
        """Measure RESULT's ``live`` tensors (those with a comparison that can compare)."""
        from maskln_cli.op.blocked import row_blocks
        from maskln_cli.verify.blockwork import BlockWork

        problem = self.problem
        keep_freed_blocks()
        # Gradients are computed only when RESULT holds one to compare, values only when
        # RESULT holds anything to compare.
        gradients = problem.grad_out is not None and any(n in live for n in GRADIENT_KEYS)
        sums = None
        if gradients:
            sums = _Sums(problem.channels, self._sum_dtypes(live), self.precisions)
        self.work = BlockWork(self, live, gradients)
        chunks = list(row_blocks(problem.rows, self.chunk_rows)) if live else []
        # Groups queued on the pool, not yet merged: a group's blocks are queued before the
        # group before it is merged, so the workers measure them meanwhile instead of waiting
        # for the merge (and, at each group's end, for its slowest block). Merged in the same
        # order: the same figures.
        done, pending = 0, []
        try:
            while done < len(chunks):
                # The first chunk alone, merged before any other block starts: its ratio
                # spares later blocks work (see Comparison.measure); then several chunks'
                # blocks to one pool of threads.
                group = self._group(chunks, done) if done else chunks[done : done + 1]
                pending.append((group, self._start_chunks(group)))
                first = done == 0
                done += len(group)
                while pending and (first or len(pending) > 1 or done == len(chunks)):
                    self._merge_group(*pending[0], live, sums, progress)
                    pending.pop(0)
        except BaseException:
            for _, started in pending:  # no block left running after the call
                started.cancel()
            raise
        if sums is not None:
            self._compare_sums(live, sums)

    def _sum_dtypes(self, live: dict[str, Checked]) -> dict[str, torch.dtype]:
        """The judged dtype of grad_scale and grad_bias (their yardsticks' and budgets')."""
        return {
            name: (live[name].judge if name in live else None) or self.judge
            for name in ("grad_scale", "grad_bias")
        }

    def _chunk(self, start: int, stop: int, live: dict[str, Checked], sums: _Sums | None) -> None:
        """Rows ``start:stop`` compared whole, in float64 (NaN and inf included)."""
        from maskln_cli.verify.budget import RowBudget

        problem = self.problem
        x = problem.x[start:stop]
        valid = problem.valid[start:stop]
        x64 = x.double()
        grad_out = problem.grad_out[start:stop] if sums is not None else None  # type: ignore[index]
        dy64 = grad_out.double() if grad_out is not None else None
        truth, _ = float64_truth(problem, x64, valid, dy64)
        self._note_poison(start, x, valid, grad_out)
        sticks = self.work.yardsticks(x, valid, grad_out)
        budgets: dict[torch.dtype, RowBudget] = {}

        def budget_in(dtype: torch.dtype) -> RowBudget:
            if dtype not in budgets:
                budgets[dtype] = RowBudget(
                    x64, valid, problem.scale, problem.bias, problem.eps, self.precisions[dtype],
                    problem.norm.centered,
                )  # fmt: skip
            return budgets[dtype]

        keep = self.mask.keep[start:stop] if self.mask is not None else None
        for name in ROW_TENSORS:
            checked = live.get(name)
            if checked is None:
                continue
            reference = truth[name]
            judge = sticks[checked.judge or self.judge]
            guess = judge.out if name == "out" else judge.grad_x
            comparison = checked.comparison
            assert comparison is not None and guess is not None
            actual = self.result.tensor(checked.key).reshape(-1, problem.channels)[start:stop]
            invalid = ~valid
            if keep is not None:  # --valid: rows left out agree (0 on every side)
                actual, reference = leave_out(actual, reference, keep)
                guess, _ = leave_out(guess, reference, keep)
                invalid = invalid & keep
            rows = budget_in(checked.judge or self.judge)
            if name in self.work.fits and self.work.fitted(start):
                rstd = rows.rstd.reshape(-1)
                fit = self.work.fit(actual, reference, valid, keep, rstd, x64, checked, dy64, start)
                self.fits.setdefault(name, FitSums()).add(fit)
            if self.mode == "budget":
                if name == "out":
                    model, size = rows.out(), self.allowance.out_size
                else:
                    model, size = rows.grad_x(dy64), rows.grad_x_size(dy64)  # type: ignore[arg-type]
                pieces = self.allowance.from_model(
                    comparison, model, guess, reference, valid.unsqueeze(1), size=size
                )
            else:  # the fixed tolerance alone, as assert_close has it; padding exactly 0
                allowed = reference.abs().mul_(comparison.rtol).add_(comparison.atol)
                pieces = {"allowance": allowed.masked_fill_(~valid.unsqueeze(1), 0.0)}
            comparison.update(actual, reference, invalid, yardstick=guess, **pieces)
        if sums is not None and dy64 is not None:
            share = SumShare(truth["grad_scale"], truth["grad_bias"])
            for name, dtype in sums.dtypes.items():
                share.judged[name] = getattr(sticks[dtype], name).double()
                if dtype not in share.budgets:
                    share.budgets[dtype] = budget_in(dtype).share_of_sums(dy64)
            sums.add(share)

    def _group(self, chunks: list[tuple[int, int]], first: int) -> list[tuple[int, int]]:
        """Chunks from ``chunks[first]`` whose blocks are measured together: about
        :data:`GROUP_ELEMENTS` elements (a pool of threads costs milliseconds to start), and
        at most :data:`GROUP_ROWS` rows (their per-row figures wait to be merged)."""
        channels = self.problem.channels
        stop = first
        rows = 0
        while stop < len(chunks) and (stop == first or (
            (rows + chunks[stop][1] - chunks[stop][0]) * channels <= GROUP_ELEMENTS
            and rows + chunks[stop][1] - chunks[stop][0] <= GROUP_ROWS
        )):  # fmt: skip
            rows += chunks[stop][1] - chunks[stop][0]
            stop += 1
        return chunks[first:stop]

    def _start_chunks(self, chunks: list[tuple[int, int]]) -> Blocks[Measured | None]:
        """Consecutive ``chunks``, their rows in cache-sized blocks queued for worker threads
        (see :meth:`Comparison.measure`), for :meth:`_merge_group`."""
        from maskln_cli.compare.comparison import BLOCK_ELEMENTS
        from maskln_cli.op.blocked import row_blocks

        block_rows = BLOCK_ELEMENTS // self.problem.channels
        blocks = [
            (start + a, start + b)
            for start, stop in chunks
            for a, b in row_blocks(stop - start, block_rows)
        ]
        return Blocks(lambda block: self.work.measure(*block), blocks)

    def _merge_group(
        self,
        chunks: list[tuple[int, int]],
        started: Blocks[Measured | None],
        live: dict[str, Checked],
        sums: _Sums | None,
        progress: Progress | None,
    ) -> None:
        """Merge the blocks of ``chunks`` (:meth:`_start_chunks`) once measured, chunk by chunk:
        a chunk with a block holding NaN or inf on either side is compared whole instead
        (:meth:`_chunk`)."""
        from maskln_cli.compare.comparison import BLOCK_ELEMENTS
        from maskln_cli.op.blocked import row_blocks

        block_rows = BLOCK_ELEMENTS // self.problem.channels
        measured = started.results()
        for start, stop in chunks:
            count = len(list(row_blocks(stop - start, block_rows)))
            figures, measured = measured[:count], measured[count:]
            if any(f is None for f in figures):
                with one_thread():
                    self._chunk(start, stop, live, sums)
            else:
                self._merge_chunk(start, stop, live, figures, sums)  # type: ignore[arg-type]
            if progress:
                progress(stop, self.problem.rows)

    def _merge_chunk(
        self,
        start: int,
        stop: int,
        live: dict[str, Checked],
        measured: list[Measured],
        sums: _Sums | None,
    ) -> None:
        """Merge the figures of the blocks of rows ``start:stop`` (see :meth:`_start_chunks`),
        and add their sums, in block order."""
        problem = self.problem
        valid = problem.valid[start:stop]
        invalid = ~valid if self.mask is None else ~valid & self.mask.keep[start:stop]
        grad_out = problem.grad_out[start:stop] if sums is not None else None  # type: ignore[index]
        # Small work on the main thread: on torch's own threads it waits for them to wake,
        # which on a busy machine took longer than measuring the blocks. Only below
        # ONE_THREAD_BELOW rows, where torch would not split the sums anyway: the same bits.
        with threads_for(stop - start):
            self._note_poison(start, problem.x[start:stop], valid, grad_out)
            for name in ROW_TENSORS:
                checked = live.get(name)
                if checked is not None:
                    assert checked.comparison is not None
                    parts = [block.figures[name] for block in measured]
                    checked.comparison.merge(parts, invalid)
        for block in measured:
            for name, fit in block.fits.items():
                self.fits.setdefault(name, FitSums()).add(fit)
            if sums is not None and block.sums is not None:
                sums.add(block.sums)

    def _note_poison(
        self, start: int, x: torch.Tensor, valid: torch.Tensor, grad_out: torch.Tensor | None
    ) -> None:
        """Remember a few invalid rows holding NaN or inf (in x or grad_out): a NaN gradient's
        diagnosis looks for them."""
        if len(self.poisoned) >= 64 or bool(valid.all()):
            return
        invalid = (~valid).nonzero().squeeze(1)  # only they are looked at
        # A row's sum is finite only if its every value is (NaN and inf carry into it, and
        # into the sum of x's and grad_out's): only rows whose sum is not are looked at
        # value by value (isfinite is slow: 1 ms a chunk of [512, 1024]). The invalid rows
        # gathered first, then summed: not every row's sum read for a quarter of them (the
        # rows sum in another order: a NaN or inf carries into the sum either way).
        sums = x.index_select(0, invalid).sum(dim=1)
        if grad_out is not None:
            sums = sums + grad_out.index_select(0, invalid).sum(dim=1)
        invalid = invalid[~sums.isfinite()]
        bad = ~x[invalid].isfinite().all(dim=1)
        if grad_out is not None:
            bad |= ~grad_out[invalid].isfinite().all(dim=1)
        rows = invalid[bad][: 64 - len(self.poisoned)]
        self.poisoned += (rows + start).tolist()

    def _distinct_rows(self, rows: int) -> int:
        """Of ``rows`` valid rows summed, how many are not copies of another (told by their
        variance, where out's fit kept every one): copies round alike, and a sum over them
        carries one row's rounding N times."""
        fit = self.fits.get("out") or self.fits.get("grad_x")
        if fit is None or fit.kept_rows != rows or not fit.kept:
            return rows
        return fit.distinct_rows()

    def _compare_sums(self, live: dict[str, Checked], sums: _Sums) -> None:
        for name, total in (("grad_scale", sums.scale), ("grad_bias", sums.bias)):
            checked = live.get(name)
            if checked is None:
                continue
            comparison = checked.comparison
            assert comparison is not None
            dtype = sums.dtypes[name]
            # The yardstick is summed in float64 over blocks, then rounded as one call would.
            guess = sums.judged[name].to(dtype).double()
            actual = self.result.tensor(checked.key)
            if self.mode == "budget":
                budget = sums.budgets[dtype]
                model = getattr(budget, name)(total)
                pieces = self.allowance.from_model(
                    comparison, model, guess, total, None, size=budget.size(name)
                )
                # grad_bias sums grad_out alone: no row statistic's rounding reaches it.
                second = budget.second_order if name == "grad_scale" else 0.0
                squares = budget.scale_squares if name == "grad_scale" else budget.bias_squares
                # grad_scale's terms move with each row's xhat (the model's first term): by its
                # mean's shift, e0; and where every row is one row, by its rounding to the
                # stored dtype too (a float16 kernel's saved mean), alike in each copy, as the
                # budget has it. Rows of a few variances (bfloat16 rows at an offset of 1e3)
                # get e0 alone: with e1 a grad_scale 1.3 times the truth passed there.
                distinct = self._distinct_rows(budget.rows)
                copies = budget.precision.store if distinct == 1 < budget.rows else 0.0
                noise = budget.moved_squares.sqrt() * (budget.e0 + copies)
                self.fits[name] = fit_elements(
                    actual.double() - total, total, second, squares.sqrt(),
                    noise if name == "grad_scale" else None, distinct,
                    grid_spacing(total, actual.dtype), guess - total,
                    budget.stagnation(),
                )  # fmt: skip
            else:
                pieces = {"allowance": total.abs().mul(comparison.rtol).add_(comparison.atol)}
            comparison.update(actual, total, yardstick=guess, **pieces)


class _Sums:
    """grad_scale and grad_bias accumulated over blocks (or chunks) in float64, in order: the
    truth's, the yardstick's (each share in its judged dtype, added in float64) and their
    budgets' (by judged dtype)."""

    def __init__(
        self,
        channels: int,
        dtypes: dict[str, torch.dtype],
        precisions: dict[torch.dtype, Precision],
    ) -> None:
        import torch

        from maskln_cli.verify.budget import SumBudget

        self.dtypes = dtypes
        zeros = torch.zeros(channels, dtype=torch.float64)
        self.scale, self.bias = zeros.clone(), zeros.clone()
        self.judged = {name: zeros.clone() for name in dtypes}
        self.budgets = {
            dtype: SumBudget(channels, precisions[dtype]) for dtype in set(dtypes.values())
        }

    def add(self, share: SumShare) -> None:
        self.scale += share.scale
        self.bias += share.bias
        for name, value in share.judged.items():
            self.judged[name] += value
        for dtype, budget in share.budgets.items():
            self.budgets[dtype].add(budget)
