"""The rows whose allowances ``maskln verify`` skips (AllowancesOnDemand): a row is skipped when
its greatest ratio is bounded below any figure it could change, each element's ratio bounded by
its difference over what it is always allowed (``Allowance.floors``). A skipped row must never
change a verdict or a figure: the floors are those very bits of each allowance
(``from_model``'s ``always``), and reports are those of every row's allowances made."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from maskln_cli.compare import judging
from maskln_cli.testing import verify
from maskln_cli.verify.allowance import Allowance
from tests import kernels

CORRECT = {"torch": kernels.torch_layer_norm, "sequential": kernels.sequential,
           "welford": kernels.welford, "written": kernels.written()}  # fmt: skip
WRONG = {
    "unbiased": kernels.unbiased,
    "eps_outside": kernels.eps_outside,
    "scaled": kernels.scaled_output,
    "no_xhat_term": kernels.written("no_xhat_term"),
    "padding_in_sums": kernels.written("padding_in_sums"),
    "half_sums": kernels.accumulate_in(torch.float16),
    "last_row_wrong": kernels.last_row_wrong(kernels.unbiased),
}
DATA = {
    "offset": lambda: kernels.offset_batch(1e4, 3, (16, 128, 64), std=0.1),
    "normal": lambda: kernels.offset_batch(0.0, 4, (16, 128, 64)),
    "heavy": lambda: kernels.heavy_tailed_batch(5, (16, 128, 64)),
    "spread": lambda: kernels.spread_batch(6, (8, 256, 64)),
}


def _report(data: dict, result: dict, gradients: bool) -> dict:
    extra = {}
    if gradients:
        extra = {k: result[k] for k in ("grad_x", "grad_scale", "grad_bias")}
        extra["grad_out"] = data["grad_out"]
    report = verify(
        result["out"], data["x"], data["valid"], data["scale"], data["bias"], kernels.EPS, **extra
    )
    return report.to_dict()


def _text(report: dict) -> str:
    """A report's JSON, as verify prints it: NaN figures compare equal."""
    return json.dumps(report, sort_keys=True)


def _every_row_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of every block gets its allowances (None: all rows), as before ceilings."""
    monkeypatch.setattr(judging.AllowancesOnDemand, "_rows_to_judge", lambda *_: None)


def _floors_used(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the blocks whose rows were picked with the floors' finer ceilings."""
    used: list[int] = []
    floors = Allowance.floors

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        made = floors(*args, **kwargs)  # type: ignore[arg-type]
        used.append(made is not None)
        return made

    monkeypatch.setattr(Allowance, "floors", counted)
    return used


@pytest.mark.parametrize("data_name", list(DATA))
@pytest.mark.parametrize("gradients", [False, True], ids=["out", "grads"])
def test_reports_are_those_of_every_row_judged(
    monkeypatch: pytest.MonkeyPatch, data_name: str, gradients: bool
) -> None:
    """On correct and wrong kernels (float32, and torch's in the half dtypes): the same report,
    to the last figure, as with every row's allowances made; and the floors did skip rows."""
    data = DATA[data_name]()
    runs = [(name, kernel, None) for name, kernel in {**CORRECT, **WRONG}.items()]
    runs += [("torch fp16", kernels.torch_layer_norm, torch.float16),
             ("torch bf16", kernels.torch_layer_norm, torch.bfloat16)]  # fmt: skip
    results = {
        name: kernels.zero_padding(kernels.run(kernel, data, dtype), data["valid"])
        for name, kernel, dtype in runs
    }
    with monkeypatch.context() as patch:
        used = _floors_used(patch)
        skipping = {name: _report(data, r, gradients) for name, r in results.items()}
    assert any(used), "no block took the floors' ceilings: the case tests nothing"
    with monkeypatch.context() as patch:
        _every_row_judged(patch)
        every_row = {name: _report(data, r, gradients) for name, r in results.items()}
    differing = [name for name in results if _text(skipping[name]) != _text(every_row[name])]
    assert not differing, differing
    verdicts = {name: report["passed"] for name, report in skipping.items()}
    assert all(verdicts[name] for name in CORRECT), verdicts
    assert not all(verdicts[name] for name in WRONG), verdicts


