"""Fuzzing the command line with mutated safetensors files.

The promise under test: every input gives a correct result, or exit code 2 with one line on
stderr starting ``maskln: error: `` (verify and diff may also exit 1 on a mismatch); never a
traceback, a hang, an unbounded allocation, or a damaged or partial output file.

Small valid files (tests/fuzzing.py: ``base_tensors``) are mutated by hypothesis strategies aimed
at the format: the header length field, the header JSON's structure, dtypes, shapes,
data_offsets, metadata (eps), truncation, appended and flipped bytes. Each mutated file goes
through normalize, inspect, verify and diff, from a path and from stdin, in-process (fast); a few
run through the real entry point in a subprocess. Explicit regression cases cover the nastiest
hand-made files. Three more generators (issue 13) aim at the reports: integer tensors one unit
apart at magnitudes float64 cannot tell apart, keys and metadata of JSON-looking text, markup
and ``:emoji:`` codes, and FIFOs, sockets and devices wherever a command takes a file.

``MASKLN_FUZZ_EXAMPLES=5000`` runs each fuzz test on that many files (default 25, so that
`make test` stays quick); ``MASKLN_FUZZ_SUBPROCESS_EXAMPLES`` likewise for the subprocess test.
The example counts here are explicit, so MASKLN_HYPOTHESIS_PROFILE does not change them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st
from safetensors import safe_open as open_safetensors

from tests.fuzzing import (
    EMOJI_CODES,
    FILE_ARGUMENTS,
    SPECIAL_KINDS,
    SPECIAL_NAMES,
    Bases,
    Case,
    Entry,
    IntegerPair,
    Layout,
    assemble,
    base_tensors,
    broken,
    check_normalize_output,
    check_outcome,
    crash_site,
    encode_json,
    hidden_files,
    integer_tensor,
    integers_one_unit_apart,
    json_looking_text,
    mutated_files,
    nbytes,
    read_file,
    read_output,
    run_in_process,
    run_subprocess,
    save_base,
    snapshot,
    special_file,
)

# In `make test-slow` (CI), not `make test`: fuzzed files through real processes.
pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("MASKLN_FUZZ_EXAMPLES", "25"))
SUBPROCESS_EXAMPLES = int(os.environ.get("MASKLN_FUZZ_SUBPROCESS_EXAMPLES", "2"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
SENTINEL = b"a pre-existing output that must survive any error\n"


class Workspace:
    """The valid base files, their expected outputs, and a scratch folder per example."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layouts = Bases()
        self.inputs: dict[str, Path] = {}
        self.expected: dict[str, Path] = {}
        spool = root / "spool"
        spool.mkdir()
        for name, (tensors, metadata) in base_tensors().items():
            path = save_base(root / f"{name}.safetensors", tensors, metadata)
            self.layouts[name] = Layout.parse(path.read_bytes())
            self.inputs[name] = path
            expected = root / f"{name}_expected.safetensors"
            outcome = run_in_process("normalize", path, expected, spool_dir=spool)
            assert outcome.exit_code == 0, outcome.describe()
            self.expected[name] = expected

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        folder = Path(tempfile.mkdtemp(dir=self.root, prefix="case-"))
        (folder / "spool").mkdir()
        (folder / "out").mkdir()
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("fuzz"))


# Strategies need the workspace, which exists only once the fixture ran: draw from st.data().
def draw_case(data: st.DataObject, workspace: Workspace) -> Case:
    case = data.draw(mutated_files(workspace.layouts), label="case")
    note(f"rebuild: Path('in.safetensors').write_bytes(bytes.fromhex({case.data.hex()!r}))")
    return case


def path_or_stdin(path: Path, data: bytes, from_stdin: bool) -> tuple[Path | str, bytes | None]:
    """How a command reads the mutated file: its argument and the run's input (``-`` and the
    bytes on stdin, or the path and no input)."""
    return ("-", data) if from_stdin else (path, None)


def _verdict(outcome) -> str:
    """A coarse label for hypothesis' statistics: exit code and the kind of error."""
    if outcome.exit_code != 2:
        return f"exit {outcome.exit_code}"
    message = outcome.stderr.removeprefix("maskln: error: ")
    if "not a valid safetensors file" in message:
        return "exit 2, rejected by the safetensors parser"
    return "exit 2, rejected by maskln's own checks"


