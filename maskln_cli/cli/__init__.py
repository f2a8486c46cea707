"""The face: the ``maskln`` command line and everything people read.

This package knows Typer and rich. :mod:`.app` holds the Typer app and lists the commands, each
a module that parses its options, calls one library function and renders its result:
:mod:`.normalize`, :mod:`.inspect`, :mod:`.generate`, :mod:`.comparisons` (verify and diff) and
:mod:`.grade`. The options several commands take are defined once in :mod:`.options`; how a
command fails (one line on stderr, an exit code) is :mod:`.failures`, how its help and usage
errors read is :mod:`.usage`. :mod:`.report` renders results: tables, notes, JSON and progress.

It is the only code that knows rich or writes to the terminal, and nothing below imports it.
torch is imported only inside the commands that compute, so ``maskln --help`` stays fast.
"""

from maskln_cli.cli.app import app, main

__all__ = ["app", "main"]
