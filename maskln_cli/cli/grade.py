"""``maskln grade``: implementations of masked_layer_normalization (or, with ``--op rms``,
masked_rms_normalization) graded clause by clause; one TARGET as a report, several (or a
folder, a shard, a gradebook) as a class."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from maskln_cli.cli.failures import (
    EXIT_ERROR,
    EXIT_MISMATCH,
    end_with_report,
    quiet_when_stdout_closes,
    reports_errors,
)
from maskln_cli.cli.options import JsonOutput, QuietReport

if TYPE_CHECKING:
    from maskln_cli.grading.report import GradeReport
    from maskln_cli.grading.rules import Rules
    from maskln_cli.grading.selection import Selection

EXIT_INTERRUPTED = 130


@reports_errors(writes=False)
def grade(
    targets: Annotated[
        list[str],
        typer.Argument(
            metavar="TARGET...",
            help="path/to/solution.py (its masked_layer_normalization; with --op rms, its"
            " masked_rms_normalization), path/to/solution.py:NAME,"
            " package.module:NAME, or a folder (each of its *.py files). Several TARGETs, or a"
            " folder, grade a class: a row each.",
            show_default=False,
        ),
    ],
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Strict clauses (maskln's own guarantees) count too, but output_layout (name"
            " it with --with).",
        ),
    ] = False,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--with",
            metavar="CLAUSES",
            help="These count too: strict clauses (positive_zero,second_order,...), optional"
            " ones (half_values, half_gradients, run only when named), or the group 'half'."
            " Comma-separated or repeated.",
            show_default=False,
        ),
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            metavar="CLAUSE",
            help="Grade only these clauses (comma-separated or repeated); each one named counts.",
            show_default=False,
        ),
    ] = None,
    op: Annotated[
        str | None,
        typer.Option(
            "--op",
            metavar="OP",
            help="The exercise: layer, masked_layer_normalization(x, valid, scale, bias,"
            " eps=1e-05); or rms, masked_rms_normalization(x, valid, scale, eps=1e-06), RMSNorm"
            " (two_pass and offset_accuracy do not apply to it). (default: the rules', else"
            " layer)",
            show_default=False,
        ),
    ] = None,
    rules_option: Annotated[
        str | None,
        typer.Option(
            "--rules",
            metavar="RULES",
            help="The rule set: a preset (specification: the required clauses; strict), or a"
            " rules file (maskln-grade.toml, or a pyproject.toml's [tool.maskln.grade]). By"
            " default maskln-grade.toml beside the submissions, or the nearest pyproject.toml's"
            " table, else the specification. --strict, --with and --only add to it.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            metavar="SEED",
            help="Seed of the cases (deterministic). (default: the rules', else 0)",
            show_default=False,
        ),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            help="Time limit of each clause. (default: the rules', else each call may take"
            " 10000 times what maskln's op takes on its case, or 25 times a Python loop over its"
            " rows, at least 5 s; a clause 60 s)",
            show_default=False,
        ),
    ] = None,
    device: Annotated[
        str,
        typer.Option(
            "--device", metavar="DEVICE", help="Device the cases are built on (cpu, cuda, ...)."
        ),
    ] = "cpu",
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            metavar="N",
            help="Submissions graded at once, each in its own processes. (default: the rules',"
            " else the CPU count)",
            show_default=False,
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            metavar="K/N",
            help="Grade the K-th of N slices of the sorted TARGETs (1/4 to 4/4: their JSON lines"
            " concatenate into the whole report).",
            show_default=False,
        ),
    ] = None,
    csv_path: Annotated[
        str | None,
        typer.Option(
            "--csv",
            metavar="FILE",
            help="Also write a gradebook: a row per submission, a column per clause.",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOutput = False,
    quiet: QuietReport = False,
) -> None:
    """Grade implementations of masked_layer_normalization against the whole contract.

    Each clause of the specification (required) and of maskln's own guarantees (strict) is
    checked on deterministic cases against maskln's float64 reference; a failure shows its
    first counterexample and the known mistake it matches, and the report leads with the one
    mistake that explains the most failing clauses. The function runs in a child process: a
    crash, a hang or too much memory fails a clause, not the grader. Several TARGETs (or a
    folder) are graded as a class, --jobs at a time: a table with a row per submission, JSON
    lines with --json. Exit code 0 when every counted clause passes (of every submission), 1
    when one fails, 2 when a TARGET cannot be found or an option is wrong (one TARGET that
    cannot be imported or called: 2; in a class, its row fails), 130 on Ctrl-C.

    **Examples**

    ```
    maskln grade solution.py
    maskln grade solution.py:my_layer_norm --strict
    maskln grade rms_solution.py --op rms
    maskln grade solution.py --with positive_zero,second_order --with half
    maskln grade my_kernels.ops:masked_ln --device cuda --only large_shapes
    maskln grade submissions/ --jobs 4 --csv gradebook.csv
    maskln grade submissions/ --shard 2/8 --json > part-2.jsonl
    ```
    """
    from maskln_cli.errors import MasklnError
    from maskln_cli.files.slices import parse_shard, shard_of
    from maskln_cli.grading.rules import resolve_rules
    from maskln_cli.grading.selection import check_timeout, select
    from maskln_cli.grading.targets import expand_targets

    # Usage errors (the rules file's too) before torch is imported.
    select(only or (), strict, include or (), op or "layer")
    if timeout is not None:
        check_timeout(timeout)
    if jobs is not None and jobs < 1:
        raise MasklnError(f"--jobs: must be at least 1, got {jobs}")
    found = resolve_rules(rules_option, targets)
    rules = found.with_command_line(strict, include or (), only or (), op)
    _say_ignored(found.ignored)
    chosen = select(**rules.grading_options())
    listed = expand_targets(targets)
    slice_of = parse_shard(shard) if shard is not None else None
    whole_class = len(listed) > 1 or any(map(os.path.isdir, targets)) or slice_of or csv_path
    if slice_of is not None:
        listed = shard_of(listed, slice_of)
    if csv_path is not None:
        _check_gradebook(csv_path, listed)
    options = {
        **rules.grading_options(),
        "seed": seed if seed is not None else _or(rules.seed, DEFAULT_SEED),
        "timeout": timeout if timeout is not None else _or(rules.timeout, DEFAULT_TIMEOUT),
        "device": device,
    }
    jobs = jobs if jobs is not None else rules.jobs
    if whole_class:
        folder = class_folder(targets)
        _grade_class(listed, options, chosen, jobs, csv_path, json_output, quiet, rules, folder)
    else:
        _grade_one(listed[0], options, json_output, quiet, rules)


def _say_ignored(paths: tuple[str, ...]) -> None:
    """A note for each rules file found beside a submission and not read."""
    if not paths:
        return
    from maskln_cli.cli.report.messages import note
    from maskln_cli.grading.rules import ignored_words

    for path in paths:
        note(ignored_words(path))


def _check_gradebook(path: str, targets: list[str]) -> None:
    """--csv is writable and none of the TARGETs (by identity: a link or another path to one
    of them is refused too)."""
    from maskln_cli.files.output import check_output_path
    from maskln_cli.files.tensorfile import file_identity

    read = {}
    for target in targets:
        location = target.rpartition(":")[0] if ":" in target else target
        identity = file_identity(location) if os.path.isfile(location) else None
        if identity is not None:
            read[identity] = f"the TARGET {target}"
    check_output_path(path, read_files=read)


DEFAULT_TIMEOUT: float | None = None
"""Seconds each clause may take, unless the rules or --timeout say otherwise: None, each call
its own limit, from what maskln's op and a Python loop over the rows take on its case (the
grading library's default)."""
DEFAULT_SEED = 0
"""The seed of the cases, unless the rules or --seed say otherwise."""


