"""maskln's native CPU kernels (``masked_layer_norm.cpp`` and its neighbours), built on first use.

The extension is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) into a
per-user cache, one folder per build of these sources against this torch and compiler (the
layout and the rules of trust are :mod:`maskln_cli.op.native.cache`'s)::

    $MASKLN_NATIVE_CACHE, else $XDG_CACHE_HOME/maskln, else ~/.cache/maskln
        native/torch-2.13.0+cpu-cpython-311-x86_64-<source hash>-<link hash>/
            maskln_native_<source hash>.so   and its build record, .json

A build runs in a child process, which compiles the library, loads it and checks a few values
against float64 arithmetic; only then is the library moved into place, with a record of its
size and SHA-256. A process loads a library only when it is trusted and matches its record, and
loads the very file it checked (through its descriptor): a truncated, damaged, planted or
half-written file is never loaded into this process (a library that fails to load can leave
its ``TORCH_LIBRARY`` half registered, and a second one poisons the process), it is rebuilt, or,
without a compiler, the op falls back to its raw-op kernels. One load is tried per process.

Processes starting together (pytest-xdist workers) build once: the first takes a lock file in
that folder, writing its pid, and the others say whom they wait for, then load its result; a
lock held by a process that died is released by the OS. ``python -m maskln_cli.op.native``
builds ahead of time (the install step); ``--clean`` removes this checkout's build.
``MASKLN_NATIVE_REBUILD=1`` rebuilds once per process (and retries a build that failed).

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
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.machinery import ExtensionFileLoader
from pathlib import Path
from types import ModuleType

from maskln_cli.op.native import cache
from maskln_cli.op.native.cache import CACHE_ENV, Damaged, NativeUnavailable, NotBuiltYet

__all__ = [
    "CACHE_ENV",
    "CacheState",
    "NativeUnavailable",
    "NotBuiltYet",
    "available",
    "build",
    "build_problem",
    "library_path",
    "load",
    "remove_build",
    "state",
    "unavailable_reason",
]

HERE = Path(__file__).resolve().parent
SOURCES = (
    "masked_layer_norm.cpp",  # tensors, checks, dispatcher ops, C++ autograd
    "bindings.cpp",  # the Python module (pybind11)
    "kernels.cpp",  # the row kernels over threads, the instruction set picked at run time
    "kernels_base.cpp",  # the row kernels for each instruction set, one unit each (compiled
    "kernels_avx2.cpp",  # side by side: together they were the build's longest unit)
    "kernels_avx512.cpp",
    "kernel_variants.h",
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
"""Seconds to wait for a build (this process's, or another's that holds the lock)."""
WAIT_NOTE_EVERY = 60.0
"""Seconds between two 'still waiting' lines while another process builds."""
REBUILD_ENV = "MASKLN_NATIVE_REBUILD"
MESSAGE_LIMIT = 4000
"""Characters of the compiler's output kept in a failed build's message (its end)."""
LIBRARY_SUFFIX = ".pyd" if os.name == "nt" else ".so"
_STARTED = time.time()
"""When this process imported the module: MASKLN_NATIVE_REBUILD rebuilds what is older."""


class _RebuildAsked(NotBuiltYet):
    """MASKLN_NATIVE_REBUILD is set and the cached build is older than this process."""


_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def load(build: bool = True) -> ModuleType:
    """The extension module, built first if the cache lacks a whole, trusted build (with
    ``build=False``, only when one is already there: a call that must not wait half a minute
    for a compiler).

    Raises:
        NotBuiltYet: ``build=False`` and no usable build (missing, or damaged: the message
            says which); not remembered, a later call may build.
        NativeUnavailable: no C++ compiler, ninja or Python headers, an unusable or untrusted
            cache, a failed build, or a library that would not load; the message says which.
            Remembered for the process: one load is tried per process.
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
            try:
                _module = _load_or_build(build)
            except NativeUnavailable as error:
                if build or not isinstance(error, NotBuiltYet):
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
    try:
        return _recorded_failure(library_path().parent / "failed.json")
    except (NativeUnavailable, OSError, ValueError):
        return None


def build() -> Path:
    """Build (or find) the extension in the cache and load it; returns the library's path."""
    load()
    return library_path()


@dataclass(frozen=True)
class CacheState:
    """What the cache holds for this process, read from files alone (no torch import, no
    load): ``library`` when a whole, trusted build is there (what :func:`load` loads);
    else ``problem`` when the native kernels cannot be used here, or ``todo``, what the first
    use will do (build or rebuild)."""

    library: Path | None = None
    folder: Path | None = None
    problem: str | None = None
    todo: str | None = None


