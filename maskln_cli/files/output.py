"""Writing safetensors files: atomic streaming outputs, to a file or stdout.

Outputs are written front to back by :class:`SafetensorsWriter` (safetensors itself only writes
whole in-memory dicts), into a temporary file beside OUTPUT that replaces it only once complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from maskln_cli.errors import MasklnError
from maskln_cli.files import shrinking
from maskln_cli.files.tensorfile import (
    DTYPE_CODES,
    STDIO,
    FileIdentity,
    dtype_name,
    file_identity,
    os_reason,
    output_name,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch


class SafetensorsWriter:
    """Writes a safetensors file front to back: the header, then each tensor's bytes in order.

    The tensors and their order are declared up front, so the header is final before any data;
    each tensor may then arrive in several chunks (consecutive slices of its flattened data).

    Example:
        >>> import io, torch
        >>> from safetensors.torch import load
        >>> stream = io.BytesIO()
        >>> writer = SafetensorsWriter(stream, "mem", {"out": ("float32", (2, 3))}, {"eps": "1"})
        >>> writer.write("out", torch.zeros(3)); writer.write("out", torch.ones(3)); writer.close()
        >>> load(stream.getvalue())["out"]
        tensor([[0., 0., 0.],
                [1., 1., 1.]])
    """

    def __init__(
        self,
        stream: BinaryIO,
        name: str,
        tensors: Mapping[str, tuple[str, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if sys.byteorder != "little":  # safetensors is little-endian; tensors here are native
            raise MasklnError("writing safetensors needs a little-endian machine")
        self._stream = stream
        self._name = name
        self._order = list(tensors)
        self._dtypes = {key: dtype for key, (dtype, _) in tensors.items()}
        self._remaining: dict[str, int] = {}
        header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for key, entry in tensors.items():
            if key == "__metadata__":
                raise MasklnError(f"{name}: '__metadata__' is reserved and cannot name a tensor")
            dtype, shape = entry
            nbytes = data_bytes({key: entry})
            header[key] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._remaining[key] = nbytes
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors does
        self._write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, chunk: torch.Tensor) -> None:
        """Append ``chunk``'s elements (row-major) to tensor ``key``."""
        if dtype_name(chunk.dtype) != self._dtypes.get(key):
            raise RuntimeError(f"{key!r} is declared {self._dtypes.get(key)}, got {chunk.dtype}")
        if chunk.numel() == 0:  # nothing to write, in or out of order
            return
        pending = [k for k in self._order if self._remaining[k]]
        if not pending or key != pending[0]:
            raise RuntimeError(f"writing {key!r} out of order; next is {pending[:1]}")
        data = chunk.detach().contiguous().reshape(-1).view(torch_dtype("uint8"))
        if data.numel() > self._remaining[key]:
            raise RuntimeError(f"more data for {key!r} than its declared shape holds")
        if data.numel():
            self._write(memoryview(data.numpy()))
        self._remaining[key] -= data.numel()

    def close(self) -> None:
        """Check that every declared tensor was written in full, then flush."""
        missing = [k for k in self._order if self._remaining[k]]
        if missing:
            raise RuntimeError(f"tensors not written in full: {missing}")
        try:
            self._stream.flush()
        except OSError as error:
            raise MasklnError(f"{self._name}: cannot write: {os_reason(error)}") from None

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self._stream.write(data)
        except OSError as error:
            raise MasklnError(f"{self._name}: cannot write: {os_reason(error)}") from None


ABORT_WAIT_SECONDS = 10.0
"""How long an aborted BackgroundWriter waits for its current write (one chunk, to a file)."""


