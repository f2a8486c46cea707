"""The lower bound of grad_x's allowances (``budget.grad_x_lower``, ``Allowance.bounds``) that
spares most rows of a block their allowances: it must be at most the model on every element
of a valid row, whatever the data and the judged dtype, and a verdict or figure must never
depend on it (reports are those of the floors alone)."""

from __future__ import annotations

import json

import pytest
import torch

from maskln_cli.compare import judging
from maskln_cli.op.blocked import backward_in_place, forward
from maskln_cli.testing import verify
from maskln_cli.verify.allowance import Allowance
from maskln_cli.verify.budget import Precision, RowBudget, grad_x_lower
from tests import kernels

FAMILIES = ["N(0, 1)", "spread 1e-2..10", "offset 1e3", "1e4 + N(0, 0.1)", "heavy tails",
            "N(0, 300)", "C = 768, 1e4 + N(0, 0.1)"]  # fmt: skip
JUDGED = {
    "float32": (torch.float32, "float32"),
    "float16": (torch.float16, "float16"),
    "bfloat16": (torch.bfloat16, "bfloat16"),
    "bfloat16 from float32 x": (torch.bfloat16, "float32"),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("judged", list(JUDGED))
def test_lower_bound_is_below_the_model(family: str, judged: str) -> None:
    dtype, stored = JUDGED[judged]
    data = kernels.DATA_FAMILIES[family](3, dtype=stored)
    channels = data["x"].shape[-1]
    x64 = data["x"].reshape(-1, channels).double()
    dy64 = data["grad_out"].reshape(-1, channels).double()
    valid = data["valid"].reshape(-1)
    scale, bias = data["scale"].double(), data["bias"].double()
    _, mean, rstd = forward(x64, valid, scale, bias, kernels.EPS)
    truth, _, _ = backward_in_place(dy64, x64, valid, scale, mean, rstd, kernels.EPS)
    precision = Precision.of(dtype, data["x"].dtype, data["scale"].dtype, data["grad_out"].dtype)
    budget = RowBudget(x64, valid, scale, bias, kernels.EPS, precision)
    lower = grad_x_lower(budget, dy64, truth.abs(), rstd)
    assert lower is not None
    model = budget.grad_x(dy64)
    rows = valid.nonzero().squeeze(1)
    assert bool((lower[rows] <= model[rows]).all())
    # and it is a bound worth having: most of the model on most elements
    share = (lower[rows] / model[rows]).median()
    print(f"{family} {judged}: median share {float(share):.3f}")
    assert float(share) > 0.2


@pytest.mark.parametrize("family", ["N(0, 1)", "offset 1e3", "heavy tails"])
@pytest.mark.parametrize("kernel", ["torch", "unbiased", "no_xhat_term", "last_row_wrong"])
def test_reports_do_not_depend_on_the_bound(
    monkeypatch: pytest.MonkeyPatch, family: str, kernel: str
) -> None:
    made = {
        "torch": kernels.torch_layer_norm,
        "unbiased": kernels.unbiased,
        "no_xhat_term": kernels.written("no_xhat_term"),
        "last_row_wrong": kernels.last_row_wrong(kernels.unbiased),
    }[kernel]
    data = kernels.DATA_FAMILIES[family](5)
    result = kernels.zero_padding(kernels.run(made, data), data["valid"])

    def report() -> str:
        grads = {k: result[k] for k in ("grad_x", "grad_scale", "grad_bias")}
        checked = verify(
            result["out"], data["x"], data["valid"], data["scale"], data["bias"], kernels.EPS,
            grad_out=data["grad_out"], **grads,
        )  # fmt: skip
        return json.dumps(checked.to_dict(), sort_keys=True)

    calls: list[bool] = []
    bounds = Allowance.bounds

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        made = bounds(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(made is not None)
        return made

    monkeypatch.setattr(Allowance, "bounds", counted)
    with_bound = report()
    assert any(calls)
    monkeypatch.setattr(Allowance, "bounds", lambda *_, **__: None)
    assert report() == with_bound
    monkeypatch.setattr(judging.AllowancesOnDemand, "_rows_to_judge", lambda *_: None)
    assert report() == with_bound
