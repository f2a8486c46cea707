"""Known mistakes in implementing masked RMSNorm: RMSNorm's catalogue, as :mod:`.mistakes` holds
LayerNorm's, matched by the same code (``diagnose_output(..., norm="rms")``).

Its formulas take the LayerNorm catalogue's arguments ``(x, valid, scale, bias, eps)`` as verify
holds an RMSNorm problem: ``scale`` the whole gain (``offset + scale``) and ``bias`` zeros, so
that ``y = x / sqrt(mean(x**2) + eps) * scale + bias`` is RMSNorm's output. A gain off by one
(Gemma's ``1 + scale`` where the model's gain is ``scale``, or the other way round) is a
formula of the gain, whichever offset the model has.

Its backward's mistake (:data:`RMS_BACKWARD_MISTAKES`) is matched as a formula too. RMSNorm has
no fitted model of its own yet for an eps mismatch or a coarser dtype's rounding (LayerNorm's
are of centered rows): those failures are not named.
"""

from __future__ import annotations

import torch

from maskln_cli.op.mistake_records import Mistake, padding_mistakes

__all__ = ["RMS_BACKWARD_MISTAKES", "RMS_MISTAKES", "rms_correct"]


def _clean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), x, 0.0)


def _masked(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), y, 0.0)


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean(dim=-1, keepdim=True)


def rms_correct(x, valid, scale, bias, eps):
    """RMSNorm as specified (float64; ``scale`` the whole gain, ``bias`` zeros)."""
    x = _clean(x, valid)
    return _masked(x / torch.sqrt(_mean_square(x) + eps) * scale + bias, valid)


def _with_rstd(make_xhat):
    """A formula that differs from RMSNorm's in how x is normalized only."""

    def formula(x, valid, scale, bias, eps):
        x = _clean(x, valid)
        return _masked(make_xhat(x, eps) * scale + bias, valid)

    return formula


def _mean_subtracted(x, eps):
    centered = x - x.mean(dim=-1, keepdim=True)
    return centered / torch.sqrt(_mean_square(centered) + eps)


def _over_c_minus_1(x, eps):
    channels = x.shape[-1]
    if channels == 1:
        return torch.full_like(x, torch.nan)
    return x / torch.sqrt(x.square().sum(dim=-1, keepdim=True) / (channels - 1) + eps)


def _gain_plus(shift: float):
    def formula(x, valid, scale, bias, eps):
        return rms_correct(x, valid, scale + shift, bias, eps)

    return formula


def _padding_not_masked(x, valid, scale, bias, eps):
    return x / torch.sqrt(_mean_square(x) + eps) * scale + bias


RMS_MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "mean_subtracted",
            "the row mean subtracted (LayerNorm where RMSNorm is due): (x - mean) /"
            " sqrt(var + eps)",
            "divide x itself by its root mean square: x / sqrt(mean(x**2) + eps)",
            _with_rstd(_mean_subtracted),
        ),
        Mistake(
            "eps_outside_sqrt",
            "eps added outside the square root: x / (sqrt(mean(x**2)) + eps)",
            "add eps inside: x / sqrt(mean(x**2) + eps)",
            _with_rstd(lambda x, eps: x / (torch.sqrt(_mean_square(x)) + eps)),
        ),
        Mistake(
            "squares_over_c_minus_1",
            "the mean of squares divided by C - 1: x / sqrt(sum(x**2) / (C - 1) + eps)",
            "average the squares over the C channels: x.square().mean(-1)",
            _with_rstd(_over_c_minus_1),
        ),
        Mistake(
            "gain_plus_one",
            "the gain is one more than due: 1 + scale where the model's gain is scale"
            " (Gemma's offset on a LLaMA-style norm)",
            "multiply by the model's gain: scale for LLaMA, Mistral, Qwen, T5; 1 + scale for"
            " Gemma only (offset 1)",
            _gain_plus(1.0),
        ),
        Mistake(
            "gain_minus_one",
            "the gain is one less than due: scale where 1 + scale is due (Gemma's zero-centred"
            " gain without its offset)",
            "multiply by offset + scale: 1 + scale for Gemma (offset 1), scale for the others",
            _gain_plus(-1.0),
        ),
        *padding_mistakes(_padding_not_masked, rms_correct),
    )
}
"""RMSNorm's formula mistakes (its forward; autograd of each gives its backward's)."""


def _backward_without_xhat_term(x, valid, scale, bias, eps, grad_out):
    """RMSNorm's hand-written backward, ``dx = rstd * (wdy - xhat * mean(xhat * wdy))`` with
    ``wdy = scale * grad_out``, its xhat term dropped (float64): ``dx = rstd * wdy``."""
    keep = valid.unsqueeze(-1)
    rows = _clean(x, valid)
    rstd = torch.rsqrt(_mean_square(rows) + eps)
    dy = torch.where(keep, grad_out.nan_to_num(0.0, 0.0, 0.0), 0.0)
    leading = tuple(range(x.dim() - 1))
    grad_x = torch.where(keep, rstd * dy * scale, 0.0)
    return grad_x, (dy * rows * rstd).sum(leading), dy.sum(leading)


RMS_BACKWARD_MISTAKES: dict[str, Mistake] = {
    mistake.name: mistake
    for mistake in (
        Mistake(
            "backward_missing_xhat_term",
            "grad_x misses its xhat term, -xhat * mean(xhat * scale * grad_out): rstd's own"
            " gradient dropped from a hand-written backward (or rstd detached from the graph)",
            "dx = rstd * (wdy - xhat * mean(xhat * wdy)), with wdy = scale * grad_out; keep rstd"
            " in the graph",
            rms_correct,
            _backward_without_xhat_term,
        ),
    )
}
"""Mistakes of an RMSNorm backward whose forward is right (``diagnose_gradient`` tries them)."""
