"""Fixes from an independent review: torch's thread count left alone for the caller's threads,
padding of float8 rows, and cosmetics a new user met."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from maskln_cli.compare import comparison as compare
from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import PerElement
from maskln_cli.compare.files import compare_tensors, threads_for
from maskln_cli.op import threads
from maskln_cli.op.threads import map_blocks

# -- torch's thread count: set per thread, never process-wide ----------------------------------


@pytest.fixture
def two_threads() -> Iterator[int]:
    """torch on at least 2 threads (the leak cannot show on 1), as it was afterwards."""
    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def _pair_1d() -> tuple[torch.Tensor, torch.Tensor]:
    """4M elements in one row: their row sum is a reduction torch splits across its threads,
    and for these values 1 thread and 2 give a rel_l2 differing in its last bits."""
    expected = torch.randn(1 << 22, generator=torch.Generator().manual_seed(1))
    return expected * (1 + 2**-22), expected


class Probe:
    """A thread the program starts while maskln works, that runs torch only after maskln is
    done: how many threads it then has, and what it then computes."""

    def __init__(self, then: Callable[[], object] = lambda: None) -> None:
        self.started = threading.Event()
        self.go_on = threading.Event()
        self.seen: list[object] = []
        self.lock = threading.Lock()  # started once, though two workers may ask at once
        # A daemon, and told to go on after a timeout: a failing test must not hang pytest.
        self.thread = threading.Thread(target=self._run, args=(then,), daemon=True)

    def _run(self, then: Callable[[], object]) -> None:
        self.seen.append(torch.get_num_threads())  # its first touch of torch's threads
        self.started.set()
        self.go_on.wait(timeout=60)
        self.seen += [torch.get_num_threads(), then()]

    def start(self) -> None:
        with self.lock:
            if not self.thread.is_alive() and not self.started.is_set():
                self.thread.start()
                self.started.wait()

    def finish(self) -> list[object]:
        self.go_on.set()
        self.thread.join()
        return self.seen


@pytest.mark.skipif(sys.platform != "linux", reason="torch's Linux wheels use GNU OpenMP")
def test_the_per_thread_setter_is_found_and_checked(two_threads: int) -> None:
    setter = threads._thread_setter()
    assert setter is not None
    seen: list[int] = []

    def worker() -> None:
        torch.get_num_threads()
        setter(1)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == two_threads


def test_a_thread_started_during_map_blocks_keeps_every_thread(two_threads: int) -> None:
    probe = Probe()

    def work(item: int) -> int:
        probe.start()
        return torch.get_num_threads()

    assert map_blocks(work, [0, 1, 2, 3]) == [1, 1, 1, 1]  # the workers, on one thread each
    assert probe.finish() == [two_threads, two_threads, None]
    assert torch.get_num_threads() == two_threads


def test_a_thread_started_during_threads_for_keeps_every_thread(two_threads: int) -> None:
    probe = Probe()
    with threads_for(8):
        assert torch.get_num_threads() == 1  # this thread, on a tiny tensor
        probe.start()
    assert probe.finish() == [two_threads, two_threads, None]
    assert torch.get_num_threads() == two_threads


def test_a_program_thread_computes_as_if_maskln_had_not_run(
    two_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reviewer's case: thread A compares a big tensor (blocks on worker threads); thread
    B, started meanwhile, then compares a 1-d tensor of 4M elements: the same rel_l2, to the
    last bit, as before A ran (it differed: B had 1 thread for good)."""
    actual, expected = _pair_1d()
    reference = compare_tensors("t", actual, expected).rel_l2
    probe = Probe(lambda: compare_tensors("t", actual, expected).rel_l2)
    measure = Comparison.measure

    def measure_and_start(self: Comparison, *args: object, **kwargs: object) -> object:
        probe.start()
        return measure(self, *args, **kwargs)

    monkeypatch.setattr(Comparison, "measure", measure_and_start)
    big = torch.randn(64, 4096, generator=torch.Generator().manual_seed(2))
    assert compare_tensors("big", big, big).passed
    assert probe.finish() == [two_threads, two_threads, reference]


