"""``maskln inspect``: each tensor of a file or checkpoint, and its metadata."""

from __future__ import annotations

from typing import Annotated

import typer

from maskln_cli.cli.failures import end_with_report, reports_errors
from maskln_cli.cli.options import NormChoice


@reports_errors(writes=False)
def inspect(
    path: Annotated[
        str,
        typer.Argument(
            metavar="FILE",
            help="A safetensors file ('-' reads stdin), or a checkpoint: a folder holding"
            " model.safetensors or model.safetensors.index.json, or the index itself.",
        ),
    ],
    keys_only: Annotated[
        bool,
        typer.Option(
            "--keys", help="Only names, dtypes, shapes and sizes, from the header: instant."
        ),
    ] = False,
    patterns: Annotated[
        list[str] | None,
        typer.Option(
            "--match",
            "-m",
            metavar="GLOB",
            help="Only keys matching this glob, case-insensitively (repeatable).",
            show_default=False,
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")
    ] = False,
    norm: Annotated[
        NormChoice | None,
        typer.Option(
            "--norm",
            metavar="NORM",
            help="The norm FILE is for: layer or rms (its eps is then looked up for it)."
            " (default: a checkpoint's config.json's, rms when it holds rms_norm_eps; else the"
            " metadata 'norm')",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Show each tensor of FILE (dtype, shape, size, statistics) and its metadata.

    Statistics are over finite values; NaN and inf are counted apart; masks (bool, or integers
    holding only 0 and 1) show their count of true. The file is read a chunk at a time, so
    large files do not need memory to match; on a terminal a progress bar shows the way. The
    norm (LayerNorm or RMSNorm, and its eps) is said when --norm, a checkpoint's config.json or
    the metadata 'norm' gives it.

    **Examples**

    ```
    maskln inspect sample_data/pair_features.safetensors
    maskln inspect --keys checkpoint/ --match '*LayerNorm*'
    maskln inspect --json dump.safetensors | jq '.tensors[] | {name, nan}'
    ```
    """
    from maskln_cli.cli.report.inspect import render_file_summary
    from maskln_cli.cli.report.json_output import print_json
    from maskln_cli.cli.report.progress import progress_bar
    from maskln_cli.jobs.inspect import summarize_file

    with progress_bar(f"inspect {path}", enabled=not keys_only) as progress:
        chosen = norm.value if norm is not None else None
        summary = summarize_file(path, patterns or (), progress, keys_only, chosen)
    end_with_report(
        0, json_output, lambda: print_json(summary.to_dict()), lambda: render_file_summary(summary)
    )
