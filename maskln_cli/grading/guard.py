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


# --- a child's imports, sealed ---------------------------------------------------------------


class _ChildSeal(importlib.abc.MetaPathFinder):
    """In the grader's child: a module none of whose files or folders changed since the grade
    began is imported as usual; one planted since (by this submission, or another one) is
    not found (``ModuleNotFoundError``, which an optional import takes for "not installed"),
    and said on stderr. The submission's own copy, made by the grader, is allowed."""

    def __init__(self, moment: int, allowed: Iterable[str]) -> None:
        self.moment = moment
        self.allowed = {os.path.realpath(p) for p in allowed}

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        paths = _spec_files(spec) + list(spec.submodule_search_locations or [])
        for found in paths:
            if os.path.realpath(found) in self.allowed or same_bytecode(found):
                continue
            if any(
                status(found).st_ctime_ns >= self.moment
                for status in (os.stat, os.lstat)
                if os.path.lexists(found)
            ):
                print(f"maskln grade: not imported: {found} (written while the grade ran)",
                      file=sys.stderr)  # fmt: skip
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def seal_child_imports(moment: int, allowed: Iterable[str] = ()) -> None:
    """From now on (in the grader's child) no module written at or after ``moment`` is
    imported, from any folder, but the ``allowed`` files (:class:`_ChildSeal`)."""
    sys.meta_path.insert(0, _ChildSeal(moment, allowed))


def sealed_at() -> int | None:
    """The moment this process was sealed (``time.time_ns()``), or None."""
    return _SEALED_AT[0] if _SEALED_AT else None


IMPORTABLE = (".py", ".pyc", ".pyw", ".pth", ".so", ".pyd")
"""What Python imports from a folder on its path (a ``.pth`` only from site folders)."""
RULES_FILES = ("maskln-grade.toml", "pyproject.toml")
"""Files the grader reads rules from."""


PACKAGE: Identity = (0, 0, 0, 0, -1)
"""What a package's folder is recorded as: its being there (what changes inside an existing
package is the child's seal's to refuse, :class:`_ChildSeal`; a folder's own times change
whenever Python writes its bytecode)."""


def _watched(folder: str) -> dict[str, Identity]:
    """The entries of ``folder`` a child could import or the grader read as rules: modules,
    packages (folders holding one), rules files; by path, with their identity."""
    found: dict[str, Identity] = {}
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            name, path = entry.name, entry.path
            package = name.isidentifier() and entry.is_dir(follow_symlinks=False)
            if name.endswith(IMPORTABLE) or name in RULES_FILES:
                found[path] = identity(path)
            elif package and _holds_code(path):
                found[path] = PACKAGE
    return found


def _holds_code(folder: str) -> bool:
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        return any(entry.name.endswith(IMPORTABLE) for entry in entries)
    return False


class Watch:
    """Folders a submission could plant in for others: the current folder, the class's, those
    of ``PYTHONPATH``. :meth:`changed` lists what appeared or changed there that a child could
    import, or the grader read as rules (a module, a package, a ``.pth``, a rules file)."""

    def __init__(self, folders: Iterable[str]) -> None:
        self.folders = sorted({os.path.abspath(f) for f in folders if f and os.path.isdir(f)})
        self.seen = {path: ident for f in self.folders for path, ident in _watched(f).items()}

    def changed(self) -> list[str]:
        now = {path: ident for f in self.folders for path, ident in _watched(f).items()}
        return sorted(p for p, ident in now.items() if self.seen.get(p, "new") != ident)


def planted_words(paths: Sequence[str]) -> str:
    """Why a grade stops when :meth:`Watch.changed` found files, naming them."""
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return (
        f"files appeared or changed where a child imports modules or the grader reads rules"
        f" while a submission ran ({', '.join(paths[:3])}{more}): a submission may have"
        " planted them for another; no verdict of this run can be trusted; remove them before"
        " grading again"
    )


def watched_folders(targets: Sequence[str]) -> list[str]:
    """The folders a grade of ``targets`` watches: the current folder, each file target's
    folder, and those of ``PYTHONPATH``."""
    folders = [os.getcwd()]
    folders += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for target in targets:
        location = target.rpartition(":")[0] if ":" in target and not os.path.exists(target) \
            else target  # fmt: skip
        if os.path.isfile(location):
            folders.append(os.path.dirname(os.path.abspath(location)))
    return folders