@pytest.mark.parametrize("gradients", [False, True], ids=["out", "grads"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_floors_are_the_bits_always_allowed(
    monkeypatch: pytest.MonkeyPatch, gradients: bool, dtype: torch.dtype | None
) -> None:
    """Each floor is, bit for bit, what the same element's allowance always allows (so at most
    its allowance) on every valid row, whether the allowances are made for the whole block or
    for some of its rows (gathered, as skipping makes them)."""
    data = kernels.offset_batch(1e3, 9, (8, 256, 64))
    result = kernels.zero_padding(kernels.run(kernels.torch_layer_norm, data, dtype), data["valid"])
    seen: list[int] = []
    rows_to_judge = judging.AllowancesOnDemand._rows_to_judge

    def checked(self: judging.AllowancesOnDemand, top_row: int, known: float):
        floors = self.floors() if self.floors else None
        if floors is not None:
            rows = self.rows
            valid = torch.ones(rows, dtype=torch.bool) if self.invalid is None else ~self.invalid
            floors = floors.reshape(rows, -1)
            whole = self.allowance_of(None)
            some = torch.arange(0, rows, 3)
            gathered = self.allowance_of(some)
            for pieces, index in ((whole, torch.arange(rows)), (gathered, some)):
                always = pieces["always"].reshape(len(index), -1)[valid[index]]
                allowance = pieces["allowance"].reshape(len(index), -1)[valid[index]]
                mine = floors[index][valid[index]]
                assert torch.equal(mine, always)
                assert bool((mine <= allowance).all())
            seen.append(int(valid.sum()))
        return rows_to_judge(self, top_row, known)

    monkeypatch.setattr(judging.AllowancesOnDemand, "_rows_to_judge", checked)
    report = _report(data, result, gradients)
    assert report["passed"]
    assert len(seen) >= (2 if gradients else 1) and all(seen), seen


def _one_wrong_element(rows: int = 2048, channels: int = 256, bad_row: int = 1300) -> dict:
    """A float32 problem whose channel 5 has scale 0 and bias 0 (its truth 0, its allowance
    what is always allowed: no rounding to model) while the others have scale 1e3 (a correct
    kernel's differences there, ~1e-4, far beyond channel 5's floor); ``out`` is torch's,
    except for one element of channel 5 in ``bad_row``, 5e-5 off: beyond its allowance, yet
    not the greatest difference of its block."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(rows, channels, generator=generator)
    valid = torch.rand(rows, generator=generator) > 0.2
    valid[bad_row] = True
    scale = torch.full((channels,), 1e3)
    scale[5] = 0.0
    bias = torch.zeros(channels)
    out = F.layer_norm(x, (channels,), scale, bias, kernels.EPS)
    out = torch.where(valid[:, None], out, 0.0)
    out[bad_row, 5] = 5e-5
    return {"out": out, "x": x, "valid": valid, "scale": scale, "bias": bias}


def test_an_element_beyond_its_floor_in_a_skippable_row_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The row's greatest ratio exceeds 1 only at the wrong element: its ceiling (difference over
    floor) must pick it. With floors raised by an atol of 1e-2 (a false bound: another atol than
    the allowance's), the row would be skipped and the kernel pass: a case the bound decides."""
    case = _one_wrong_element()
    args = (case["out"], case["x"], case["valid"], case["scale"], case["bias"], kernels.EPS)
    x64, scale64 = case["x"].double(), case["scale"].double()
    truth = F.layer_norm(x64, (256,), scale64, bias=None, eps=kernels.EPS)
    # Not the greatest difference: the row of that one is always judged.
    assert float((case["out"].double() - truth).abs()[case["valid"]].amax()) > 5e-5 * 2
    report = verify(*args)
    assert not report.passed
    out = report.tensors[0]
    assert out.budget_ratio > 1
    failing = report.to_dict()["tensors"][0]
    assert "1300" in str(failing), failing
    with monkeypatch.context() as patch:
        _every_row_judged(patch)
        assert _text(verify(*args).to_dict()) == _text(report.to_dict())
    floors = Allowance.floors

    def too_great(*a: object, **k: object) -> torch.Tensor | None:
        made = floors(*a, **k)  # type: ignore[arg-type]
        return None if made is None else made + 1e-2

    with monkeypatch.context() as patch:
        patch.setattr(Allowance, "floors", too_great)
        assert verify(*args).passed  # what a false bound would do


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_floors_made_are_the_always_of_every_row_judged(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype | None
) -> None:
    """Where the floors were made and every row is judged anyway (grad_x, with gradients), they
    are taken as the allowances' ``always``: each piece the same bits as made afresh, and the
    report that of every row's allowances made. With floors one ulp too great (a stale or
    foreign tensor taken), a piece differs."""
    data = kernels.offset_batch(1e3, 9, (8, 256, 64))
    result = kernels.zero_padding(kernels.run(kernels.torch_layer_norm, data, dtype), data["valid"])
    from_model = Allowance.from_model
    taken: list[bool] = []

    def compared(self: Allowance, *args: object, **kwargs: object) -> dict:
        pieces = from_model(self, *args, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("always") is not None:
            fresh = from_model(self, *args, **{**kwargs, "always": None})  # type: ignore[arg-type]
            taken.append(all(torch.equal(pieces[k], fresh[k]) for k in fresh))
        return pieces

    monkeypatch.setattr(Allowance, "from_model", compared)
    report = _report(data, result, True)
    assert report["passed"]
    assert taken and all(taken), taken
    with monkeypatch.context() as patch:
        _every_row_judged(patch)
        assert _text(_report(data, result, True)) == _text(report)
    taken.clear()
    floors = Allowance.floors

    def ulp_greater(*a: object, **k: object) -> torch.Tensor | None:
        made = floors(*a, **k)  # type: ignore[arg-type]
        return None if made is None else torch.nextafter(made, torch.tensor(math.inf).double())

    monkeypatch.setattr(Allowance, "floors", ulp_greater)
    _report(data, result, True)
    assert taken and not all(taken), taken
