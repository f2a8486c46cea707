"""Comparing valid rows only: ``--valid FILE[:KEY]`` of ``maskln diff`` and ``maskln verify``.

A model's own LayerNorm output is not zero on padding, so compared with maskln's it differs on
exactly the padded rows. Given a mask (:mod:`maskln_cli.files.masks`), the rows it marks invalid
are left out: both sides are set to 0 there before a chunk reaches
:class:`~maskln_cli.compare.comparison.Comparison` (which is unchanged: left-out rows simply
agree), and the outcome records how many rows were left out, with its mismatch fraction taken
over the rows compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.files.masks import RowMask

if TYPE_CHECKING:
    import torch

    from maskln_cli.compare.data import TensorComparison


def leave_out(
    actual: torch.Tensor, expected: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``actual`` and ``expected`` (a chunk of whole rows, one ``keep`` entry per row) with the
    rows not kept set to 0 on both sides, so that they compare equal.

    Example:
        >>> import torch
        >>> a, e = leave_out(torch.tensor([[1., 2.], [3., 4.]]), torch.tensor([[1., 2.], [9., 9.]]),
        ...                  torch.tensor([True, False]))
        >>> e.tolist()
        [[1.0, 2.0], [0.0, 0.0]]
    """
    rows = keep.numel()
    drop = ~keep.reshape(rows, 1)
    kept_actual = actual.reshape(rows, -1).masked_fill(drop, 0).reshape(actual.shape)
    kept_expected = expected.reshape(rows, -1).masked_fill(drop, 0).reshape(expected.shape)
    return kept_actual, kept_expected


def count_left_out(outcome: TensorComparison, left_out: int) -> TensorComparison:
    """Record on ``outcome`` the rows left out; its mismatch fraction, and the problem that
    counts mismatched elements, are then over the elements that were compared.

    Example:
        >>> from maskln_cli.compare.data import TensorComparison
        >>> outcome = TensorComparison("out", False, ["3 of 40 elements differ beyond tolerance"],
        ...                            [10, 4], [10, 4], "float32", "float32", 0.0, 0.0,
        ...                            numel=40, rows=10, mismatched=3)
        >>> count_left_out(outcome, 5).problems, outcome.mismatched_fraction
        (['3 of 20 compared elements differ beyond tolerance'], 0.15)
    """
    outcome.rows_left_out = left_out
    if outcome.numel and outcome.rows and outcome.mismatched is not None:
        compared = outcome.numel - left_out * (outcome.numel // outcome.rows)
        outcome.mismatched_fraction = outcome.mismatched / compared if compared else 0.0
        counted = f"{outcome.mismatched:,} of {outcome.numel:,} elements differ beyond tolerance"
        recounted = f"{outcome.mismatched:,} of {compared:,} compared elements differ beyond"
        outcome.problems = [
            f"{recounted} tolerance" if problem == counted else problem
            for problem in outcome.problems
        ]
    return outcome


def row_mask_notes(mask: RowMask, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What ``mask`` leaves out of the tensors of these ``shapes``, as a note; refused when it
    fits none of them (a mask for another file, most likely).

    Example:
        >>> import torch
        >>> mask = RowMask("m:valid", (2,), torch.tensor([True, False]))
        >>> row_mask_notes(mask, {"out": (2, 4), "grad_scale": (4,)})
        ['--valid m:valid: compared 1 of 2 rows of out; in full: grad_scale']
    """
    fitting = [name for name, shape in shapes.items() if mask.applies_to(shape)]
    if not fitting:
        raise MasklnError(
            f"--valid: {mask.source} has shape {list(mask.shape)}, and no tensor compared has"
            f" shape [{', '.join(map(str, mask.shape))}, C]"
        )
    note = f"--valid {mask.source}: compared {mask.rows - mask.left_out:,} of {mask.rows:,} rows"
    note += f" of {', '.join(fitting)}"
    others = [name for name in shapes if name not in fitting]
    return [note + (f"; in full: {', '.join(others)}" if others else "")]
