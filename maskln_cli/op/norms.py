"""The norms the op computes, as a table: LayerNorm and RMSNorm, one parameter of every part.

RMSNorm (Zhang & Sennrich, 2019) is LayerNorm without centering and without bias, with an
offset on the gain (Gemma's ``1 + scale``)::

    LayerNorm  y = (x - mean) / sqrt(var + eps) * scale + bias
    RMSNorm    y = x / sqrt(mean(x**2) + eps) * (offset + scale)

Every part of the op takes the norm as a parameter rather than being written twice: the native
kernels (``kCentered``), the raw-op kernels and the float64 composite (``centered``), the
autograd Functions, the vmap rules and the registered ops. Inside the op both norms use one
calling convention, the LayerNorm op's with the offset added (:data:`INNER_FORWARD`,
:data:`INNER_BACKWARD`): ``(x, valid, scale, bias, eps, offset)`` in, ``(y, mean, rstd)`` out,
``(dx, dscale, dbias)`` back, where RMSNorm's bias, mean and dbias are None. Only the public
functions and the registered ops have each norm's own signature, whose argument names a
:class:`Norm` lists, so that the conversion between the two is by name (:meth:`Norm.inner`,
:meth:`Norm.outer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["INNER_BACKWARD", "INNER_FORWARD", "LAYER", "NORMS", "RMS", "Norm"]

INNER_FORWARD = ("x", "valid", "scale", "bias", "eps", "offset")
"""The forward's arguments inside the op, for both norms."""
INNER_BACKWARD = ("dy", "x", "valid", "scale", "mean", "rstd", "eps", "offset", "output_mask")
"""The backward's, for both norms (``output_mask``: dx, dscale, dbias)."""
ABSENT = {"bias": None, "mean": None, "offset": 0.0}
"""What the inner convention holds for an argument a norm does not have."""


@dataclass(frozen=True)
class Norm:
    """One norm of the op.

    ``centered``: the mean is subtracted and a bias added (LayerNorm); else the statistics are
    rstd alone and the gain is ``offset + scale`` (RMSNorm). ``op`` and ``backward_op`` name its
    registered ops in the ``maskln`` namespace, whose arguments are ``forward_arguments`` and
    ``backward_arguments``; ``title`` is how messages say it.
    """

    name: str
    title: str
    centered: bool
    default_eps: float
    op: str
    backward_op: str
    forward_arguments: tuple[str, ...]
    backward_arguments: tuple[str, ...]

    @property
    def statistics(self) -> tuple[str, ...]:
        """The statistics its forward op returns after y (its backward op takes them)."""
        return ("mean", "rstd") if self.centered else ("rstd",)

    @property
    def gradients(self) -> tuple[str, ...]:
        """The gradients its backward op can return, in order (its output_mask's entries)."""
        return ("dx", "dscale", "dbias") if self.centered else ("dx", "dscale")

    def inner(self, names: Sequence[str], values: Sequence[Any], order: Sequence[str]) -> tuple:
        """``values`` of the arguments ``names`` (an op's) in the order ``order`` (the inner
        convention's), with what :data:`ABSENT` says for those the norm has not; a short
        output_mask gets False for dbias.

        Example:
            >>> RMS.inner(RMS.forward_arguments, ("x", "v", "s", 1e-6, 1.0), INNER_FORWARD)
            ('x', 'v', 's', None, 1e-06, 1.0)
        """
        given = dict(zip(names, values, strict=True))
        if "output_mask" in given:
            given["output_mask"] = (*given["output_mask"], False, False)[:3]
        return tuple(given[name] if name in given else ABSENT[name] for name in order)

    def outer(self, names: Sequence[str], values: Sequence[Any], order: Sequence[str]) -> tuple:
        """The inverse of :meth:`inner`: ``values`` of the inner arguments ``names``, in the
        order ``order`` of an op's (an output_mask cut to the norm's gradients).

        Example:
            >>> RMS.outer(INNER_FORWARD, ("x", "v", "s", None, 1e-6, 1.0), RMS.forward_arguments)
            ('x', 'v', 's', 1e-06, 1.0)
        """
        given = dict(zip(names, values, strict=True))
        if "output_mask" in given:
            given["output_mask"] = list(given["output_mask"][: len(self.gradients)])
        return tuple(given[name] for name in order)


LAYER = Norm(
    name="layer",
    title="LayerNorm",
    centered=True,
    default_eps=1e-5,
    op="masked_layer_norm",
    backward_op="masked_layer_norm_backward",
    forward_arguments=("x", "valid", "scale", "bias", "eps"),
    backward_arguments=("dy", "x", "valid", "scale", "mean", "rstd", "eps", "output_mask"),
)
RMS = Norm(
    name="rms",
    title="RMSNorm",
    centered=False,
    default_eps=1e-6,
    op="masked_rms_norm",
    backward_op="masked_rms_norm_backward",
    forward_arguments=("x", "valid", "scale", "eps", "offset"),
    backward_arguments=("dy", "x", "valid", "scale", "rstd", "eps", "offset", "output_mask"),
)
NORMS = {norm.name: norm for norm in (LAYER, RMS)}
"""Every norm, by name (what ``--norm`` and a file's metadata will name)."""
