"""Hostile inputs, round two: each test breaks a promise of the README's Guarantees on the code
before issue 13, and holds it now."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from maskln_cli import stats
from tests.clitools import ROOT, assert_one_line_error, invoke, metadata, read, run, write


def small_input(path: Path, **metadata: str) -> Path:
    generator = torch.Generator().manual_seed(0)
    return write(path, {"x": torch.randn(2, 3, 4, generator=generator)}, **metadata)


# --- 2. a FIFO or device never blocks: refused before it is opened ------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ("inspect", "{fifo}"),
        ("inspect", "--keys", "{fifo}"),
        ("normalize", "{fifo}", "{out}"),
        ("normalize", "{input}", "{out}", "--params", "{fifo}"),
        ("normalize", "{input}", "{out}", "--config", "{fifo}"),
        ("verify", "{input}", "{fifo}"),
        ("diff", "{fifo}", "{input}"),
    ],
    ids=lambda c: " ".join(c),
)
def test_a_fifo_with_no_writer_is_refused_not_waited_on(tmp_path, command):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    names = {"fifo": fifo, "out": tmp_path / "out.safetensors", "input": tmp_path / "in.st"}
    small_input(names["input"])
    args = [part.format(**names) for part in command]
    # A real process: a blocked open cannot be interrupted in-process; timeout makes a hang fail.
    done = subprocess.run(
        [sys.executable, "-m", "maskln_cli", *args], cwd=ROOT, capture_output=True, timeout=60
    )
    assert done.returncode == 2
    assert_one_line_error(done.stderr, str(fifo), "FIFO", "'-'")


def test_a_character_device_is_refused_and_stdin_still_works(tmp_path):
    done = run("inspect", "/dev/zero")
    assert done.returncode == 2
    assert_one_line_error(done.stderr, "/dev/zero", "character device")
    source = small_input(tmp_path / "in.safetensors")
    with open(source, "rb") as stdin:
        piped = run("inspect", "--json", "-", stdin=stdin)
    assert piped.returncode == 0 and b'"x"' in piped.stdout


# --- 6. stdin or stdout that is the input file ------------------------------------------------


def test_output_that_is_the_file_on_stdin_is_refused(tmp_path):
    source = small_input(tmp_path / "in.safetensors")
    before = source.read_bytes()
    with open(source, "rb") as stdin:
        done = run("normalize", "-", source, stdin=stdin)
    assert done.returncode == 2
    assert_one_line_error(done.stderr, "is the input (<stdin>)")
    assert source.read_bytes() == before


def test_stdout_appended_to_the_input_is_refused(tmp_path):
    source = small_input(tmp_path / "in.safetensors")
    before = source.read_bytes()
    with open(source, "ab") as stdout:
        done = run("normalize", source, "-", stdout=stdout)
    assert done.returncode == 2
    assert_one_line_error(done.stderr, "<stdout>", "redirected into the input")
    assert source.read_bytes() == before


# --- 7. masks of every integer and floating dtype ----------------------------------------------

MASK_DTYPES = ["uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
               "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
               "float8_e4m3fnuz", "float8_e5m2fnuz"]  # fmt: skip


@pytest.mark.parametrize("dtype", MASK_DTYPES)
def test_masks_of_any_integer_or_floating_dtype_holding_0_and_1(tmp_path, dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=generator)
    mask = torch.rand(3, 5, generator=generator) < 0.6
    as_bool = write(tmp_path / "bool.safetensors", {"x": x, "valid": mask})
    typed = write(tmp_path / "typed.safetensors", {"x": x, "valid": mask.to(getattr(torch, dtype))})
    for source, out in ((as_bool, "a.safetensors"), (typed, "b.safetensors")):
        assert invoke("normalize", source, tmp_path / out, "-q").exit_code == 0
    assert torch.equal(
        read(tmp_path / "a.safetensors")["out"], read(tmp_path / "b.safetensors")["out"]
    )


@pytest.mark.parametrize(
    ("values", "dtype", "fragment"),
    [
        ([0, 2, 1], torch.uint16, "found 2 at index [1]"),
        ([0, 1, 2**31 + 7], torch.uint32, "at index [2]"),
        ([0.0, 1.0, 0.5], torch.float8_e4m3fn, "found 0.5 at index [2]"),
        ([0.0, 1.0, 1.0], torch.float8_e8m0fnu, "must hold only 0 and 1"),  # e8m0 has no 0
    ],
)
def test_masks_holding_other_values_are_refused_by_name(tmp_path, values, dtype, fragment):
    source = write(
        tmp_path / "in.safetensors",
        {"x": torch.randn(3, 4), "valid": torch.tensor(values).to(dtype)},
    )
    result = invoke("normalize", source, tmp_path / "out.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "'valid'", fragment)


# --- 8. eps in metadata: a number as people write it, nothing else ----------------------------


@pytest.mark.parametrize("text", ["1_0", "\u0661", "nan", "inf", "1e-5x", "0x10", "1e-5 1", ""])
def test_eps_metadata_that_is_not_a_plain_number_is_refused(tmp_path, text):
    source = small_input(tmp_path / "in.safetensors", eps=text)
    result = invoke("normalize", source, tmp_path / "out.safetensors")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "in.safetensors", "metadata 'eps'", repr(text))


PLAIN_NUMBERS = [("1e-05", 1e-5), (" 1E-5 ", 1e-5), ("0.00001", 1e-5), ("3", 3.0), (".5", 0.5),
                 ("+2.5e-3", 2.5e-3)]  # fmt: skip


@pytest.mark.parametrize(("text", "value"), PLAIN_NUMBERS)
def test_eps_metadata_as_people_write_it_is_read(tmp_path, text, value):
    source = small_input(tmp_path / "in.safetensors", eps=text)
    result = invoke("normalize", source, tmp_path / "out.safetensors", "-q")
    assert result.exit_code == 0, result.stderr
    assert float(metadata(tmp_path / "out.safetensors")["eps"]) == value


# --- 5. inspect statistics: finite and right for every finite input ---------------------------


def exact_moments(values: list[int] | list[float]) -> tuple[float, float]:
    """(mean, population std) by exact rational arithmetic."""
    exact = [Fraction(v) for v in values]
    mean = sum(exact) / len(exact)
    variance = sum((v - mean) ** 2 for v in exact) / len(exact)
    # the std of values near 1.8e308 is itself near 1e308: take the root of a scaled variance
    scale = 2**1000 if variance > 2**1000 else 1
    return float(mean), math.sqrt(float(variance / scale**2)) * scale


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([1e308, 1e308, 1.7e308], torch.float64),
        ([1e200, -1e200, 3e200], torch.float64),
        ([1.7e308, -1.7e308, 1e-300], torch.float64),
        ([3e38, 3.3e38, -3.4e38], torch.float32),
        ([2**62, 2**62 + 1], torch.int64),
        ([-(2**63), 2**63 - 1, 0], torch.int64),
        ([2**63 + 5, 2**63 + 6], torch.uint64),
    ],
)
@pytest.mark.parametrize("chunk", [1, 1 << 20])  # one element a chunk: the merge is exercised
def test_inspect_statistics_are_finite_and_exact(tmp_path, monkeypatch, values, dtype, chunk):
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", chunk)
    if dtype == torch.uint64:
        tensor = torch.tensor([v - 2**64 for v in values], dtype=torch.int64).view(torch.uint64)
    else:
        tensor = torch.tensor(values, dtype=dtype)
    write(tmp_path / "t.safetensors", {"t": tensor})
    (summary,) = stats.summarize_file(str(tmp_path / "t.safetensors")).tensors
    stored = [float(v) for v in tensor.double().tolist()] if dtype.is_floating_point else values
    mean, std = exact_moments(stored)
    assert summary.min == min(stored) and summary.max == max(stored)
    assert math.isfinite(summary.mean) and math.isfinite(summary.std)
    assert summary.mean == pytest.approx(mean, rel=1e-12)
    assert summary.std == pytest.approx(std, rel=1e-12, abs=0.0)


def test_large_integers_keep_their_spread_across_chunks(monkeypatch, tmp_path):
    """int64 values near 2**62 that differ by 1..3: float64 sees them all as 2**62."""
    monkeypatch.setattr(stats, "CHUNK_ELEMENTS", 3)
    values = [2**62 + d for d in (0, 1, 2, 3, 1, 2, 0, 3)]
    write(tmp_path / "t.safetensors", {"t": torch.tensor(values)})
    (summary,) = stats.summarize_file(str(tmp_path / "t.safetensors")).tensors
    assert summary.std == pytest.approx(statistics.pstdev([0, 1, 2, 3, 1, 2, 0, 3]), rel=1e-12)
    assert summary.min == 2**62 and summary.max == 2**62 + 3