def state() -> CacheState:
    """The cache's state for this process (see :class:`CacheState`); never raises."""
    try:
        library = library_path()
        usable = _usable(library)
    except NativeUnavailable as error:
        return CacheState(problem=str(error))
    except (OSError, ValueError) as error:
        return CacheState(problem=_unreadable(error))
    if isinstance(usable, cache.Opened):
        os.close(usable.fd)
        return CacheState(library=library, folder=library.parent)
    damage = str(usable) if isinstance(usable, Damaged) else None
    problem = build_problem()
    if problem is not None:
        return CacheState(
            folder=library.parent, problem=f"{damage}; {problem}" if damage else problem
        )
    if damage is not None or isinstance(usable, _RebuildAsked):
        return CacheState(
            folder=library.parent, todo=f"{usable}: rebuilt on first use (about a minute)"
        )
    return CacheState(
        folder=library.parent,
        todo="not built yet: compiled on first use (about a minute), or now by python -m"
        " maskln_cli.op.native",
    )


def remove_build() -> Path | None:
    """Remove this checkout's build (its folder in the cache); return the folder removed, or
    None when there was none. (``make clean``.)

    Raises:
        NativeUnavailable: the cache may not be trusted or cannot be read.
    """
    folder = library_path().parent
    try:
        if not cache.check_folders(folder):
            return None
        shutil.rmtree(folder)
    except OSError as error:
        raise NativeUnavailable(_unreadable(error)) from error
    return folder


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
    return cache.cache_root()


def build_directory() -> Path:
    """The cache folder of this build: these sources, torch's build and the compiler."""
    return cache.entry_folder(source_hash())


def torch_version() -> str:
    """torch's version, read from its package without importing it."""
    return cache.torch_version()


def library_path() -> Path:
    return build_directory() / f"{module_name()}{LIBRARY_SUFFIX}"


# --- loading and building ---------------------------------------------------------------------


def _load_or_build(build: bool = True) -> ModuleType:
    try:
        library = library_path()
        usable = _usable(library)
        if isinstance(usable, cache.Opened):
            return _import(usable)
        if not build:
            raise usable
        try:
            return _build_and_load(library, usable)
        except NotBuiltYet as error:  # changed again since this process built it
            raise NativeUnavailable(str(error)) from None
        except NativeUnavailable as error:
            if isinstance(usable, Damaged) and not isinstance(error, Damaged):
                raise NativeUnavailable(f"{usable}, and it cannot be rebuilt: {error}") from None
            raise
    except (OSError, ValueError) as error:  # a path too long, an unreadable folder, a NUL
        raise NativeUnavailable(_unreadable(error)) from error


def _build_and_load(library: Path, why: NotBuiltYet) -> ModuleType:
    """Build ``library`` (missing, damaged, or to be rebuilt: ``why``) unless another process
    did while this one waited for the lock, and load it."""
    problem = _toolchain_problem()
    if problem is not None:
        raise NativeUnavailable(problem)
    directory = library.parent
    try:
        cache.make_folders(directory)
    except OSError as error:
        raise NativeUnavailable(
            f"cannot create the build cache {directory} ({error}); set {CACHE_ENV} to a"
            " writable folder of your own"
        ) from error
    with _exclusive(directory / "build.lock"):
        usable = _usable(library)  # another process may have built it meanwhile
        if isinstance(usable, cache.Opened):
            return _import(usable)
        failed = directory / "failed.json"
        # the same sources and toolchain failed before: say so at once, without building
        # again in every process (pytest-xdist workers would each wait for a compile)
        recorded = _recorded_failure(failed)
        if recorded is not None:
            raise NativeUnavailable(recorded)
        _say(_what_builds(why, directory))
        start = time.perf_counter()
        try:
            _build(library)
        except NativeUnavailable as error:
            record = {"toolchain": _toolchain_fingerprint(), "error": str(error)}
            with contextlib.suppress(OSError):
                failed.write_text(json.dumps(record))
            raise
        with contextlib.suppress(OSError):
            failed.unlink()
        _say(f"maskln: native CPU kernels built in {time.perf_counter() - start:.0f} s")
        return _import(cache.open_library(library))


