"""Rows of INPUT and RESULT re-read for a diagnosis (:mod:`.diagnose`), and their truth: the
record the diagnosis and the granularity test (:mod:`.granularity`) both take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from maskln_cli.files.problem import Problem


@dataclass
class Sample:
    """Rows of INPUT and RESULT re-read for a diagnosis, in their leading shape."""

    problem: Problem
    actual: torch.Tensor
    x: torch.Tensor
    valid: torch.Tensor
    grad_out: torch.Tensor | None

    def reference(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The truth (float64) and PyTorch's result in ``dtype`` for ``name`` on these rows."""
        from maskln_cli.verify.blockwork import float64_truth
        from maskln_cli.verify.yardstick import yardstick

        problem = self.problem
        channels = problem.channels
        rows, valid = self.x.reshape(-1, channels), self.valid.reshape(-1)
        upstream = self.grad_out.reshape(-1, channels) if name == "grad_x" else None
        dy64 = upstream.double() if upstream is not None else None
        truth = float64_truth(problem, rows.double(), valid, dy64)[0][name]
        guess = yardstick(
            rows, valid, problem.scale, problem.bias, problem.eps, dtype, upstream,
            centered=problem.norm.centered,
        )  # fmt: skip
        value = guess.out if upstream is None else guess.grad_x
        assert value is not None
        return truth.reshape(self.x.shape), value.double().reshape(self.x.shape)
