"""The grader's own files, sealed before any submission runs: a solution runs as the same user,
so it can write into the grader's environment (rich's ``__init__.py``, a ``.pth`` file in
site-packages, a shared library), and code planted there would run inside the grader the next
time it imports or loads it, and could forge a verdict.

:func:`sealing` records the moment before the first child starts and installs an import hook:
from then on, a module whose source or cached bytecode changed after that moment (its ctime,
which a process that is not root cannot set back) is refused instead of imported.
:func:`tampered` lists the files this process has loaded (modules, their bytecode, the shared
libraries mapped into it, and the folders Python searches at start-up for ``.pth`` files and
``sitecustomize``) that changed since: the grader checks it each time a child has ended, and a
grade during which they changed has no verdict but FAIL (:class:`Tampered`).

Python does not write bytecode in a sealed process (a ``.pyc`` written after the seal would
look like tampering).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import site
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

from maskln_cli.errors import MasklnError

_SEALED_AT: list[int] = []


class Tampered(MasklnError):
    """Files the grader loads changed while a submission ran: named in the message."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        shown = ", ".join(self.paths[:3]) + (
            f" and {len(self.paths) - 3} more" if len(paths) > 3 else ""
        )
        super().__init__(
            f"the grader's own files changed while a submission ran ({shown}): no verdict of"
            " this run can be trusted; reinstall the environment (make clean && make) before"
            " grading again"
        )


class _SealedFinder(importlib.abc.MetaPathFinder):
    """Refuses to import a module whose files changed after the seal."""

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        changed = [p for p in _spec_files(spec) if _changed(p) and not same_bytecode(p)]
        if changed:
            raise Tampered(changed)
        return None  # let the usual finders import it


def _spec_files(spec: importlib.machinery.ModuleSpec) -> list[str]:
    files = []
    if spec.origin and os.path.isabs(spec.origin):
        files.append(spec.origin)
    cached = getattr(spec, "cached", None)
    if cached and os.path.exists(cached):
        files.append(cached)
    return files


@contextlib.contextmanager
def sealing(at: int | None = None) -> Iterator[None]:
    """This process's imports sealed inside the block (see the module docstring); nested
    blocks keep the first moment. A command seals itself for its whole run, rendering
    included; the seal is lifted on exit, for a process that goes on (a test suite). ``at``:
    the moment of the seal (``time.time_ns()``) when it is earlier than now: a class grade's
    worker is sealed from the moment the class began, so that a file changed before the worker
    started (by a submission graded earlier) is seen as changed."""
    if _SEALED_AT:
        yield
        return
    finder = _SealedFinder()
    writing = sys.dont_write_bytecode
    _SEALED_AT.append(min(at, time.time_ns()) if at is not None else time.time_ns())
    sys.dont_write_bytecode = True
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
        sys.dont_write_bytecode = writing
        _SEALED_AT.clear()


def sealed() -> bool:
    """Whether this process is sealed now."""
    return bool(_SEALED_AT)


def forget() -> None:
    """No seal any more, in a child forked from a sealed process: the seal was its parent's."""
    _SEALED_AT.clear()
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _SealedFinder)]


def _changed(path: str) -> bool:
    """Whether ``path`` (or the link itself) changed, or appeared, after the seal."""
    if not _SEALED_AT:
        return False
    for status in (os.stat, os.lstat):
        try:
            if status(path).st_ctime_ns >= _SEALED_AT[0]:
                return True
        except OSError:
            continue  # gone: nothing of it can be loaded any more
    return False


def loaded_files() -> Iterator[str]:
    """The files this process has loaded or would read at a start-up: each module's source and
    bytecode, each file mapped into its memory (shared libraries), and the site folders."""
    for module in list(sys.modules.values()):
        for attribute in ("__file__", "__cached__"):
            path = getattr(module, attribute, None)
            if isinstance(path, str) and os.path.isabs(path):
                yield path
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if path.startswith("/") and not path.startswith(_NOT_FILES):
                yield path.removesuffix(" (deleted)")
    folders = [*site.getsitepackages(), site.getusersitepackages()]
    yield from (folder for folder in folders if os.path.isdir(folder))


_NOT_FILES = ("/dev/", "/proc/", "/sys/", "/memfd:")
"""Mappings that are no file the grader loads (shared memory, devices)."""


def tampered() -> list[str]:
    """The loaded files (:func:`loaded_files`) that changed since the seal, sorted; [] when
    not sealed."""
    if not _SEALED_AT:
        return []
    return sorted({p for p in loaded_files() if _changed(p) and not same_bytecode(p)})


def same_bytecode(path: str) -> bool:
    """Whether ``path`` is a ``.pyc`` holding exactly the code its source compiles to: written
    again by another process (Python itself, importing a module whose bytecode was missing or
    stale, or pip), it changed, but nothing was planted in it. A planted ``.pyc`` (one Python
    would run instead of its source: its header matching the source, or an unchecked hash) holds
    other code."""
    if not path.endswith(".pyc"):
        return False
    try:
        source_path = importlib.util.source_from_cache(path)
        with open(path, "rb") as cached:
            data = cached.read()
        with open(source_path, "rb") as source:
            expected = compile(source.read(), source_path, "exec", dont_inherit=True)
        return bool(
            data[:4] == importlib.util.MAGIC_NUMBER and marshal.loads(data[16:]) == expected
        )
    except (OSError, ValueError, SyntaxError, EOFError, TypeError, NotImplementedError):
        return False


def check() -> None:
    """Raise :class:`Tampered` when a loaded file changed since the seal."""
    changed = tampered()
    if changed:
        raise Tampered(changed)


def search_folders() -> list[str]:
    """The folders this process imports from (``sys.path``'s): a file added there (a ``.pth``,
    a module named like one it imports) changes the folder."""
    return [folder for folder in sys.path if folder and os.path.isdir(folder)]


Identity = tuple[int, int, int, int, int] | None


def identity(path: str) -> Identity:
    """What changes when a file or folder is written, replaced, renamed over, its mode or
    owner changed (device, inode, ctime, the link's ctime, size); None when it does not exist."""
    try:
        status, link = os.stat(path), os.lstat(path)
    except OSError:
        return None
    return (status.st_dev, status.st_ino, status.st_ctime_ns, link.st_ctime_ns, status.st_size)


class Snapshot:
    """Files and folders as they were when recorded, to tell later which changed: the files a
    class grade's workers load (checked before each worker starts and after each submission),
    and the submissions' own files."""

    def __init__(self, paths: Iterable[str] = ()) -> None:
        self.identities: dict[str, Identity] = {}
        self.add(paths)

    def add(self, paths: Iterable[str]) -> None:
        """Record these paths as they are now (those recorded already are kept as they were)."""
        for path in paths:
            if path not in self.identities:
                self.identities[path] = identity(path)

    def changed(self) -> list[str]:
        """The paths that changed since they were recorded (or appeared, or went), sorted; a
        ``.pyc`` written again with its source's very code is not (:func:`same_bytecode`)."""
        changed = []
        for path, was in self.identities.items():
            now = identity(path)
            if now == was:
                continue
            if same_bytecode(path):
                self.identities[path] = now
                continue
            changed.append(path)
        return sorted(changed)
