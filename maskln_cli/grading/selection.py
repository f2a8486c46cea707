"""Which clauses a grade runs and which count toward its verdict, decided from names alone (this
module imports neither torch nor the clauses: the command line checks its options with it
before anything slow is imported).

Levels (:data:`CLAUSE_LEVELS`, the same as :data:`maskln_cli.grading.clauses.CLAUSES`):

- ``required``: a sentence of the specification; always run, always counted;
- ``strict``: one of maskln's own stronger guarantees; always run and reported, counted with
  ``strict`` (all but :data:`NOT_STRICT_BY_DEFAULT`) or when named in ``include``;
- ``optional``: beyond the specification (half precision); run, and counted, only when named
  in ``include`` (a clause, or a group of :data:`GROUPS`).

``only`` grades the clauses named, each counted. :func:`check_timeout` checks ``--timeout``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from maskln_cli.errors import MasklnError

CLAUSE_LEVELS: dict[str, str] = {
    "signature": "required",
    "worked_example": "required",
    "values": "required",
    "large_shapes": "required",
    "leading_axes": "required",
    "invalid_rows_zero": "required",
    "sanitized_padding": "required",
    "gradients": "required",
    "sanitized_gradients": "required",
    "dtypes": "required",
    "strided_inputs": "required",
    "no_mutation": "required",
    "raw_ops": "required",
    "no_reinit": "required",
    "deterministic": "required",
    "no_shared_results": "required",
    "no_global_effects": "required",
    "no_hooks_left": "required",
    "two_pass": "required",
    "positive_zero": "strict",
    "output_layout": "strict",
    "second_order": "strict",
    "grad_flags": "strict",
    "offset_accuracy": "strict",
    "half_values": "optional",
    "half_gradients": "optional",
}
"""Every clause's level, in the order clauses run and are reported."""

GROUPS: dict[str, tuple[str, ...]] = {
    "half": ("half_values", "half_gradients"),
    "strict": tuple(name for name, level in CLAUSE_LEVELS.items() if level == "strict"),
}
"""Names ``include`` (``--with``) accepts for several clauses at once."""

NOT_STRICT_BY_DEFAULT = ("output_layout",)
"""Strict clauses ``strict`` leaves out unless named: ``output_layout`` asks the output's
memory layout to be ``torch.empty_like(x)``'s, maskln's own convention, which a correct
function need not follow."""


@dataclass(frozen=True)
class Selection:
    """The clauses to run, in table order, and those whose verdict counts."""

    run: tuple[str, ...]
    counted: frozenset[str]
    strict: bool = False

    def level(self, name: str) -> str:
        return CLAUSE_LEVELS[name]


def split_names(values: Iterable[str]) -> list[str]:
    """Names given as repeated options and/or comma-separated lists, in order, once each.

    Example:
        >>> split_names(["positive_zero,second_order", "half", "second_order"])
        ['positive_zero', 'second_order', 'half']
    """
    names = [name.strip() for value in values for name in value.split(",")]
    return list(dict.fromkeys(name for name in names if name))


def select(
    only: Iterable[str] = (),
    strict: bool = False,
    include: Iterable[str] = (),
    op: str = "layer",
) -> Selection:
    """The clauses to run and to count; a usage error naming the option for an unknown name.

    Example:
        >>> chosen = select(include=["positive_zero"])
        >>> "positive_zero" in chosen.counted, "second_order" in chosen.counted
        (True, False)
        >>> "output_layout" in select(strict=True).counted
        False
        >>> "half_values" in select().run, "half_values" in select(include=["half"]).run
        (False, True)
        >>> "two_pass" in select(op="rms").run
        False

    ``op``: the exercise (:mod:`.exercise`); the clauses that do not apply to it are not run,
    and naming one is a usage error.
    """
    from maskln_cli.grading.exercise import check_op, not_run

    skipped = check_op(op).not_run
    only_names = split_names(only)
    unknown = [name for name in only_names if name not in CLAUSE_LEVELS]
    if unknown:
        raise MasklnError(
            f"--only: no clause {unknown[0]!r}; the clauses are {', '.join(CLAUSE_LEVELS)}"
        )
    included: list[str] = []
    for name in split_names(include):
        if name in GROUPS:
            included += GROUPS[name]
        elif name in CLAUSE_LEVELS:
            included.append(name)
        else:
            choosable = [n for n, level in CLAUSE_LEVELS.items() if level != "required"]
            raise MasklnError(
                f"--with: no clause or group {name!r}; the groups are {', '.join(GROUPS)}, the"
                f" clauses {', '.join(choosable)}"
            )
    not_run(only_names, op)
    not_run(split_names(include), op, "--with")
    included = [name for name in included if name not in skipped]  # a group's, silently
    if only_names:
        run = [name for name in CLAUSE_LEVELS if name in only_names or name in included]
        return Selection(tuple(run), frozenset(run), strict)
    run = [
        name
        for name, level in CLAUSE_LEVELS.items()
        if (level in ("required", "strict") or name in included) and name not in skipped
    ]
    counted = {
        name
        for name in run
        if CLAUSE_LEVELS[name] == "required"
        or name in included
        or (strict and CLAUSE_LEVELS[name] == "strict" and name not in NOT_STRICT_BY_DEFAULT)
    }
    return Selection(tuple(run), frozenset(counted), strict)


TIMEOUT_RANGE = (1.0, 86_400.0)
"""Seconds a clause may take, at least and at most (a day): what --timeout or a rules file may
say."""


def check_timeout(timeout: float) -> None:
    """A usage error unless ``timeout`` is a positive number of seconds, within
    :data:`TIMEOUT_RANGE`."""
    if not (timeout > 0 and math.isfinite(timeout)):
        raise MasklnError(f"--timeout: must be a positive number of seconds, got {timeout}")
    low, high = TIMEOUT_RANGE
    if not low <= timeout <= high:
        raise MasklnError(
            f"--timeout: must be between {low:g} and {high:,.0f} seconds, got {timeout:g}"
        )
