"""Work ``maskln verify`` takes from one step of a block into another, or skips once it has
been seen to spare nothing: each must leave every figure the same bits as doing it afresh."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from maskln_cli.compare import comparison as comparison_module
from maskln_cli.compare import judging
from maskln_cli.testing import verify
from maskln_cli.verify import blockwork
from maskln_cli.verify.allowance import Allowance
from maskln_cli.verify.budget import Precision, RowBudget
from tests import kernels

KERNELS = {
    "torch": kernels.torch_layer_norm,
    "written": kernels.written(),
    "unbiased": kernels.unbiased,
    "no_xhat_term": kernels.written("no_xhat_term"),
    "half_sums": kernels.accumulate_in(torch.float16),
}


CORRECT = ("torch", "written")


def _same(a: object, b: object) -> bool:
    """Equal to the last bit, all the way down (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
            and bool(torch.equal(a.isnan(), b.isnan()))
            and bool(torch.equal(a.nan_to_num(nan=0.0), b.nan_to_num(nan=0.0)))
        )  # fmt: skip
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _report(data: dict, result: dict) -> str:
    extra = {k: result[k] for k in ("grad_x", "grad_scale", "grad_bias")}
    report = verify(
        result["out"], data["x"], data["valid"], data["scale"], data["bias"], kernels.EPS,
        grad_out=data["grad_out"], **extra,
    )  # fmt: skip
    return json.dumps(report.to_dict(), sort_keys=True)


