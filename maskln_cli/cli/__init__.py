"""The face: the ``maskln`` command line and everything people read.

This package knows Typer and rich: the commands (:mod:`.app`), which parse options, call one
library function each and render its result (:mod:`.report`: tables, notes, JSON and progress).
It is the only code that knows rich or writes to the terminal, and nothing below imports it.
torch is imported only inside the commands that compute, so ``maskln --help`` stays fast.
"""

from maskln_cli.cli.app import app, main

__all__ = ["app", "main"]
