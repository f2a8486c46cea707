"""What the catalogue of known mistakes is made of: a :class:`Mistake` (the op written wrongly in
one way) and a :class:`Diagnosis` (a result found to match one). :mod:`.mistakes` holds the
catalogue and the matching; :mod:`.backward_mistakes` the mistakes of a backward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

Formula = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``(x, valid, scale, bias, eps) -> out``, in float64."""
Gradients = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(x, valid, scale, bias, eps, grad_out) -> (grad_x, grad_scale, grad_bias)``, in float64."""


@dataclass(frozen=True)
class Mistake:
    """One way of getting the op wrong: its name, what it does in words, how to fix it, and the
    output it gives (float64, from float64 inputs). ``gradients``, for a mistake in the
    backward pass: the gradients it gives (None: autograd's of ``formula``)."""

    name: str
    description: str
    fix: str
    formula: Formula
    gradients: Gradients | None = None


def padding_mistakes(unmasked: Formula, correct: Formula) -> tuple[Mistake, Mistake]:
    """The padding's two mistakes, worded alike for every norm: invalid rows normalized like
    valid ones (``unmasked``, the norm's formula with no mask), and the mask read the other way
    round (``correct`` given ``~valid``)."""

    def inverted(x, valid, scale, bias, eps):
        return correct(x, ~valid, scale, bias, eps)

    return (
        Mistake(
            "padding_not_masked",
            "invalid rows are normalized like valid ones and not zeroed",
            "sanitize invalid x before the reductions and zero invalid outputs at the end",
            unmasked,
        ),
        Mistake(
            "mask_inverted",
            "the mask read the other way round: valid rows zeroed and invalid ones normalized"
            " (valid taken for a padding mask, as nn.MultiheadAttention's key_padding_mask is)",
            "True in valid means a row to normalize: keep = valid[..., None], zero where ~keep",
            inverted,
        ),
    )


@dataclass
class Diagnosis:
    """A known mistake a result matches. ``distance`` is the relative L2 distance between the
    result and that mistake's output (for a precision mistake: between their errors' sizes)."""

    mistake: str
    description: str
    fix: str
    distance: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def sentence(self) -> str:
        """``likely: unbiased variance (divides by C - 1); fix: ...``"""
        return f"likely {self.description}; {self.fix}"


@dataclass(frozen=True)
class Catalogue:
    """One norm's known mistakes: its ``correct`` formula (the truth a result is matched
    against), its formula ``mistakes`` and ``backward`` ones, and whether the fitted models
    of its rounding and statistics (a one-pass variance, a coarser dtype's grid, an eps, a
    backward term) are of this norm (``fitted``: LayerNorm's are; RMSNorm has none yet)."""

    correct: Formula
    mistakes: dict[str, Mistake]
    backward: dict[str, Mistake]
    fitted: bool