class BackgroundWriter:
    """A :class:`SafetensorsWriter` fed from the caller and writing on a thread of its own, so
    that computing the next chunk overlaps writing the last one: here, writing 512 MiB to a
    file took 1.3 s, longer than normalizing it (0.8 s).

    At most ``depth`` chunks wait to be written. An error in writing is raised in the caller,
    at its next :meth:`write` or at :meth:`close`; leaving the ``with`` block on an error of the
    caller's (Ctrl-C included) drops what waits, and waits for the thread's current write.
    For files only: a write to a pipe can block for as long as its reader likes, and the
    caller could then not be interrupted.

    Example:
        >>> import io, torch
        >>> from safetensors.torch import load
        >>> stream = io.BytesIO()
        >>> with BackgroundWriter(SafetensorsWriter(stream, "mem", {"t": ("float32", (4,))})) as w:
        ...     w.write("t", torch.zeros(2)); w.write("t", torch.ones(2))
        >>> load(stream.getvalue())["t"]
        tensor([0., 0., 1., 1.])
    """

    def __init__(self, writer: SafetensorsWriter, depth: int = 2) -> None:
        import queue
        import threading

        self._writer = writer
        self._chunks: queue.Queue[tuple[str, torch.Tensor] | None] = queue.Queue(depth)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maskln-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._chunks.get()) is not None:
            if self._error is None and not self._stop.is_set():
                try:
                    self._writer.write(*item)
                except BaseException as error:  # raised again in the caller
                    self._error = error

    def write(self, key: str, chunk: torch.Tensor) -> None:
        """Queue ``chunk`` for tensor ``key`` (see :meth:`SafetensorsWriter.write`); the caller
        must not change it afterwards."""
        self._raise_error()
        self._chunks.put((key, chunk))

    def close(self) -> None:
        """Wait for every queued chunk to be written, then close the writer."""
        try:
            if self._thread.is_alive():
                self._chunks.put(None)
                self._thread.join()
        except BaseException:  # Ctrl-C while waiting: nothing more is written
            self._abort()
            raise
        self._raise_error()
        self._writer.close()

    def _abort(self) -> None:
        """Stop writing: drop what waits and wait (a bounded time: a file, not a pipe) for the
        thread to end after its current write. Left running, it would be killed at the
        interpreter's exit inside a write's native code: C++ then calls std::terminate, and a
        SIGTERM that should exit 143 aborted with -6 ("terminate called without an active
        exception", 1 of CI's runs)."""
        import queue

        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._chunks.get_nowait()
        with contextlib.suppress(queue.Full):
            self._chunks.put_nowait(None)
        self._thread.join(ABORT_WAIT_SECONDS)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self._abort()


