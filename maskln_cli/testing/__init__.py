"""maskln in a kernel author's own test suite: tensors in memory judged as ``maskln verify``
judges files.

- :func:`check_kernel` (:mod:`.checking`): a kernel called on copies of its inputs, its output
  and gradients judged against the inputs as given, and any change it made to an input a
  failure (:class:`InputModified`). The one to use when the kernel can be called.
- :func:`assert_close` (:mod:`.judging`): ``out`` and the gradients given, judged by the error
  budget; raises an AssertionError whose message is the plain-text report, and a pass that
  could not check everything warns (:class:`NotCheckedWarning`). :func:`verify` returns that
  report as data.
- :mod:`.strategies`: Hypothesis strategies drawing the inputs that break kernels (Hypothesis
  is an optional dependency: ``pip install 'maskln[testing]'``).
- :mod:`.plugin`: the pytest plugin (entry point ``pytest11``) that shows a failing
  ``assert_close``'s report as ``maskln verify`` prints it.
- :mod:`.inputs` makes a problem and a result of the tensors, :mod:`.text` the report's text.

The judging is verify's own (:func:`maskln_cli.verify.job.verify_problem`), never a copy: this
package imports verify, op (the argument rules), files (the problem it builds), compare (the
report's data) and, to render the report as verify prints it, the command line's report
(``maskln_cli.cli.report``), nothing else of it. Nothing of maskln_cli imports this package.
Importing it imports neither torch nor hypothesis (pytest loads the plugin in every run): its
names are looked up when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maskln_cli.testing.checking import InputModified, check_kernel
    from maskln_cli.testing.judging import NotCheckedWarning, VerifyFailed, assert_close, verify
    from maskln_cli.testing.text import report_text

__all__ = [
    "InputModified",
    "NotCheckedWarning",
    "VerifyFailed",
    "assert_close",
    "check_kernel",
    "report_text",
    "verify",
]

_HOMES = {
    "check_kernel": "maskln_cli.testing.checking",
    "InputModified": "maskln_cli.testing.checking",
    "assert_close": "maskln_cli.testing.judging",
    "NotCheckedWarning": "maskln_cli.testing.judging",
    "verify": "maskln_cli.testing.judging",
    "VerifyFailed": "maskln_cli.testing.judging",
    "report_text": "maskln_cli.testing.text",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'maskln_cli.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
