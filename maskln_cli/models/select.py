"""Which norms of a model a call takes: all of them (of the kinds asked for), or those whose
path matches."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import NamedTuple

from torch import nn

from maskln_cli.models.kinds import KINDS, Kind, kind_of


class Found(NamedTuple):
    """A norm of a model: its path, the module and its kind."""

    path: str
    module: nn.Module
    kind: Kind


def select_layer_norms(
    model: nn.Module, modules: str | Iterable[str] | None, kinds: tuple[Kind, ...] = KINDS
) -> list[Found]:
    """Each module of ``model`` that is of one of ``kinds`` (by default every kind of
    :data:`~maskln_cli.models.kinds.KINDS`: layer norms and RMS norms), in the order of
    ``model.named_modules()``; with
    ``modules`` (glob patterns of module paths, as ``"encoder.layer.11.*"``; fnmatch's ``*``
    matches dots too), those matching one of them. A pattern that matches none of them is a
    ValueError naming it and some paths that exist.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.RMSNorm(4))
        >>> [(found.path, found.kind.name) for found in select_layer_norms(model, "2")]
        [('2', 'RMSNorm')]
        >>> select_layer_norms(model, ["1", "norm*"])
        Traceback (most recent call last):
        ...
        ValueError: modules: 'norm*' matches none of the model's 2 layer norms ('1', '2')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = []
    for path, module in model.named_modules():
        kind = kind_of(module, kinds)
        if kind is not None:
            found.append(Found(path, module, kind))
    if modules is None:
        return found
    patterns = [modules] if isinstance(modules, str) else list(modules)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"modules: expected glob patterns (str), got {type(pattern).__name__}")
        if not any(fnmatchcase(each.path, pattern) for each in found):
            shown = ", ".join(repr(each.path) for each in found[:4])
            more = ", ..." if len(found) > 4 else ""
            raise ValueError(
                f"modules: {pattern!r} matches none of the model's {len(found)} layer norms"
                f" ({shown}{more})"
            )
    return [each for each in found if any(fnmatchcase(each.path, p) for p in patterns)]
