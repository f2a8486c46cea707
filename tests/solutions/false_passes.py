"""Wrong solutions that passed every required clause before the clauses tried their case
(issue 22): each is right everywhere the old clauses looked, and wrong in one realistic way, in
the clause named in its docstring. Three classes, each in several styles:

- values with grad mode off (a "fast inference path"): ``values``;
- every row invalid, with garbage (NaN, inf) in the padding: ``sanitized_padding``;
- a 0-d valid (x [C]) or a single row, with garbage in it: ``sanitized_padding`` and, when only
  the gradients go wrong, ``sanitized_gradients``.
"""

import torch

from tests.solutions.correct import masked_layer_normalization as correct


def _normalized(x, eps):
    mean = x.mean(dim=-1, keepdim=True)
    centered = x - mean
    return centered / torch.sqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)


# values with grad mode off ------------------------------------------------------------------------


def no_grad_path_forgets_mask(x, valid, scale, bias, eps=1e-05):
    """values: under torch.no_grad() a "fused" inference path sanitizes the padding but forgets
    the final mask, so invalid rows return bias."""
    if not torch.is_grad_enabled():
        x_clean = torch.where(valid[..., None], x, 0.0)
        return _normalized(x_clean, eps) * scale + bias
    return correct(x, valid, scale, bias, eps)


def inference_mode_path_unbiased(x, valid, scale, bias, eps=1e-05):
    """values: under torch.inference_mode() a separate path takes torch.var's default, the
    unbiased variance."""
    if torch.is_inference_mode_enabled():
        keep = valid.unsqueeze(-1)
        xc = x.masked_fill(~keep, 0.0)
        y = (xc - xc.mean(-1, keepdim=True)) / torch.sqrt(xc.var(-1, keepdim=True) + eps)
        return (y * scale + bias).masked_fill(~keep, 0.0)
    return correct(x, valid, scale, bias, eps)


def eval_path_eps_outside_sqrt(x, valid, scale, bias, eps=1e-05):
    """values: with grad mode off (evaluation), an "optimized" path divides by std + eps."""
    if not torch.is_grad_enabled():
        keep = valid.unsqueeze(-1)
        xc = x.masked_fill(~keep, 0.0)
        centered = xc - xc.mean(-1, keepdim=True)
        std = centered.square().mean(-1, keepdim=True).sqrt()
        return (centered / (std + eps) * scale + bias).masked_fill(~keep, 0.0)
    return correct(x, valid, scale, bias, eps)


# every row invalid, with garbage padding ----------------------------------------------------------


def all_invalid_times_zero(x, valid, scale, bias, eps=1e-05):
    """sanitized_padding: a shortcut for a batch of pure padding, x * 0, which is NaN where x
    holds NaN or inf."""
    if not valid.any():
        return x * 0
    return correct(x, valid, scale, bias, eps)


def all_invalid_x_minus_x(x, valid, scale, bias, eps=1e-05):
    """sanitized_padding: zeros "with x's graph" as x - x, which is NaN for NaN and inf."""
    if not bool(valid.any()):
        return x - x
    return correct(x, valid, scale, bias, eps)


def all_invalid_skips_sanitizing(x, valid, scale, bias, eps=1e-05):
    """sanitized_padding: sanitizes only when some rows are valid ("nothing to protect
    otherwise") and then masks by multiplying."""
    keep = valid.unsqueeze(-1)
    if valid.any():
        x = x.masked_fill(~keep, 0.0)
    return (_normalized(x, eps) * scale + bias) * keep.to(x.dtype)


# a 0-d valid or a single row, with garbage -------------------------------------------------------


def vector_path_multiplies_by_flag(x, valid, scale, bias, eps=1e-05):
    """sanitized_padding (and sanitized_gradients): a special path for a single vector, x [C]
    with a 0-d valid, that multiplies by the flag: NaN * False is NaN."""
    if x.dim() == 1:
        return (_normalized(x, eps) * scale + bias) * valid
    return correct(x, valid, scale, bias, eps)


def vector_path_selects_unsanitized(x, valid, scale, bias, eps=1e-05):
    """sanitized_gradients: the single-vector path selects with torch.where (the values are
    right) but normalizes the unsanitized vector: its gradients are NaN."""
    if valid.dim() == 0:
        return torch.where(valid, _normalized(x, eps) * scale + bias, 0.0)
    return correct(x, valid, scale, bias, eps)


def single_row_path_scales_by_mask(x, valid, scale, bias, eps=1e-05):
    """sanitized_padding: one row ([1, C], or x [C]) takes a scalar path scaled by the mask."""
    if valid.numel() == 1:
        flag = valid.reshape(()).to(x.dtype)
        return (_normalized(x, eps) * scale + bias) * flag
    return correct(x, valid, scale, bias, eps)
