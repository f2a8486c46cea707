"""Which layer norms of a model a call takes: all of them, or those whose path matches."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from torch import nn

from maskln_cli.op.module import MaskedLayerNorm

LAYER_NORMS = (nn.LayerNorm, MaskedLayerNorm)


def select_layer_norms(
    model: nn.Module, modules: str | Iterable[str] | None, kinds: tuple[type, ...] = LAYER_NORMS
) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each module of ``model`` that is one of ``kinds``, in the order
    of ``model.named_modules()``; with ``modules`` (glob patterns of module paths, as
    ``"encoder.layer.11.*"``; fnmatch's ``*`` matches dots too), those matching one of them.
    A pattern that matches none of them is a ValueError naming it and some paths that exist.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.LayerNorm(4))
        >>> [path for path, _ in select_layer_norms(model, "2")]
        ['2']
        >>> select_layer_norms(model, ["1", "norm*"])
        Traceback (most recent call last):
        ...
        ValueError: modules: 'norm*' matches none of the model's 2 layer norms ('1', '2')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = [(path, module) for path, module in model.named_modules() if isinstance(module, kinds)]
    if modules is None:
        return found
    patterns = [modules] if isinstance(modules, str) else list(modules)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"modules: expected glob patterns (str), got {type(pattern).__name__}")
        if not any(fnmatchcase(path, pattern) for path, _ in found):
            shown = ", ".join(repr(path) for path, _ in found[:4])
            more = ", ..." if len(found) > 4 else ""
            raise ValueError(
                f"modules: {pattern!r} matches none of the model's {len(found)} layer norms"
                f" ({shown}{more})"
            )
    return [(path, m) for path, m in found if any(fnmatchcase(path, p) for p in patterns)]
