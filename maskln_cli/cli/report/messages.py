"""One-line messages on stderr: errors, notes, and what ``maskln normalize`` wrote."""

from __future__ import annotations

from typing import TYPE_CHECKING

from maskln_cli.cli.report import consoles
from maskln_cli.cli.report.text import safe

if TYPE_CHECKING:
    from maskln_cli.jobs.normalize import NormalizeResult


def error(message: str) -> None:
    """One line on stderr: ``maskln: error: <message>``."""
    consoles.stderr_console().print(f"[bold red]maskln: error:[/] {safe(message)}", soft_wrap=True)


def note(message: str) -> None:
    """One informational line on stderr."""
    consoles.stderr_console().print(f"[dim]maskln:[/] {safe(message)}", soft_wrap=True)


def render_normalize_result(result: NormalizeResult) -> None:
    """One line on stderr saying what was written."""
    keys = ", ".join(result.keys)
    rms = "" if result.norm == "layer" else "RMSNorm "  # LayerNorm's line as it always was
    note(
        f"wrote {result.output}: {rms}{keys} {list(result.shape)} {result.dtype}, "
        f"{result.valid_rows:,} of {result.rows:,} positions valid, eps {result.eps!r}"
        f" ({result.eps_source})"
    )
