"""The documentation site builds with --strict, its CLI reference is what --help prints, the
README stays short, and every example a page shows is one the runner runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cogapp import Cog

from tests.docs.runner import EXECUTED, ROOT, blocks_of, pages

NOT_RUN = ("sh", "text")  # what a reader types that the tests cannot run (make test), and help text


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_site_builds_with_strict(tmp_path: Path):
    built = run(sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path))
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "reference" / "api" / "index.html").read_text().count("doc-heading") > 5
    assert "Usage: maskln verify" in (tmp_path / "reference" / "cli" / "index.html").read_text()


def test_the_cli_reference_is_what_help_prints(capsys: pytest.CaptureFixture[str]):
    status = Cog().main(["cog", "--check", "--diff", str(ROOT / "docs" / "reference" / "cli.md")])
    assert status == 0, capsys.readouterr().out + "\nregenerate it: make docs-examples"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_bytes()) <= 12_000


def test_every_block_is_run_or_is_not_a_command():
    for page in pages():
        for block in blocks_of(page.read_text()):
            where = f"{page.relative_to(ROOT)}:{block.start + 1}"
            assert block.lang in EXECUTED + NOT_RUN, f"{where}: a ```{block.lang} block"
            if block.lang in NOT_RUN:
                commands = [line for line in block.lines if line.lstrip().startswith("$ maskln")]
                assert not commands, f"{where}: a maskln command in a block that is not run"
