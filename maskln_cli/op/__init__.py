"""The op: masked layer normalization and masked RMS normalization on tensors, and nothing else.

This package knows torch and the arithmetic: the norms, a parameter of every part below
(:mod:`.norms`), the public functions and their argument checks (:mod:`.api`, :mod:`.checks`),
the native C++ kernels (:mod:`.native`) and the raw-op kernels (:mod:`.blocked`) with the choice
between them (:mod:`.backend`), the op's derivatives (:mod:`.autograd`) and its registration in
torch's dispatcher (:mod:`.library`, defined as soon as torch is imported:
:mod:`.registration`), the purely functional float64 composite of its second derivatives
(:mod:`.functional`), the plain float64 references (:mod:`.reference`), the worker threads the
raw-op kernels run on (:mod:`.threads`), the modules (:mod:`.module`), and the catalogue of
known wrong formulas that verify and grade both diagnose with (:mod:`.mistakes`).

It must not import anything else of maskln_cli (no files, comparison, screen or command line):
tensors in, tensors out. Importing the package itself does not import torch (``maskln --help``
stays fast): its names are looked up when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maskln_cli.op.registration import register_with_torch

if TYPE_CHECKING:
    from maskln_cli.op.api import masked_layer_normalization, masked_rms_normalization
    from maskln_cli.op.backend import Backend, active_backend, set_backend
    from maskln_cli.op.module import MaskedLayerNorm, MaskedRMSNorm

__all__ = [
    "Backend",
    "MaskedLayerNorm",
    "MaskedRMSNorm",
    "active_backend",
    "masked_layer_normalization",
    "masked_rms_normalization",
    "set_backend",
]

_HOMES = {
    "masked_layer_normalization": "maskln_cli.op.api",
    "masked_rms_normalization": "maskln_cli.op.api",
    "MaskedLayerNorm": "maskln_cli.op.module",
    "MaskedRMSNorm": "maskln_cli.op.module",
    "Backend": "maskln_cli.op.backend",
    "active_backend": "maskln_cli.op.backend",
    "set_backend": "maskln_cli.op.backend",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'maskln_cli.op' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


register_with_torch()
