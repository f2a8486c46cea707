"""The one exception the command line turns into a one-line message and exit code 2."""

from __future__ import annotations


class MasklnError(Exception):
    """A usage, input or output error, with a message naming the file, key or argument.

    Example:
        >>> str(MasklnError("in.safetensors: no tensor 'x'"))
        "in.safetensors: no tensor 'x'"
    """


class StdoutClosed(Exception):
    """stdout was closed by its reader (``maskln verify ... | head``): a report ends there,
    quietly, as git's and grep's do; the command keeps its own exit code."""
