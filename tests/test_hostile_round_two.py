"""Hostile inputs, round two: each test breaks a promise of docs/guarantees.md on the code
before issue 13, and holds it now."""

from __future__ import annotations

import json
import math
import os
import statistics
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from maskln_cli.jobs import inspect as stats
from tests.clitools import ROOT, assert_one_line_error, invoke, metadata, read, run, write

# In `make test-slow` (CI), not `make test`: real processes and hostile files.
pytestmark = pytest.mark.slow


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


# --- 1. integers and bool compare exactly -------------------------------------------------------


def uint64(values: list[int]) -> torch.Tensor:
    """A uint64 tensor of ``values`` (torch makes none from ints of 2**63 and up)."""
    return torch.tensor([v - 2**64 if v >= 2**63 else v for v in values]).view(torch.uint64)


def diff_json(tmp_path: Path, actual: dict, expected: dict, *options: str) -> tuple[int, dict]:
    a = write(tmp_path / "a.safetensors", actual)
    e = write(tmp_path / "e.safetensors", expected)
    result = invoke("diff", a, e, "--json", *options)
    assert result.exit_code in (0, 1), result.stderr
    return result.exit_code, json.loads(result.stdout)


def test_int64_that_float64_cannot_tell_apart_differ(tmp_path):
    actual = torch.tensor([2**60, 2**53 + 1, -(2**62)])
    expected = torch.tensor([2**60 + 1, 2**53, -(2**62) + 100])
    code, document = diff_json(tmp_path, {"t": actual}, {"t": expected})
    assert code == 1 and document["passed"] is False
    (tensor,) = document["tensors"]
    assert tensor["mismatched"] == 3 and tensor["mismatched_rows"] == 3
    assert tensor["max_abs_diff"] == 100 and type(tensor["max_abs_diff"]) is int
    assert tensor["max_abs_index"] == [2]
    worst = {tuple(w["index"]): w for w in tensor["worst"]}
    assert worst[(0,)]["actual"] == 2**60 and worst[(0,)]["expected"] == 2**60 + 1
    assert worst[(1,)]["actual"] == 2**53 + 1 and worst[(1,)]["abs_diff"] == 1
    assert worst[(2,)]["expected"] == -(2**62) + 100 and worst[(2,)]["abs_diff"] == 100
    assert tensor["max_rel_diff"] == 1 / 2**53  # 1 / 2**53 at index 1, exactly


def test_uint64_beyond_2_63_compares_exactly(tmp_path):
    code, document = diff_json(tmp_path, {"u": uint64([2**63 + 5])}, {"u": uint64([2**63 + 6])})
    assert code == 1
    (tensor,) = document["tensors"]
    assert tensor["mismatched"] == 1 and tensor["max_abs_diff"] == 1
    assert tensor["worst"][0]["actual"] == 2**63 + 5
    assert tensor["worst"][0]["expected"] == 2**63 + 6
    assert diff_json(tmp_path, {"u": uint64([2**64 - 1])}, {"u": uint64([2**64 - 1])})[0] == 0


@pytest.mark.parametrize(
    ("actual", "expected", "difference"),
    [
        (torch.tensor([-(2**63)]), torch.tensor([2**63 - 1]), 2**64 - 1),
        (uint64([0]), uint64([2**64 - 1]), 2**64 - 1),
        (torch.tensor([-1]), uint64([2**64 - 1]), 2**64),  # int64 against uint64: a dtype problem
        (torch.tensor([2**31 - 1], dtype=torch.int32), torch.tensor([-(2**31)]), 2**32 - 1),
        (torch.tensor([True, False]), torch.tensor([False, False]), 1),
    ],
)
def test_integer_differences_are_exact_at_the_extremes(tmp_path, actual, expected, difference):
    code, document = diff_json(tmp_path, {"t": actual}, {"t": expected})
    assert code == 1
    (tensor,) = document["tensors"]
    assert tensor["max_abs_diff"] == difference and tensor["mismatched"] == 1


