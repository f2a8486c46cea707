"""What people read: rich tables, notes, errors, JSON and progress, from the plain data of the
library.

Everything shown that came from a file (keys, metadata) goes through
:func:`~maskln_cli.cli.report.text.safe` first, so a hostile file cannot inject terminal control
sequences or rich markup; the consoles replace no ``:name:`` emoji codes, so ``enc:warning:w``
is shown as it is.

Its modules, by what they render:

- :mod:`.consoles`: the stdout and stderr consoles, and output made plain when piped. The
  others reach them as ``consoles.stderr_console()``: swap that one name to capture stderr.
- :mod:`.text`: text from a file made safe to show (``safe``, ``plain_safe``); compact numbers.
- :mod:`.messages`: one-line errors and notes on stderr.
- :mod:`.json_output`: the ``--json`` documents.
- :mod:`.tables`: a fast path for rich's layout of simple tables, byte for byte rich's own.
- :mod:`.progress`: the progress bar on stderr.
- :mod:`.inspect`, :mod:`.comparison` and :mod:`.grade`: the reports of ``maskln inspect``,
  of ``verify`` and ``diff``, and of ``grade`` (a class's table, JSON lines and gradebook in
  :mod:`.gradebook`).

It imports rich (inside functions: ``maskln --help`` does not pay for it) and the plain data it
renders from the layers below; only the commands (:mod:`maskln_cli.cli`) import it.
"""

from maskln_cli.cli.report.json_output import to_json
from maskln_cli.cli.report.text import plain_safe, safe

__all__ = ["plain_safe", "safe", "to_json"]
