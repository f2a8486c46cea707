"""The cases of the clauses: a call's inputs (:class:`Case`), kept so that the grader's child
process and the grader build the same tensors, in the same layouts, and described in words
for a verdict, led by the family of data they belong to (:mod:`.families`). Their random data
comes from :mod:`.draws`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from maskln_cli.grading.clauses.assumed import reference_formula


@dataclass
class Case:
    """Inputs of one call, kept as contiguous CPU base tensors plus the views that give each
    input its layout, so that the child and the parent build the same tensors, on any device.

    ``views[name]`` is a tuple of ``("permute", dims)``, ``("step", dim, step)`` or
    ``("expand", sizes)``, for ``x``, ``valid``, ``scale``, ``bias`` and ``grad_out`` (the
    upstream gradient, given to the function's backward as it is, in its own layout).
    ``clean_x``, when set, is ``x`` with ordinary numbers in its invalid rows instead of the
    NaN, inf and 1e30 of ``x``. ``family``: the family of data the case belongs to, which its
    label names first.
    """

    label: str
    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    eps: float
    grad_out: torch.Tensor | None = None
    views: dict[str, tuple[tuple[Any, ...], ...]] = field(default_factory=dict)
    clean_x: torch.Tensor | None = None
    directions: dict[str, torch.Tensor] | None = None
    family: str = ""

    def inputs(self, device: str | torch.device = "cpu", clean: bool = False) -> dict[str, Any]:
        """Fresh tensors (a call may mutate them) on ``device``, in their layouts."""
        bases = {
            "x": self.clean_x if clean and self.clean_x is not None else self.x,
            "valid": self.valid,
            "scale": self.scale,
            "bias": self.bias,
        }
        tensors = {}
        for name, base in bases.items():
            tensor = base.clone().to(device)
            for view in self.views.get(name, ()):
                tensor = apply_view(tensor, view)
            tensors[name] = tensor
        if self.grad_out is not None:
            grad_out = self.grad_out.clone().to(device)
            for view in self.views.get("grad_out", ()):
                grad_out = apply_view(grad_out, view)
            tensors["grad_out"] = grad_out
        return tensors

    def invalid(self) -> torch.Tensor:
        """Where x's elements are in invalid rows (bool, x's logical shape)."""
        t = self.inputs()
        return ~t["valid"][..., None].expand(t["x"].shape)

    def reference(self) -> torch.Tensor:
        """The float64 reference output for this case's inputs (an assumed mistake's, while
        one is assumed: :mod:`.assumed`)."""
        t = self.inputs()
        return reference_formula()(t["x"], t["valid"], t["scale"], t["bias"], self.eps)


def apply_view(tensor: torch.Tensor, view: tuple[Any, ...]) -> torch.Tensor:
    kind = view[0]
    if kind == "permute":
        return tensor.permute(*view[1])
    if kind == "step":
        _, dim, step = view
        return tensor[(slice(None),) * dim + (slice(None, None, step),)]
    if kind == "expand":
        return tensor.expand(*view[1])
    raise ValueError(f"unknown view {kind!r}")


RANDOM = "random rows"
"""The family of most cases (:mod:`.families` has the others)."""


def labelled(family: str, label: str) -> str:
    """A case's label, led by its family.

    Example:
        >>> labelled("constant rows", "x [2, 5, 8] float64, eps 1e-05, contiguous")
        '[constant rows] x [2, 5, 8] float64, eps 1e-05, contiguous'
    """
    return f"[{family}] {label}"


def make_case(
    label: str,
    x: torch.Tensor,
    valid: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    dtype: torch.dtype,
    g: torch.Generator | None = None,
    grad: bool = False,
    family: str = RANDOM,
) -> Case:
    """A case from float64 data, in ``dtype``, of a ``family`` (which leads its label); with
    ``g`` and ``grad``, a random upstream gradient (finite everywhere, in invalid rows
    too)."""
    scale, bias = params
    grad_out = None
    if grad:
        assert g is not None
        grad_out = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    return Case(
        label=labelled(family, label),
        family=family,
        x=x.to(dtype),
        valid=valid,
        scale=scale.to(dtype),
        bias=bias.to(dtype),
        eps=eps,
        grad_out=grad_out,
    )


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_inputs(
    x: torch.Tensor, dtype: torch.dtype, eps: float, layout: str = "contiguous"
) -> str:
    return f"x {_shape(x)} {dtype_name(dtype)}, eps {eps:g}, {layout}"
