"""Every Python and console example of the README, CONTRIBUTING.md and docs/ runs, and prints
what the page shows (see runner.py; ``make docs-examples`` regenerates the shown output)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import EXECUTED, ROOT, blocks_of, pages, run_page

RUN = [page for page in pages() if any(b.lang in EXECUTED for b in blocks_of(page.read_text()))]


@pytest.mark.parametrize("page", RUN, ids=[str(p.relative_to(ROOT)) for p in RUN])
def test_the_examples_of_the_page_run_and_print_what_it_shows(page: Path, tmp_path: Path):
    assert run_page(page, tmp_path) > 0
