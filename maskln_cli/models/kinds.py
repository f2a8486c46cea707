"""The norms maskln knows in a model, by kind: which modules ``capture`` records and
``swap_layer_norms`` replaces, and how each computes (its norm, where its eps is, its offset).

torch's own classes match by ``isinstance`` (a subclass with a forward of its own is refused by
the swap); the transformers classes match exactly, by their module and name, without importing
transformers: a class maskln has not checked might compute otherwise (Gemma's gain is ``1 +
weight``, LLaMA's ``weight``), and a wrong guess would change a model's results. Each row of
:data:`KINDS` is checked against the class's own forward (``tests/models/test_rms_models.py``). A
module whose class name says it is a norm but that no kind matches is a *lookalike*: both
``capture`` and the swap name it, rather than leave it out silently.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from maskln_cli.op.checks import compute_dtype
from maskln_cli.op.module import MaskedLayerNorm, MaskedRMSNorm
from maskln_cli.op.norms import LAYER, RMS, Norm

__all__ = ["KINDS", "Kind", "kind_of", "lookalikes", "summary"]


@dataclass(frozen=True)
class Kind:
    """A kind of norm module.

    ``match``: a class (its instances are of this kind) or ``"module.Class"`` (that very class);
    ``eps``: the attribute holding eps (None there: ``nn.RMSNorm``'s rule, the machine epsilon
    of the compute dtype); ``offset``: the gain's offset (Gemma's 1), or the attribute holding
    it; ``masked``: a maskln module, which zeroes the padding already (capture records the mask
    it was given; the swap leaves it).
    """

    name: str
    norm: Norm
    match: type | str
    eps: str
    offset: float | str = 0.0
    masked: bool = False

    def matches(self, module: nn.Module) -> bool:
        if isinstance(self.match, type):
            return isinstance(module, self.match)
        kind = type(module)
        return f"{kind.__module__}.{kind.__qualname__}" == self.match

    def eps_of(self, module: nn.Module, dtype: torch.dtype) -> float:
        """The eps a call of ``module`` on x of ``dtype`` adds."""
        eps = getattr(module, self.eps)
        return torch.finfo(compute_dtype(dtype)).eps if eps is None else float(eps)

    def offset_of(self, module: nn.Module) -> float:
        return float(getattr(module, self.offset) if isinstance(self.offset, str) else self.offset)

    def shape_of(self, module: nn.Module) -> tuple[int, ...]:
        """The trailing shape the module normalizes (transformers' norms: their weight's)."""
        shape = getattr(module, "normalized_shape", None)
        if shape is None:
            shape = module.weight.shape  # type: ignore[union-attr]
        return tuple(shape)  # type: ignore[arg-type]


def _transformers(model: str, name: str) -> str:
    return f"transformers.models.{model}.modeling_{model}.{name}"


KINDS: tuple[Kind, ...] = (
    Kind("LayerNorm", LAYER, nn.LayerNorm, "eps"),
    Kind("MaskedLayerNorm", LAYER, MaskedLayerNorm, "eps", masked=True),
    Kind("RMSNorm", RMS, nn.RMSNorm, "eps"),
    Kind("MaskedRMSNorm", RMS, MaskedRMSNorm, "eps", offset="offset", masked=True),
    # x / sqrt(mean(x**2) + eps) * weight, computed in float32
    Kind("LlamaRMSNorm", RMS, _transformers("llama", "LlamaRMSNorm"), "variance_epsilon"),
    Kind("MistralRMSNorm", RMS, _transformers("mistral", "MistralRMSNorm"), "variance_epsilon"),
    Kind("MixtralRMSNorm", RMS, _transformers("mixtral", "MixtralRMSNorm"), "variance_epsilon"),
    Kind("Qwen2RMSNorm", RMS, _transformers("qwen2", "Qwen2RMSNorm"), "variance_epsilon"),
    Kind("Qwen3RMSNorm", RMS, _transformers("qwen3", "Qwen3RMSNorm"), "variance_epsilon"),
    Kind("T5LayerNorm", RMS, _transformers("t5", "T5LayerNorm"), "variance_epsilon"),
    # x / sqrt(mean(x**2) + eps) * (1 + weight), computed in float32
    Kind("GemmaRMSNorm", RMS, _transformers("gemma", "GemmaRMSNorm"), "eps", offset=1.0),
    Kind("Gemma2RMSNorm", RMS, _transformers("gemma2", "Gemma2RMSNorm"), "eps", offset=1.0),
    Kind("Gemma3RMSNorm", RMS, _transformers("gemma3", "Gemma3RMSNorm"), "eps", offset=1.0),
)
"""Every kind of norm maskln knows, by class."""

_NORM_NAME = re.compile(r"(rms|layer)_?norm", re.IGNORECASE)


def kind_of(module: nn.Module, kinds: Iterable[Kind] = KINDS) -> Kind | None:
    """The first of ``kinds`` that ``module`` is of, or None.

    Example:
        >>> kind_of(nn.RMSNorm(8)).name, kind_of(nn.Linear(2, 2))
        ('RMSNorm', None)
    """
    for kind in kinds:
        if kind.matches(module):
            return kind
    return None


def lookalikes(model: nn.Module) -> dict[str, str]:
    """``{path: class name}`` of the modules whose class name says they are a norm (RMSNorm,
    LayerNorm) but that no kind matches: maskln does not know how they compute.

    Example:
        >>> class FancyRMSNorm(nn.Module):
        ...     pass
        >>> lookalikes(nn.Sequential(nn.LayerNorm(4), FancyRMSNorm()))
        {'1': 'FancyRMSNorm'}
    """
    return {
        path: type(module).__name__
        for path, module in model.named_modules()
        if kind_of(module) is None and _NORM_NAME.search(type(module).__name__)
    }


def summary(names: Iterable[str]) -> str:
    """Counts by name, most first: ``5 LlamaRMSNorm, 1 LayerNorm``.

    Example:
        >>> summary(["LlamaRMSNorm", "LayerNorm", "LlamaRMSNorm"])
        '2 LlamaRMSNorm, 1 LayerNorm'
    """
    return ", ".join(f"{count} {name}" for name, count in Counter(names).most_common())