@pytest.mark.parametrize("name", list(KERNELS))
def test_fits_from_the_comparisons_row_norms_are_those_made_afresh(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """out's and grad_x's fits take each row's sum of the truth's squares from the comparison:
    every sum of the fit the same bits as with those made from the truth again."""
    data = kernels.offset_batch(3.0, 2, (8, 96, 64))
    result = kernels.zero_padding(kernels.run(KERNELS[name], data), data["valid"])
    fit = blockwork.BlockWork.fit
    compared: list[tuple[str, bool]] = []

    def both(self: blockwork.BlockWork, *args: object, **kwargs: object):
        given = fit(self, *args, **kwargs)  # type: ignore[arg-type]
        assert kwargs.get("row_norms") is not None or len(args) >= 12
        fresh = fit(self, *args[:11], **{**kwargs, "row_norms": None})  # type: ignore[arg-type]
        compared.append((args[6].name, _same(given, fresh)))  # type: ignore[attr-defined]
        return given

    monkeypatch.setattr(blockwork.BlockWork, "fit", both)
    _report(data, result)
    assert {n for n, _ in compared} == {"out", "grad_x"}, compared
    assert all(same for _, same in compared), compared


def test_fits_from_wrong_row_norms_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above can fail: row norms one ulp off change a fit's sums."""
    data = kernels.offset_batch(3.0, 2, (8, 96, 64))
    result = kernels.zero_padding(kernels.run(kernels.unbiased, data), data["valid"])
    fit = blockwork.BlockWork.fit
    compared: list[bool] = []

    def both(self: blockwork.BlockWork, *args: object, **kwargs: object):
        given = fit(self, *args, **kwargs)  # type: ignore[arg-type]
        norms = args[11] if len(args) >= 12 else kwargs["row_norms"]
        off = torch.nextafter(norms, torch.tensor(math.inf, dtype=norms.dtype))  # type: ignore[arg-type]
        wrong = fit(self, *args[:11], **{**kwargs, "row_norms": off})  # type: ignore[arg-type]
        compared.append(_same(given, wrong))
        return given

    monkeypatch.setattr(blockwork.BlockWork, "fit", both)
    _report(data, result)
    assert compared and not any(compared), compared


@pytest.mark.parametrize("name", list(KERNELS))
def test_likeliest_rows_first_skipped_after_sparing_nothing_changes_no_figure(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """With many blocks (small ones here) grad_x's likeliest rows are not judged first again
    for FIRST_RETRY blocks once that spared a block nothing: the report is the same, to the
    last figure, as when they are tried on every block (FIRST_RETRY 1); for a correct kernel
    fewer were tried. Without grad_x's lower bounds (Allowance.bounds), which spare its
    rows as the floors do out's: the likeliest rows first then spare a block nothing."""
    monkeypatch.setattr(comparison_module, "BLOCK_ELEMENTS", 1 << 14)  # blocks of 32 rows
    monkeypatch.setattr(Allowance, "bounds", lambda *_, **__: None)
    data = kernels.offset_batch(0.0, 4, (2, 256, 512))
    result = kernels.zero_padding(kernels.run(KERNELS[name], data), data["valid"])
    judged = judging.AllowancesOnDemand._judge_picked
    tried: list[int] = []

    def counted(self: judging.AllowancesOnDemand, picked: torch.Tensor):
        if picked.numel() == judging.PICKED_FIRST:
            tried.append(1)
        return judged(self, picked)

    monkeypatch.setattr(judging.AllowancesOnDemand, "_judge_picked", counted)
    skipping = _report(data, result)
    skipped = len(tried)
    tried.clear()
    monkeypatch.setattr(judging, "FIRST_RETRY", 1)
    every_time = _report(data, result)
    assert skipping == every_time
    assert skipped <= len(tried), (skipped, len(tried))
    if name in CORRECT:  # a correct kernel's grad_x has every row judged: skipped there
        assert skipped < len(tried), (skipped, len(tried))


@pytest.mark.parametrize("name", list(KERNELS))
def test_floors_from_the_comparisons_magnitudes_are_those_made_afresh(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The floors of a block's rows take |truth| from the comparison (finite on its fast
    path): the same bits as floors made from the truth again, for out and grad_x."""
    data = kernels.offset_batch(3.0, 2, (8, 96, 64))
    result = kernels.zero_padding(kernels.run(KERNELS[name], data), data["valid"])
    floors = Allowance.floors
    compared: list[bool] = []

    def both(self: Allowance, *args: object, finite_abs: torch.Tensor | None = None):
        fresh = floors(self, *args)  # type: ignore[arg-type]
        assert finite_abs is not None and bool(finite_abs.isfinite().all())
        given = floors(self, *args, finite_abs=finite_abs)  # type: ignore[arg-type]
        compared.append(_same(given, fresh))
        return given

    monkeypatch.setattr(Allowance, "floors", both)
    _report(data, result)
    assert len(compared) >= 2 and all(compared), compared


def test_padding_set_by_index_has_the_bits_of_a_broadcast_mask() -> None:
    """RowBudget and the allowances set the padding by index (index_fill): the bits
    torch.where and masked_fill of the row mask give, NaN and inf rows and -0.0 included."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16, 8, generator=generator, dtype=torch.float64)
    x[3, 2], x[5, 1], x[6, 0] = math.nan, -math.inf, -0.0
    valid = torch.rand(16, generator=generator) > 0.4
    valid[3] = valid[6] = False
    one = torch.ones(8, dtype=torch.float64)
    budget = RowBudget(x.clone(), valid, one, one * 0, 1e-5, Precision.of(torch.float32))
    keep = valid[:, None]
    finite = x.clone()
    finite[5, 1] = 7.0  # a valid row: upstream zeroes non-finite values there too
    for upstream in (x, finite):
        expected = torch.where(keep, upstream, 0.0)
        if not math.isfinite(float(expected.sum())):
            expected = torch.where(keep & upstream.isfinite(), upstream, 0.0)
        assert _bits(budget.upstream(upstream)) == _bits(expected)
    padded = torch.where(x.isfinite(), x, 1.0)  # finite: the padding is zeroed by index
    precision = Precision.of(torch.float32)
    mine = RowBudget(padded, valid, one, one * 0, 1e-5, precision)
    zeroed = RowBudget(torch.where(keep, padded, 0.0), valid, one, one * 0, 1e-5, precision)
    for name in ("xhat", "rstd", "offset"):
        assert _bits(getattr(mine, name)) == _bits(getattr(zeroed, name)), name
    model = torch.rand(16, 8, generator=generator, dtype=torch.float64)
    truth = torch.randn(16, 8, generator=generator, dtype=torch.float64)
    allowance = Allowance.__new__(Allowance)
    allowance.factor, allowance.judge, allowance.scaled = 3.0, torch.float32, True
    allowance.yardstick_raises = True
    comparison = comparison_module.Comparison("out", [16, 8], "float32", [16, 8], "float64")
    pieces = allowance.from_model(comparison, model, truth.float(), truth, keep, size=1.0)
    assert _bits(pieces["allowance"]) == _bits(pieces["allowance"].masked_fill(~keep, 0.0))
    assert bool((pieces["allowance"][~valid] == 0).all())
    assert bool((pieces["always"][~valid] == math.inf).all())
    assert bool((pieces["always"][valid] < math.inf).all())


def _bits(tensor: torch.Tensor) -> list[int]:
    """A float64 tensor's bits (NaN payloads and -0.0 told apart)."""
    return tensor.contiguous().view(torch.int64).reshape(-1).tolist()


def test_likeliest_rows_first_skipped_where_some_rows_are_judged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """out alone, of a correct kernel, over many blocks: once the ratio merged from earlier
    chunks is as great as a block's, its likeliest rows judged first spare no row of the rest,
    and they are tried again only every FIRST_RETRY blocks; the report is the same, to the last
    figure, as when they are tried on every block."""
    monkeypatch.setattr(comparison_module, "BLOCK_ELEMENTS", 1 << 16)  # blocks of 128 rows
    data = kernels.offset_batch(0.0, 4, (4, 1024, 512))
    result = kernels.zero_padding(kernels.run(KERNELS["torch"], data), data["valid"])
    judged = judging.AllowancesOnDemand._judge_picked
    calls: list[int] = []

    def counted(self: judging.AllowancesOnDemand, picked: torch.Tensor):
        calls.append(picked.numel())
        return judged(self, picked)

    def report() -> str:
        made = verify(result["out"], data["x"], data["valid"], data["scale"], data["bias"],
                      kernels.EPS)  # fmt: skip
        return json.dumps(made.to_dict(), sort_keys=True)

    monkeypatch.setattr(judging.AllowancesOnDemand, "_judge_picked", counted)
    skipping, tried = report(), calls.count(judging.PICKED_FIRST)
    calls.clear()
    monkeypatch.setattr(judging, "FIRST_RETRY", 1)
    every_time, every_tried = report(), calls.count(judging.PICKED_FIRST)
    assert skipping == every_time
    assert tried < every_tried, (tried, every_tried)


@pytest.mark.parametrize("name", list(KERNELS))
def test_results_alike_the_yardstick_give_the_figures_made_afresh(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Where RESULT's rows are the yardstick's bit for bit (PyTorch's own kernel) the
    comparison takes its differences from the yardstick's error instead of making them: the
    report is the same, to the last figure, as with them made afresh (alike never found)."""
    monkeypatch.setattr(comparison_module, "BLOCK_ELEMENTS", 1 << 14)  # blocks of 32 rows
    data = kernels.offset_batch(0.0, 4, (2, 256, 512))
    result = kernels.zero_padding(kernels.run(KERNELS[name], data), data["valid"])
    alike = blockwork.yardstick_alike
    found: list[tuple[str, bool]] = []

    def counted(missed: dict[str, int], tensor: str, *args: torch.Tensor) -> bool:
        found.append((tensor, alike(missed, tensor, *args)))
        return found[-1][1]

    monkeypatch.setattr(blockwork, "yardstick_alike", counted)
    shortcut = _report(data, result)
    monkeypatch.setattr(blockwork, "yardstick_alike", lambda *_: False)
    assert shortcut == _report(data, result)
    if name == "torch":  # other kernels' blocks may be alike too, now and then
        assert found and all(same for _, same in found), found
