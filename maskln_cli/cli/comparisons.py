"""``maskln verify`` and ``maskln diff``: a kernel's result judged against maskln's, and two
files compared key by key; both end in the same report, or the same JSON."""

from __future__ import annotations

import os
import sys
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from maskln_cli.cli.failures import (
    EXIT_ERROR,
    EXIT_MISMATCH,
    end_with_report,
    reports_errors,
)
from maskln_cli.cli.options import (
    Atol,
    BiasKey,
    ChunkRows,
    ComputeDtype,
    Config,
    Eps,
    GradOutFile,
    GradOutKey,
    JsonOutput,
    Module,
    NormChoice,
    NormName,
    Offset,
    Params,
    QuietReport,
    Rtol,
    ScaleKey,
    ValidKey,
    ValidRows,
    XKey,
    key_option,
    normalize_options,
    tolerance_option,
)
from maskln_cli.errors import MasklnError

if TYPE_CHECKING:
    from maskln_cli.compare.data import ComparisonReport
    from maskln_cli.verify.folder import FolderReport


class JudgeDtype(str, Enum):
    auto = "auto"
    float64 = "float64"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class ToleranceMode(str, Enum):
    budget = "budget"
    fixed = "fixed"


@reports_errors(writes=False)
def verify(
    input_path: Annotated[
        str, typer.Argument(metavar="INPUT", help="The input file; '-' reads stdin.")
    ],
    result_path: Annotated[
        str | None,
        typer.Argument(
            metavar="RESULT",
            help="The kernel's result to judge; '-' reads stdin. With a folder of dumps as"
            " INPUT: a folder of results, paired by file name (left out: each dump's own out"
            " and gradients are judged).",
            show_default=False,
        ),
    ] = None,
    x_key: XKey = "x",
    valid_key: ValidKey = None,
    scale_key: ScaleKey = None,
    bias_key: BiasKey = None,
    grad_out_key: GradOutKey = None,
    out_key: Annotated[
        str,
        key_option(
            "--out-key", "RESULT's key of out (as --result-key out=KEY).", show_default=True
        ),
    ] = "out",
    result_keys: Annotated[
        list[str] | None,
        key_option(
            "--result-key",
            "RESULT's KEY holds NAME (out, grad_x, grad_scale or grad_bias), e.g. grad_x=dx."
            " Repeatable.",
            metavar="NAME=KEY",
        ),
    ] = None,
    check: Annotated[
        list[str] | None,
        typer.Option(
            "--check",
            metavar="NAMES",
            help="Check only these, e.g. out,grad_x. (default: out, and grad_x, grad_scale and"
            " grad_bias when INPUT holds grad_out)",
            show_default=False,
        ),
    ] = None,
    params: Params = None,
    module: Module = None,
    grad_out: GradOutFile = None,
    eps: Eps = None,
    config: Config = None,
    norm: NormName = None,
    offset: Offset = None,
    dtype: Annotated[
        JudgeDtype,
        tolerance_option(
            "--dtype",
            "DTYPE",
            "The dtype the kernel computed in, whose error budget applies: auto (RESULT's"
            " dtype), float64, float32, float16 or bfloat16.",
        ),
    ] = JudgeDtype.auto,
    tolerance: Annotated[
        ToleranceMode | None,
        tolerance_option(
            "--tolerance",
            "MODE",
            "budget: within --factor times the rounding of a correct kernel in its dtype,"
            " calibrated against PyTorch's F.layer_norm; fixed: within --rtol and --atol."
            " (default: budget, fixed when --rtol or --atol is given)",
        ),
    ] = None,
    factor: Annotated[
        float | None,
        tolerance_option(
            "--factor", "F", "How many times the modelled rounding a kernel may err. (default: 3)"
        ),
    ] = None,
    rtol: Rtol = None,
    atol: Atol = None,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Also fail -0.0 in the padding, and any key of RESULT that was not compared.",
            rich_help_panel="Tolerance",
        ),
    ] = False,
    allow_systematic: Annotated[
        bool,
        typer.Option(
            "--allow-systematic",
            help="Report a systematic error of out (every valid row scaled or shifted alike,"
            " beyond what rounding does) without failing on it.",
            rich_help_panel="Tolerance",
        ),
    ] = False,
    plain_layer_norm: Annotated[
        bool,
        typer.Option(
            "--plain-layer-norm",
            help="RESULT is a plain LayerNorm's output (a model's own nn.LayerNorm): its padding"
            " is not zeroed. Every row is normalized, as it does; only the valid rows are"
            " compared.",
        ),
    ] = False,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            metavar="K/N",
            help="With a folder: judge only the K-th (1 to N) of N slices of its sorted file"
            " names; the slices' --json lines concatenate into the whole report.",
            show_default=False,
        ),
    ] = None,
    chunk_rows: ChunkRows = None,
    valid_rows: ValidRows = None,
    json_output: JsonOutput = False,
    quiet: QuietReport = False,
) -> None:
    """Judge RESULT, a kernel's output, against maskln's float64 result for INPUT.

    RESULT's out (and grad_x, grad_scale and grad_bias when INPUT holds grad_out) must each be
    as close to the float64 truth as a correct kernel in RESULT's dtype can be: within --factor
    times a model of that dtype's rounding, checked against PyTorch's own F.layer_norm
    (F.rms_norm with --norm rms) on the same data; out must show no systematic error (every
    valid row scaled or shifted alike). A tensor of RESULT that is missing fails; out and grad_x
    must be exactly 0 at every invalid position. A failing tensor is described and diagnosed.
    Exit code 0 when all pass, 1 on any failure, 2 on an error.

    INPUT may be a folder of dumps (a safetensors file per LayerNorm call: x, valid, scale,
    bias, out, optionally grad_out and the gradients; eps in its metadata): each file is judged
    (its own out, or RESULT's file of the same name), a row each in one table, then the failing
    files' reports; --json prints a JSON line per file.

    **Examples**

    ```
    maskln verify inputs.safetensors kernel_out.safetensors
    maskln verify in.safetensors kernel.safetensors --result-key grad_x=dx \\
        --check out,grad_x
    maskln verify in.safetensors kernel.safetensors --rtol 1e-4 --atol 1e-5
    maskln verify in.safetensors kernel.safetensors --json | jq .passed
    maskln verify acts.safetensors layer_dump.safetensors --params checkpoint/ \\
        --module encoder.layer.0.output.LayerNorm --config checkpoint/ \\
        --valid-key attention_mask --plain-layer-norm
    maskln verify dumps/
    maskln verify dumps/ kernel_results/ --json --shard 3/8
    ```
    """
    # OpenMP threads that finish a parallel region sleep at once rather than spin (set before
    # torch loads libgomp; a user's choice stands): verify's work runs on its own worker
    # threads, and spinning threads took the cores from them and from the main thread's
    # merges. On a busy 2-core machine a 128 MiB verify took 21-22 s spinning, 13.5-15.6 s not.
    if "torch" not in sys.modules:  # else libgomp has read it (a test calling the command)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from maskln_cli.cli.report.progress import progress_bar
    from maskln_cli.files.slices import parse_shard
    from maskln_cli.verify.folder import is_folder_verify
    from maskln_cli.verify.job import VerifyOptions, parse_check, parse_result_keys, verify_file

    folder = is_folder_verify(input_path, result_path)
    if shard is not None and not folder:
        raise MasklnError(f"--shard {shard}: only with a folder of dumps as INPUT")
    slice_of = parse_shard(shard) if shard is not None else None
    options = normalize_options({**locals(), "dtype": ComputeDtype.auto})
    judged = VerifyOptions(
        check=parse_check(check) if check else None,
        result_keys=parse_result_keys(result_keys or ()),
        tolerance=tolerance.value if tolerance is not None else None,
        factor=factor,
        rtol=rtol,
        atol=atol,
        strict=strict,
        dtype=dtype.value,
        valid=valid_rows,
        plain_layer_norm=plain_layer_norm,
        allow_systematic=allow_systematic,
    )
    if folder:
        from maskln_cli.verify.folder import verify_folder

        with progress_bar(f"verify {input_path}") as progress:
            report = verify_folder(input_path, result_path, options, judged, slice_of, progress)
        _finish_folder(report, json_output, quiet)
        return
    assert result_path is not None
    with progress_bar(f"verify {input_path}") as progress:
        result = verify_file(input_path, result_path, options, judged, progress)
    _finish_comparison(result, json_output, quiet)