@contextlib.contextmanager
def writing_chunks(writer: SafetensorsWriter) -> Iterator[SafetensorsWriter | BackgroundWriter]:
    """``writer``, or a :class:`BackgroundWriter` over it when it writes to a regular file; the
    writer is closed at the end of the block, unless the block fails."""
    try:
        regular = stat.S_ISREG(os.fstat(writer._stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # no file descriptor (an in-memory stream)
        regular = False
    if regular:
        with BackgroundWriter(writer) as background:
            yield background
    else:
        yield writer
        writer.close()


WRITE_CHUNK_BYTES = 8 * 2**20
"""write_tensors writes this much at a time, telling ``progress`` after each."""


def write_tensors(
    path: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    fsync: bool = False,
) -> None:
    """Write whole in-memory tensors to ``path`` (``-`` for stdout), atomically (``fsync``: and
    durably, see :func:`open_output`).

    Tensors are laid out by descending element size, then name, as safetensors does, so every
    tensor's data is aligned to its element size. ``progress`` is told (bytes written, total).
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    specs = {k: (dtype_name(tensors[k].dtype), tensors[k].shape) for k in order}
    total = data_bytes(specs)
    done = 0
    with open_output(path, total, fsync=fsync) as stream:
        writer = SafetensorsWriter(stream, output_name(path), specs, metadata)
        for key in order:
            flat = tensors[key].reshape(-1)
            step = max(1, WRITE_CHUNK_BYTES // flat.element_size())
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step]
                writer.write(key, chunk)
                done += chunk.numel() * chunk.element_size()
                if progress:
                    progress(done, total)
        writer.close()


def check_output_path(
    path: str,
    inputs: Sequence[str | None] = (),
    read_files: Mapping[FileIdentity, str] | None = None,
) -> None:
    """Fail early, before any work, when OUTPUT cannot be written, or would replace a file the
    command reads: one of ``inputs`` (paths), or of ``read_files`` (by identity, whatever path
    reaches it: a checkpoint's shard, a config, a hard link; their value names them)."""
    read_files = read_files or {}
    if path == STDIO:
        if sys.stdout is None:
            raise MasklnError("<stdout>: is closed")
        if sys.stdout.isatty():
            raise MasklnError(
                "<stdout>: refusing to write binary data to a terminal; redirect it, or give"
                " an OUTPUT path"
            )
        for source in inputs:
            if source and source != STDIO and _same_as_stdio(sys.stdout, source):
                raise MasklnError(
                    f"<stdout>: is redirected into the input {source}; write the output elsewhere"
                )
        read = read_files.get(_stdio_identity(sys.stdout) or (-1, -1))
        if read is not None:
            raise MasklnError(f"<stdout>: is redirected into {read}; write the output elsewhere")
        return
    target = os.path.realpath(path)  # a symlink is followed: its target is what gets written
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        raise MasklnError(f"{path}: is a folder; give a file path for the output")
    if not os.path.isdir(parent):
        raise MasklnError(f"{path}: folder {os.path.dirname(path) or '.'!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MasklnError(f"{path}: folder {os.path.dirname(path) or '.'!r} is not writable")
    for source in inputs:
        if not source or not os.path.exists(target):
            continue
        if source == STDIO:  # stdin redirected from a file: that file is the input
            if _same_as_stdio(sys.stdin, target):
                raise MasklnError(f"{path}: is the input (<stdin>); write the output elsewhere")
        elif _same_file(source, target):
            raise MasklnError(f"{path}: is the input {source}; write the output elsewhere")
    read = read_files.get(file_identity(target) or (-1, -1))
    if read is not None:
        raise MasklnError(f"{path}: is {read}; write the output elsewhere")


def _stdio_identity(stream: object) -> FileIdentity | None:
    """The identity of the regular file ``stream`` (sys.stdout) is redirected into, if any."""
    try:
        opened = os.fstat(stream.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return None
    return (opened.st_dev, opened.st_ino) if stat.S_ISREG(opened.st_mode) else None


def _same_as_stdio(stream: object, path: str) -> bool:
    """Whether ``stream`` (sys.stdin or sys.stdout) is the regular file at ``path``."""
    try:
        opened = os.fstat(stream.fileno())  # type: ignore[attr-defined]
        named = os.stat(path)
    except (AttributeError, OSError, ValueError):
        return False
    return stat.S_ISREG(opened.st_mode) and os.path.samestat(opened, named)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def data_bytes(tensors: Mapping[str, tuple[str, Sequence[int]]]) -> int:
    """Bytes of tensor data a safetensors file with these (dtype, shape) entries holds.

    Example:
        >>> data_bytes({"out": ("float32", (2, 3)), "valid": ("bool", (2,))})
        26
    """
    return sum(torch_dtype(dtype).itemsize * math.prod(shape) for dtype, shape in tensors.values())


@contextlib.contextmanager
def open_output(
    path: str,
    size: int = 0,
    inputs: Sequence[str | None] = (),
    fsync: bool = False,
    read_files: Mapping[FileIdentity, str] | None = None,
) -> Iterator[BinaryIO]:
    """A binary stream for OUTPUT: stdout for ``-``, else a new file that replaces ``path`` only
    when the block completes.

    On any error, Ctrl-C or SIGTERM the new file is dropped and an existing ``path`` is left
    untouched. ``size``, the bytes to be written, is checked against the free disk space first.
    A symlink is followed (the link stays, its target is replaced); a device or FIFO
    (``/dev/null``) is written to directly. ``inputs`` (paths) and ``read_files`` (identities:
    every file the command reads) are refused as OUTPUT.

    Where the filesystem allows it (Linux, ``O_TMPFILE``), the data goes into an anonymous file
    in OUTPUT's folder: it has no name while it is written, so nothing is left behind however
    the process ends, kill -9 and SIGBUS included. Complete, it is linked under a hidden
    temporary name and renamed over OUTPUT, two calls of microseconds (a kill -9 between them
    would leave that complete file beside OUTPUT). Elsewhere the data is written under the
    hidden name ``.NAME.HEX.partial`` from the start: removed on errors and signals that can be
    caught, but left behind by kill -9 or a power loss.

    The rename makes the new file whole or absent for every other process at once; surviving a
    power loss or an OS crash also needs the data and the rename on disk: ``fsync`` flushes the
    file before the rename and its folder after.
    """
    from maskln_cli.files.resources import check_disk

    check_output_path(path, inputs, read_files)
    if path == STDIO:
        yield sys.stdout.buffer
        return
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with _write_errors(path), open(target, "wb") as stream:
            yield stream
        return
    check_disk(str(target), size)
    replacement = _Replacement(target, path)
    with shrinking.writing():  # a SIGBUS meanwhile says this output was not written
        try:
            fd = replacement.create()
            with _write_errors(path):
                with os.fdopen(fd, "wb") as stream:
                    yield stream
                    stream.flush()
                    if fsync:
                        os.fsync(stream.fileno())
                    os.fchmod(stream.fileno(), _output_mode(target))
                    replacement.name_it(stream.fileno())
                os.replace(replacement.name, target)
                if fsync:
                    _fsync_folder(target.parent)
        except BaseException:
            replacement.discard()
            raise
        finally:
            shrinking.discard_partial(replacement.name)


class _Replacement:
    """OUTPUT's new content until it replaces OUTPUT: an anonymous file, or a hidden named one.

    ``name`` is set before the file it names exists, so that a Ctrl-C or SIGTERM landing while
    it is created or linked (inside the call, it would escape) still finds it and removes it.
    """

    def __init__(self, target: Path, path: str) -> None:
        self.target = target
        self.path = path
        self.name = ""
        self.anonymous = False

    def create(self) -> int:
        """A descriptor to write the new content to."""
        fd = _anonymous_file(self.target.parent, self.path)
        if fd is not None:
            self.anonymous = True
            return fd
        for _ in range(100):
            self.name = _temporary_name(self.target)
            shrinking.add_partial(self.name)
            fd = _create_new(self.name, self.path)
            if fd is not None:
                return fd
        self.name = ""  # the last name is another process's file: not ours to remove
        raise MasklnError(f"{self.path}: cannot create a file beside it: no free temporary name")

    def name_it(self, fd: int) -> None:
        """Complete: give an anonymous file its hidden name, ready to be renamed over OUTPUT."""
        if not self.anonymous:
            return
        for _ in range(100):
            self.name = _temporary_name(self.target)
            if _link(fd, self.name, self.path):
                return
        self.name = ""
        raise MasklnError(f"{self.path}: cannot name the file: no free temporary name")

    def discard(self) -> None:
        if self.name:
            _remove(self.name)


_NOT_ANONYMOUS = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL}
"""What open(O_TMPFILE) says where the filesystem or the kernel has no anonymous files."""


def _anonymous_file(folder: Path, path: str) -> int | None:
    """A descriptor of a new nameless file in ``folder`` (mode 0o600), or None where there are
    none (not Linux, no /proc to link it through, a filesystem without them)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as error:
        if error.errno in _NOT_ANONYMOUS:
            return None
        raise MasklnError(f"{path}: cannot create a file beside it: {os_reason(error)}") from None


def _temporary_name(target: Path) -> str:
    return str(target.parent / f".{target.name}.{secrets.token_hex(6)}.partial")


def _link(fd: int, name: str, path: str) -> bool:
    """Give the anonymous file ``fd`` the name ``name``; False when that name is taken."""
    folder = os.open(os.path.dirname(name), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        # linkat(AT_SYMLINK_FOLLOW) through /proc: Python calls plain link(), which would link
        # the magic symlink itself, unless a directory descriptor is given.
        os.link(f"/proc/self/fd/{fd}", os.path.basename(name), src_dir_fd=folder, dst_dir_fd=folder)
    except FileExistsError:
        return False
    except OSError as error:
        raise MasklnError(f"{path}: cannot write: {os_reason(error)}") from None
    finally:
        os.close(folder)
    return True


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_new(name: str, path: str) -> int | None:
    """A descriptor of the new, empty file ``name`` (mode 0o600, as mkstemp makes it), or None
    if ``name`` exists already."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(name, flags, 0o600)
    except FileExistsError:
        return None
    except OSError as error:
        raise MasklnError(f"{path}: cannot create a file beside it: {os_reason(error)}") from None


@contextlib.contextmanager
def _write_errors(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise MasklnError(f"{path}: cannot write: {os_reason(error)}") from None


def _output_mode(target: Path) -> int:
    """An existing OUTPUT keeps its permissions; a new one gets the usual 0o666 & ~umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0o022)
        os.umask(mask)
        return 0o666 & ~mask


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
