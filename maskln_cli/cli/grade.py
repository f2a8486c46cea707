"""``maskln grade``: an implementation of masked_layer_normalization graded clause by clause."""

from __future__ import annotations

from typing import Annotated

import typer

from maskln_cli.cli.failures import EXIT_MISMATCH, reports_errors
from maskln_cli.cli.options import JsonOutput, QuietReport


@reports_errors
def grade(
    target: Annotated[
        str,
        typer.Argument(
            metavar="TARGET",
            help="path/to/solution.py (its masked_layer_normalization), path/to/solution.py:NAME,"
            " or package.module:NAME.",
            show_default=False,
        ),
    ],
    strict: Annotated[
        bool,
        typer.Option("--strict", help="Strict clauses (maskln's own guarantees) count too."),
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            metavar="CLAUSE",
            help="Grade only this clause (repeatable); each one named counts.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", metavar="SEED", help="Seed of the cases (deterministic).")
    ] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", help="Time limit of each clause.")
    ] = 60.0,
    device: Annotated[
        str,
        typer.Option(
            "--device", metavar="DEVICE", help="Device the cases are built on (cpu, cuda, ...)."
        ),
    ] = "cpu",
    json_output: JsonOutput = False,
    quiet: QuietReport = False,
) -> None:
    """Grade an implementation of masked_layer_normalization against the whole contract.

    Each clause of the specification (required) and of maskln's own guarantees (strict) is
    checked on deterministic cases against maskln's float64 reference; a failure shows its
    first counterexample and the known mistake it matches. The function runs in a child
    process: a crash, a hang or too much memory fails a clause, not the grader.
    Exit code 0 when every required clause passes (and strict ones with --strict), 1 when one
    fails, 2 when TARGET cannot be found, imported or called.

    **Examples**

    ```
    maskln grade solution.py
    maskln grade solution.py:my_layer_norm --strict
    maskln grade my_kernels.ops:masked_ln --device cuda --only gradients
    maskln grade solution.py --json | jq '.clauses[] | select(.passed | not)'
    ```
    """
    from maskln_cli.cli.report.grade import render_grade
    from maskln_cli.cli.report.json_output import print_json
    from maskln_cli.grading.runner import grade_target

    result = grade_target(
        target,
        strict=strict,
        only=only or (),
        seed=seed,
        timeout=timeout,
        device=device,
        contain_processes=True,  # this process does nothing else: detached processes come back
    )
    if json_output:
        print_json(result.to_dict())
    else:
        render_grade(result, quiet=quiet)
    if not result.passed:
        raise typer.Exit(EXIT_MISMATCH)
