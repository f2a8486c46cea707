"""The report of ``maskln verify`` and ``maskln diff``: a header, a block per tensor (or a line
per passing tensor in a long report), the worst rows of each failing tensor, notes, and the
verdict line last."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from maskln_cli.cli.report.consoles import plain_when_piped
from maskln_cli.cli.report.tables import flush_segments, print_table
from maskln_cli.cli.report.text import number, plain_safe, safe
from maskln_cli.compare.data import INTEGRAL_DTYPES, has_values, times

if TYPE_CHECKING:
    from rich.console import Console
    from rich.segment import Segment
    from rich.style import Style
    from rich.table import Table

    from maskln_cli.compare.data import ComparisonReport, TensorComparison


def verdict_line(report: ComparisonReport) -> str:
    """``PASS: ...`` or ``FAIL: ...``, naming the tensors, as rich markup.

    Example:
        >>> from maskln_cli.compare.data import ComparisonReport, TensorComparison
        >>> ok = TensorComparison("out", True, [], [2], [2], "float32", "float32", 1e-5, 1e-5)
        >>> verdict_line(ComparisonReport("diff", "a", "b", [ok]))
        '[bold green]PASS[/]: out within tolerance'
    """
    failed = [t for t in report.tensors if not t.passed]
    if not report.tensors:
        return "[bold yellow]PASS[/]: nothing to compare"
    if not failed:
        names = ", ".join(safe(t.name) for t in report.tensors[:8])
        if len(report.tensors) > 8:
            names = f"{len(report.tensors):,} tensors ({names}, ...)"
        return (
            f"[bold green]PASS[/]: {names} {_within(report)}{_lower_precision(report)}"
            f"{_not_checked(report)}"
        )
    if report.command == "verify":
        described = "; ".join(
            f"{and_list([safe(n) for n in names])}: {safe(what)}"
            for what, names in explanations(failed).items()
        )
    else:
        described = "; ".join(f"{safe(t.name)} ({safe(t.problems[0])})" for t in failed)
    return (
        f"[bold red]FAIL[/]: {len(failed)} of {len(report.tensors)} tensors: {described}"
        f"{_lower_precision(report)}"
    )


def explanations(failed: list[TensorComparison]) -> dict[str, list[str]]:
    """The failing tensors of a verify report by their one explanation (or first problem), in
    the report's order.

    Example:
        >>> from maskln_cli.compare.data import TensorComparison
        >>> def failing(name, why):
        ...     t = TensorComparison(name, False, [why], [2], [2], "float32", "float64", 0, 0)
        ...     t.explanation = why
        ...     return t
        >>> explanations([failing("out", "eps"), failing("grad_x", "eps")])
        {'eps': ['out', 'grad_x']}
    """
    grouped: dict[str, list[str]] = {}
    for tensor in failed:
        what = tensor.explanation or (tensor.problems[0] if tensor.problems else "failed")
        grouped.setdefault(what, []).append(tensor.name)
    return grouped


def and_list(names: list[str]) -> str:
    """``out``, ``out and grad_x``, ``out, grad_x and grad_scale``.

    Example:
        >>> and_list(["out", "grad_x", "grad_scale"])
        'out, grad_x and grad_scale'
    """
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _not_checked(report: ComparisonReport) -> str:
    """``; not checked: ...``: what a passing verify could not see (too few rows to tell a
    systematic error from rounding; C = 1)."""
    missed = report.context.get("not_checked")
    if not isinstance(missed, list) or not missed:
        return ""
    return f"; not checked: {'; '.join(safe(str(m)) for m in missed)}"


def _lower_precision(report: ComparisonReport) -> str:
    """``; RESULT's out is float16, a lower precision than x (float32): judged by float16's
    budget`` when verify judged a tensor in a coarser dtype than INPUT's x."""
    lower = report.context.get("lower_precision")
    if not isinstance(lower, dict):
        return ""
    tensors: dict[str, str] = lower["tensors"]
    by_dtype: dict[str, list[str]] = {}
    for name, dtype in tensors.items():
        by_dtype.setdefault(dtype, []).append(name)
    x_dtype = lower["x_dtype"]
    parts = [
        f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {dtype}, a lower precision"
        f" than x ({x_dtype}): judged by {dtype}'s budget"
        for dtype, names in by_dtype.items()
    ]
    return f"; RESULT's {'; '.join(parts)} (--dtype {x_dtype} judges by {x_dtype}'s)"