def _usable(library: Path) -> cache.Opened | NotBuiltYet:
    """The trusted, whole library open, or why there is none to load (missing, damaged, or
    older than this process when MASKLN_NATIVE_REBUILD asks for a new one).

    Raises:
        NativeUnavailable: the cache is untrusted or unreadable.
    """
    try:
        opened = cache.open_library(library)
    except NotBuiltYet as missing:
        return missing
    if os.environ.get(REBUILD_ENV) and opened.built < _STARTED:
        os.close(opened.fd)
        return _RebuildAsked(f"{REBUILD_ENV} is set: {library}")
    return opened


def _what_builds(why: NotBuiltYet, directory: Path) -> str:
    if isinstance(why, Damaged):
        return f"maskln: rebuilding the native CPU kernels (about a minute): {why}"
    if isinstance(why, _RebuildAsked):
        return f"maskln: rebuilding the native CPU kernels in {directory} ({REBUILD_ENV} is set)"
    return (
        f"maskln: compiling the native CPU kernels into {directory} (once per torch build and"
        " compiler; about a minute)"
    )


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _unreadable(error: BaseException) -> str:
    return (
        f"cannot use the native kernels' cache ({error}); set {CACHE_ENV} to a folder of your own"
    )


def _recorded_failure(failed: Path) -> str | None:
    """The error of an earlier build with this toolchain, recorded in ``failed``, or None."""
    if os.environ.get(REBUILD_ENV):
        return None
    try:
        record = json.loads(failed.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("toolchain") != _toolchain_fingerprint():
        return None
    return (
        f"{record.get('error', 'the build failed')} (an earlier build with this toolchain; set"
        f" {REBUILD_ENV}=1 or delete {failed} to retry)"
    )


def _import(opened: cache.Opened) -> ModuleType:
    """Load the library ``opened`` has checked, through its descriptor: the file loaded is the
    file checked, whatever happens to the path meanwhile."""
    import torch  # noqa: F401  (the extension links against the libraries torch loads)

    name = module_name()
    try:
        if name in sys.modules:
            return sys.modules[name]
        origin = str(opened.library)
        if os.path.isdir("/proc/self/fd"):
            origin = f"/proc/self/fd/{opened.fd}"
        loader = ExtensionFileLoader(name, origin)
        spec = importlib.util.spec_from_file_location(name, origin, loader=loader)
        if spec is None:
            raise NativeUnavailable(f"cannot load {opened.library}")
        try:
            module = importlib.util.module_from_spec(spec)  # dlopen
            loader.exec_module(module)
        except Exception as error:  # ImportError, or whatever its initialization raised
            raise NativeUnavailable(f"cannot load {opened.library}: {error}") from error
    finally:
        os.close(opened.fd)
    module.__file__ = spec.origin = str(opened.library)  # the path, not the descriptor's
    sys.modules[name] = module
    return module


def _build(library: Path) -> None:
    """Compile, load and check the library in a child process (:func:`_compile`), then move
    it into place with its record (:func:`cache.install`)."""
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=library.parent))
    try:
        built = _compile(scratch, module_name())
        cache.install(built, library)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _compile(scratch: Path, name: str) -> Path:
    """Build the library ``name`` in ``scratch`` in a child process, which loads it and checks
    its values (:func:`compile_and_check`): this process loads nothing that failed there."""
    code = (
        f"import sys; sys.path[0] = {str(HERE.parents[2])!r};"  # this maskln, not the cwd's
        " from maskln_cli.op.native import compile_and_check;"
        f" sys.exit(compile_and_check({str(scratch)!r}, {name!r}))"
    )
    verbose = bool(os.environ.get("MASKLN_NATIVE_VERBOSE"))
    environment = dict(os.environ, MASKLN_BACKEND="raw")  # the child loads no cached build
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        env=environment,
        stdin=subprocess.DEVNULL,
        stdout=None if verbose else subprocess.PIPE,
        stderr=None if verbose else subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # its compilers are killed with it on a timeout
    )
    try:
        output, _ = process.communicate(timeout=BUILD_TIMEOUT)
    except BaseException as error:  # a timeout, Ctrl-C, SIGTERM: no compiler left behind
        _kill_group(process)
        if isinstance(error, subprocess.TimeoutExpired):
            raise NativeUnavailable(
                f"building the native kernels failed: no result after {BUILD_TIMEOUT:.0f} s"
            ) from None
        raise
    built = scratch / f"{name}{LIBRARY_SUFFIX}"
    if process.returncode != 0 or not built.is_file():
        message = (output or "").strip() or f"the build exited with status {process.returncode}"
        if len(message) > MESSAGE_LIMIT:
            message = "..." + message[-MESSAGE_LIMIT:]
        raise NativeUnavailable(f"building the native kernels failed: {message}")
    return built


