"""The streaming pass of ``maskln verify``: RESULT measured against the truth, chunk by chunk.

Each chunk of rows of x gets its float64 truth, the yardstick (PyTorch in the judged dtype) and
each element's allowance (:mod:`maskln_cli.verify.allowance`); RESULT's rows are compared with
them and all three are dropped. Only the gradient sums over rows are accumulated, and compared
at the end. Without gradients every step is row by row, so a chunk's rows are measured in
cache-sized blocks on worker threads and their figures merged: the same figures, bit for bit.
Along the way a few invalid rows holding NaN or inf are remembered for the diagnosis.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from maskln_cli.compare.files import threads_for
from maskln_cli.compare.rows import leave_out
from maskln_cli.files.problem import GRADIENT_KEYS, Progress
from maskln_cli.verify.allowance import Allowance
from maskln_cli.verify.options import ROW_TENSORS

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.data import BlockFigures
    from maskln_cli.files.masks import RowMask
    from maskln_cli.verify.budget import SumBudget, Yardstick
    from maskln_cli.verify.plan import Checked, Plan

CHUNK_ELEMENTS = 1 << 19
"""Elements of x per chunk: the truth, yardstick and budget of a chunk are float64 temporaries
of 4 MiB each."""
GROUP_ELEMENTS = 1 << 22
"""Elements of x whose blocks are measured by one pool of threads (whole chunks)."""
GROUP_ROWS = 1 << 16
"""At most this many rows of x in such a group, but for a single chunk."""


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
        self.precision = plan.precision
        self.allowance = Allowance(plan, yardstick_raises)
        self.chunk_rows = chunk_rows or max(2, CHUNK_ELEMENTS // problem.channels)
        self.poisoned: list[int] = []  # invalid rows with NaN or inf in x or grad_out
        self.torch = torch

    def run(self, live: dict[str, Checked], progress: Progress | None) -> None:
        """Measure RESULT's ``live`` tensors (those with a comparison that can compare)."""
        from maskln_cli.op.blocked import row_blocks
        from maskln_cli.verify.budget import SumBudget

        problem = self.problem
        # Gradients are computed only when RESULT holds one to compare, values only when
        # RESULT holds anything to compare.
        gradients = problem.grad_out is not None and any(n in live for n in GRADIENT_KEYS)
        sums = _Sums(problem.channels) if gradients else None
        sum_budget = SumBudget(problem.channels, self.precision) if gradients else None
        # Without gradients (sums over rows), every step is row by row: a chunk's rows are
        # then computed in blocks on worker threads.
        blocked = sums is None
        chunks = list(row_blocks(problem.rows, self.chunk_rows)) if live else []
        done = 0
        while done < len(chunks):
            # The first chunk alone: its merged ratio spares later blocks work (see
            # Comparison.measure); then several chunks' blocks to one pool of threads.
            group = self._group(chunks, done) if blocked and done else chunks[done : done + 1]
            measured = self._measure_chunks(group, live) if blocked else [None] * len(group)
            for (start, stop), figures in zip(group, measured, strict=True):
                if figures is None:  # not blocked, or a block holds NaN or inf
                    self._chunk(start, stop, live, sums, sum_budget)
                else:
                    self._merge_chunk(start, stop, live, figures)
                if progress:
                    progress(stop, problem.rows)
            done += len(group)
        if sums is not None and sum_budget is not None:
            self._compare_sums(live, sums, sum_budget)

    def _chunk(
        self,
        start: int,
        stop: int,
        live: dict[str, Checked],
        sums: _Sums | None,
        sum_budget: SumBudget | None,
    ) -> None:
        from maskln_cli.op.api import masked_layer_normalization
        from maskln_cli.verify.budget import RowBudget, yardstick

        torch = self.torch
        problem = self.problem
        x = problem.x[start:stop]
        valid = problem.valid[start:stop]
        x64 = x.double()
        grad_out = problem.grad_out[start:stop] if sums is not None else None  # type: ignore[index]
        dy64 = grad_out.double() if grad_out is not None else None
        if dy64 is not None:
            leaves = [t.detach().requires_grad_() for t in (x64, problem.scale, problem.bias)]
            with torch.enable_grad():
                out = masked_layer_normalization(
                    leaves[0], valid, leaves[1], leaves[2], problem.eps
                )
                grads = torch.autograd.grad(out, leaves, dy64)
            truth = dict(zip(GRADIENT_KEYS, grads, strict=True), out=out.detach())
        else:
            with torch.no_grad():
                truth = {
                    "out": masked_layer_normalization(
                        x64, valid, problem.scale, problem.bias, problem.eps
                    )
                }
        self._note_poison(start, x, valid, grad_out)
        judge = yardstick(x, valid, problem.scale, problem.bias, problem.eps, self.judge, grad_out)
        rows = RowBudget(x64, valid, problem.scale, problem.bias, problem.eps, self.precision)
        keep = self.mask.keep[start:stop] if self.mask is not None else None
        for name in ROW_TENSORS:
            checked = live.get(name)
            if checked is None:
                continue
            reference = truth[name]
            guess = judge.out if name == "out" else judge.grad_x
            comparison = checked.comparison
            assert comparison is not None and guess is not None
            actual = self.result.tensor(checked.key).reshape(-1, problem.channels)[start:stop]
            invalid = ~valid
            if keep is not None:  # --valid: rows left out agree (0 on every side)
                actual, reference = leave_out(actual, reference, keep)
                guess, _ = leave_out(guess, reference, keep)
                invalid = invalid & keep
            if self.mode == "budget":
                model = rows.out() if name == "out" else rows.grad_x(dy64)  # type: ignore[arg-type]
                pieces = self.allowance.from_model(
                    comparison, model, guess, reference, valid.unsqueeze(1)
                )
            else:  # the fixed tolerance alone, as assert_close has it; padding exactly 0
                allowed = reference.abs().mul_(comparison.rtol).add_(comparison.atol)
                pieces = {"allowance": allowed.masked_fill_(~valid.unsqueeze(1), 0.0)}
            comparison.update(actual, reference, invalid, yardstick=guess, **pieces)
        if sums is not None and sum_budget is not None and dy64 is not None:
            sums.add(truth["grad_scale"], truth["grad_bias"], judge)
            rows.add_to(sum_budget, dy64)

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

    def _measure_chunks(
        self, chunks: list[tuple[int, int]], live: dict[str, Checked]
    ) -> list[list[dict[str, BlockFigures]] | None]:
        """:meth:`_chunk` without gradients for consecutive ``chunks``, their rows in
        cache-sized blocks measured on worker threads (see :meth:`Comparison.measure`), for
        :meth:`_merge_chunk`: the same figures, bit for bit, as every step is row by row.
        None for a chunk with a block holding NaN or inf on either side: :meth:`_chunk` then
        compares it."""
        from maskln_cli.compare.comparison import BLOCK_ELEMENTS
        from maskln_cli.op.blocked import row_blocks
        from maskln_cli.op.threads import map_blocks

        problem = self.problem
        block_rows = BLOCK_ELEMENTS // problem.channels
        blocks = [
            (start + a, start + b)
            for start, stop in chunks
            for a, b in row_blocks(stop - start, block_rows)
        ]
        results = {
            name: self.result.tensor(checked.key).reshape(-1, problem.channels)
            for name, checked in live.items()
        }
        measured = map_blocks(lambda block: self._measure_block(*block, live, results), blocks)
        by_chunk: list[list[dict[str, BlockFigures]] | None] = []
        for start, stop in chunks:
            count = len(list(row_blocks(stop - start, block_rows)))
            figures, measured = measured[:count], measured[count:]
            by_chunk.append(None if any(f is None for f in figures) else figures)  # type: ignore[misc]
        return by_chunk

    def _merge_chunk(
        self,
        start: int,
        stop: int,
        live: dict[str, Checked],
        measured: list[dict[str, BlockFigures]],
    ) -> None:
        """Merge the figures of the blocks of rows ``start:stop`` (see :meth:`_measure_chunks`)."""
        valid = self.problem.valid[start:stop]
        invalid = ~valid if self.mask is None else ~valid & self.mask.keep[start:stop]
        # Small work on the main thread: on torch's own threads it waits for them to wake,
        # which on a busy machine took longer than measuring the blocks. Only below
        # ONE_THREAD_BELOW rows, where torch would not split the sums anyway: the same bits.
        with threads_for(stop - start):
            self._note_poison(start, self.problem.x[start:stop], valid, None)
            for name in ROW_TENSORS:
                checked = live.get(name)
                if checked is not None:
                    assert checked.comparison is not None
                    parts = [figures[name] for figures in measured]
                    checked.comparison.merge(parts, invalid)

    def _measure_block(
        self, start: int, stop: int, live: dict[str, Checked], results: dict[str, torch.Tensor]
    ) -> dict[str, BlockFigures] | None:
        """The truth, yardstick and allowance of rows ``start:stop``, as :meth:`_chunk` makes
        them, measured against RESULT (None when a value is NaN or inf)."""
        from maskln_cli.op.api import masked_layer_normalization
        from maskln_cli.verify.budget import yardstick

        torch = self.torch
        problem = self.problem
        x = problem.x[start:stop]
        valid = problem.valid[start:stop]
        x64 = x.double()
        with torch.no_grad():
            truth = masked_layer_normalization(x64, valid, problem.scale, problem.bias, problem.eps)
        guess = yardstick(x, valid, problem.scale, problem.bias, problem.eps, self.judge).out
        actual = results["out"][start:stop]
        invalid = ~valid
        if self.mask is not None:  # --valid: rows left out agree (0 on every side)
            keep = self.mask.keep[start:stop]
            actual, truth = leave_out(actual, truth, keep)
            guess, _ = leave_out(guess, truth, keep)
            invalid = invalid & keep
        # |yardstick - truth|: for the budget and the comparison alike, computed once.
        error = (guess.double() - truth).abs_()
        measured: dict[str, BlockFigures] = {}
        checked = live.get("out")  # grad_x is checked only with gradients: not here
        if checked is None:
            return measured
        comparison = checked.comparison
        assert comparison is not None
        allowance_of = functools.partial(
            self.allowance.of_rows, comparison, (x64, valid, truth, guess, error)
        )
        # Every element of a valid row is allowed atol or more: what is always allowed
        # (budget.floor) adds it, and the allowance is at least that.
        figures = comparison.measure(
            actual, truth, invalid, yardstick=guess, yardstick_error=error,
            allowance_of=allowance_of, lower=comparison.atol,
        )  # fmt: skip
        if figures is None:
            return None
        measured["out"] = figures
        return measured

    def _note_poison(
        self, start: int, x: torch.Tensor, valid: torch.Tensor, grad_out: torch.Tensor | None
    ) -> None:
        """Remember a few invalid rows holding NaN or inf (in x or grad_out): a NaN gradient's
        diagnosis looks for them."""
        if len(self.poisoned) >= 64 or bool(valid.all()):
            return
        invalid = (~valid).nonzero().squeeze(1)  # only they are looked at
        if grad_out is None:
            # A row's sum is finite only if its every value is (NaN and inf carry into it):
            # only rows whose sum is not are looked at value by value (isfinite is slow).
            sums = x.sum(dim=1)[invalid]
            invalid = invalid[~sums.isfinite()]
        bad = ~x[invalid].isfinite().all(dim=1)
        if grad_out is not None:
            bad |= ~grad_out[invalid].isfinite().all(dim=1)
        rows = invalid[bad][: 64 - len(self.poisoned)]
        self.poisoned += (rows + start).tolist()

    def _compare_sums(self, live: dict[str, Checked], sums: _Sums, sum_budget: SumBudget) -> None:
        for name, total, guess in (
            ("grad_scale", sums.scale, sums.judge_scale),
            ("grad_bias", sums.bias, sums.judge_bias),
        ):
            checked = live.get(name)
            if checked is None:
                continue
            comparison = checked.comparison
            assert comparison is not None
            # The yardstick is summed in float64 over chunks, then rounded as one call would.
            guess = guess.to(self.judge).double()
            actual = self.result.tensor(checked.key)
            if self.mode == "budget":
                model = getattr(sum_budget, name)(total)
                pieces = self.allowance.from_model(comparison, model, guess, total, None)
            else:
                pieces = {"allowance": total.abs().mul(comparison.rtol).add_(comparison.atol)}
            comparison.update(actual, total, yardstick=guess, **pieces)


class _Sums:
    """grad_scale and grad_bias accumulated over chunks in float64: the truth's and the
    yardstick's (each chunk's share, in the judged dtype, added in float64)."""

    def __init__(self, channels: int) -> None:
        import torch

        zeros = torch.zeros(channels, dtype=torch.float64)
        self.scale, self.bias = zeros.clone(), zeros.clone()
        self.judge_scale, self.judge_bias = zeros.clone(), zeros.clone()

    def add(self, scale: torch.Tensor, bias: torch.Tensor, judge: Yardstick) -> None:
        assert judge.grad_scale is not None and judge.grad_bias is not None
        self.scale += scale
        self.bias += bias
        self.judge_scale += judge.grad_scale.double()
        self.judge_bias += judge.grad_bias.double()
