"""Reading and writing safetensors files: lazy inputs, stdin and stdout, atomic streaming outputs.

Inputs are memory-mapped by safetensors, so opening a 10 GB file reads only its header; a tensor's
bytes are read when a chunk of it is used. Outputs are written front to back by
:class:`SafetensorsWriter` (safetensors itself only writes whole in-memory dicts), into a
temporary file beside OUTPUT that replaces it only once complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from maskln_cli.errors import MasklnError
from maskln_cli.keynames import missing_key_message

if TYPE_CHECKING:
    import numpy
    import torch

STDIO = "-"
"""The path that means stdin (for an input) or stdout (for an output)."""

STDIN_LIMIT_VARIABLE = "MASKLN_STDIN_MAX_BYTES"
DEFAULT_STDIN_LIMIT = 16 * 2**30
"""stdin is spooled to a temporary file (in TMPDIR) of at most this many bytes."""

# safetensors dtype codes and torch's names for them.
DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
DTYPE_CODES = {name: code for code, name in DTYPE_NAMES.items()}


def input_name(path: str) -> str:
    """How messages name an input: the path as given, or ``<stdin>`` for ``-``."""
    return "<stdin>" if path == STDIO else path


def output_name(path: str) -> str:
    """How messages name an output: the path as given, or ``<stdout>`` for ``-``."""
    return "<stdout>" if path == STDIO else path


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: what a file says it holds, read without loading it."""

    name: str
    dtype: str  # torch's name: "float32", "bool", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class TensorFile:
    """An open safetensors file; tensors come memory-mapped, read as they are used."""

    def __init__(
        self, handle: object, name: str, file: BinaryIO, torch_tensors: bool = True
    ) -> None:
        self._handle = handle
        self._file = file
        self.name = name
        self.torch_tensors = torch_tensors
        self.metadata: dict[str, str] = dict(handle.metadata() or {})  # type: ignore[attr-defined]
        keys = list(handle.keys())  # type: ignore[attr-defined]
        self._data_start, self._offsets = _data_offsets(file, keys)
        self._mapped: numpy.ndarray | None = None
        # Data order is the order a person reading the header expects, and it is stable
        # (safetensors' own offset_keys() leaves ties, empty tensors, in hash order).
        self._keys = sorted(self._offsets, key=lambda key: (self._offsets[key], key))

    def keys(self) -> list[str]:
        return list(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._offsets

    def info(self, key: str) -> TensorInfo:
        """The dtype and shape of ``key``, without reading its data."""
        self._require(key)
        view = self._handle.get_slice(key)  # type: ignore[attr-defined]
        code = view.get_dtype()
        return TensorInfo(key, DTYPE_NAMES.get(code, code), tuple(view.get_shape()))

    def data_size(self, key: str) -> int:
        """Bytes of ``key``'s data, from the header (nothing is read).

        Example:
            >>> with open_tensor_file("sample_data/worked_example.safetensors", False) as f:
            ...     f.data_size("x"), f.data_size("valid")
            (32, 2)
        """
        self._require(key)
        start, stop = self._offsets[key]
        return stop - start

    def read_data(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        """Bytes ``start`` to ``stop`` of ``key``'s data as stored, whatever its dtype (F6_E2M3,
        which torch cannot decode, included).

        Example:
            >>> with open_tensor_file("sample_data/worked_example.safetensors", False) as f:
            ...     f.read_data("valid")
            b'\\x01\\x00'
        """
        self._require(key)
        begin, end = self._offsets[key]
        stop = end - begin if stop is None else min(stop, end - begin)
        position, wanted = self._data_start + begin + start, max(0, stop - start)
        parts: list[bytes] = []
        while wanted:  # pread may return less than asked (2 GiB at most on Linux)
            try:
                part = os.pread(self._file.fileno(), wanted, position)
            except OSError as error:
                reason = _os_reason(error)
                raise MasklnError(f"{self.name}: cannot read tensor {key!r}: {reason}") from None
            if not part:
                raise MasklnError(
                    f"{self.name}: cannot read tensor {key!r}: the file ends before its data"
                )
            parts.append(part)
            position += len(part)
            wanted -= len(part)
        return b"".join(parts)

    def stacked(self, keys: Sequence[str]) -> torch.Tensor:
        """The tensors ``keys``, all of one dtype and number of elements, flattened: the rows
        of one new 2-d tensor, copied from the memory-mapped data a slice each (asking
        safetensors for each tensor costs some 20 us, much more than a tiny tensor's data).

        Example:
            >>> with open_tensor_file("sample_data/worked_example.safetensors") as f:
            ...     f.stacked(["bias", "scale"])
            tensor([[ 0.5000,  1.0000],
                    [ 2.0000, -1.0000]], dtype=torch.float64)
        """
        import torch

        infos = [self.info(key) for key in keys]
        dtype = torch_dtype(infos[0].dtype)
        if dtype is None or any(
            (i.dtype, i.numel) != (infos[0].dtype, infos[0].numel) for i in infos
        ):
            raise ValueError("stacked takes tensors of one dtype and size that torch can read")
        self._require_torch()
        data = torch.from_numpy(self._data())
        rows = [data[slice(*self._offsets[key])] for key in keys]
        return torch.stack(rows).view(dtype)

    def mapped(self, key: str) -> numpy.ndarray:
        """``key``'s data as stored, a 1-d uint8 numpy array over the memory-mapped file: read
        as it is used, whatever the dtype, and without torch (``maskln inspect``).

        Example:
            >>> with open_tensor_file("sample_data/worked_example.safetensors", False) as f:
            ...     f.mapped("valid").tolist(), f.mapped("bias").view("<f8").tolist()
            ([1, 0], [0.5, 1.0])
        """
        self._require(key)
        start, stop = self._offsets[key]
        data = self._data()[start:stop]
        if data.size != stop - start:  # the file shrank since it was opened
            raise MasklnError(
                f"{self.name}: cannot read tensor {key!r}: the file ends before its data"
            )
        return data

    def _data(self) -> numpy.ndarray:
        """The data section, as bytes memory-mapped copy-on-write (never written)."""
        import mmap

        import numpy

        if self._mapped is None:
            try:
                mapping = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as error:
                raise MasklnError(f"{self.name}: cannot map its data: {error}") from None
            self._mapped = numpy.frombuffer(mapping, dtype=numpy.uint8)[self._data_start :]
        return self._mapped

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key``, backed by the memory-mapped file (nothing is read yet)."""
        self._require(key)
        self._require_torch()
        try:
            return self._handle.get_tensor(key)  # type: ignore[attr-defined]
        except Exception as error:  # safetensors raises several types for bad data
            raise MasklnError(f"{self.name}: cannot read tensor {key!r}: {error}") from None

    def _require_torch(self) -> None:
        if not self.torch_tensors:
            raise RuntimeError(f"{self.name} was opened without torch tensors")

    def _require(self, key: str) -> None:
        if key not in self._offsets:
            raise MasklnError(missing_key_message(self.name, key, self._keys))


@contextlib.contextmanager
def open_tensor_file(path: str, torch_tensors: bool = True) -> Iterator[TensorFile]:
    """Open a safetensors file, or stdin for ``-``, checking it on the way.

    Without ``torch_tensors`` the file's keys, dtypes, shapes, metadata and bytes can be read
    but not torch tensors, and torch is not imported (``maskln inspect``: its statistics take
    a fraction of torch's import time).

    Example:
        >>> with open_tensor_file("sample_data/worked_example.safetensors") as f:
        ...     f.info("x"), f.metadata
        (TensorInfo(name='x', dtype='float64', shape=(1, 2, 2)), {'eps': '3.0'})
    """
    from safetensors import safe_open

    name = input_name(path)
    with contextlib.ExitStack() as stack:
        if path == STDIO:
            spool = stack.enter_context(_spooled_stdin())
            source = spool
        else:
            _check_readable_file(path)
            source = path
        try:
            # framework "pt" imports torch; "numpy" reads the same header and imports numpy.
            framework = "pt" if torch_tensors else "numpy"
            handle = stack.enter_context(safe_open(source, framework=framework))
        except Exception as error:
            raise MasklnError(f"{name}: not a valid safetensors file: {_reason(error)}") from None
        try:  # the same file, for the bytes of dtypes torch cannot decode
            file = stack.enter_context(open(source, "rb"))
        except OSError as error:
            raise MasklnError(f"{name}: cannot read: {_os_reason(error)}") from None
        tensor_file = TensorFile(handle, name, file, torch_tensors)
        if path == STDIO:
            os.unlink(spool)  # the mapping keeps the data; nothing is left behind on a crash
        yield tensor_file


def _data_offsets(file: BinaryIO, keys: list[str]) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where the data starts in ``file``, and each key's ``(start, stop)`` byte offsets in the
    data, from the header that safetensors has validated."""
    file.seek(0)
    (length,) = struct.unpack("<Q", file.read(8))
    header = json.loads(file.read(length))
    wanted = set(keys)
    offsets = {key: tuple(entry["data_offsets"]) for key, entry in header.items() if key in wanted}
    return 8 + length, {key: offsets[key] for key in keys}  # type: ignore[misc]


def _check_readable_file(path: str) -> None:
    check_regular_file(path, "not a safetensors file")


_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_regular_file(path: str, folder_message: str) -> None:
    """Raise, naming ``path``, unless it is a readable regular file (symlinks followed).

    A FIFO, device or socket is refused before it is opened: opening a FIFO with no writer
    blocks in the kernel, deaf to Ctrl-C and SIGTERM, and inputs are memory-mapped, which
    needs a regular file. Such data can come through stdin instead (``-``).

    Example:
        >>> check_regular_file("/dev/null", "not a file")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        maskln_cli.errors.MasklnError: /dev/null: is a character device, not a regular file; ...
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise MasklnError(f"{path}: no such file") from None
    except OSError as error:
        raise MasklnError(f"{path}: cannot read: {_os_reason(error)}") from None
    if stat.S_ISDIR(mode):
        raise MasklnError(f"{path}: is a folder, {folder_message}")
    for is_kind, kind in _SPECIAL_FILES:
        if is_kind(mode):
            raise MasklnError(
                f"{path}: is {kind}, not a regular file; pipe it in as '-' instead (... - < {path})"
            )
    if not os.access(path, os.R_OK):
        raise MasklnError(f"{path}: permission denied")


def _reason(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.removeprefix("Error while deserializing header: ")


def stdin_limit() -> int:
    """The most bytes read from stdin: ``MASKLN_STDIN_MAX_BYTES`` (bytes, or with a K, M, G or T
    suffix, binary), default 16 GiB.

    Example:
        >>> os.environ[STDIN_LIMIT_VARIABLE] = "2G"; stdin_limit()
        2147483648
        >>> del os.environ[STDIN_LIMIT_VARIABLE]
    """
    value = os.environ.get(STDIN_LIMIT_VARIABLE)
    if value is None:
        return DEFAULT_STDIN_LIMIT
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if text[-1:] in _BINARY_UNITS:
        scale, text = _BINARY_UNITS[text[-1]], text[:-1]
    try:
        limit = int(text) * scale
    except ValueError:
        limit = -1
    if limit < 0:
        raise MasklnError(
            f"{STDIN_LIMIT_VARIABLE}: must be a number of bytes such as 1000000 or 4G,"
            f" got {value!r}"
        )
    return limit


_BINARY_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@contextlib.contextmanager
def _spooled_stdin() -> Iterator[str]:
    """Copy stdin into a temporary file (safetensors needs a file to map); yield its path."""
    if sys.stdin is None:
        raise MasklnError("<stdin>: is closed")
    stdin = sys.stdin.buffer
    if sys.stdin.isatty():
        raise MasklnError("<stdin>: is a terminal; pipe a safetensors file in, or give a path")
    limit = stdin_limit()
    try:
        fd, spool = tempfile.mkstemp(prefix="maskln-stdin-", suffix=".safetensors")
    except OSError as error:
        where = tempfile.gettempdir()
        raise MasklnError(f"<stdin>: cannot spool to {where}: {_os_reason(error)}") from None
    try:
        _copy_bounded(stdin, fd, limit)
        yield spool
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spool)


def _copy_bounded(stdin: BinaryIO, fd: int, limit: int) -> None:
    with os.fdopen(fd, "wb") as file:
        copied = 0
        while block := stdin.read(1 << 20):
            copied += len(block)
            if copied > limit:
                raise MasklnError(
                    f"<stdin>: more than {limit} bytes; set {STDIN_LIMIT_VARIABLE} to raise"
                    " the limit, or pass a file path"
                )
            try:
                file.write(block)
            except OSError as error:
                where = tempfile.gettempdir()
                raise MasklnError(
                    f"<stdin>: cannot spool to {where}: {_os_reason(error)}"
                ) from None


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
            raise MasklnError(f"{self._name}: cannot write: {_os_reason(error)}") from None

    def _write(self, data: bytes | memoryview) -> None:
        try:
            self._stream.write(data)
        except OSError as error:
            raise MasklnError(f"{self._name}: cannot write: {_os_reason(error)}") from None


class BackgroundWriter:
    """A :class:`SafetensorsWriter` fed from the caller and writing on a thread of its own, so
    that computing the next chunk overlaps writing the last one: here, writing 512 MiB to a
    file took 1.3 s, longer than normalizing it (0.8 s).

    At most ``depth`` chunks wait to be written. An error in writing is raised in the caller,
    at its next :meth:`write` or at :meth:`close`; leaving the ``with`` block on an error of the
    caller's (Ctrl-C included) drops what waits, and the thread ends after its current write.
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
        """Stop writing: drop what waits and let the thread end after its current write, without
        waiting for it (a write may hang, on a pipe nobody reads)."""
        import queue

        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._chunks.get_nowait()
        with contextlib.suppress(queue.Full):
            self._chunks.put_nowait(None)

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


def check_output_path(path: str, inputs: Sequence[str | None] = ()) -> None:
    """Fail early, before any work, when OUTPUT cannot be written, or would replace an input."""
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
    path: str, size: int = 0, inputs: Sequence[str | None] = (), fsync: bool = False
) -> Iterator[BinaryIO]:
    """A binary stream for OUTPUT: stdout for ``-``, else a temporary file beside ``path``.

    The temporary file replaces ``path`` only when the block completes; on any error, Ctrl-C or
    SIGTERM it is removed, and an existing ``path`` is left untouched. ``size``, the bytes to be
    written, is checked against the free disk space first. A symlink is followed (the link
    stays, its target is replaced); a device or FIFO (``/dev/null``) is written to directly.
    ``inputs`` are refused as OUTPUT.

    The rename makes the new file whole or absent for every other process at once, even if
    this one is killed; surviving a power loss or an OS crash also needs the data and the
    rename on disk: ``fsync`` flushes the file before the rename and its folder after.
    """
    from maskln_cli.resources import check_disk

    check_output_path(path, inputs)
    if path == STDIO:
        yield sys.stdout.buffer
        return
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        with _write_errors(path), open(target, "wb") as stream:
            yield stream
        return
    check_disk(str(target), size)
    temporary = ""
    try:
        # The name is set before the file exists, so that a Ctrl-C or SIGTERM landing while it
        # is created (inside mkstemp, it would escape) still finds it here and removes it.
        for _ in range(100):
            temporary = str(target.parent / f".{target.name}.{secrets.token_hex(6)}.partial")
            fd = _create_new(temporary, path)
            if fd is not None:
                break
        else:
            temporary = ""  # the last name is another process's file: not ours to remove
            raise MasklnError(f"{path}: cannot create a file beside it: no free temporary name")
        with _write_errors(path):
            with os.fdopen(fd, "wb") as stream:
                yield stream
                stream.flush()
                if fsync:
                    os.fsync(stream.fileno())
            os.chmod(temporary, _output_mode(target))
            os.replace(temporary, target)
            if fsync:
                _fsync_folder(target.parent)
    except BaseException:
        if temporary:
            _remove(temporary)
        raise


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
        raise MasklnError(f"{path}: cannot create a file beside it: {_os_reason(error)}") from None


@contextlib.contextmanager
def _write_errors(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise MasklnError(f"{path}: cannot write: {_os_reason(error)}") from None


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


def _os_reason(error: OSError) -> str:
    return error.strerror or str(error)


def torch_dtype(name: str) -> torch.dtype | None:
    """torch's dtype named ``name`` (``"float32"``), or None if torch has none (``"F6_E2M3"``)."""
    import torch

    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")
