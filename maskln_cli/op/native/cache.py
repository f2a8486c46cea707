"""The native kernels' cache: where this checkout's build lives, whether this user may trust it,
and whether it is whole. Standard library only (``maskln --version`` reads it without torch).

One folder per build, keyed by what the library is built from and links against::

    <root>/native/torch-<version>-<python>-<machine>-<source hash>-<link hash>/
        maskln_native_<source hash>.so     the library
        maskln_native_<source hash>.json   its build record: size, SHA-256, time
        build.lock                          held by the building process, which writes its pid
        failed.json                         a failed build and the toolchain it failed with

The link hash covers torch's build (its ``version.py``: version, git commit, CUDA) and the sizes
of the torch libraries the extension links against, the C++ compiler (its real path, size and
time), the Python ABI and the machine: a home shared between machines, or a new compiler,
never loads another's build.

Trusted, as ssh trusts its keys: the library, its record, and each folder from the root down are
owned by this user (or root) and writable by no one else (neither group nor others); each folder
above the root is owned by this user or root and, when others may write to it, sticky (as
``/tmp``). Whole: the library's size and SHA-256 are those its build recorded after a process of
its own had loaded and run it. A library that is not both is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import stat
import sys
import sysconfig
import time
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path

__all__ = [
    "CACHE_ENV",
    "Damaged",
    "NativeUnavailable",
    "NotBuiltYet",
    "Opened",
    "cache_root",
    "entry_folder",
    "install",
    "link_fingerprint",
    "make_folders",
    "open_library",
    "record_path",
    "torch_version",
]

CACHE_ENV = "MASKLN_NATIVE_CACHE"
RECORD_FORMAT = "maskln native build record 1"
TORCH_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
"""The torch libraries the extension links against (their sizes are in the key)."""
SECURE_FOLDER = 0o700
"""The mode of every folder maskln creates in the cache, whatever the umask."""


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


class NotBuiltYet(NativeUnavailable):
    """No usable build in the cache (a build would make one)."""


class Damaged(NotBuiltYet):
    """A file is at the library's path, but not the build its record describes."""


@dataclass
class Opened:
    """A trusted, whole library, open (``fd``: the caller closes it) so that what is loaded is
    the file that was checked; ``built``: when its record was written (``time.time()``)."""

    library: Path
    fd: int
    built: float


# --- where ------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$MASKLN_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/maskln``, else ``~/.cache/maskln``,
    made absolute.

    Raises:
        NativeUnavailable: no home folder to put it in (HOME unset and no password entry).
    """
    try:
        if os.environ.get(CACHE_ENV):
            root = Path(os.environ[CACHE_ENV]).expanduser()
        elif os.environ.get("XDG_CACHE_HOME"):
            root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "maskln"
        else:
            root = Path.home() / ".cache" / "maskln"
    except (RuntimeError, KeyError) as error:  # Path.home() without HOME or a passwd entry
        raise NativeUnavailable(
            f"no folder for the native kernels' cache: the home folder is unknown ({error});"
            f" set {CACHE_ENV} to a folder of your own"
        ) from error
    return Path(os.path.abspath(root))


def entry_folder(source_hash: str) -> Path:
    """The cache folder of a build of sources hashing to ``source_hash`` here."""
    key = "-".join(
        (
            f"torch-{torch_version()}",
            sys.implementation.cache_tag or sys.implementation.name,
            platform.machine() or "unknown",
            source_hash,
            link_fingerprint(),
        )
    )
    return cache_root() / "native" / key


def record_path(library: Path) -> Path:
    return library.with_suffix(".json")


def torch_folder() -> Path | None:
    """torch's package folder, found without importing torch (nor asking the meta-path finders,
    one of which defines maskln's ops when torch is imported)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        return Path(torch.__file__).parent
    spec = PathFinder.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def torch_version() -> str:
    """torch's version, read from its ``version.py`` (the same whether torch is imported)."""
    text = _torch_version_file()
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "unknown"))


def link_fingerprint() -> str:
    """A hash of what the library is compiled with and links against (see the module's doc)."""
    digest = hashlib.sha256(_torch_version_file().encode())
    folder = torch_folder()
    for name in TORCH_LIBRARIES:
        digest.update(f"\0{name}:{_library_size(folder, name)}".encode())
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is not None:
        real = os.path.realpath(compiler)
        with contextlib.suppress(OSError):
            status = os.stat(real)
            real += f"@{status.st_size}@{status.st_mtime_ns}"
        digest.update(f"\0cxx:{real}".encode())
    digest.update(f"\0{sysconfig.get_config_var('EXT_SUFFIX')}\0{platform.machine()}".encode())
    return digest.hexdigest()[:12]


def _torch_version_file() -> str:
    folder = torch_folder()
    if folder is None:
        return ""
    try:
        return (folder / "version.py").read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def _library_size(folder: Path | None, name: str) -> int:
    if folder is None:
        return -1
    for pattern in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        with contextlib.suppress(OSError):
            return (folder / "lib" / pattern).stat().st_size
    return -1


# --- trust ------------------------------------------------------------------------------------


