"""How a model's mask meets a layer norm's rows.

A transformers ``attention_mask`` is ``[batch, seq]``; the layer norms of the model see
``[batch, seq, C]`` hidden states, or sometimes more leading axes (a norm per attention head:
``[batch, seq, heads, C]``) or the tokens flattened (``[batch * seq, C]``). The mask fits those
three, and nothing else: a guess (a pooled ``[batch, C]``, a sequence with a token added, heads
before positions) could silently zero the wrong rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def fit_mask(mask: torch.Tensor, leading: Sequence[int], where: str) -> torch.Tensor:
    """``mask`` over the rows of an input whose leading shape (its shape without the channel
    axis) is ``leading``: the mask itself when its shape is ``leading``; broadcast over the axes
    that follow when ``leading`` starts with its shape; flattened when ``leading`` is one axis
    of as many rows. Otherwise a ValueError that starts with ``where``.

    Example:
        >>> mask = torch.tensor([[True, False, False], [True, True, False]])
        >>> fit_mask(mask, (2, 3), "norm").shape, fit_mask(mask, (2, 3, 4), "norm").shape
        (torch.Size([2, 3]), torch.Size([2, 3, 4]))
        >>> fit_mask(mask, (6,), "norm").tolist()
        [True, False, False, True, True, False]
        >>> fit_mask(mask, (2,), "pooler.norm")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: pooler.norm: its input's rows [2] do not fit the mask [2, 3] ...
    """
    shape = tuple(mask.shape)
    leading = tuple(leading)
    if leading == shape:
        return mask
    if len(leading) > len(shape) and leading[: len(shape)] == shape:
        return mask.reshape(shape + (1,) * (len(leading) - len(shape))).expand(leading)
    if len(leading) == 1 and len(shape) > 1 and leading[0] == math.prod(shape):
        return mask.reshape(-1)
    raise ValueError(
        f"{where}: its input's rows {list(leading)} do not fit the mask {list(shape)} (a mask"
        " fits rows of its own shape, of its shape followed by more axes, or flattened to one"
        " axis); leave this layer norm out with modules=, or give a mask that fits"
    )
