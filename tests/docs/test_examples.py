"""Every Python and console example of the README, CONTRIBUTING.md and docs/ runs, and prints
what the page shows (see runner.py; ``make docs-examples`` regenerates the shown output).

The pages show what a process with the runner's ``NUMERIC_ENV`` prints, the same bits on most
x86-64 CPUs, and figures are compared to what varies by machine (figures.py). pytest's workers
run without it (the rest of the suite tests torch as users run it), so a worker runs its pages
in a process of its own that has it (``runner --serve``, one per worker), unless the worker has
it already."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.docs.runner import EXECUTED, ROOT, blocks_of, pages, pinned, pinned_environment, run_page

RUN = [page for page in pages() if any(b.lang in EXECUTED for b in blocks_of(page.read_text()))]

# Pages whose examples take long enough to be `make test-slow`'s (CI runs both): the grading
# guide grades seven times, 35 s of one worker's time on two quiet cores, a fifth of `make test`;
# the models guide builds, captures and swaps transformers models, 23 s of CPU (measured loaded,
# the longest test of `make test`, whose newcomer's run, native build included, was over 4 min).
SLOW_PAGES = {"docs/guides/grading.md", "docs/guides/models.md"}


def _page_param(page: Path) -> object:
    name = str(page.relative_to(ROOT))
    return pytest.param(page, id=name, marks=[pytest.mark.slow] if name in SLOW_PAGES else [])


@pytest.fixture(scope="session")
def run_pinned() -> Iterator[Callable[[Path, Path], dict[str, object]]]:
    """A page run in a process with NUMERIC_ENV: its answer, ``{"blocks": N}`` or
    ``{"failed": why}``."""
    if pinned():
        yield lambda page, folder: {"blocks": run_page(page, folder)}
        return
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.docs.runner", "--serve"],
            cwd=ROOT,
            env=pinned_environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert server.stdin is not None and server.stdout is not None

        def run(page: Path, folder: Path) -> dict[str, object]:
            server.stdin.write(f"{page}\n")
            server.stdin.flush()
            answer = server.stdout.readline()
            if not answer:
                log.seek(0)
                pytest.fail(f"the pages' process ended (exit code {server.wait()}):\n{log.read()}")
            return json.loads(answer)

        try:
            yield run
        finally:
            server.stdin.close()
            server.wait(timeout=60)


X86_64 = platform.machine().lower() in ("x86_64", "amd64")
pytestmark = pytest.mark.skipif(
    not X86_64,
    reason="the pages show what x86-64 CPUs print; other CPUs round differently in the last digits",
)


@pytest.mark.parametrize("page", [_page_param(page) for page in RUN])
def test_the_examples_of_the_page_run_and_print_what_it_shows(
    page: Path, tmp_path: Path, run_pinned: Callable[[Path, Path], dict[str, object]]
):
    answer = run_pinned(page, tmp_path)
    assert "failed" not in answer, answer["failed"]
    assert answer["blocks"] > 0


def _verify_example(tmp_path: Path) -> Path:
    """A page of one example, docs/commands/verify.md's first: a verify on sample_data."""
    verify_page = (ROOT / "docs/commands/verify.md").read_text()
    block = next(b for b in blocks_of(verify_page) if b.lang == "console")
    page = tmp_path / "page.md"
    page.write_text(f"```console\n{block.text}```\n")
    return page


def test_the_example_of_a_page_made_from_the_docs_passes(tmp_path, run_pinned):
    assert run_pinned(_verify_example(tmp_path), tmp_path / "run") == {"blocks": 1}


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("a verdict", lambda text: text.replace("PASS out", "FAIL out", 1)),
        ("a count", lambda text: text.replace("0 of ", "1 of ", 1)),
        ("a rounding figure, three times as large", lambda text: _scaled(text, "error", 3)),
        ("a rounding figure, a third", lambda text: _scaled(text, "worst element", 1 / 3)),
        (
            "a figure beyond its last digit",
            lambda text: text.replace("rtol 1.3e-06", "rtol 1.5e-06"),
        ),
        ("the reference's rows", lambda text: text.replace("3,529 valid", "3,528 valid", 1)),
    ],
)
def test_a_real_change_of_the_output_fails(tmp_path, run_pinned, what, change):
    """The pages' figures are not compared to their last digits, which vary by machine
    (figures.py), but a verdict, a count, or a figure beyond what varies is a change."""
    page = _verify_example(tmp_path)
    text = page.read_text()
    page.write_text(change(text))
    assert page.read_text() != text, what
    answer = run_pinned(page, tmp_path / "run")
    assert "failed" in answer and "the page shows" in answer["failed"], answer


@pytest.mark.parametrize(
    ("what", "change"),
    [
        ("a rounding figure's last digit", lambda text: _scaled(text, "worst element", 1.01)),
        ("a rounding figure a fifth smaller, elsewhere", lambda text: _moved(text, 0.8)),
    ],
)
def test_what_varies_by_machine_passes(tmp_path, run_pinned, what, change):
    """On an AVX2-only AMD EPYC a float32 kernel in torch ops printed its error 20% off the page
    made on an AVX-512 Xeon, at another position: not a change of the output."""
    page = _verify_example(tmp_path)
    text = page.read_text()
    page.write_text(change(text))
    assert page.read_text() != text, what
    assert run_pinned(page, tmp_path / "run") == {"blocks": 1}


def _scaled(text: str, label: str, factor: float) -> str:
    """The page with the first figure of the row ``label`` times ``factor`` (3 digits)."""
    row = re.compile(rf"(\n  {label} +(?:max abs )?)(\d\.?\d*(?:e-\d+)?)")
    return row.sub(lambda m: m[1] + f"{float(m[2]) * factor:.4g}", text, count=1)


def _moved(text: str, factor: float) -> str:
    """The error row's largest difference times ``factor``, at another position."""
    text = _scaled(text, "error", factor)
    return re.sub(r"(\n  error +max abs [^ ]+ at \[)\d+", r"\g<1>1", text, count=1)