# --- normalize ----------------------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_fuzz_normalize(workspace, data):
    """From a path into an existing file, from stdin into a new file, and into stdout: the same
    verdict, one error line or a correct output, and outputs untouched after an error."""
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(case.data)
        out = folder / "out"
        existing, fresh = out / "existing.safetensors", out / "fresh.safetensors"
        existing.write_bytes(SENTINEL)
        spool = folder / "spool"

        by_path = run_in_process("normalize", source, existing, spool_dir=spool)
        check_outcome(by_path, {0, 2})
        by_stdin = run_in_process("normalize", "-", fresh, input=case.data, spool_dir=spool)
        check_outcome(by_stdin, {0, 2})
        to_stdout = run_in_process("normalize", source, "-", spool_dir=spool)
        check_outcome(to_stdout, {0, 2})

        event(f"normalize: {_verdict(by_path)}")
        assert hidden_files(out) == [], "temporary files left beside the output"
        codes = (by_path.exit_code, by_stdin.exit_code, to_stdout.exit_code)
        assert len(set(codes)) == 1, (
            f"path, stdin and stdout runs disagree: {codes}\n{by_path.describe()}\n"
            f"{by_stdin.describe()}\n{to_stdout.describe()}"
        )
        if by_path.exit_code == 2:
            assert existing.read_bytes() == SENTINEL, "an existing output was changed by an error"
            assert not fresh.exists(), "an output was created by a failing run"
            assert to_stdout.stdout == b"", "partial output written to stdout by a failing run"
            return
        assert existing.read_bytes() == fresh.read_bytes() == to_stdout.stdout, (
            "path, stdin and stdout runs wrote different outputs"
        )
        check_normalize_output(source, fresh)
        # verify recomputes exactly as normalize does: maskln's own output must pass.
        again = run_in_process("verify", source, fresh, spool_dir=spool)
        check_outcome(again, {0, 1, 2})
        assert again.exit_code == 0, f"verify rejects normalize's own output\n{again.describe()}"


@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))
@given(data=st.data())
def test_fuzz_normalize_batch(workspace, data):
    """--out-dir with a mutated input and a valid one: the valid one is written, the bad one not."""
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        bad = folder / "bad.safetensors"
        bad.write_bytes(case.data)
        good = workspace.inputs["f32"]
        out = folder / "out"
        (out / "bad.safetensors").write_bytes(SENTINEL)
        result = run_in_process(
            "normalize", bad, good, "--out-dir", out, spool_dir=folder / "spool"
        )
        site = crash_site(result)
        if site is not None:
            raise broken(f"crash: {site}", result.describe())
        assert result.exit_code in (0, 2), result.describe()
        assert all(line.startswith("maskln: ") for line in result.stderr.splitlines()), (
            result.describe()
        )
        assert hidden_files(out) == []
        written = out / good.name
        assert written.read_bytes() == workspace.expected["f32"].read_bytes()
        if result.exit_code == 2:
            assert (out / "bad.safetensors").read_bytes() == SENTINEL
            errors = [x for x in result.stderr.splitlines() if x.startswith("maskln: error: ")]
            assert errors and "bad.safetensors" in errors[0], result.describe()
        else:
            check_normalize_output(bad, out / "bad.safetensors")


@FUZZ
@given(data=st.data(), params_from_stdin=st.booleans())
def test_fuzz_params_and_grad_out_files(workspace, data, params_from_stdin):
    """A mutated file as --params (scale and bias) and as --grad-out, for a valid input."""
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        side = folder / "side.safetensors"
        side.write_bytes(case.data)
        out = folder / "out"
        target = out / "existing.safetensors"
        target.write_bytes(SENTINEL)
        spool = folder / "spool"
        source = workspace.inputs["f32"]
        side_arg, stdin = path_or_stdin(side, case.data, params_from_stdin)
        for option in ("--params", "--grad-out"):
            result = run_in_process(
                "normalize", source, target, option, side_arg, input=stdin, spool_dir=spool
            )
            check_outcome(result, {0, 2})
            assert hidden_files(out) == []
            if result.exit_code == 2:
                assert target.read_bytes() == SENTINEL, "an existing output was changed"
            else:
                outputs, _ = read_output(target)
                invalid = ~read_file(source)[0]["valid"].reshape(-1)
                out_rows = outputs["out"].reshape(-1, 8)[invalid]
                assert bool((out_rows == 0).all()), "out is not exactly 0 at invalid rows"
                target.write_bytes(SENTINEL)


OPTION_VALUES = {
    "--eps": ["nan", "inf", "-1", "0", "-0.0", "1e-50", "5e-324", "1e400", "1e300", "abc", ""],
    "--chunk-rows": ["0", "1", "2", "-1", str(2**70), "1.5", ""],
    "--x-key": ["valid", "scale", "", "__metadata__", "missing", "\x1b[2J"],
    "--valid-key": ["x", "scale", "missing", "", "valid"],
    "--scale-key": ["x", "valid", "bias", "missing"],
    "--bias-key": ["x", "scale", "missing"],
    "--grad-out-key": ["x", "valid", "missing"],
    "--out-key": ["grad_x", "grad_scale", "", "__metadata__", "\x00", "out"],
    "--dtype": ["float16", "bfloat16", "int8", "float64", "float32", "AUTO"],
    "--rtol": ["nan", "-1", "inf", "0", "1e308"],
    "--atol": ["nan", "-1", "inf", "0"],
}


