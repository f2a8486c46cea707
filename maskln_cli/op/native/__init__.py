"""maskln's native CPU kernels (``masked_layer_norm.cpp`` and its neighbours), built on first use.

The extension is built with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja) into
a per-user cache, one folder per torch version, Python version, machine and source hash::

    $MASKLN_NATIVE_CACHE, else $XDG_CACHE_HOME/maskln, else ~/.cache/maskln
        native/torch-2.13.0+cpu-cpython-311-x86_64-<hash>/maskln_native_<hash>.so

Later imports load that file directly (no compiler, no ninja, a few milliseconds). Processes
starting together (pytest-xdist workers) build once: the first takes a lock file in that folder
and the others wait for it, then load its result; a lock held by a process that died is released
by the OS. ``python -m maskln_cli.op.native`` builds ahead of time (an install step).

The module exposes plain functions, callable without the dispatcher::

    forward(x, valid, scale, bias, eps, keep_statistics=True) -> (y, mean, rstd)
    backward(dy, x, valid, scale, mean, rstd, eps, output_mask) -> [the requested gradients]
    register_maskln_kernels(enable=True) -> whether they were registered before
    set_contract_error(report)   # the Python function that raises the op's own errors
    isa() -> "avx512" | "avx2" | "base";  set_isa(name) -> previous name

and, once ``register_maskln_kernels`` is called, the CPU kernels of maskln's own ops
``maskln::masked_layer_norm`` and ``maskln::masked_layer_norm_backward`` (defined in
:mod:`maskln_cli.op.library`; the extension defines no ops of its own). Inputs of the plain
functions follow the op's contract (:func:`maskln_cli.op.checks.check_inputs`): they check only
what memory safety needs. :mod:`maskln_cli.op.backend` decides when they are used.

This module imports torch only to build or load (``maskln --version`` reads the cache's state
without it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = [
    "NativeUnavailable",
    "NotBuiltYet",
    "available",
    "build",
    "build_problem",
    "library_path",
    "load",
    "unavailable_reason",
]

HERE = Path(__file__).resolve().parent
SOURCES = (
    "masked_layer_norm.cpp",  # tensors, checks, dispatcher ops, C++ autograd
    "bindings.cpp",  # the Python module (pybind11)
    "kernels.cpp",  # the row kernels for three instruction sets, over threads
    "kernels.h",
    "masked_layer_norm.h",
    "ops.h",
)
CFLAGS = (
    "-O3",  # -O2's cheap cost model leaves the lane loops scalar
    "-ffp-contract=off",  # no fused multiply-adds: the same bits from every instruction set
    "-fno-math-errno",  # sqrt as one instruction (torch itself is built so)
    "-Wno-unused-function",
    "-Wno-psabi",  # the ABI notes on vector arguments: all of them are inlined
    # at::parallel_for is a header template that runs on torch's OpenMP threads only when
    # compiled with OpenMP; without it every call ran on one thread.
    "-fopenmp",
)
LDFLAGS = ("-fopenmp",)  # libgomp.so.1: the one torch has loaded, by its soname
BUILD_TIMEOUT = 900.0
"""Seconds to wait for another process's build before giving up."""
CACHE_ENV = "MASKLN_NATIVE_CACHE"
MESSAGE_LIMIT = 4000
"""Characters of the compiler's output kept in a failed build's message (its end)."""
LIBRARY_SUFFIX = ".pyd" if os.name == "nt" else ".so"


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


class NotBuiltYet(NativeUnavailable):
    """``load(build=False)`` found no build in the cache (one may still be possible)."""


_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def load(build: bool = True) -> ModuleType:
    """The extension module, built first if the cache lacks it (with ``build=False``, only
    when a build is already there: a call that must not wait half a minute for a compiler).

    Raises:
        NativeUnavailable: no C++ compiler, no ninja, no Python headers, an unwritable cache,
            or a failed build; the message says which. Remembered for the process (except
            "not built yet" with ``build=False``).
    """
    global _module, _failure
    if _module is not None:
        return _module
    # torch first, outside the lock: importing it defines maskln's ops (maskln_cli.op.library),
    # which loads this module in turn when it is built.
    import torch  # noqa: F401

    with _lock:
        if _module is None:
            if _failure is not None:
                raise NativeUnavailable(_failure)
            if not build and not library_path().exists():
                raise NotBuiltYet(
                    f"not built yet ({library_path()}): python -m maskln_cli.op.native builds it"
                )
            try:
                _module = _load_or_build()
            except NativeUnavailable as error:
                _failure = str(error)
                raise
    return _module


def available(build: bool = True) -> bool:
    """Whether :func:`load` succeeds (building the extension if needed and ``build``)."""
    try:
        load(build)
    except NativeUnavailable:
        return False
    return True


def unavailable_reason() -> str | None:
    """None when the extension loads, else why it does not."""
    try:
        load()
    except NativeUnavailable as error:
        return str(error)
    return None


def build_problem() -> str | None:
    """Why a build would fail here, without building: no compiler, ninja or Python headers, or
    an earlier failed build with this toolchain (remembered in the cache); None otherwise."""
    problem = _toolchain_problem()
    if problem is not None:
        return problem
    return _recorded_failure(library_path().parent / "failed.json")


def build() -> Path:
    """Build (or find) the extension in the cache and load it; returns the library's path."""
    load()
    return library_path()


def source_hash() -> str:
    """A hash of the sources, the compiler flags and how they are built."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    digest.update("\0".join(CFLAGS + LDFLAGS).encode())
    return digest.hexdigest()[:16]


def module_name() -> str:
    # Named by its hash: a process never mixes two builds under one name.
    return f"maskln_native_{source_hash()}"


def cache_root() -> Path:
    """$MASKLN_NATIVE_CACHE, else $XDG_CACHE_HOME/maskln, else ~/.cache/maskln."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "maskln"
    return Path.home() / ".cache" / "maskln"


