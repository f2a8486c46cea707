"""The ``maskln`` command line: a thin Typer layer over the library.

Each command parses its options, calls one library function and renders the result. torch is
imported only inside commands that compute, so ``maskln --help`` and ``--version`` are fast.
Exit codes: 0 success, 1 a comparison found a mismatch, 2 a usage, input or output error.

This module holds the app and its commands, in the order ``--help`` lists them. Each command is
a module of its own (verify and diff share :mod:`.comparisons`), the options several take are in
:mod:`.options`, how they fail in :mod:`.failures`, how their help and usage errors read in
:mod:`.usage`, and what they print in :mod:`.report`.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Annotated

import typer

from maskln_cli.cli.comparisons import diff, verify
from maskln_cli.cli.failures import raise_terminated
from maskln_cli.cli.generate import generate
from maskln_cli.cli.grade import grade
from maskln_cli.cli.inspect import inspect
from maskln_cli.cli.normalize import normalize
from maskln_cli.cli.usage import OneLineErrors, PlainHelp
from maskln_cli.errors import MasklnError
from maskln_cli.version import installed_version

app = typer.Typer(
    cls=OneLineErrors,
    name="maskln",
    help="Masked layer normalization over safetensors files: a reference result in one command.",
    epilog="Exit codes: 0 success, 1 mismatch (verify, diff) or failed clause (grade), 2 usage,"
    " input or output error,"
    " 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"maskln {installed_version()}")
        from maskln_cli.op.backend import active_backend  # reads the kernel cache, not torch

        try:
            typer.echo(f"op backend: {active_backend()}")
        except MasklnError as error:
            typer.echo(f"op backend: unknown ({error})")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            help="Print the version and the op's backend (native or raw kernels), and exit.",
        ),
    ] = False,
) -> None:
    """Masked layer normalization over safetensors files: a reference result in one command.

    Valid rows of x [..., C] become (x - mean) / sqrt(var + eps) * scale + bias over the last
    axis; invalid rows become exactly 0, whatever they hold.
    """
    if hasattr(signal, "SIGTERM"):
        # ValueError: not the main thread (an embedding program); leave its handlers be.
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, raise_terminated)


# The commands, in the order --help lists them.
for command in (normalize, inspect, generate, verify, diff, grade):
    app.command(cls=PlainHelp, no_args_is_help=True)(command)


def main() -> None:
    """The console script: ``maskln``."""
    from maskln_cli.files import shrinking

    shrinking.install_handler()  # an input truncated while mapped: one line, exit 2
    app(prog_name="maskln")
