"""maskln: masked layer normalization, forward and backward, over tensors and safetensors files.

    >>> from maskln_cli import MaskedLayerNorm, masked_layer_normalization

torch is imported only when the op or the module is first looked up, so ``maskln --help`` stays
fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import maskln_cli.op  # noqa: F401  (defines maskln's torch ops once torch is imported)

if TYPE_CHECKING:
    from maskln_cli.op.api import masked_layer_normalization
    from maskln_cli.op.module import MaskedLayerNorm

__all__ = ["MaskedLayerNorm", "__version__", "masked_layer_normalization"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from maskln_cli.version import installed_version

        globals()["__version__"] = version = installed_version()
        return version
    if name == "masked_layer_normalization":
        from maskln_cli.op.api import masked_layer_normalization

        return masked_layer_normalization
    if name == "MaskedLayerNorm":
        from maskln_cli.op.module import MaskedLayerNorm

        return MaskedLayerNorm
    raise AttributeError(f"module 'maskln_cli' has no attribute {name!r}")
