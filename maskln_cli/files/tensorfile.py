"""Reading safetensors files: lazy, memory-mapped inputs, stdin, and dtype names.

Inputs are memory-mapped by safetensors, so opening a 10 GB file reads only its header; a tensor's
bytes are read when a chunk of it is used. Writing is :mod:`maskln_cli.files.output`'s.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import struct
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from maskln_cli.errors import MasklnError
from maskln_cli.files import shrinking
from maskln_cli.files.keynames import missing_key_message

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
FLOATING = ("float16", "bfloat16", "float32", "float64")
NUMERIC = (*FLOATING, "int8", "int16", "int32", "int64", "uint8")
"""dtypes a parameter may have (cast to the compute dtype); torch cannot convert float4, and
barely computes with uint16 to uint64."""


def input_name(path: str) -> str:
    """How messages name an input: the path as given, or ``<stdin>`` for ``-``."""
    return "<stdin>" if path == STDIO else path


def output_name(path: str) -> str:
    """How messages name an output: the path as given, or ``<stdout>`` for ``-``."""
    return "<stdout>" if path == STDIO else path


FileIdentity = tuple[int, int]
"""A file as the kernel knows it, ``(st_dev, st_ino)``: the same for every path (symlink, hard
link, ``./``, ``/proc/self/cwd``) that reaches it."""


def file_identity(path: str) -> FileIdentity | None:
    """``path``'s :data:`FileIdentity`, following symlinks; None when it does not exist.

    Example:
        >>> file_identity("sample_data") == file_identity("./sample_data/../sample_data")
        True
    """
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return status.st_dev, status.st_ino


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
        status = os.fstat(file.fileno())
        self.identity: FileIdentity = (status.st_dev, status.st_ino)
        """The file opened, whatever path led to it."""
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

    def read_files(self) -> dict[FileIdentity, str]:
        """The files this reads: itself, by its name."""
        return {self.identity: self.name}

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
                reason = os_reason(error)
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
            source = _utf8_path(path, stack)
        try:
            # framework "pt" imports torch; "numpy" reads the same header and imports numpy.
            framework = "pt" if torch_tensors else "numpy"
            handle = stack.enter_context(safe_open(source, framework=framework))
        except Exception as error:
            if path.endswith(".json"):  # "header too large" would say nothing of what it is
                raise MasklnError(
                    f"{name}: a JSON file, not a safetensors file (a sharded checkpoint's index?"
                    " diff, inspect and --params read one; here give a .safetensors file)"
                ) from None
            raise MasklnError(f"{name}: not a valid safetensors file: {_reason(error)}") from None
        try:  # the same file, for the bytes of dtypes torch cannot decode
            file = stack.enter_context(open(source, "rb"))
        except OSError as error:
            raise MasklnError(f"{name}: cannot read: {os_reason(error)}") from None
        tensor_file = TensorFile(handle, name, file, torch_tensors)
        if path == STDIO and not source.startswith(_OPEN_FILES):
            os.unlink(spool)  # the mapping keeps the data (no /proc: named until now)
        stack.enter_context(shrinking.watch(name, file.fileno()))
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


def _utf8_path(path: str, stack: contextlib.ExitStack) -> str:
    """``path`` as safetensors can take it: a path that is not UTF-8 (a name of bytes Python
    decoded with surrogates, which Linux allows) is opened here and reached through
    /proc/self/fd; safetensors refuses it otherwise ("Path ... is not valid UTF-8")."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        if os.path.isdir(_OPEN_FILES):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            stack.callback(os.close, fd)
            return f"{_OPEN_FILES}{fd}"
    return path


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
        raise MasklnError(f"{path}: cannot read: {os_reason(error)}") from None
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


_OPEN_FILES = "/proc/self/fd/"
"""Where Linux shows this process's open files: an unnamed file is opened again through it."""


@contextlib.contextmanager
def _spooled_stdin() -> Iterator[str]:
    """Copy stdin into a temporary file (safetensors needs a file to map); yield a path to it.

    The file has no name in TMPDIR while it is filled: anonymous where the filesystem allows it
    (O_TMPFILE), else unlinked the moment it is created. It is reached through /proc/self/fd,
    so up to 16 GiB of spool is never left behind, kill -9 included. Without /proc (not
    Linux) it keeps its name until safetensors has opened it.
    """
    if sys.stdin is None:
        raise MasklnError("<stdin>: is closed")
    stdin = sys.stdin.buffer
    if sys.stdin.isatty():
        raise MasklnError("<stdin>: is a terminal; pipe a safetensors file in, or give a path")
    limit = stdin_limit()
    fd, spool = _spool_file()
    try:
        _copy_bounded(stdin, fd, limit)
        yield spool
    finally:
        os.close(fd)
        if not spool.startswith(_OPEN_FILES):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spool)


def _spool_file() -> tuple[int, str]:
    """A new file for stdin's bytes in TMPDIR, and the path to open it by (see above)."""
    where = tempfile.gettempdir()
    reachable = os.path.isdir(_OPEN_FILES)
    flag = getattr(os, "O_TMPFILE", 0)
    try:
        if reachable and flag:
            with contextlib.suppress(OSError):  # a filesystem without them: a named file
                fd = os.open(where, os.O_RDWR | flag | getattr(os, "O_CLOEXEC", 0), 0o600)
                return fd, f"{_OPEN_FILES}{fd}"
        fd, spool = tempfile.mkstemp(prefix="maskln-stdin-", suffix=".safetensors")
    except OSError as error:
        raise MasklnError(f"<stdin>: cannot spool to {where}: {os_reason(error)}") from None
    if reachable:
        os.unlink(spool)
        return fd, f"{_OPEN_FILES}{fd}"
    return fd, spool


def _copy_bounded(stdin: BinaryIO, fd: int, limit: int) -> None:
    copied = 0
    while block := stdin.read(1 << 20):
        copied += len(block)
        if copied > limit:
            raise MasklnError(
                f"<stdin>: more than {limit} bytes; set {STDIN_LIMIT_VARIABLE} to raise"
                " the limit, or pass a file path"
            )
        view = memoryview(block)
        while view:
            try:
                written = os.write(fd, view)
            except OSError as error:
                where = tempfile.gettempdir()
                raise MasklnError(f"<stdin>: cannot spool to {where}: {os_reason(error)}") from None
            view = view[written:]


def os_reason(error: OSError) -> str:
    """An OSError as a message names it: its strerror ("No space left on device")."""
    return error.strerror or str(error)


def torch_dtype(name: str) -> torch.dtype | None:
    """torch's dtype named ``name`` (``"float32"``), or None if torch has none (``"F6_E2M3"``)."""
    import torch

    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")