def test_integer_tolerances_are_evaluated_exactly(tmp_path):
    # rtol * |e| is 5 - 5 / 2**62 at e = 2**62 - 1: a difference of 5 is beyond it, though in
    # float64 (where e rounds to 2**62) the bound is 5.
    expected = torch.tensor([2**62 - 1, 2**62 - 1, 10])
    within = torch.tensor([2**62 + 3, 2**62 - 5, 10])
    beyond = torch.tensor([2**62 + 4, 2**62 - 5, 10])
    options = ("--rtol", repr(5 * 2.0**-62))
    assert diff_json(tmp_path, {"t": within}, {"t": expected}, *options)[0] == 0
    code, document = diff_json(tmp_path, {"t": beyond}, {"t": expected}, *options)
    assert code == 1 and document["tensors"][0]["mismatched"] == 1
    assert document["tensors"][0]["worst"][0]["abs_diff"] == 5
    # --atol alone: |a - e| <= atol, exactly, at any magnitude
    huge = torch.tensor([2**62, -(2**62)])
    off_by_one = torch.tensor([2**62 + 1, -(2**62) - 1])
    assert diff_json(tmp_path, {"t": off_by_one}, {"t": huge}, "--atol", "1")[0] == 0
    assert diff_json(tmp_path, {"t": off_by_one}, {"t": huge}, "--atol", "0.999")[0] == 1


def test_integer_comparison_across_chunks_keeps_the_first_worst(tmp_path, monkeypatch):
    from maskln_cli.compare import comparison as compare

    monkeypatch.setattr(compare, "CHUNK_ELEMENTS", 4)
    expected = torch.full((6, 4), 2**62)
    actual = expected.clone()
    actual[1, 2] += 3
    actual[4, 0] -= 3  # as far off as [1, 2], later: [1, 2] stays the max
    actual[5, 3] += 1
    code, document = diff_json(tmp_path, {"t": actual}, {"t": expected})
    (tensor,) = document["tensors"]
    assert code == 1 and tensor["mismatched"] == 3 and tensor["mismatched_rows"] == 3
    assert tensor["max_abs_diff"] == 3 and tensor["max_abs_index"] == [1, 2]
    assert [w["index"] for w in tensor["worst"]] == [[1, 2], [4, 0], [5, 3]]


def test_integer_report_shows_exact_figures(tmp_path):
    a = write(tmp_path / "a.safetensors", {"t": torch.tensor([2**60, 7])})
    e = write(tmp_path / "e.safetensors", {"t": torch.tensor([2**60 + 1, 7])})
    result = invoke("diff", a, e)
    assert result.exit_code == 1
    assert "max abs diff  1 at [0]" in result.stdout
    assert f"{2**60:,}" in result.stdout and f"{2**60 + 1:,}" in result.stdout


def test_integers_with_a_valid_mask_compare_exactly(tmp_path):
    mask = write(tmp_path / "mask.safetensors", {"valid": torch.tensor([True, False])})
    options = ("--valid", str(mask))
    actual = {"t": uint64([2**63 + 1, 2**63 + 1, 5, 5]).reshape(2, 2)}
    expected = {"t": uint64([2**63 + 1, 2**63 + 2, 5, 9]).reshape(2, 2)}
    code, document = diff_json(tmp_path, actual, expected, *options)
    assert code == 1 and document["tensors"][0]["max_abs_diff"] == 1
    expected = {"t": uint64([2**63 + 1, 2**63 + 1, 5, 9]).reshape(2, 2)}  # only the left-out row
    code, document = diff_json(tmp_path, actual, expected, *options)
    assert code == 0 and document["tensors"][0]["rows_left_out"] == 1


