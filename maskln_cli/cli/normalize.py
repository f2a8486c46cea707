"""``maskln normalize``: the reference result for input files, written to output files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from maskln_cli.cli.failures import reports_errors
from maskln_cli.cli.options import (
    BiasKey,
    ChunkRows,
    ComputeDtype,
    Config,
    Eps,
    Fsync,
    GradOutFile,
    GradOutKey,
    Module,
    NormName,
    Offset,
    Params,
    Quiet,
    ScaleKey,
    ValidKey,
    XKey,
    key_option,
    normalize_options,
)
from maskln_cli.errors import MasklnError

OutKey = Annotated[str, key_option("--out-key", "Key of the result.", show_default=True)]
Dtype = Annotated[
    ComputeDtype,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="Compute and output dtype: auto (x's), float32 or float64. [default: auto]",
        show_default=False,
    ),
]


@reports_errors
def normalize(
    paths: Annotated[
        list[str],
        typer.Argument(
            metavar="INPUT OUTPUT | INPUT... --out-dir DIR",
            help="Input and output safetensors files; '-' is stdin or stdout.",
            show_default=False,
        ),
    ],
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out-dir",
            "-o",
            metavar="DIR",
            help="Normalize every INPUT into DIR/NAME, NAME being the input's file name,"
            " in one process.",
            file_okay=False,
        ),
    ] = None,
    x_key: XKey = "x",
    valid_key: ValidKey = None,
    scale_key: ScaleKey = None,
    bias_key: BiasKey = None,
    grad_out_key: GradOutKey = None,
    out_key: OutKey = "out",
    params: Params = None,
    module: Module = None,
    grad_out: GradOutFile = None,
    eps: Eps = None,
    config: Config = None,
    norm: NormName = None,
    offset: Offset = None,
    dtype: Dtype = ComputeDtype.auto,
    chunk_rows: ChunkRows = None,
    fsync: Fsync = False,
    quiet: Quiet = False,
) -> None:
    """Normalize x from INPUT and write the result to OUTPUT under 'out'.

    When the input holds an upstream gradient 'grad_out', OUTPUT also holds grad_x, grad_scale
    and grad_bias: the gradients of sum(out * grad_out), to check a kernel's backward pass.
    With --norm rms, RMSNorm: x / sqrt(mean(x**2) + eps) * (offset + scale), no bias, no
    grad_bias.

    **Examples**

    ```
    maskln normalize sample_data/pair_features.safetensors out.safetensors
    maskln normalize - - < in.safetensors | maskln diff - expected.safetensors
    maskln normalize acts.safetensors out.safetensors --params checkpoint/ \\
        --module encoder.layer.0.output.LayerNorm --config checkpoint/
    maskln normalize acts.safetensors out.safetensors --params llama/ \\
        --module model.layers.0.input_layernorm --config llama/
    maskln normalize dumps/*.safetensors --out-dir normalized/
    ```
    """
    from maskln_cli.cli.report import messages
    from maskln_cli.cli.report.progress import progress_bar
    from maskln_cli.jobs.normalize import normalize_file

    options = normalize_options(locals())
    jobs = _normalize_jobs(paths, out_dir)
    failures = 0
    for input_path, output_path in jobs:
        try:
            with progress_bar(f"normalize {input_path}", enabled=not quiet) as progress:
                result = normalize_file(input_path, output_path, options, progress, fsync)
        except MasklnError as failure:
            if len(jobs) == 1:
                raise
            messages.error(str(failure))
            failures += 1
            continue
        if not quiet:
            for message in result.notes:
                messages.note(message)
            messages.render_normalize_result(result)
    if failures:
        raise MasklnError(
            f"{failures} of {len(jobs)} inputs failed; their outputs were not written"
        )


def _normalize_jobs(paths: list[str], out_dir: Path | None) -> list[tuple[str, str]]:
    """(input, output) pairs from the command line, checked before any work."""
    if out_dir is None:
        if len(paths) != 2:
            got = f"{len(paths)} path" + ("" if len(paths) == 1 else "s")
            raise MasklnError(
                f"normalize takes INPUT OUTPUT (got {got}); for many inputs use --out-dir DIR"
            )
        return [(paths[0], paths[1])]
    if not out_dir.is_dir():
        try:
            out_dir.mkdir()  # one level, as mkdir does: a typo in a parent is still an error
        except OSError as error:
            raise MasklnError(f"--out-dir: cannot create {out_dir}: {error.strerror}") from None
    if "-" in paths:
        raise MasklnError("--out-dir: inputs must be files, not '-' (stdin has no name)")
    names: dict[str, str] = {}
    for path in paths:
        name = Path(path).name
        if name in names:
            raise MasklnError(f"--out-dir: {names[name]} and {path} would both write {name}")
        names[name] = path
    return [(path, str(out_dir / Path(path).name)) for path in paths]