def _within(report: ComparisonReport) -> str:
    context = report.context
    if context.get("tolerance") == "budget":
        return f"within the {context.get('result_dtype')} error budget"
    if all(compared_exactly(tensor) for tensor in report.tensors):
        return "equal (compared exactly)"  # no tolerance was involved
    return "within tolerance"


COMPACT_AFTER = 8
"""With more tensors than this, those that pass get one line each instead of a block."""


def render_comparison(
    report: ComparisonReport, quiet: bool = False, to: Console | None = None
) -> None:
    """The human report of ``maskln diff`` and ``maskln verify``: a header, a block per tensor,
    the worst rows of each mismatched tensor, notes, and the verdict line last; on stdout, or
    on the console ``to`` (maskln_cli.testing's, for an assertion's message)."""
    import contextlib

    from rich.segment import Segment

    with plain_when_piped() if to is None else contextlib.nullcontext(to) as console:
        if not quiet:
            _render_header(console, report)
            compact = len(report.tensors) > COMPACT_AFTER
            if compact:
                console.print()
            # Lines and tables are printed at once: a print each was much of what a report of
            # 10,000 tensors took.
            pending: list[Segment] = []
            # A worst-rows table ends with its blank bottom edge: one blank line between
            # sections, so no other is added after it.
            after_blank = compact
            for tensor in report.tensors:
                if compact and tensor.passed:
                    pending += _tensor_line(tensor)
                    after_blank = False
                    continue
                if not after_blank:
                    pending.append(Segment.line())
                print_table(console, _tensor_block(tensor, report), pending)
                after_blank = False
                if tensor.worst and not tensor.passed:
                    pending.append(Segment.line())
                    print_table(console, _worst_rows_table(tensor, report), pending)
                    after_blank = True
            flush_segments(console, pending)
            for message in report.notes:
                console.print(f"[yellow]note:[/] {safe(message)}", soft_wrap=True)
                after_blank = False
            if not after_blank:
                console.print()
        console.print(verdict_line(report), soft_wrap=True)


def _render_header(console: Console, report: ComparisonReport) -> None:
    if report.command != "verify":
        console.print(f"[bold]actual[/]    {safe(report.actual)}", soft_wrap=True)
        console.print(f"[bold]expected[/]  {safe(report.expected)}", soft_wrap=True)
        return
    context = report.context
    dtype = context.get("result_dtype")
    rows, valid = context.get("rows"), context.get("valid_rows")
    assert isinstance(rows, int) and isinstance(valid, int)
    lines = [
        ("result", f"{safe(report.actual)} (actual)"),
        ("reference", f"maskln in float64, from {safe(report.expected)} (expected)"),
        ("eps", f"{context.get('eps')!r}, {_eps_origin(context.get('eps_source'))}"),
        ("rows", f"{valid:,} valid and {rows - valid:,} invalid, of {rows:,}"),
    ]
    if context.get("tolerance") == "budget":
        judged = (
            f"as a {dtype} kernel: within {context.get('factor'):g}x a model of {dtype} rounding"
            f" (--factor), checked against PyTorch's {_yardstick(context)} in {dtype}"
        )
    else:
        judged = "by a fixed tolerance: |actual - expected| <= atol + rtol * |expected|"
    lines.append(("judged", judged))
    grid = _grid()
    for label, value in lines:
        grid.add_row(label, value)
    console.print(grid)