def test_float8_tensors_compare_on_the_valid_rows_only(tmp_path):
    # float8 has no masked_fill: the rows left out are zeroed in float64 instead.
    mask = write(tmp_path / "mask.safetensors", {"valid": torch.tensor([True, False])})
    f8 = torch.float8_e4m3fn
    actual = {"t": torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(f8)}
    left_out_differs = {"t": torch.tensor([[1.0, 2.0], [8.0, 8.0]]).to(f8)}
    kept_differs = {"t": torch.tensor([[1.0, 2.5], [3.0, 4.0]]).to(f8)}
    code, document = diff_json(tmp_path, actual, left_out_differs, "--valid", str(mask))
    assert code == 0 and document["tensors"][0]["rows_left_out"] == 1
    code, document = diff_json(tmp_path, actual, kept_differs, "--valid", str(mask))
    (tensor,) = document["tensors"]
    assert code == 1 and tensor["mismatched"] == 1 and tensor["max_abs_index"] == [0, 1]
    assert tensor["max_abs_diff"] == 0.5


# --- 3. JSON carries every key and metadata value as it is -------------------------------------

JSON_LOOKING = ["w[ 1,  2 ]", "[ 3,   4 ]", "[1,\n 2]", "[null,  -1e5 ]", 'q"uote\\back',
                "line\u2028sep", "é ∑ 💥", "{\"a\": [1, 2]}", "tab\there"]  # fmt: skip


def test_json_carries_keys_and_metadata_byte_for_byte(tmp_path):
    keys = {f"{text}": torch.ones(2) for text in JSON_LOOKING}
    metadata = {f"m{i}": text for i, text in enumerate(JSON_LOOKING)}
    a = write(tmp_path / "a.safetensors", keys, **metadata)
    e = write(tmp_path / "e.safetensors", {k: torch.zeros(2) for k in keys})
    inspected = invoke("inspect", "--json", a)
    assert inspected.exit_code == 0
    document = json.loads(inspected.stdout)
    assert document["metadata"] == metadata
    assert sorted(t["name"] for t in document["tensors"]) == sorted(keys)
    keys_only = json.loads(invoke("inspect", "--keys", "--json", a).stdout)
    assert sorted(t["name"] for t in keys_only["tensors"]) == sorted(keys)
    diffed = invoke("diff", a, e, "--json")
    assert diffed.exit_code == 1
    assert sorted(t["name"] for t in json.loads(diffed.stdout)["tensors"]) == sorted(keys)
    for text in JSON_LOOKING:  # each string as the json module writes it, untouched
        assert json.dumps(text) in inspected.stdout and json.dumps(text) in diffed.stdout
    assert '"shape": [2]' in inspected.stdout  # number lists still on one line


def test_to_json_is_the_json_module_but_for_number_lists():
    from maskln_cli.cli.report import to_json

    document = {"a": [1, 2.5, None, -3e-300], "b": [[1, 2], [3]], "c": [True, 1], "d": [],
                "e": {}, "f": ["[ 1,  2 ]", 1], "g": {"h": [{"i": "[ 5 ]"}]}}  # fmt: skip
    text = to_json(document)
    assert json.loads(text) == document
    assert '"a": [1, 2.5, null, -3e-300]' in text and "[1, 2]" in text
    plain = json.dumps(document, indent=2)
    assert text.replace(" ", "").replace("\n", "") == plain.replace(" ", "").replace("\n", "")


# --- 4. no :emoji: codes ----------------------------------------------------------------------

EMOJI = ("\u26a0", "\U0001f44d", "\U0001f199", "\u274c")