def build_directory() -> Path:
    """The cache folder of this torch, Python, machine and source hash."""
    key = "-".join(
        (
            f"torch-{torch_version()}",
            sys.implementation.cache_tag or sys.implementation.name,
            platform.machine() or "unknown",
            source_hash(),
        )
    )
    return cache_root() / "native" / key


def torch_version() -> str:
    """torch's version: ``torch.__version__`` once torch is imported, else its package's."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        return str(torch.__version__)
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "unknown"


def library_path() -> Path:
    return build_directory() / f"{module_name()}{LIBRARY_SUFFIX}"


def _load_or_build() -> ModuleType:
    library = library_path()
    if library.exists():
        return _import(library)
    problem = _toolchain_problem()
    if problem is not None:
        raise NativeUnavailable(problem)
    directory = library.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise NativeUnavailable(
            f"cannot create the build cache {directory} ({error}); set {CACHE_ENV} to a writable"
            " folder"
        ) from error
    with _exclusive(directory / "build.lock"):
        if library.exists():  # another process built it while this one waited
            return _import(library)
        failed = directory / "failed.json"
        # the same sources and toolchain failed before: say so at once, without building
        # again in every process (pytest-xdist workers would each wait for a compile)
        recorded = _recorded_failure(failed)
        if recorded is not None:
            raise NativeUnavailable(recorded)
        try:
            return _build(library)
        except NativeUnavailable as error:
            record = {"toolchain": _toolchain_fingerprint(), "error": str(error)}
            with contextlib.suppress(OSError):
                failed.write_text(json.dumps(record))
            raise


def _recorded_failure(failed: Path) -> str | None:
    """The error of an earlier build with this toolchain, recorded in ``failed``, or None."""
    if os.environ.get("MASKLN_NATIVE_REBUILD"):
        return None
    try:
        record = json.loads(failed.read_text())
    except (OSError, ValueError):
        return None
    if record.get("toolchain") != _toolchain_fingerprint():
        return None
    return (
        f"{record.get('error', 'the build failed')} (an earlier build with this toolchain; set"
        f" MASKLN_NATIVE_REBUILD=1 or delete {failed} to retry)"
    )


def _import(library: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against the libraries torch loads)

    name = module_name()
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise NativeUnavailable(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:
        raise NativeUnavailable(f"cannot load {library}: {error}") from error
    sys.modules[name] = module
    return module


def _build(library: Path) -> ModuleType:
    """Compile into a private folder, then move the library into place (atomically)."""
    from torch.utils import cpp_extension

    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=library.parent))
    name = module_name()
    try:
        with _ninja_on_path():
            module = cpp_extension.load(
                name,
                sources=[str(HERE / name) for name in SOURCES if name.endswith(".cpp")],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                extra_include_paths=[str(HERE)],
                build_directory=str(scratch),
                verbose=bool(os.environ.get("MASKLN_NATIVE_VERBOSE")),
            )
        os.replace(scratch / f"{name}{LIBRARY_SUFFIX}", library)
    except Exception as error:  # the compiler's messages are in the error: their end
        message = str(error)
        if len(message) > MESSAGE_LIMIT:
            message = "..." + message[-MESSAGE_LIMIT:]
        raise NativeUnavailable(f"building the native kernels failed: {message}") from error
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.modules[name] = module
    return module


def _toolchain_problem() -> str | None:
    """Why the extension cannot be compiled here, or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: '{compiler}' is not on PATH (install g++ or clang, or set CXX)"
    if _ninja_folder() is None and shutil.which("ninja") is None:
        return "no ninja: pip install ninja (torch.utils.cpp_extension builds with it)"
    include = sysconfig.get_path("include", scheme="nt" if os.name == "nt" else "posix_prefix")
    if include is None or not (Path(include) / "Python.h").exists():
        return f"no Python headers (Python.h) in {include}: install python3-dev"
    return None


def _toolchain_fingerprint() -> list[str]:
    """What a retry after a failed build would need to differ in: the compiler and ninja."""
    found = [shutil.which(os.environ.get("CXX", "c++")), _ninja_folder(), shutil.which("ninja")]
    fingerprint = []
    for path in found:
        try:
            fingerprint.append(f"{path}@{os.stat(path).st_mtime_ns}" if path else "")
        except OSError:
            fingerprint.append(str(path))
    return fingerprint


def _ninja_folder() -> str | None:
    """The folder of the ninja that the ``ninja`` package installed, if it is installed."""
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", None)
    return folder if folder and Path(folder).is_dir() else None


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs ``ninja`` from PATH, which lacks the venv's bin when the venv's
    Python is run without activating it: the ninja package's folder goes first meanwhile."""
    folder = _ninja_folder()
    if folder is None:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = folder + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes, released by the OS if the holder dies."""
    with open(path, "a+b") as handle:
        deadline = time.monotonic() + BUILD_TIMEOUT
        while not _try_lock(handle):
            if time.monotonic() > deadline:
                raise NativeUnavailable(
                    f"waited {BUILD_TIMEOUT:.0f} s for another process's build ({path})"
                )
            time.sleep(0.1)
        try:
            yield
        finally:
            _unlock(handle)


def _try_lock(handle: object) -> bool:
    try:
        if os.name == "nt":
            import msvcrt

            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        else:
            import fcntl

            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[attr-defined]
    except OSError:
        return False
    return True


def _unlock(handle: object) -> None:
    if os.name == "nt":
        import msvcrt

        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]
    else:
        import fcntl

        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)  # type: ignore[attr-defined]
