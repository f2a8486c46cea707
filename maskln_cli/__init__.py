"""maskln: masked layer normalization, forward and backward, over tensors and safetensors files.

    >>> from maskln_cli import MaskedLayerNorm, masked_layer_normalization
    >>> from maskln_cli import MaskedRMSNorm, masked_rms_normalization  # RMSNorm, the same way
    >>> from maskln_cli import capture, swap_layer_norms  # a whole model's layer norms

torch is imported only when one of them is first looked up, so ``maskln --help`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import maskln_cli.op  # noqa: F401  (defines maskln's torch ops once torch is imported)

if TYPE_CHECKING:
    from maskln_cli.models.capture import capture
    from maskln_cli.models.swap import swap_layer_norms
    from maskln_cli.op.api import masked_layer_normalization, masked_rms_normalization
    from maskln_cli.op.module import MaskedLayerNorm, MaskedRMSNorm

__all__ = [
    "MaskedLayerNorm",
    "MaskedRMSNorm",
    "__version__",
    "capture",
    "masked_layer_normalization",
    "masked_rms_normalization",
    "swap_layer_norms",
]


# Where each public name lives: imported on first use.
_LAZY_HOMES = {
    "masked_layer_normalization": "maskln_cli.op.api",
    "masked_rms_normalization": "maskln_cli.op.api",
    "MaskedLayerNorm": "maskln_cli.op.module",
    "MaskedRMSNorm": "maskln_cli.op.module",
    "capture": "maskln_cli.models.capture",
    "swap_layer_norms": "maskln_cli.models.swap",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from maskln_cli.version import installed_version

        globals()["__version__"] = version = installed_version()
        return version
    if name in _LAZY_HOMES:
        return getattr(importlib.import_module(_LAZY_HOMES[name]), name)
    raise AttributeError(f"module 'maskln_cli' has no attribute {name!r}")
