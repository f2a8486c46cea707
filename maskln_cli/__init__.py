"""maskln: masked layer normalization, forward and backward, over tensors and safetensors files.

    >>> from maskln_cli import MaskedLayerNorm, masked_layer_normalization
    >>> from maskln_cli import capture, swap_layer_norms  # a whole model's layer norms

torch is imported only when one of them is first looked up, so ``maskln --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import maskln_cli.op  # noqa: F401  (defines maskln's torch ops once torch is imported)

if TYPE_CHECKING:
    from maskln_cli.models.capture import capture
    from maskln_cli.models.swap import swap_layer_norms
    from maskln_cli.op.api import masked_layer_normalization
    from maskln_cli.op.module import MaskedLayerNorm

__all__ = [
    "MaskedLayerNorm",
    "__version__",
    "capture",
    "masked_layer_normalization",
    "swap_layer_norms",
]


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
    if name == "capture":
        from maskln_cli.models.capture import capture

        return capture
    if name == "swap_layer_norms":
        from maskln_cli.models.swap import swap_layer_norms

        return swap_layer_norms
    raise AttributeError(f"module 'maskln_cli' has no attribute {name!r}")