@reports_errors(writes=False)
def diff(
    actual_path: Annotated[
        str, typer.Argument(metavar="ACTUAL", help="A safetensors file; '-' reads stdin.")
    ],
    expected_path: Annotated[
        str, typer.Argument(metavar="EXPECTED", help="A safetensors file; '-' reads stdin.")
    ],
    keys: Annotated[
        list[str] | None,
        typer.Option(
            "--key",
            "-k",
            metavar="KEY",
            help="Compare only this key (repeatable).",
            show_default=False,
        ),
    ] = None,
    rtol: Rtol = None,
    atol: Atol = None,
    valid_rows: ValidRows = None,
    norm: Annotated[
        NormChoice | None,
        typer.Option(
            "--norm",
            metavar="NORM",
            help="Refuse a file whose metadata 'norm' names another norm than this (layer or"
            " rms). (default: files naming different norms are compared, with a note)",
            show_default=False,
        ),
    ] = None,
    json_output: JsonOutput = False,
    quiet: QuietReport = False,
) -> None:
    """Compare the tensors of two safetensors files, key by key.

    A key in only one file, or a shape or dtype difference, is a mismatch. An element passes when
    |actual - expected| <= atol + rtol * |expected|; NaN matches only NaN, inf only the same inf.
    Exit code 0 when everything matches, 1 on any mismatch, 2 on an error.

    **Examples**

    ```
    maskln diff kernel_out.safetensors reference.safetensors
    maskln normalize - - < in.safetensors | maskln diff - ref.safetensors -k out
    maskln diff a.safetensors b.safetensors --json --rtol 1e-3
    maskln diff out.safetensors model_layer.safetensors \\
        --valid acts.safetensors:attention_mask
    ```
    """
    from maskln_cli.compare.files import diff_files

    chosen = norm.value if norm is not None else None
    result = diff_files(actual_path, expected_path, keys or (), rtol, atol, valid_rows, chosen)
    _finish_comparison(result, json_output, quiet)


def _finish_folder(report: FolderReport, json_output: bool, quiet: bool) -> None:
    from maskln_cli.cli.report.folder import print_json_lines, render_folder

    # A file that could not be judged is an error of its input: exit 2, as for one file.
    end_with_report(
        EXIT_ERROR if report.errors else 0 if report.passed else EXIT_MISMATCH,
        json_output,
        lambda: print_json_lines(report),
        lambda: render_folder(report, quiet=quiet),
    )


def _finish_comparison(result: ComparisonReport, json_output: bool, quiet: bool) -> None:
    from maskln_cli.cli.report.comparison import render_comparison
    from maskln_cli.cli.report.json_output import print_json

    end_with_report(
        0 if result.passed else EXIT_MISMATCH,
        json_output,
        lambda: print_json(result.to_dict()),
        lambda: render_comparison(result, quiet=quiet),
    )