def _trust_problem(path: Path | str, status: os.stat_result, *, inside: bool) -> str | None:
    """Why ``path`` may not be trusted, or None: in the cache (``inside``), owned by this user
    or root and writable by no one else; above it, owned by this user or root and, when others
    may write to it, sticky."""
    if not hasattr(os, "geteuid"):
        return None  # Windows: no POSIX owners and modes
    user = os.geteuid()
    if status.st_uid not in (user, 0):
        return f"{path} is owned by uid {status.st_uid}, not by you (uid {user}) or root"
    mode = stat.S_IMODE(status.st_mode)
    if inside and mode & 0o022:
        who = "group and others" if mode & 0o022 == 0o022 else "group" if mode & 0o020 else "others"
        return (
            f"{path} is writable by its {who} (mode {mode:04o}); run chmod go-w on it, or remove it"
        )
    if not inside and mode & 0o002 and not mode & stat.S_ISVTX:
        return f"{path} is writable by everyone and not sticky (mode {mode:04o})"
    return None


def _untrusted(problem: str) -> NativeUnavailable:
    return NativeUnavailable(
        f"not loading the native kernels from an unsafe cache: {problem}; or set {CACHE_ENV} to"
        " a folder of your own"
    )


def check_folders(entry: Path) -> bool:
    """Raise :class:`NativeUnavailable` when a folder on the way to ``entry`` (a cache entry
    folder) may not be trusted; return whether ``entry`` exists."""
    root = entry.parent.parent
    real_root = Path(os.path.realpath(root))
    for ancestor in reversed(real_root.parents):
        try:
            status = os.stat(ancestor)
        except FileNotFoundError:
            return False
        problem = _trust_problem(ancestor, status, inside=False)
        if problem is not None:
            raise _untrusted(problem)
    for folder in (real_root, real_root / "native", real_root / "native" / entry.name):
        try:
            status = os.stat(folder)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(status.st_mode):
            raise NativeUnavailable(f"the native kernels' cache {folder} is not a folder")
        problem = _trust_problem(folder, status, inside=True)
        if problem is not None:
            raise _untrusted(problem)
    return True


def make_folders(entry: Path) -> None:
    """Create the folders down to ``entry`` that are missing, each private to this user, then
    check them all (:func:`check_folders`)."""
    missing = []
    folder = entry
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(folder, SECURE_FOLDER)
            os.chmod(folder, SECURE_FOLDER)  # the umask may have taken bits
    check_folders(entry)


# --- whole ------------------------------------------------------------------------------------


def open_library(library: Path) -> Opened:
    """``library`` opened, once it is trusted and whole.

    Raises:
        NotBuiltYet: nothing there (or the folder is missing).
        Damaged: something there that its build did not record (truncated, changed, planted,
            or written by a maskln before build records).
        NativeUnavailable: untrusted, or the cache cannot be read (the message says why).
    """
    try:
        if not check_folders(library.parent):
            raise NotBuiltYet(f"not built yet ({library})")
        try:
            fd = _open_trusted(library)
        except FileNotFoundError:
            raise NotBuiltYet(f"not built yet ({library})") from None
        try:
            record = _read_record(record_path(library))
            problem = _differs(fd, record)
            if problem is not None:
                raise Damaged(f"the cached library {library} {problem}")
        except BaseException:
            os.close(fd)
            raise
    except OSError as error:
        raise NativeUnavailable(
            f"cannot read the native kernels' cache ({error}); set {CACHE_ENV} to a folder of"
            " your own"
        ) from error
    return Opened(library, fd, float(record.get("built", 0.0)))  # type: ignore[arg-type]


def _open_trusted(path: Path) -> int:
    """An fd on ``path`` (a link is refused), once the file it is proves trusted."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        status = os.fstat(fd)
        problem = _trust_problem(path, status, inside=True)
        if problem is None and not stat.S_ISREG(status.st_mode):
            problem = f"{path} is not a regular file"
        if problem is not None:
            raise _untrusted(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_record(path: Path) -> dict[str, object] | None:
    try:
        fd = _open_trusted(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        try:
            record = json.loads(handle.read(65536))
        except ValueError:
            return None
    return record if isinstance(record, dict) and record.get("format") == RECORD_FORMAT else None


def _differs(fd: int, record: dict[str, object] | None) -> str | None:
    """Why the library open on ``fd`` is not the build ``record`` describes, or None."""
    if record is None:
        return "has no build record (not built by this maskln, or its build was interrupted)"
    size = os.fstat(fd).st_size
    if size != record.get("size"):
        return f"is {size} bytes, not the {record.get('size')} its build wrote (changed since)"
    if _sha256(fd) != record.get("sha256"):
        return "differs from what its build wrote (changed since)"
    return None


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def install(built: Path, library: Path) -> None:
    """Move a library that a build has loaded and checked into place as ``library``, and
    record its size and hash (the record is written last: an interruption leaves a library
    without its record, which is rebuilt, never loaded)."""
    os.chmod(built, 0o755)
    fd = os.open(built, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        record = {
            "format": RECORD_FORMAT,
            "size": os.fstat(fd).st_size,
            "sha256": _sha256(fd),
            "built": time.time(),
            "pid": os.getpid(),
        }
    finally:
        os.close(fd)
    target = record_path(library)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)
    os.replace(built, library)
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    part.write_text(json.dumps(record))
    os.chmod(part, 0o644)
    os.replace(part, target)
