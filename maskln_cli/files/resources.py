"""Refusing work that cannot fit, before starting it: memory and disk space known beforehand.

Better a one-line error up front than the OOM killer or a full disk half way through. Where the
machine does not say (no /proc/meminfo), the checks pass and the work is attempted.
"""

from __future__ import annotations

import os
import shutil

from maskln_cli.errors import MasklnError


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux ``MemAvailable``), or None.

    Example:
        >>> available_memory() is None or available_memory() > 0
        True
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(needed: int, what: str) -> None:
    """Raise when ``needed`` bytes are more than the memory available; ``what`` asks for it."""
    available = available_memory()
    if available is not None and needed > available:
        raise MasklnError(
            f"{what} needs about {human_bytes(needed)} of memory; only"
            f" {human_bytes(available)} is available"
        )


def check_disk(path: str, needed: int) -> None:
    """Raise when the folder that will hold ``path`` has less than ``needed`` bytes free."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return
    free = usage.free
    if usage.total == 0:  # a pseudo file system (/proc, /sys): it says nothing about space
        return
    if needed > free:
        raise MasklnError(
            f"{path}: needs {human_bytes(needed)} on disk; only {human_bytes(free)} is free"
        )


def human_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    Example:
        >>> human_bytes(1536), human_bytes(12)
        ('1.5 KiB', '12 B')
    """
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