KEY_OPTIONS = {"--x-key", "--valid-key", "--scale-key", "--bias-key", "--grad-out-key", "--out-key"}


@FUZZ
@given(
    data=st.data(),
    options=st.lists(
        st.sampled_from(sorted(OPTION_VALUES)).flatmap(
            lambda o: st.tuples(st.just(o), st.sampled_from(OPTION_VALUES[o]))
        ),
        max_size=3,
    ),
)
def test_fuzz_options(workspace, data, options):
    """Nasty option values on a (possibly mutated) input: one error line or a correct result."""
    mutate = data.draw(st.integers(0, 3), label="mutate") == 0
    if mutate:
        case = draw_case(data, workspace)
        name, blob = case.base, case.data
    else:
        name = data.draw(st.sampled_from(sorted(workspace.inputs)), label="base")
        blob = workspace.inputs[name].read_bytes()
    given = dict(options)
    flat = [part for pair in options for part in pair]
    normalize_flat = [
        part for pair in options if pair[0] not in ("--rtol", "--atol") for part in pair
    ]
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(blob)
        out = folder / "out"
        target = out / "existing.safetensors"
        target.write_bytes(SENTINEL)
        spool = folder / "spool"
        normalized = run_in_process("normalize", source, target, *normalize_flat, spool_dir=spool)
        check_outcome(normalized, {0, 2})
        event(f"options normalize: {_verdict(normalized)}")
        assert hidden_files(out) == []
        if normalized.exit_code == 2:
            assert target.read_bytes() == SENTINEL
        elif not KEY_OPTIONS & given.keys():
            # Options given more than once: the last one counts.
            check_normalize_output(
                source, target, eps=given.get("--eps"), dtype=given.get("--dtype", "auto")
            )
        else:
            outputs, meta = read_output(target)
            assert given.get("--out-key", "out") in outputs, list(outputs)
            eps = float(meta["eps"])
            assert math.isfinite(eps) and eps > 0, meta
        verified = run_in_process(
            "verify", source, workspace.expected[name], *flat, spool_dir=spool
        )
        check_outcome(verified, {0, 1, 2})


# --- inspect ------------------------------------------------------------------------------------


def _strict_json(text: str) -> object:
    def reject(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=reject)


@FUZZ
@given(data=st.data())
def test_fuzz_inspect(workspace, data):
    """inspect from a path (table) and from stdin (--json): the same verdict; JSON is strict."""
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(case.data)
        spool = folder / "spool"
        table = run_in_process("inspect", source, spool_dir=spool)
        check_outcome(table, {0, 2})
        as_json = run_in_process("inspect", "-", "--json", input=case.data, spool_dir=spool)
        check_outcome(as_json, {0, 2})
        assert table.exit_code == as_json.exit_code, f"{table.describe()}\n{as_json.describe()}"
        if as_json.exit_code == 0:
            document = _strict_json(as_json.stdout.decode())
            with open_safetensors(str(source), framework="pt") as handle:
                keys = list(handle.offset_keys())
            # Order is checked by test_inspect_order_is_stable; here, the same keys.
            assert sorted(t["name"] for t in document["tensors"]) == sorted(keys)


# --- verify -------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), input_from_stdin=st.booleans(), expected_from_stdin=st.booleans())
def test_fuzz_verify(workspace, data, input_from_stdin, expected_from_stdin):
    """The mutated file as INPUT against a valid EXPECTED, and as EXPECTED for a valid INPUT.

    As INPUT, verify fails with exit 2 exactly when normalize does (it recomputes the same way).
    """
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(case.data)
        spool = folder / "spool"
        expected = workspace.expected[case.base]
        argument, stdin = path_or_stdin(source, case.data, input_from_stdin)
        as_input = run_in_process("verify", argument, expected, input=stdin, spool_dir=spool)
        check_outcome(as_input, {0, 1, 2})
        argument, stdin = path_or_stdin(source, case.data, expected_from_stdin)
        as_expected = run_in_process(
            "verify", workspace.inputs[case.base], argument, "--json", input=stdin, spool_dir=spool
        )
        check_outcome(as_expected, {0, 1, 2})
        if as_expected.exit_code in (0, 1):
            document = _strict_json(as_expected.stdout.decode())
            assert document["passed"] is (as_expected.exit_code == 0), as_expected.describe()

        normalized = run_in_process(
            "normalize", source, folder / "out" / "o.safetensors", spool_dir=spool
        )
        check_outcome(normalized, {0, 2})
        assert (as_input.exit_code == 2) == (normalized.exit_code == 2), (
            f"verify and normalize disagree on INPUT\n{as_input.describe()}\n"
            f"{normalized.describe()}"
        )


