"""maskln's installed version, looked up when asked for (standard library only)."""

from __future__ import annotations

import functools


@functools.cache
def installed_version() -> str:
    """The version pip installed, or ``0+unknown`` in a source tree that is not installed.

    importlib.metadata takes some 45 ms to import: looked up only when asked for, so that
    ``maskln --help`` does not pay for it.
    """
    from importlib import metadata

    try:
        return metadata.version("maskln")
    except metadata.PackageNotFoundError:
        return "0+unknown"