def _kill_group(process: subprocess.Popen[str]) -> None:
    if hasattr(os, "killpg"):
        with contextlib.suppress(OSError):
            os.killpg(process.pid, 9)
    else:
        process.kill()
    process.wait()


def compile_and_check(scratch: str, name: str) -> int:
    """The build's child process: compile the library into ``scratch``, load it, check its
    values against float64 arithmetic. 0 when it passes; 1, with the reason, when not."""
    from torch.utils import cpp_extension

    try:
        with _ninja_on_path():
            module = cpp_extension.load(
                name,
                sources=[str(HERE / source) for source in SOURCES if source.endswith(".cpp")],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                extra_include_paths=[str(HERE)],
                build_directory=scratch,
                verbose=bool(os.environ.get("MASKLN_NATIVE_VERBOSE")),
            )
        problem = _self_check(module)
    except Exception as error:  # the compiler's messages are in the error
        problem = str(error)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


def _self_check(module: ModuleType) -> str | None:
    """Why a freshly built library computes wrongly, or None: its forward and bias gradient on
    three rows (one invalid), against float64 arithmetic written out here."""
    import torch

    double = torch.float64
    x = torch.tensor(
        [[1.0, 2.0, 4.0, 8.0], [3.0, -1.0, 0.0, 5.0], [0.5, 0.25, -2.0, 7.0]], dtype=double
    )
    valid = torch.tensor([True, False, True])
    scale = torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=double)
    bias = torch.tensor([0.0, 0.25, -1.0, 3.0], dtype=double)
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    want = torch.where(valid[:, None], (x - mean) / torch.sqrt(variance + 1e-5) * scale + bias, 0.0)
    for dtype, tolerance in ((double, 1e-12), (torch.float32, 1e-5)):
        y, mean_out, rstd = module.forward(
            x.to(dtype), valid, scale.to(dtype), bias.to(dtype), 1e-5, True
        )
        if not torch.allclose(y.double(), want, rtol=tolerance, atol=tolerance):
            return f"the built library's {dtype} forward differs from float64 arithmetic"
    dy = torch.ones_like(x)
    y, mean_out, rstd = module.forward(x, valid, scale, bias, 1e-5, True)
    (dbias,) = module.backward(dy, x, valid, scale, mean_out, rstd, 1e-5, [False, False, True])
    if not torch.equal(dbias, torch.full_like(bias, 2.0)):
        return "the built library's bias gradient differs from the count of valid rows"
    module.isa()
    return None


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


# --- the build lock ---------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes, released by the OS if the holder dies.
    The holder writes its pid there; a waiter says whom it waits for, and keeps saying it."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        if not _try_lock(fd):
            _wait_for(fd, path)
        _write_holder(fd, f"{os.getpid()}\n")
        try:
            yield
        finally:
            _write_holder(fd, "")
            _unlock(fd)
    finally:
        os.close(fd)


def _wait_for(fd: int, path: Path) -> None:
    """Wait for the lock on ``fd``; past a moment (a holder about to finish says nothing),
    say whom for, then again every WAIT_NOTE_EVERY seconds."""
    start = time.monotonic()
    note = start + 0.3
    said = False
    while not _try_lock(fd):
        now = time.monotonic()
        if now - start > BUILD_TIMEOUT:
            raise NativeUnavailable(
                f"waited {BUILD_TIMEOUT:.0f} s for {_holder(fd)} to build the native kernels"
                f" ({path})"
            )
        if now >= note:
            holder = _holder(fd)
            if said:
                _say(f"maskln: still waiting for {holder} ({now - start:.0f} s)")
            else:
                _say(
                    f"maskln: waiting for {holder} to finish building the native kernels in"
                    f" {path.parent} (it holds {path.name}; waiting up to {BUILD_TIMEOUT:.0f} s)"
                )
            said = True
            note = now + WAIT_NOTE_EVERY
        time.sleep(0.1)


def _holder(fd: int) -> str:
    """Whom the lock on ``fd`` is held by, as its holder wrote it: ``process 1234``."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        pid = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


def _write_holder(fd: int, text: str) -> None:
    if os.name == "nt":  # msvcrt's lock bars the locked byte to readers: no pid there
        return
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, text.encode())


def _try_lock(fd: int) -> bool:
    try:
        if os.name == "nt":
            import msvcrt

            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        else:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[attr-defined]
    except OSError:
        return False
    return True


def _unlock(fd: int) -> None:
    if os.name == "nt":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_UN)  # type: ignore[attr-defined]