# --- diff ---------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), mutated_from_stdin=st.booleans())
def test_fuzz_diff(workspace, data, mutated_from_stdin):
    """diff MUTATED BASE, diff BASE MUTATED --json (one side from stdin), diff MUTATED MUTATED."""
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(case.data)
        spool = folder / "spool"
        base = workspace.inputs[case.base]
        stdin_side, stdin = path_or_stdin(source, case.data, mutated_from_stdin)
        forward = run_in_process("diff", stdin_side, base, input=stdin, spool_dir=spool)
        check_outcome(forward, {0, 1, 2})
        other, stdin = path_or_stdin(source, case.data, not mutated_from_stdin)
        backward = run_in_process("diff", base, other, "--json", input=stdin, spool_dir=spool)
        check_outcome(backward, {0, 1, 2})
        assert (forward.exit_code == 2) == (backward.exit_code == 2), (
            f"{forward.describe()}\n{backward.describe()}"
        )
        if backward.exit_code in (0, 1):
            document = _strict_json(backward.stdout.decode())
            assert document["passed"] is (backward.exit_code == 0)
        itself = run_in_process("diff", source, source, spool_dir=spool)
        check_outcome(itself, {0, 1, 2})
        if itself.exit_code == 1:
            tensors, _ = read_file(source)
            assert any(t.is_complex() for t in tensors.values()), (
                f"a file differs from itself\n{itself.describe()}"
            )


# --- files that must keep working ---------------------------------------------------------------


@FUZZ
@given(
    data=st.data(),
    pad=st.booleans(),
    extra_dtype=st.sampled_from(["F32", "I64", "U16", "BOOL", "C64", "F8_E4M3", "F4", "BF16"]),
)
def test_fuzz_harmless_changes_keep_the_result(workspace, data, pad, extra_dtype):
    """Header order, padding, buffer order, an unrelated tensor of any dtype and extra metadata
    change nothing: exit 0 and the base's expected output, byte for byte."""
    name = data.draw(st.sampled_from(sorted(workspace.layouts)), label="base")
    layout = Layout.parse(workspace.inputs[name].read_bytes())
    if data.draw(st.booleans(), label="unrelated tensor"):
        size = nbytes(extra_dtype, [2, 4])
        layout.entries.append(Entry("encoder.other", extra_dtype, [2, 4], b"\x01" * size))
    if data.draw(st.booleans(), label="extra metadata"):
        layout.metadata = {**(layout.metadata or {}), "format": "pt", "comment": "\x1b[31m"}
    layout.entries = data.draw(st.permutations(layout.entries), label="buffer order")
    order = data.draw(st.permutations(range(len(layout.entries))), label="header order")
    pairs, buffer = layout.header_pairs(list(order))
    blob = assemble(encode_json(pairs), buffer, pad)
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(blob)
        target = folder / "out" / "o.safetensors"
        result = run_in_process("normalize", source, target, spool_dir=folder / "spool")
        check_outcome(result, {0})
        produced, _ = read_file(target)
        expected, _ = read_file(workspace.expected[name])
        assert produced.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(produced[key], value) or (
                value.isnan().any() and torch.equal(produced[key].isnan(), value.isnan())
            ), key


# --- the real entry point -----------------------------------------------------------------------


@settings(FUZZ, max_examples=SUBPROCESS_EXAMPLES)
@given(data=st.data())
def test_fuzz_subprocess_stdin(workspace, data):
    """The real `python -m maskln_cli`, stdin to stdout and stdin to a file, under a timeout."""
    case = draw_case(data, workspace)
    with workspace.scratch() as folder:
        spool = folder / "spool"
        out = folder / "out"
        target = out / "existing.safetensors"
        target.write_bytes(SENTINEL)
        piped = run_subprocess("normalize", "-", "-", input=case.data, tmpdir=spool)
        check_outcome(piped, {0, 2})
        to_file = run_subprocess("normalize", "-", target, input=case.data, tmpdir=spool)
        check_outcome(to_file, {0, 2})
        assert piped.exit_code == to_file.exit_code, f"{piped.describe()}\n{to_file.describe()}"
        assert hidden_files(out) == []
        if piped.exit_code == 2:
            assert piped.stdout == b""
            assert target.read_bytes() == SENTINEL
        else:
            assert piped.stdout == target.read_bytes()
            source = folder / "in.safetensors"
            source.write_bytes(case.data)
            check_normalize_output(source, target)


# --- regressions: hand-made nasty files ---------------------------------------------------------


