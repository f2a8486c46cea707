"""A capture's folder of dumps: one safetensors file per layer norm call.

A dump holds the call's ``x``, ``valid``, ``scale``, ``bias`` and the module's own ``out``, in
the dtypes the model ran them in, and, once a backward pass has reached the call, ``grad_out``
and the module's gradients ``grad_x``, ``grad_scale`` and ``grad_bias`` (this call's
contribution, not the parameters' accumulated ``.grad``). These are the names ``maskln
verify`` reads, and its metadata says how to judge it (see :data:`PADDING`).

Files are named ``{call:05d}-{module path}.safetensors``, so that they sort in call order, and
written atomically (:func:`maskln_cli.files.output.write_tensors`): a file is complete or
absent, never partial. Gradients arrive after the forward pass, a call at a time: the call's
file is then read back and written again, whole, with them.
"""

from __future__ import annotations

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


def dump_name(call: int, path: str) -> str:
    """The file name of call ``call`` of the module at ``path``.

    Example:
        >>> dump_name(12, "encoder.layer.3.output.LayerNorm")
        '00012-encoder.layer.3.output.LayerNorm.safetensors'
        >>> dump_name(0, ""), dump_name(1, "blocks/a b")
        ('00000-model.safetensors', '00001-blocks_a_b.safetensors')
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", path) if path else "model"
    return f"{call:05d}-{safe}.safetensors"


class DumpFolder:
    """Writes a capture's dumps into ``folder`` and keeps where each call's file is."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[int, Path] = {}

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


def _on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: tensor.detach().to("cpu") for key, tensor in tensors.items()}
