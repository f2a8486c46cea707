"""inspect at checkpoint scale (issue 12, item 5): --keys, --match, progress, fast statistics.

Statistics are checked against float64 computed by torch on the whole tensor; the fast path
(a chunk's own dtype) and the float64 path (chunks holding NaN or inf) are both exercised.
Speed itself is measured by benchmarks/bench.py (figure 8), not here.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics

import pytest
import torch
from rich.console import Console

from maskln_cli.errors import MasklnError
from maskln_cli.files.checkpoint import open_checkpoint
from maskln_cli.files.resources import human_bytes
from maskln_cli.files.tensorfile import TensorFile
from maskln_cli.jobs import inspect as stats
from tests.clitools import invoke, run_without_torch_check, write


def reference_stats(tensor):
    values = tensor.double().reshape(-1)
    finite = values[values.isfinite()]
    return {
        "min": finite.min().item(),
        "max": finite.max().item(),
        "mean": finite.mean().item(),
        "std": finite.std(unbiased=False).item(),
    }


def assert_stats_match(summary, tensor, rtol):
    expected = reference_stats(tensor)
    assert summary["min"] == expected["min"] and summary["max"] == expected["max"]
    # The mean to within rtol of the spread (a mean near 0 has no relative precision to give).
    assert abs(summary["mean"] - expected["mean"]) <= rtol * max(expected["std"], 1e-300) + (
        rtol * abs(expected["mean"])
    )
    assert summary["std"] == pytest.approx(expected["std"], rel=rtol)


def checkpoint(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embeddings.LayerNorm.weight": 1 + 0.1 * torch.randn(64, generator=generator),
        "embeddings.LayerNorm.bias": 0.1 * torch.randn(64, generator=generator),
        "encoder.layer.0.output.LayerNorm.weight": torch.ones(64),
        "encoder.layer.0.output.LayerNorm.bias": torch.zeros(64),
        "encoder.layer.0.output.dense.weight": 0.02 * torch.randn(64, 256, generator=generator),
        "position_ids": torch.arange(512),
    }
    return write(tmp_path / "model.safetensors", tensors, format="pt"), tensors


# --- --keys and --match -------------------------------------------------------------------------


def test_keys_reads_the_header_only(tmp_path, monkeypatch):
    path, tensors = checkpoint(tmp_path)

    def no_data(self, key):
        raise AssertionError(f"tensor data read: {key}")

    full = json.loads(invoke("inspect", "--json", path).stdout)
    monkeypatch.setattr(TensorFile, "tensor", no_data)
    monkeypatch.setattr(TensorFile, "mapped", no_data)
    result = invoke("inspect", "--keys", "--json", path)
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    # The same tensors in the same (data) order as with statistics.
    assert [t["name"] for t in document["tensors"]] == [t["name"] for t in full["tensors"]]
    assert sorted(t["name"] for t in document["tensors"]) == sorted(tensors)
    for entry in document["tensors"]:
        tensor = tensors[entry["name"]]
        assert entry == {
            "name": entry["name"],
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape),
            "numel": tensor.numel(),
            "bytes": tensor.numel() * tensor.element_size(),
        }
    human = invoke("inspect", "--keys", path)
    assert human.exit_code == 0
    size = human_bytes(sum(t.numel() * t.element_size() for t in tensors.values()))
    assert f"{path}\n" in human.stdout  # the path whole, on a line of its own
    assert f"{len(tensors)} tensors, {size}" in human.stdout and "min=" not in human.stdout


def test_keys_does_not_import_torch(tmp_path):
    path, _ = checkpoint(tmp_path)
    result = run_without_torch_check("inspect", "--keys", path)
    assert not result.exit_code, result.stderr
    assert not result.torch_imported, result.stderr
    assert "encoder.layer.0.output.dense.weight" in result.stdout


def test_match_is_a_case_insensitive_glob(tmp_path):
    path, _ = checkpoint(tmp_path)
    document = json.loads(
        invoke("inspect", "--keys", "--json", "-m", "*layernorm.WEIGHT", path).stdout
    )
    assert [t["name"] for t in document["tensors"]] == [
        "embeddings.LayerNorm.weight",
        "encoder.layer.0.output.LayerNorm.weight",
    ]
    both = invoke("inspect", "--match", "*.bias", "--match", "position*", path)
    assert both.exit_code == 0
    assert "3 of 6 tensors match '*.bias' or 'position*'" in both.stdout
    assert "min=0  max=511" in both.stdout  # statistics still computed, for matches only
    assert "dense" not in both.stdout
    none = json.loads(invoke("inspect", "--json", "-m", "nothing*", path).stdout)
    assert none["tensors"] == []


# --- statistics ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "make", "rtol"),
    [
        ("weights", lambda g: 0.02 * torch.randn(300_000, generator=g), 1e-6),
        ("offset 1e4", lambda g: 1e4 + 0.1 * torch.randn(300_000, generator=g), 1e-6),
        ("offset 1e6", lambda g: 1e6 + torch.randn(300_000, generator=g), 1e-6),
        (
            "outliers",
            lambda g: torch.cat([torch.randn(300_000, generator=g), torch.tensor([3e7])]),
            1e-6,
        ),
        ("lognormal", lambda g: torch.randn(300_000, generator=g).exp(), 1e-6),
        (
            "huge",
            lambda g: 1e30 * torch.randn(300_000, generator=g),
            1e-6,
        ),  # squares overflow float32
        ("bfloat16", lambda g: (50 + torch.randn(300_000, generator=g)).bfloat16(), 1e-6),
        ("float16", lambda g: torch.randn(300_000, generator=g).half(), 1e-6),
        (
            "float64 offset",
            lambda g: 1e8 + torch.randn(300_000, generator=g, dtype=torch.float64),
            1e-12,
        ),
        ("int64", lambda g: torch.randint(-(2**40), 2**40, (300_000,), generator=g), 1e-12),
        ("constant", lambda g: torch.full((300_000,), 0.1), 1e-6),
    ],
)
def test_statistics_match_float64(tmp_path, monkeypatch, name, make, rtol):
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 65_536)  # several chunks, merged
    tensor = make(torch.Generator().manual_seed(1))
    path = write(tmp_path / "t.safetensors", {"t": tensor})
    summary = stats.summarize_file(str(path)).tensors[0].to_dict()
    assert_stats_match(summary, tensor, rtol)


def test_nan_and_inf_chunks_among_finite_ones(tmp_path, monkeypatch):
    """Chunks with NaN or inf take the float64 path, the others the fast one: one result."""
    generator = torch.Generator().manual_seed(2)
    x = 3.0 + torch.randn(10_000, generator=generator)
    x[5_000:5_010] = math.nan
    x[7_777] = math.inf
    path = write(tmp_path / "t.safetensors", {"x": x})
    results = []
    for chunk in (97, 1024, 1 << 20):
        monkeypatch.setattr(stats, "CHUNK_ELEMENTS", chunk)
        summary = stats.summarize_file(str(path)).tensors[0].to_dict()
        assert (summary["nan"], summary["inf"]) == (10, 1)
        assert_stats_match(summary, x, 1e-6)
        results.append(summary)
    for other in results[1:]:
        assert other["std"] == pytest.approx(results[0]["std"], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_zero_one_mask_shows_its_count_of_true(tmp_path, dtype):
    mask = (torch.arange(40) % 3 != 0).to(dtype).reshape(4, 10)
    ids = torch.tensor([0, 1, 2], dtype=dtype)
    path = write(tmp_path / "m.safetensors", {"attention_mask": mask, "ids": ids})
    document = json.loads(invoke("inspect", "--json", path).stdout)
    tensors = {t["name"]: t for t in document["tensors"]}
    assert tensors["attention_mask"]["true"] == int((mask != 0).sum()) == 26
    assert tensors["ids"]["true"] is None  # holds a 2: not a mask
    human = invoke("inspect", path)
    assert "26 of 40 true (65.0%)" in human.stdout


def test_progress_reaches_the_total_in_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 1000)
    path, tensors = checkpoint(tmp_path)
    calls = []
    stats.summarize_file(str(path), progress=lambda done, total: calls.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert len(calls) > len(tensors)  # per chunk, not per tensor


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        (torch.float32, 1e-25),
        (torch.float32, 1e-40),  # subnormal
        (torch.bfloat16, 1e-30),
        (torch.float64, 1e-200),
        (torch.float64, 1e-310),  # subnormal
    ],
)
def test_tiny_values_keep_their_spread(tmp_path, monkeypatch, dtype, scale):
    """Squared deviations of tiny values underflow (float32 values of 1e-25 had a std of 0):
    such chunks are summarized scaled by a power of two."""
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 1000)  # merged over chunks too
    values = scale * torch.randn(
        3000, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    tensor = values.to(dtype)
    path = write(tmp_path / "t.safetensors", {"t": tensor})
    (summary,) = stats.summarize_file(str(path)).tensors
    stored = tensor.double().tolist()
    assert summary.std == pytest.approx(statistics.pstdev(stored), rel=1e-6)  # exact, rounded
    assert summary.mean == pytest.approx(statistics.mean(stored), rel=1e-6, abs=1e-3 * summary.std)
    assert (summary.min, summary.max) == (min(stored), max(stored))


def test_constant_values_near_float64s_limit_have_no_spread(tmp_path):
    path = write(
        tmp_path / "t.safetensors", {"t": torch.full((2000,), 1.7e308, dtype=torch.float64)}
    )
    (summary,) = stats.summarize_file(str(path)).tensors
    assert (summary.mean, summary.std) == (1.7e308, 0.0)


def test_a_file_that_shrinks_after_opening_is_an_error(tmp_path):
    """No statistics of a tensor cut short: an error naming the file and the key."""
    path = write(tmp_path / "t.safetensors", {"y": torch.arange(3000.0)})
    with open_checkpoint(str(path), torch_tensors=False) as tensors:
        os.truncate(path, os.path.getsize(path) - 6000)
        with pytest.raises(
            MasklnError, match=r"t.safetensors: cannot read tensor 'y': the file ends"
        ):
            tensors.mapped("y")


@pytest.mark.parametrize("workers", [1, 3])
def test_statistics_do_not_depend_on_the_number_of_threads(tmp_path, monkeypatch, workers):
    """Chunks are summarized on several threads and merged in file order: the same bits."""
    generator = torch.Generator().manual_seed(5)
    tensors = {
        "a": 1e4 + torch.randn(50_000, generator=generator),
        "b": torch.randn(30_000, generator=generator, dtype=torch.float64).exp(),
        "c": torch.randn(20_000, generator=generator).bfloat16(),
    }
    tensors["a"][17_000] = math.nan
    path = write(tmp_path / "t.safetensors", tensors)
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(stats, "_workers", lambda: 2)
    two = stats.summarize_file(str(path)).to_dict()
    monkeypatch.setattr(stats, "_workers", lambda: workers)
    assert stats.summarize_file(str(path)).to_dict() == two
    for summary in two["tensors"]:
        assert_stats_match(summary, tensors[summary["name"]], 1e-6)


def test_inspect_computes_without_torch_but_for_float8(tmp_path):
    """Importing torch takes seconds: inspect's statistics do without it, but for float8."""
    common = {
        "w": torch.randn(3, 5),
        "h": torch.randn(4).bfloat16(),
        "ids": torch.arange(6),
        "mask": torch.tensor([True, False]),
    }
    plain = write(tmp_path / "plain.safetensors", common)
    quantized = torch.randn(3).to(torch.float8_e4m3fn)
    with_float8 = write(tmp_path / "f8.safetensors", {**common, "q": quantized})
    for path, imported in ((plain, False), (with_float8, True)):
        result = run_without_torch_check("inspect", "--json", path)
        assert result.torch_imported == imported, result.stderr
        listed = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
        for name, tensor in common.items():
            if name == "mask":
                assert listed[name]["true"] == 1
            else:
                assert_stats_match(listed[name], tensor, 1e-6)
    assert_stats_match(listed["q"], quantized, 1e-6)


def test_statistics_leave_torch_threads_as_they_were(tmp_path):
    path, _ = checkpoint(tmp_path)
    before = torch.get_num_threads()
    stats.summarize_file(str(path))
    assert torch.get_num_threads() == before


def terminal(monkeypatch):
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=250)  # room for long tmp paths
    monkeypatch.setattr("maskln_cli.cli.report.consoles.stderr_console", lambda: console)
    monkeypatch.setattr("maskln_cli.cli.report.progress.PROGRESS_DELAY", 0.0)
    return screen


def test_inspect_shows_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    path, _ = checkpoint(tmp_path)
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 1000)
    screen = terminal(monkeypatch)
    assert invoke("inspect", path).exit_code == 0
    assert f"inspect {path}" in screen.getvalue() and "%" in screen.getvalue()
    screen.seek(0)
    screen.truncate()
    assert invoke("inspect", "--keys", path).exit_code == 0
    assert screen.getvalue() == ""  # nothing to wait for


def test_generate_shows_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    screen = terminal(monkeypatch)
    output = tmp_path / "g.safetensors"
    assert invoke("generate", output, "--shape", "4,64,32", "--grad").exit_code == 0
    assert f"generate {output}" in screen.getvalue() and "%" in screen.getvalue()