def test_without_a_per_thread_setter_nothing_is_set(
    two_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another backend, or no OpenMP runtime found: blocks run in the calling thread and tiny
    tensors on every thread, with the same figures; the process-wide setter is never called."""
    monkeypatch.setattr(compare, "BLOCK_ELEMENTS", 16)  # 2 rows a block: 20 blocks
    values = torch.randn(40, 8, generator=torch.Generator().manual_seed(3))
    before = compare_tensors("t", values * 1.001, values)
    monkeypatch.setattr(threads, "_CHECKED", [None])

    def refused(count: int) -> None:
        raise AssertionError("torch.set_num_threads called")

    monkeypatch.setattr(torch, "set_num_threads", refused)
    names = map_blocks(lambda _: threading.current_thread().name, [0, 1])
    assert names == [threading.current_thread().name] * 2
    with threads_for(8):
        assert torch.get_num_threads() == two_threads
    after = compare_tensors("t", values * 1.001, values)
    assert (after.rel_l2, after.max_abs_diff, after.mismatched) == (
        before.rel_l2,
        before.max_abs_diff,
        before.mismatched,
    )


def test_a_thread_started_during_inspect_keeps_every_thread(two_threads: int, tmp_path) -> None:
    """``maskln inspect`` summarizes on one thread: this thread's, not the program's others."""
    from safetensors.torch import save_file

    from maskln_cli.jobs import inspect as stats

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(6.0), "b": torch.ones(3, 4)}, str(path))
    probe = Probe()
    summary = stats.summarize_file(str(path), progress=lambda done, total: probe.start())
    assert [(s.name, s.max) for s in summary.tensors] == [("a", 5.0), ("b", 1.0)]
    assert probe.finish() == [two_threads, two_threads, None]
    assert torch.get_num_threads() == two_threads


# -- padding (invalid rows) of float8 tensors --------------------------------------------------

FLOATING = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz"]
FLOATING += ["float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]
"""Every floating dtype a safetensors file can hold."""
INVALID = torch.tensor([False, True, False, True])


def _padding(dtype: str, actual: torch.Tensor, fast: bool = True) -> tuple[object, ...]:
    comparison = Comparison("t", [4, 8], dtype, [4, 8], dtype)
    if fast:
        comparison.update(actual, actual, invalid_rows=INVALID)
    else:
        comparison._update_general(actual, actual, INVALID, PerElement())
    result = comparison.result()
    return result.passed, result.invalid_rows_zero, result.negative_zeros


def test_the_reviewers_float8_case_passes() -> None:
    zeros = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    assert _padding("float8_e4m3fn", zeros) == (True, True, 0)


@pytest.mark.parametrize("dtype", FLOATING)
def test_padding_of_every_floating_dtype_counts_negative_zeros(dtype: str) -> None:
    """Rows 1 and 3 invalid, all 0; row 1 holds three -0.0 where the dtype has a -0.0 (float8
    ...fnuz have none: their -0.0 rounds to 0); e8m0 has no 0 at all (its smallest value is
    2**-127), so its padding is never zero, and fails. The general path agrees."""
    values = torch.randn(4, 8, generator=torch.Generator().manual_seed(4)).abs() + 1
    values[1] = values[3] = 0.0
    values[1, :3] = -0.0
    actual = values.to(getattr(torch, dtype))
    if dtype == "float8_e8m0fnu":
        expected = (False, False, 0)  # invalid rows must be exactly 0: they fail
    elif dtype.endswith("fnuz"):
        expected = (True, True, 0)
    else:
        expected = (True, True, 3)
    assert _padding(dtype, actual) == expected
    assert _padding(dtype, actual, fast=False) == expected


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_padding_that_is_not_zero_is_found(dtype: str) -> None:
    actual = torch.zeros(4, 8)
    actual[3, 7] = 0.5
    actual[1, 0] = -0.0
    assert _padding(dtype, actual.to(getattr(torch, dtype))) == (False, False, 1)


# -- the reports: one blank line between sections, none at the end ------------------------------


def _blank_runs(text: str) -> list[int]:
    """Line numbers where a blank line follows a blank line."""
    lines = text.split("\n")
    return [i for i in range(1, len(lines)) if not lines[i].strip() and not lines[i - 1].strip()]


def _failing_pair(tmp_path, count: int) -> tuple[object, object]:
    from tests.clitools import write

    actual = {f"t{i}": torch.arange(4.0) + i for i in range(count)}
    expected = {**actual, "t0": actual["t0"] + 1, "t1": actual["t1"] + 1}
    return write(tmp_path / "a.safetensors", actual), write(tmp_path / "e.safetensors", expected)


@pytest.mark.parametrize("count", [3, 10])  # 10: passing tensors get a line each
def test_diff_report_has_one_blank_line_between_sections(tmp_path, count: int) -> None:
    from tests.clitools import invoke

    result = invoke("diff", *_failing_pair(tmp_path, count))
    assert result.exit_code == 1
    assert _blank_runs(result.stdout) == [], result.stdout
    lines = result.stdout.rstrip("\n").split("\n")
    assert lines[2] == "" and lines[3].startswith("FAIL t0")
    assert lines[-2] == "" and lines[-1].startswith("FAIL: 2 of")
    # each worst-rows table ends with one blank line, then the next tensor's block, or line
    for table, following in (("worst rows of t0", "FAIL t1"), ("worst rows of t1", "PASS t2")):
        end = lines.index("", lines.index(table) + 2)  # past the title's blank line
        assert lines[end + 1].startswith(following)
        assert lines[lines.index(table) - 2].startswith("  tolerance")


def test_inspect_ends_without_a_blank_line(tmp_path) -> None:
    from tests.clitools import invoke, write

    path = write(tmp_path / "m.safetensors", {"w": torch.ones(2)}, eps="1e-05", note="hi")
    result = invoke("inspect", path)
    assert result.exit_code == 0
    assert _blank_runs(result.stdout) == []
    assert result.stdout.endswith("\n") and not result.stdout.endswith("\n\n")
    assert result.stdout.rstrip("\n").split("\n")[-4:] == [
        "metadata",
        "",
        "  eps    1e-05",
        "  note   hi",
    ]


# -- the reports: exact comparisons say so, not "rtol 0, atol 0" --------------------------------


def test_exact_comparisons_say_they_were_exact(tmp_path) -> None:
    from tests.clitools import invoke, write

    tensors = {
        "mask": torch.tensor([[True, False], [True, True]]),
        "ids": torch.arange(6).reshape(2, 3),
        "z": torch.ones(3, dtype=torch.complex64),
    }
    path = write(tmp_path / "t.safetensors", tensors)
    result = invoke("diff", path, path)
    assert result.exit_code == 0
    rows = [line.split(None, 1) for line in result.stdout.splitlines() if "compared" in line]
    assert rows == [  # in the file's order
        ["compared", "exactly (integers: no tolerance applies)"],
        ["compared", "bit for bit, as stored (complex64 has no float64 form)"],
        ["compared", "exactly (bool: no tolerance applies)"],
        ["PASS:", "ids, z, mask equal (compared exactly)"],
    ]
    assert "rtol" not in result.stdout and "tolerance" not in result.stdout.replace(
        "no tolerance applies", ""
    )


def test_integers_with_a_tolerance_and_mixed_files_keep_the_tolerance(tmp_path) -> None:
    from tests.clitools import invoke, write

    path = write(tmp_path / "t.safetensors", {"ids": torch.arange(4), "x": torch.ones(4)})
    result = invoke("diff", path, path, "--atol", "1")
    assert result.exit_code == 0
    assert "  tolerance     rtol 0, atol 1, exactly" in result.stdout
    assert "  tolerance     rtol 1.3e-06, atol 1\n" in result.stdout
    assert result.stdout.rstrip().endswith("PASS: ids, x within tolerance")


def test_worst_rows_of_an_exact_comparison_have_no_tolerance_column(tmp_path) -> None:
    from tests.clitools import invoke, write

    actual = write(tmp_path / "a.safetensors", {"ids": torch.tensor([[1, 2], [3, 4]])})
    expected = write(tmp_path / "e.safetensors", {"ids": torch.tensor([[1, 2], [3, 5]])})
    result = invoke("diff", actual, expected)
    assert result.exit_code == 1
    table = result.stdout.split("worst rows of ids")[1].splitlines()
    assert table[2].split() == ["row", "channel", "actual", "expected", "abs", "diff"]
    assert table[4].split() == ["[1]", "1", "4", "5", "1", "max", "abs", "diff"]


# -- --valid FILE[:KEY] with a ':' in the path ----------------------------------------------


@pytest.fixture
def masked_pair(tmp_path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Two equal outputs of shape [2, 3, 4] and, in a folder named ``d:x``, their mask (and a
    copy in a file named ``a:b.safetensors``); relative paths, as a user types them."""
    from tests.clitools import write

    monkeypatch.chdir(tmp_path)
    out = {"out": torch.ones(2, 3, 4)}
    mask = {"valid": torch.tensor([[True, True, False], [True, False, False]])}
    (tmp_path / "d:x").mkdir()
    write(tmp_path / "d:x" / "m.safetensors", mask)
    write(tmp_path / "a:b.safetensors", mask)
    write(tmp_path / "a.safetensors", out)
    write(tmp_path / "e.safetensors", out)
    return "a.safetensors", "e.safetensors"


@pytest.mark.parametrize("spec", ["a:b.safetensors", "a:b.safetensors:valid", "d:x/m.safetensors"])
def test_valid_paths_holding_a_colon_are_read(masked_pair: tuple[str, str], spec: str) -> None:
    from tests.clitools import invoke

    result = invoke("diff", *masked_pair, "--valid", spec)
    assert result.exit_code == 0, result.stderr
    assert "compared 3 of 6 rows of out" in result.stdout


@pytest.mark.parametrize(
    ("spec", "part", "key"),
    [
        ("d:x/missing.safetensors", "d", "x/missing.safetensors"),
        ("nothing.safetensors:valid", "nothing.safetensors", "valid"),
    ],
)
def test_a_missing_valid_file_is_named_as_given(
    masked_pair: tuple[str, str], spec: str, part: str, key: str
) -> None:
    from tests.clitools import assert_one_line_error, invoke

    result = invoke("diff", *masked_pair, "--valid", spec)
    assert result.exit_code == 2
    assert_one_line_error(
        result.stderr, f"--valid: no such file: '{spec}' (nor '{part}', reading '{key}' as the KEY)"
    )
