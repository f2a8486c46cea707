"""Every Python and console example of the README, CONTRIBUTING.md and docs/ runs, and prints
what the page shows (see runner.py; ``make docs-examples`` regenerates the shown output).

The pages show what a process with the runner's ``NUMERIC_ENV`` prints, the same bits on every
x86-64 CPU. pytest's workers run without it (the rest of the suite tests torch as users run
it), so a worker runs its pages in a process of its own that has it (``runner --serve``, one
per worker), unless the worker has it already."""

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
# guide grades seven times, 35 s of one worker's time on two quiet cores, a fifth of `make test`.
SLOW_PAGES = {"docs/guides/grading.md"}


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
        ("a figure's last digit", lambda text: re.sub(LAST_DIGIT, _digit, text, count=1)),
        ("a verdict", lambda text: text.replace("PASS out", "FAIL out", 1)),
        ("a count", lambda text: text.replace("0 of ", "1 of ", 1)),
    ],
)
def test_a_real_change_of_the_output_fails(tmp_path, run_pinned, what, change):
    """The pages are compared exactly: NUMERIC_ENV, not a tolerance, keeps them the same on every
    machine, so a figure's last digit that changes is a change."""
    page = _verify_example(tmp_path)
    text = page.read_text()
    page.write_text(change(text))
    assert page.read_text() != text, what
    answer = run_pinned(page, tmp_path / "run")
    assert "failed" in answer and "the page shows" in answer["failed"], answer


LAST_DIGIT = r"(worst element +\d\.\d*)(\d)"


def _digit(match: re.Match[str]) -> str:
    return match[1] + str((int(match[2]) + 1) % 10)