def _grid() -> Table:
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")  # a long path wraps on a terminal, never cut
    return grid


def _tensor_block(tensor: TensorComparison, report: ComparisonReport) -> object:
    verify = report.command == "verify"
    verdict = "[bold green]PASS[/]" if tensor.passed else "[bold red]FAIL[/]"
    grid = _grid()
    grid.add_row(f"{verdict} {safe(tensor.name)}", _shapes(tensor, verify))
    for problem in tensor.problems:
        grid.add_row("  problem", f"[red]{safe(problem)}[/]")
    for found in tensor.diagnosis:
        said = " ".join(tensor.problems)
        if str(found["fix"]) in said:
            continue  # the problem line says what it is and what to do
        if str(found["description"]) in said:
            grid.add_row("  fix", safe(str(found["fix"])))  # the problem line says what it is
        else:
            grid.add_row(
                "  diagnosis", f"likely {safe(found['description'])}; {safe(found['fix'])}"
            )
    if tensor.mismatched is not None:
        grid.add_row("  mismatched", _mismatched(tensor))
        if tensor.rows_left_out is not None:
            by = report.context.get("rows_left_out_by", "--valid")
            grid.add_row("  left out", f"{tensor.rows_left_out:,} rows ({safe(str(by))})")
        if verify:
            _error_rows(grid, tensor, report)
        else:
            grid.add_row("  max abs diff", _at(tensor.max_abs_diff, tensor.max_abs_index))
        grid.add_row("  max rel diff", _at(tensor.max_rel_diff, tensor.max_rel_index))
        if not verify:
            grid.add_row(
                "  rel L2 error", number(tensor.rel_l2) if tensor.rel_l2 is not None else ""
            )
        grid.add_row("  NaN/inf", _nonfinite(tensor, verify))
    if tensor.invalid_rows_zero is not None or tensor.negative_zeros:
        grid.add_row("  padding", _padding(tensor))
    exactly = compared_exactly(tensor)
    if exactly is not None:  # "rtol 0, atol 0" would read as a tolerance chosen to be 0
        if exactly:
            grid.add_row("  compared", exactly)
    elif tensor.rtol == tensor.rtol:  # not NaN: a tolerance applied
        label = "  always allowed" if report.context.get("tolerance") == "budget" else "  tolerance"
        extra = ", 2 ulps" if report.context.get("tolerance") == "budget" else ""
        if INTEGRAL_DTYPES.issuperset((tensor.dtype, tensor.expected_dtype)):
            extra = ", exactly"  # integers within a tolerance, in their exact values
        grid.add_row(label, f"rtol {tensor.rtol:g}, atol {tensor.atol:g}{extra}")
    return grid


def compared_exactly(tensor: TensorComparison) -> str | None:
    """How a tensor compared without any tolerance was compared, for the report: integers
    and bool (unless a tolerance was given) exactly in their values, dtypes without a float64
    form bit for bit (empty when their values were not compared); None when a tolerance applied.

    Example:
        >>> from maskln_cli.compare.data import TensorComparison
        >>> mask = TensorComparison("valid", True, [], [2], [2], "bool", "bool", 0.0, 0.0)
        >>> compared_exactly(mask)
        'exactly (bool: no tolerance applies)'
    """
    dtypes = (tensor.dtype, tensor.expected_dtype)
    if None in dtypes:  # missing on one side: nothing was compared
        return None
    if not all(has_values(dtype) for dtype in dtypes):
        same = tensor.dtype == tensor.expected_dtype and tensor.shape == tensor.expected_shape
        return f"bit for bit, as stored ({tensor.dtype} has no float64 form)" if same else ""
    if INTEGRAL_DTYPES.issuperset(dtypes) and not (tensor.rtol or tensor.atol):
        kind = "bool" if dtypes == ("bool", "bool") else "integers"
        return f"exactly ({kind}: no tolerance applies)"
    return None


