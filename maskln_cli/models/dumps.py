"""A capture's folder of dumps: one safetensors file per layer norm call.

A dump holds the call's ``x``, ``valid``, ``scale``, ``bias`` and the module's own ``out``, in
the dtypes the model ran them in, and, once a backward pass has reached the call, ``grad_out``
and the module's gradients ``grad_x``, ``grad_scale`` and ``grad_bias`` (this call's
contribution, not the parameters' accumulated ``.grad``). These are the names ``maskln
verify`` reads, and its metadata says how to judge it (see :data:`PADDING`).

Files are named ``{call:05d}-{module path}.safetensors``, so that they sort in call order (a
path too long for a file name is shortened, see :func:`dump_name`; the metadata keeps it whole),
and written atomically (:func:`maskln_cli.files.output.write_tensors`): a file is complete or
absent, never partial. Gradients arrive after the forward pass, a call at a time: the call's
file is then read back and written again, whole, with them.

A capture holds its folder while it runs (:meth:`DumpFolder.claim`): a second capture into the
same folder, in this process or another, is refused instead of writing the same names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from maskln_cli.files.output import write_tensors

MAX_CALLS = 100_000
"""Call indices have five digits: file names sort in call order."""
PADDING = {
    "zeroed": "the module zeroes invalid rows (a MaskedLayerNorm): out is compared everywhere",
    "normalized": "the module normalizes every row (an nn.LayerNorm): out's invalid rows hold"
    " what it made of the padding, not 0; compare the valid rows only",
}
"""Metadata ``padding``: what ``out`` holds on invalid rows."""
GRADIENTS = ("grad_out", "grad_x", "grad_scale", "grad_bias")
MAX_NAME = 200
"""Characters of a dump's file name at most: file systems allow 255 bytes, and the atomic write
adds 22 to the temporary name (``.NAME.HEX.partial``)."""
CLAIM = ".maskln-capture.lock"
"""The file a capture holds a lock on while it writes into its folder (removed at its end)."""


def dump_name(call: int, path: str) -> str:
    """The file name of call ``call`` of the module at ``path``: a path too long for a file name
    keeps its start and end around a hash of the whole (the same name each time, another for
    another path).

    Example:
        >>> dump_name(12, "encoder.layer.3.output.LayerNorm")
        '00012-encoder.layer.3.output.LayerNorm.safetensors'
        >>> dump_name(0, ""), dump_name(1, "blocks/a b")
        ('00000-model.safetensors', '00001-blocks_a_b.safetensors')
        >>> name = dump_name(7, "deep." * 80 + "LayerNorm")
        >>> len(name), name[:16], name[-26:]
        (200, '00007-deep.deep.', 'deep.LayerNorm.safetensors')
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", path) if path else "model"
    name = f"{call:05d}-{safe}.safetensors"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(path.encode()).hexdigest()[:12]
    room = MAX_NAME - len(f"{call:05d}-") - len(f"--{digest}--") - len(".safetensors")
    head = room // 2
    return f"{call:05d}-{safe[:head]}--{digest}--{safe[-(room - head) :]}.safetensors"


class DumpFolder:
    """Writes a capture's dumps into ``folder`` and keeps where each call's file is."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[int, Path] = {}
        self._claim: int | None = None

    def claim(self) -> None:
        """Hold the folder for this capture (an exclusive lock on its :data:`CLAIM` file, which
        the OS releases if the process dies).

        Raises:
            ValueError: another capture holds it, in this process or another (its pid named).
        """
        path = self.folder / CLAIM
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            if not _try_lock(fd):
                holder = _read_holder(fd)
                os.close(fd)
                raise ValueError(
                    f"out_dir {str(self.folder)!r}: another capture is writing into it"
                    f" ({holder}); capture into a folder of its own, so that the dumps of two"
                    " runs never mix"
                )
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:  # its holder removed it as this one took it
                same = False
            if same:
                break
            os.close(fd)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._claim = fd

    def release(self) -> None:
        """Let the folder go: the claim file is removed, then unlocked."""
        if self._claim is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.folder / CLAIM)
        os.close(self._claim)  # closing the last descriptor releases the lock
        self._claim = None

    def write(
        self, call: int, path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]
    ) -> Path:
        """Write call ``call``'s forward dump; return its path."""
        file = self.folder / dump_name(call, path)
        write_tensors(str(file), _on_cpu(tensors), metadata)
        self.files[call] = file
        return file

    def add_gradients(self, call: int, gradients: Mapping[str, torch.Tensor]) -> None:
        """Add ``gradients`` to call ``call``'s file (to those it holds, when a second backward
        pass over the same graph reaches the call again: the module's contribution to each is
        their sum, as ``.grad`` sums them), and write it again, whole."""
        from safetensors import safe_open

        file = self.files[call]
        with safe_open(str(file), framework="pt") as dump:
            tensors = {key: dump.get_tensor(key) for key in dump.keys()}  # noqa: SIM118
            metadata = dict(dump.metadata() or {})
        shapes = {"grad_out": "out", "grad_x": "x", "grad_scale": "scale", "grad_bias": "bias"}
        for key, gradient in _on_cpu(gradients).items():
            gradient = gradient.reshape(tensors[shapes[key]].shape)  # a flattened normalized_shape
            tensors[key] = tensors[key] + gradient if key in tensors else gradient
        write_tensors(str(file), tensors, metadata)


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


def _read_holder(fd: int) -> str:
    """Whom a claim is held by, as its holder wrote it."""
    try:
        pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except (OSError, AttributeError):  # AttributeError: no pread (Windows)
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


def _on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: tensor.detach().to("cpu") for key, tensor in tensors.items()}