def test_emoji_codes_from_files_and_paths_are_shown_as_they_are(tmp_path):
    source = write(
        tmp_path / "run:up:1.safetensors",
        {"enc:warning:w": torch.ones(2), "x": torch.randn(2, 4)},
        note=":thumbs_up: ok",
    )
    other = write(tmp_path / "other.safetensors", {"enc:warning:w": torch.zeros(2)})
    outputs = {
        "inspect": invoke("inspect", source).stdout,
        "inspect --keys": invoke("inspect", "--keys", source).stdout,
        "diff": invoke("diff", source, other).stdout,
        "diff --quiet": invoke("diff", source, other, "--quiet").stdout,
    }
    for label, text in outputs.items():
        assert not any(e in text for e in EMOJI), (label, text)
        assert "enc:warning:w" in text, label
        if label != "diff --quiet":
            assert "run:up:1.safetensors" in text, label
    assert ":thumbs_up: ok" in outputs["inspect"]
    out = tmp_path / "o.safetensors"
    missing = invoke("normalize", source, out, "--valid-key", "layer:x:weight")
    assert missing.exit_code == 2
    assert_one_line_error(missing.stderr, "run:up:1.safetensors", "'layer:x:weight'")
    assert not any(e in missing.stderr for e in EMOJI)
    written = invoke("normalize", source, tmp_path / "out:cross_mark:.safetensors")
    assert written.exit_code == 0 and "out:cross_mark:.safetensors" in written.stderr


def test_verify_shows_emoji_codes_as_they_are(tmp_path):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=generator)
    inputs = {"x": x, "valid": torch.tensor([True, True, False]), "scale": torch.ones(4),
              "bias": torch.zeros(4)}  # fmt: skip
    source = write(tmp_path / "run:up:1.safetensors", inputs, eps="1e-05")
    out = torch.nn.functional.layer_norm(x, (4,), eps=1e-5) * inputs["valid"][:, None]
    result = write(tmp_path / "res:x:.safetensors", {"enc:warning:w": out})
    passed = invoke("verify", source, result, "--result-key", "out=enc:warning:w", "--check", "out")
    assert passed.exit_code == 0, passed.stdout
    for name in ("run:up:1.safetensors", "res:x:.safetensors", "PASS out"):
        assert name in passed.stdout, name
    failed = invoke("verify", source, result, "--result-key", "out=layer:x:weight")
    assert failed.exit_code == 1
    assert "no key 'layer:x:weight' (it holds 'enc:warning:w'" in failed.stdout
    for text in (passed.stdout, failed.stdout):
        assert not any(e in text for e in EMOJI)


def test_the_progress_bar_shows_a_path_as_it_is(monkeypatch):
    import io

    from rich.console import Console

    from maskln_cli.cli.report.progress import progress_bar

    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, emoji=False, width=120)
    monkeypatch.setattr("maskln_cli.cli.report.consoles.stderr_console", lambda: console)
    monkeypatch.setattr("maskln_cli.cli.report.progress.PROGRESS_DELAY", 0.0)
    with progress_bar("inspect run:up:1.safetensors [red]x") as update:
        update(1, 2)
        console.file.flush()
        shown = stream.getvalue()
    assert "run:up:1.safetensors [red]x" in shown and "\U0001f199" not in shown


# --- 9. dtypes maskln cannot decode -------------------------------------------------------------