def _or(value: float | None, default: float | None) -> float | None:
    return default if value is None else value


def class_folder(targets: list[str]) -> str | None:
    """The folder a class's rows are shown relative to: the one folder TARGET, else the folder
    the file TARGETs share; None when they share none (or are modules)."""
    from maskln_cli.grading.rules import graded_folder

    folder = graded_folder(targets)
    return str(folder) if folder is not None else None


def _grade_one(target: str, options: dict, json_output: bool, quiet: bool, rules: Rules) -> None:
    """One TARGET: its report (or JSON document), the verdict's exit code."""
    from maskln_cli.cli.report.grade import clause_progress, prepare_rendering, render_grade
    from maskln_cli.cli.report.json_output import print_json
    from maskln_cli.grading import guard, sandbox
    from maskln_cli.grading.runner import grade_target

    # Everything the grader uses is imported (its bytecode written) before the seal and before
    # any submission runs: a module first imported sealed leaves no bytecode, which another
    # process could write meanwhile and look like tampering.
    prepare_rendering()
    sandbox.preload()
    with guard.sealing(), clause_progress(target, enabled=not json_output) as progress:
        result = grade_target(
            target,
            **options,
            contain_processes=True,  # this process does nothing else: detached processes come back
            progress=progress,
        )
    result.rules, result.rules_source = rules.name, rules.source_words
    end_with_report(
        0 if result.passed else EXIT_MISMATCH,
        json_output,
        lambda: print_json(result.to_dict()),
        lambda: render_grade(result, quiet=quiet),
    )