def _mismatched(tensor: TensorComparison) -> str:
    """``N of M (p%), in R of S rows``, over the rows compared (those --valid kept)."""
    numel, rows = tensor.numel or 0, tensor.rows
    if tensor.rows_left_out and rows:
        numel -= tensor.rows_left_out * (numel // rows)
        rows -= tensor.rows_left_out
    share = 100 * (tensor.mismatched_fraction or 0.0)
    text = f"{tensor.mismatched:,} of {numel:,} ({share:.3g}%)"
    if rows is not None and tensor.rows != tensor.numel:
        text += f", in {tensor.mismatched_rows:,} of {rows:,} rows"
    return text


def _error_rows(grid: Table, tensor: TensorComparison, report: ComparisonReport) -> None:
    """verify: the kernel's error and PyTorch's beside it, their ratio, and the budget."""
    dtype = report.context.get("result_dtype")
    kernel = (
        f"max abs {_at(tensor.max_abs_diff, tensor.max_abs_index)}, rel L2 {number(tensor.rel_l2)}"
    )
    nonfinite = (tensor.nan_where_finite or 0) + (tensor.inf_where_finite or 0)
    if nonfinite:  # a NaN is no difference of 0: say which elements the figures cover
        kernel += f" [red](finite elements only: {nonfinite:,} are NaN or inf)[/]"
    grid.add_row("  error", kernel)
    yard_max, yard_l2 = tensor.yardstick_max_abs_diff, tensor.yardstick_rel_l2
    if yard_max is not None:
        grid.add_row(f"  PyTorch {dtype}", f"max abs {number(yard_max)}, rel L2 {number(yard_l2)}")
        ratios = [
            (name, _ratio(ours, theirs))
            for name, ours, theirs in (
                ("max abs", tensor.max_abs_diff, yard_max),
                ("rel L2", tensor.rel_l2, yard_l2),
            )
        ]
        shown = ", ".join(f"{value} ({name})" for name, value in ratios if value)
        if shown:
            grid.add_row("  vs PyTorch", f"{shown} as far from float64")
    if tensor.budget_ratio is not None:
        what = "budget" if report.context.get("tolerance") == "budget" else "tolerance"
        ratio = tensor.budget_ratio
        text = (
            f"{ratio:.3g} of what its {what} allows"
            if ratio <= 1
            else f"[red]{times(ratio)} what its {what} allows[/]"
        )
        # Invalid rows are judged by being exactly 0, not by the budget: when they fail, this
        # figure (of the valid rows) must not read as the failure's size.
        label = "worst valid element" if tensor.invalid_rows_zero is False else "worst element"
        grid.add_row(f"  {label}", text)


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or not math.isfinite(ours):
        return ""
    if theirs == 0:
        return "exact, as PyTorch's" if ours == 0 else ""
    return times(ours / theirs)


def _nonfinite(tensor: TensorComparison, verify: bool) -> str:
    if not verify:
        text = f"NaN {tensor.nan_mismatched:,}, inf {tensor.inf_mismatched:,}"
        return f"[red]{text}[/]" if tensor.nan_mismatched or tensor.inf_mismatched else text
    if not (tensor.nan_mismatched or tensor.inf_mismatched):
        return "none where the reference is finite"
    return (
        f"[red]disagree with the reference: NaN at {tensor.nan_mismatched:,} elements, inf at"
        f" {tensor.inf_mismatched:,}[/]"
    )


def _padding(tensor: TensorComparison) -> str:
    if tensor.invalid_rows_zero is False:
        return "[red]not all exactly 0 at invalid positions[/]"
    if tensor.negative_zeros:
        return (
            f"[yellow]-0.0 at {tensor.negative_zeros:,} padded positions[/] (+0.0 expected;"
            " --strict fails it)"
        )
    return "exactly +0.0 at every invalid position"


def _tensor_line(tensor: TensorComparison) -> list[Segment]:
    """One line for a tensor that passed, in a long report, as segments: a report may hold
    10,000 of them, and parsing each one's markup took longer than comparing the tensor."""
    from rich.segment import Segment

    figures = ""
    if tensor.max_abs_diff is not None:
        figures = f"  max abs diff {number(tensor.max_abs_diff)}, rel L2 {number(tensor.rel_l2)}"
    if tensor.rows_left_out:
        figures += f", {tensor.rows_left_out:,} rows left out"
    return [
        Segment("PASS", _style("bold green")),
        Segment(" "),
        Segment(plain_safe(tensor.name), _style("bold")),
        Segment(f"  {_shapes(tensor)}{figures}"),
        Segment.line(),
    ]


@functools.cache
def _style(definition: str) -> Style:
    from rich.style import Style

    return Style.parse(definition)


def _shapes(tensor: TensorComparison, verify: bool = False) -> str:
    def side(dtype: str | None, shape: list[int] | None) -> str:
        return "missing" if dtype is None else f"{dtype} {shape}"

    actual = side(tensor.dtype, tensor.shape)
    if verify:  # the reference is float64 by design: only its shape can tell
        if tensor.shape == tensor.expected_shape or tensor.expected_shape is None:
            return actual
        return f"{actual}, reference {tensor.expected_shape}"
    expected = side(tensor.expected_dtype, tensor.expected_shape)
    return actual if actual == expected else f"actual {actual}, expected {expected}"


def _at(value: float | None, index: list[int] | None) -> str:
    if value is None:
        return "no finite pair"
    if value == 0:
        return "0"
    return f"{number(value)} at {index}"


def _worst_rows_table(tensor: TensorComparison, report: ComparisonReport) -> object:
    from rich import box
    from rich.table import Table

    allowed = "budget" if report.context.get("tolerance") == "budget" else "tolerance"
    exactly = compared_exactly(tensor) is not None  # no tolerance: its column stays empty
    table = Table(
        title=f"worst rows of {safe(tensor.name)}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    table.add_column("row")
    table.add_column("channel", justify="right")
    table.add_column("actual", justify="right")
    table.add_column("expected", justify="right")
    table.add_column("abs diff", justify="right")
    table.add_column("" if exactly else allowed, justify="right")
    table.add_column("")
    for position, worst in enumerate(tensor.worst):
        # The last row may be the max abs diff's, added when not among the worst.
        label = ""
        if position == len(tensor.worst) - 1 and worst.index == tensor.max_abs_index:
            within = worst.allowed is not None and worst.abs_diff <= worst.allowed
            label = f"max abs diff{f', within its {allowed}' if within else ''}"
        table.add_row(
            str(worst.row),
            "" if worst.row == worst.index else str(worst.index[-1]),
            _value(worst.actual, ".7g"),
            _value(worst.expected, ".7g"),
            _value(worst.abs_diff, ".3g") if math.isfinite(worst.abs_diff) else "not finite",
            "" if worst.allowed is None or exactly else f"{worst.allowed:.3g}",
            label,
        )
    return table


def _eps_origin(source: object) -> str:
    """Where eps came from, as the header says it: ``the default``, ``from --eps``...

    Example:
        >>> _eps_origin("default"), _eps_origin("metadata 'eps'")
        ('the default', "from metadata 'eps'")
    """
    return "the default" if source == "default" else f"from {safe(source)}"


def _value(value: float | int, spec: str) -> str:
    """A value of the worst rows: an integer exactly, a float to ``spec``."""
    return f"{value:,}" if isinstance(value, int) else format(value, spec)


def _yardstick(context: dict[str, object]) -> str:
    """``F.layer_norm`` or ``F.rms_norm``: the function verify's yardstick ran."""
    named = str(context.get("yardstick", "torch.nn.functional.layer_norm"))
    return "F." + named.removeprefix("torch.nn.functional.").split(" ", 1)[0]