def raw_file(path: Path, entries: list[tuple[str, str, list[int], bytes]], **metadata) -> Path:
    """A safetensors file written by hand: (key, dtype code, shape, data) in order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, code, shape, data in entries:
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(e[3] for e in entries))
    return path


EXOTIC = [
    ("f4", "F4", [2, 4], b"\x12\x34\x56\x78"),  # 4 bits a value: 8 values in 4 bytes
    ("f6a", "F6_E2M3", [4], b"\x01\x02\x03"),  # 6 bits a value: 4 values in 3 bytes
    ("f6b", "F6_E3M2", [2, 4], b"\x04\x05\x06\x07\x08\x09"),
    ("c", "C64", [1], struct.pack("<2f", 1.0, -1.0)),
    ("e8", "F8_E8M0", [2], b"\x7f\x80"),
    ("x", "F32", [3], struct.pack("<3f", 1.0, 2.0, 4.0)),
]


def test_inspect_lists_tensors_it_cannot_decode_and_shows_the_rest(tmp_path):
    source = raw_file(tmp_path / "exotic.safetensors", EXOTIC, eps="1e-05")
    result = invoke("inspect", "--json", source)
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    listed = {t["name"]: t for t in document["tensors"]}
    for key, _, shape, data in EXOTIC:
        assert listed[key]["shape"] == shape and listed[key]["bytes"] == len(data), key
        assert listed[key]["numel"] == math.prod(shape), key
    assert [listed[k]["dtype"] for k in ("f4", "f6a", "f6b")] == ["F4", "F6_E2M3", "F6_E3M2"]
    assert listed["x"]["mean"] == pytest.approx(7 / 3) and listed["x"]["max"] == 4.0
    assert listed["e8"]["min"] == 1.0 and listed["e8"]["max"] == 2.0
    assert listed["f6a"]["min"] is None and listed["c"]["min"] is None
    assert document["metadata"] == {"eps": "1e-05"}
    table = invoke("inspect", source)
    assert table.exit_code == 0
    lines = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip()}
    assert lines["f4"].split()[1:4] == ["F4", "2\N{MULTIPLICATION SIGN}4", "4"]
    assert "no statistics" in lines["f4"]
    assert lines["f6a"].split()[1:4] == ["F6_E2M3", "4", "3"]
    assert "min=1" in lines["x"]


def test_an_f4_tensor_shows_its_true_size_and_shape(tmp_path):
    # The case: 4 F4 values are 2 bytes (torch reads them as 2 float4_e2m1fn_x2).
    entries = [("q", "F4", [4], b"\x12\x34"), ("x", "F32", [1], struct.pack("<f", 1.0))]
    source = raw_file(tmp_path / "f4.safetensors", entries)
    (q, x) = json.loads(invoke("inspect", "--json", source).stdout)["tensors"]
    assert (q["name"], q["dtype"], q["shape"], q["numel"], q["bytes"]) == ("q", "F4", [4], 4, 2)
    assert x["min"] == 1.0
    row = next(line for line in invoke("inspect", source).stdout.splitlines() if "F4" in line)
    assert row.split()[:5] == ["q", "F4", "4", "2", "B"]
    compared = json.loads(invoke("diff", source, source, "--json").stdout)["tensors"][0]
    assert compared["passed"] is True
    assert compared["shape"] == [4] and compared["expected_shape"] == [4]
    text = invoke("diff", source, source).stdout
    assert next(line for line in text.splitlines() if "PASS q" in line).split() == [
        "PASS", "q", "F4", "[4]"]  # fmt: skip


def test_diff_compares_undecodable_tensors_bit_for_bit_in_their_header_shape(tmp_path):
    a = raw_file(tmp_path / "a.safetensors", EXOTIC)
    changed = [(k, c, s, (d[:-1] + bytes([d[-1] ^ 1])) if k != "x" else d) for k, c, s, d in EXOTIC]
    b = raw_file(tmp_path / "b.safetensors", changed)
    same = invoke("diff", a, a, "--json")
    assert same.exit_code == 0, same.stderr
    document = json.loads(invoke("diff", a, b, "--json").stdout)
    results = {t["name"]: t for t in document["tensors"]}
    for key, _, shape, _ in EXOTIC:
        assert results[key]["shape"] == shape and results[key]["expected_shape"] == shape, key
    for key in ("f4", "f6a", "f6b", "c"):
        assert results[key]["passed"] is False
        assert "compared bit for bit" in results[key]["problems"][0], results[key]["problems"]
    assert results["f4"]["dtype"] == "F4" and results["f6a"]["dtype"] == "F6_E2M3"
    assert results["x"]["passed"] is True and results["e8"]["passed"] is False
    text = invoke("diff", a, b).stdout
    assert "F4 [2, 4]" in text and "F6_E2M3 [4]" in text
    shaped = raw_file(tmp_path / "s.safetensors", [("f6a", "F6_E2M3", [2, 2], b"\x01\x02\x03")])
    other = json.loads(invoke("diff", shaped, a, "--json", "--key", "f6a").stdout)["tensors"][0]
    assert other["passed"] is False and other["shape"] == [2, 2]
    assert other["expected_shape"] == [4]