def _entry(dtype: str, shape: list, offsets: list) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _header_file(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return assemble(text, data, pad=True, length=length)


F32x8 = struct.pack("<8f", *range(8))
NASTY = {
    # [2**40, 8] float32 is 32 TiB: rejected from the header alone, before any allocation.
    "huge_shape_tiny_file": _header_file({"x": _entry("F32", [2**40, 8], [0, 32])}, F32x8 * 1),
    "huge_shape_offsets_beyond_file": _header_file(
        {"x": _entry("F32", [2**40, 8], [0, 2**45])}, F32x8
    ),
    "header_length_2_63": struct.pack("<Q", 2**63) + b'{"x":{}}',
    "header_length_2_64_minus_1": struct.pack("<Q", 2**64 - 1) + b"{}" + b"\0" * 64,
    "header_length_beyond_file": struct.pack("<Q", 1000) + b"{}      ",
    "header_length_zero": struct.pack("<Q", 0) + b"{}      ",
    "header_is_an_array": _header_file([{"x": _entry("F32", [8], [0, 32])}], F32x8),
    "header_is_a_string": _header_file("x", F32x8),
    "header_is_null": _header_file(None),
    "duplicate_tensor_names_same_offsets": _header_file(
        b'{"x":{"dtype":"F32","shape":[1,8],"data_offsets":[0,32]},'
        b'"x":{"dtype":"F32","shape":[1,8],"data_offsets":[0,32]}}',
        F32x8,
    ),
    "duplicate_tensor_names_two_regions": _header_file(
        b'{"x":{"dtype":"F32","shape":[1,8],"data_offsets":[0,32]},'
        b'"x":{"dtype":"F32","shape":[2,4],"data_offsets":[32,64]}}',
        F32x8 * 2,
    ),
    "duplicate_metadata": _header_file(
        b'{"__metadata__":{"eps":"1"},"__metadata__":{"eps":"nan"},'
        b'"x":{"dtype":"F32","shape":[1,8],"data_offsets":[0,32]}}',
        F32x8,
    ),
    "metadata_is_a_tensor": _header_file(
        {"__metadata__": _entry("F32", [1, 8], [0, 32]), "x": _entry("F32", [1, 8], [32, 64])},
        F32x8 * 2,
    ),
    "metadata_is_a_list": _header_file(
        {"__metadata__": [1, 2], "x": _entry("F32", [1, 8], [0, 32])}, F32x8
    ),
    "metadata_eps_is_an_object": _header_file(
        {"__metadata__": {"eps": {"value": "1e-5"}}, "x": _entry("F32", [1, 8], [0, 32])}, F32x8
    ),
    "metadata_eps_1e400": _header_file(
        {"__metadata__": {"eps": "1e400"}, "x": _entry("F32", [1, 8], [0, 32])}, F32x8
    ),
    "metadata_eps_10k": _header_file(
        {"__metadata__": {"eps": "7" * 10_000}, "x": _entry("F32", [1, 8], [0, 32])}, F32x8
    ),
    "metadata_key_control_chars": _header_file(
        {
            "__metadata__": {"eps\x1b[2J\n": "1", "eps": "\x07nan"},
            "x": _entry("F32", [1, 8], [0, 32]),
        },
        F32x8,
    ),
    "deep_nesting": _header_file(b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "invalid_utf8_key": _header_file(
        b'{"x\xff":{"dtype":"F32","shape":[1,8],"data_offsets":[0,32]}}', F32x8
    ),
    "lone_surrogate_key": _header_file(
        b'{"\\ud800":{"dtype":"F32","shape":[1,8],"data_offsets":[0,32]}}', F32x8
    ),
    "x_zero_rows_huge_channels": _header_file({"x": _entry("F32", [0, 2**40], [0, 0])}),
    "x_zero_rows_2_31_channels": _header_file({"x": _entry("F32", [0, 2**31], [0, 0])}),
    "x_huge_zero_size_leading": _header_file({"x": _entry("F32", [2**40, 0, 8], [0, 0])}),
    "x_0d": _header_file({"x": _entry("F32", [], [0, 4])}, F32x8[:4]),
    "x_unaligned": _header_file(
        {"valid": _entry("BOOL", [1], [0, 1]), "x": _entry("F32", [1, 8], [1, 33])},
        b"\x01" + F32x8,
    ),
    # F4 is float4_e2m1fn_x2 in torch, two values a byte: [..., 2C] loads as [..., C], and
    # torch can neither compare nor convert it.
    "x_f4": _header_file({"x": _entry("F4", [3, 4, 16], [0, 96])}, b"\x11" * 96),
    "scale_f4": _header_file(
        {"x": _entry("F32", [1, 8], [0, 32]), "scale": _entry("F4", [16], [32, 40])},
        F32x8 + b"\x11" * 8,
    ),
    "valid_f4": _header_file(
        {"x": _entry("F32", [2, 8], [0, 64]), "valid": _entry("F4", [4], [64, 66])},
        F32x8 * 2 + b"\x22" * 2,
    ),
    "valid_f8_e8m0": _header_file(
        {"x": _entry("F32", [2, 8], [0, 64]), "valid": _entry("F8_E8M0", [2], [64, 66])},
        F32x8 * 2 + b"\x7f\x7f",
    ),
    "bias_f6": _header_file(
        {"x": _entry("F32", [1, 8], [0, 32]), "bias": _entry("F6_E2M3", [8], [32, 38])},
        F32x8 + b"\x00" * 6,
    ),
    "out_c64": _header_file({"out": _entry("C64", [3, 4, 8], [0, 768])}, F32x8 * 24),
    # Invalid rows are exactly 0 whatever they hold: here finite values whose variance
    # overflows float32, and a constant row with an eps that underflows float32.
    "invalid_row_overflows": _header_file(
        {"x": _entry("F32", [2, 2], [0, 16]), "valid": _entry("BOOL", [2], [16, 18])},
        struct.pack("<4f", 2.0, 1.0, -2.9e37, 1.0) + b"\x01\x00",
    ),
    "invalid_constant_row_tiny_eps": _header_file(
        {
            "__metadata__": {"eps": "1e-50"},
            "x": _entry("F32", [2, 2], [0, 16]),
            "grad_out": _entry("F32", [2, 2], [16, 32]),
            "valid": _entry("BOOL", [2], [32, 34]),
        },
        struct.pack("<8f", 2.0, 1.0, 5.0, 5.0, 1.0, 2.0, 3.0, 4.0) + b"\x01\x00",
    ),
    "eps_underflows_float32": _header_file(
        {"__metadata__": {"eps": "1e-50"}, "x": _entry("F32", [1, 8], [0, 32])},
        struct.pack("<8f", *[3.0] * 8),
    ),
}


def _nasty_commands(path: Path, data: bytes, valid_input: Path, expected: Path):
    return {
        "normalize": (("normalize", path, "OUT"), None),
        "normalize-stdin": (("normalize", "-", "-"), data),
        "inspect": (("inspect", path), None),
        "inspect-stdin": (("inspect", "-", "--json"), data),
        "verify-input": (("verify", path, expected), None),
        "verify-expected": (("verify", valid_input, "-"), data),
        "diff": (("diff", path, valid_input), None),
        "diff-stdin": (("diff", valid_input, "-"), data),
    }


@pytest.mark.parametrize("name", sorted(NASTY))
def test_nasty_file(workspace, name):
    """Every command on each hand-made file: one error line, or a correct result; fast."""
    data = NASTY[name]
    with workspace.scratch() as folder:
        source = folder / f"{name}.safetensors"
        source.write_bytes(data)
        out = folder / "out"
        target = out / "existing.safetensors"
        commands = _nasty_commands(source, data, workspace.inputs["f32"], workspace.expected["f32"])
        failures = []
        for label, (args, stdin) in commands.items():
            target.write_bytes(SENTINEL)
            args = tuple(target if a == "OUT" else a for a in args)
            started = time.perf_counter()
            result = run_in_process(*args, input=stdin, spool_dir=folder / "spool")
            elapsed = time.perf_counter() - started
            try:
                check_outcome(result, {0, 1, 2})
                if label.startswith(("normalize", "inspect")):
                    assert result.exit_code in (0, 2), result.describe()
                assert elapsed < 5, f"took {elapsed:.1f} s\n{result.describe()}"
                assert hidden_files(out) == []
                if label == "normalize":
                    if result.exit_code == 2:
                        assert target.read_bytes() == SENTINEL
                    else:
                        check_normalize_output(source, target)
            except AssertionError as failure:
                failures.append(f"[{label}] {failure}")
        assert not failures, "\n\n".join(failures)


def test_nasty_eps_1e400_is_refused(workspace):
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(NASTY["metadata_eps_1e400"])
        result = run_in_process(
            "normalize", source, folder / "out" / "o.safetensors", spool_dir=folder / "spool"
        )
        check_outcome(result, {2})
        assert "eps" in result.stderr and "'1e400'" in result.stderr


def test_nasty_huge_shape_is_refused_before_allocating(workspace):
    """The 32 TiB header is refused with at most 64 MiB more address space than we have."""
    from tests.fuzzing import bounded

    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(NASTY["huge_shape_tiny_file"])
        with bounded(seconds=10, headroom=64 * 2**20):
            from tests.clitools import invoke

            result = invoke("normalize", source, folder / "out" / "o.safetensors")
        assert result.exit_code == 2, result.stderr
        assert result.stderr.startswith("maskln: error: ")
        assert not (folder / "out" / "o.safetensors").exists()


@pytest.mark.parametrize(
    "name", ["huge_shape_tiny_file", "header_length_2_63", "x_zero_rows_huge_channels"]
)
def test_nasty_file_through_the_real_entry_point(workspace, name):
    """stdin into the real process, with a timeout and an 8 GiB address-space cap."""
    with workspace.scratch() as folder:
        result = run_subprocess("normalize", "-", "-", input=NASTY[name], tmpdir=folder / "spool")
        check_outcome(result, {0, 2})
        if result.exit_code == 2:
            assert result.stdout == b""


@pytest.mark.parametrize("out_key", ["__metadata__", ""])
def test_out_key_gives_a_readable_file(workspace, out_key):
    """Whatever --out-key names, exit 0 means OUTPUT is a valid safetensors file holding it."""
    with workspace.scratch() as folder:
        target = folder / "out" / "o.safetensors"
        result = run_in_process(
            "normalize", workspace.inputs["f32"], target, "--out-key", out_key,
            spool_dir=folder / "spool",
        )  # fmt: skip
        check_outcome(result, {0, 2})
        if result.exit_code == 0:
            outputs, metadata = read_output(target)
            assert list(outputs) == [out_key]
            assert metadata.get("eps") == "1e-05"


def test_no_python_warning_reaches_stderr(workspace):
    """verify against an EXPECTED whose 'out' is complex: a mismatch, without a torch warning
    (which prints a file name, a line number and a source line on stderr). A real process:
    torch warns only once per process, so an in-process check would depend on test order."""
    with workspace.scratch() as folder:
        expected = folder / "expected.safetensors"
        expected.write_bytes(NASTY["out_c64"])
        result = run_subprocess(
            "verify", workspace.inputs["f32"], expected, "--quiet", tmpdir=folder / "spool"
        )
        check_outcome(result, {1})
        assert result.stderr == "", result.describe()


def test_inspect_order_is_stable(workspace):
    """inspect lists tensors in file order, the same on every run, zero-size ones included."""
    header = {
        name: _entry(
            "F32", [0, 8] if name != "bias" else [8], [0, 0] if name != "bias" else [0, 32]
        )
        for name in ("bias", "x", "valid", "scale", "grad_out", "a", "b", "c")
    }
    with workspace.scratch() as folder:
        source = folder / "in.safetensors"
        source.write_bytes(_header_file(header, F32x8))
        orders = set()
        for _ in range(8):
            result = run_in_process("inspect", source, "--json", spool_dir=folder / "spool")
            check_outcome(result, {0})
            orders.add(tuple(t["name"] for t in _strict_json(result.stdout.decode())["tensors"]))
        assert len(orders) == 1, f"inspect lists the tensors in {len(orders)} orders: {orders}"


def test_workspace_bases_are_valid(workspace):
    """The starting files themselves pass every command (sanity check of the fuzzer)."""
    for name, path in workspace.inputs.items():
        with workspace.scratch() as folder:
            spool = folder / "spool"
            out = folder / "out" / "o.safetensors"
            check_outcome(run_in_process("normalize", path, out, spool_dir=spool), {0})
            check_normalize_output(path, out)
            check_outcome(run_in_process("inspect", path, spool_dir=spool), {0})
            verified = run_in_process("verify", path, workspace.expected[name], spool_dir=spool)
            check_outcome(verified, {0})
            assert snapshot(folder / "out").keys() == {"o.safetensors"}


# --- issue 13: integers compared exactly, text carried as it is, special files refused ---------

EXACT = settings(
    max_examples=max(1, EXAMPLES * 2 // 5),  # 10 by default: each example runs several commands
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
EMOJI = {"\u26a0", "\U0001f44d", "\u274c", "\U0001f199", "\U0001f604"}
"""What rich makes of EMOJI_CODES: none may appear unless the input holds it."""


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for size in reversed(shape):
        flat, position = divmod(flat, size)
        index.append(position)
    return index[::-1]


@EXACT
@given(pair=integers_one_unit_apart())
def test_fuzz_integers_one_unit_apart_differ_by_exactly_one(pair: IntegerPair):
    """int64, uint64, int32 and bool values one unit apart, at any magnitude: each such
    place is a mismatch, the differences and values reported are exact ints (JSON and the
    report alike), and each tensor matches itself."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "spool").mkdir()
        tensors = [integer_tensor(v, pair.dtype, pair.shape) for v in (pair.actual, pair.expected)]
        a = save_base(root / "a.safetensors", {"t": tensors[0]}, None)
        e = save_base(root / "e.safetensors", {"t": tensors[1]}, None)
        outcome = run_in_process("diff", a, e, "--json", spool_dir=root / "spool")
        check_outcome(outcome, {1})
        (tensor,) = _strict_json(outcome.stdout.decode())["tensors"]
        first = _unravel(pair.changed[0], pair.shape)
        assert tensor["mismatched"] == len(pair.changed)
        assert tensor["max_abs_diff"] == 1 and tensor["max_abs_index"] == first
        assert tensor["worst"], tensor
        for worst in tensor["worst"]:
            flat = sum(i * math.prod(pair.shape[d + 1 :]) for d, i in enumerate(worst["index"]))
            assert flat in pair.changed, worst
            assert (worst["actual"], worst["expected"], worst["abs_diff"]) == (
                pair.actual[flat], pair.expected[flat], 1
            )  # fmt: skip
        report = run_in_process("diff", a, e, spool_dir=root / "spool")
        check_outcome(report, {1})
        text = report.stdout.decode()
        assert re.search(rf"max abs diff +1 at {re.escape(str(first))}", text), text
        worst = tensor["worst"][0]
        assert f"{worst['actual']:,}" in text and f"{worst['expected']:,}" in text, text
        check_outcome(run_in_process("diff", a, a, "--json", spool_dir=root / "spool"), {0})


@EXACT
@given(
    keys=st.lists(json_looking_text(min_size=1), min_size=1, max_size=4, unique=True),
    metadata=st.dictionaries(json_looking_text(), json_looking_text(), max_size=4),
)
def test_fuzz_keys_and_metadata_are_carried_as_they_are(keys, metadata):
    """Keys and metadata holding JSON-looking text, markup and :emoji: codes: --json carries
    each string as the json module writes it, the reports show each as it is (control
    characters escaped), and no emoji appears that the file does not hold."""
    from maskln_cli.cli.report import plain_safe

    assume("__metadata__" not in keys and "__metadata__" not in metadata)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        spool = root / "spool"
        spool.mkdir()
        a = save_base(root / "a.safetensors", {k: torch.ones(2) for k in keys}, metadata or None)
        e = save_base(root / "e.safetensors", {k: torch.zeros(2) for k in keys}, None)
        strings = [*keys, *metadata, *metadata.values()]
        held = {c for c in EMOJI if any(c in text for text in strings)}

        inspected = run_in_process("inspect", "--json", a, spool_dir=spool)
        diffed = run_in_process("diff", a, e, "--json", spool_dir=spool)
        check_outcome(inspected, {0})
        check_outcome(diffed, {1})
        document = _strict_json(inspected.stdout.decode())
        assert document["metadata"] == metadata
        assert sorted(t["name"] for t in document["tensors"]) == sorted(keys)
        compared = _strict_json(diffed.stdout.decode())
        assert sorted(t["name"] for t in compared["tensors"]) == sorted(keys)
        for text in strings:
            assert json.dumps(text) in inspected.stdout.decode(), text
        for key in keys:
            assert json.dumps(key) in diffed.stdout.decode(), key

        table = run_in_process("inspect", a, spool_dir=spool)
        report = run_in_process("diff", a, e, spool_dir=spool)
        check_outcome(table, {0})
        check_outcome(report, {1})
        for shown in (table.stdout.decode(), report.stdout.decode()):
            for key in keys:
                assert plain_safe(key) in shown, (key, shown)
            assert {c for c in EMOJI if c in shown} <= held, shown
        for text in [*metadata, *metadata.values()]:  # line ends are stripped off a terminal
            assert plain_safe(text).rstrip() in table.stdout.decode(), text
        absent = keys[0] + "?"
        if absent not in keys:
            error = run_in_process("diff", a, e, "--key", absent, spool_dir=spool)
            check_outcome(error, {2})
            assert repr(absent) in error.stderr and not {c for c in EMOJI if c in error.stderr}


@settings(EXACT, max_examples=EXAMPLES)
@given(
    kind=st.sampled_from(sorted(SPECIAL_KINDS)),
    name=st.sampled_from(SPECIAL_NAMES),
    command=st.sampled_from(FILE_ARGUMENTS),
)
def test_fuzz_fifos_sockets_and_devices_are_refused_at_once(workspace, kind, name, command):
    """A FIFO, a socket or a device wherever a command takes a file: exit 2, one line naming
    the file as given and what it is, before it is opened (a FIFO with no writer would block
    the open), and no output written."""
    assert any(" " in n or ":" in n for n in SPECIAL_NAMES) and ":up:" in EMOJI_CODES
    with workspace.scratch() as folder, special_file(kind, folder, name) as special:
        output = folder / "out" / "o.safetensors"
        names = {"s": special, "i": workspace.inputs["f32"], "r": workspace.expected["f32"],
                 "o": output}  # fmt: skip
        args = [part.format(**names) for part in command]
        outcome = run_in_process(*args, spool_dir=folder / "spool")
        check_outcome(outcome, {2})
        assert str(special) in outcome.stderr, outcome.describe()
        assert f"is a {SPECIAL_KINDS[kind]}" in outcome.stderr, outcome.describe()
        assert not output.exists()