def _grade_class(
    targets: list[str],
    options: dict,
    chosen: Selection,
    jobs: int | None,
    csv_path: str | None,
    json_output: bool,
    quiet: bool,
    rules: Rules,
    folder: str | None,
) -> None:
    """Several TARGETs: a row each (or a JSON line each, as each is graded), the gradebook, and
    exit 1 when any fails, 130 when interrupted. Each report says which ``rules`` graded it,
    and where they come from; a rules file is recorded with the class's files (a change stops
    the class); rows show paths relative to ``folder``."""
    from maskln_cli.cli.report.grade import (
        class_progress,
        prepare_rendering,
        print_json_line,
        render_class,
        write_gradebook,
    )
    from maskln_cli.errors import StdoutClosed
    from maskln_cli.grading import guard
    from maskln_cli.grading.classroom import grade_class

    if options["device"].split(":")[0] != "cpu":
        from maskln_cli.grading.runner import check_device

        check_device(options["device"])
    prepare_rendering()
    printing = [json_output]  # off once stdout's reader has gone (| head)

    def on_report(report: GradeReport, graded: int, total: int) -> None:
        report.rules, report.rules_source = rules.name, rules.source_words
        progress(graded, total)
        if printing[0]:
            try:
                print_json_line(report.to_dict())
            except StdoutClosed:
                printing[0] = False  # the rest is still graded: the verdict is the whole class's

    with guard.sealing():
        with class_progress(len(targets), enabled=not json_output) as progress:
            recorded = [rules.path] if rules.path else []
            result = grade_class(targets, **options, jobs=jobs, on_report=on_report,
                                 recorded=recorded)  # fmt: skip
        code = 0
        if result.interrupted:
            code = EXIT_INTERRUPTED
        elif result.problem is not None:
            code = EXIT_ERROR
        elif not result.passed:
            code = EXIT_MISMATCH
        for report in result.reports:  # those not graded too (a worker that ended, ...)
            report.rules, report.rules_source = rules.name, rules.source_words
        shown = f"{rules.name} ({rules.source_words})"
        if not json_output:
            with quiet_when_stdout_closes(code):
                render_class(result, chosen, quiet=quiet, folder=folder, rules=shown)
        elif result.problem is not None:  # why the JSON lines stop: on stderr, one line
            from maskln_cli.cli.report import messages

            messages.error(result.problem)
        if csv_path is not None:
            write_gradebook(csv_path, result, folder=folder, rules=rules.name,
                            rules_source=rules.source_words, op=rules.op)  # fmt: skip
    if code:
        raise typer.Exit(code)
