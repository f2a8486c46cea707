"""``maskln generate``: a random input file, the same bytes for the same arguments."""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated

import typer

from maskln_cli.cli.failures import reports_errors
from maskln_cli.cli.options import Fsync, NormChoice, Quiet
from maskln_cli.errors import MasklnError
from maskln_cli.version import installed_version


class ValidDtype(str, Enum):
    bool = "bool"
    int64 = "int64"
    uint8 = "uint8"


class GenerateDtype(str, Enum):
    float32 = "float32"
    float64 = "float64"
    float16 = "float16"
    bfloat16 = "bfloat16"


@reports_errors
def generate(
    output: Annotated[
        str, typer.Argument(metavar="OUTPUT", help="File to write; '-' writes stdout.")
    ],
    shape: Annotated[
        str,
        typer.Option(
            "--shape", metavar="SIZES", help="Shape of x, comma-separated; the last axis is C."
        ),
    ],
    dtype: Annotated[
        GenerateDtype,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="dtype of x, scale, bias: float32, float64, float16 or bfloat16."
            " [default: float32]",
            show_default=False,
        ),
    ] = GenerateDtype.float32,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Random seed.")] = 0,
    invalid: Annotated[
        float,
        typer.Option(
            "--invalid",
            min=0.0,
            max=1.0,
            metavar="FRACTION",
            help="Fraction of positions that are padding, from 0 to 1 (trailing, along the last"
            " leading axis).",
        ),
    ] = 0.25,
    poison: Annotated[
        bool, typer.Option("--poison", help="Fill padded x with NaN, +inf and -inf.")
    ] = False,
    grad: Annotated[
        bool, typer.Option("--grad", help="Add an upstream gradient 'grad_out'.")
    ] = False,
    norm: Annotated[
        NormChoice,
        typer.Option(
            "--norm",
            metavar="NORM",
            help="The norm the file is for, stored in the metadata: layer or rms (RMSNorm: no"
            " bias). [default: layer]",
            show_default=False,
        ),
    ] = NormChoice.layer,
    eps: Annotated[
        float | None,
        typer.Option(
            "--eps",
            metavar="EPS",
            help="eps stored in the metadata. (default: 1e-05 for layer, 1e-06 for rms)",
            show_default=False,
        ),
    ] = None,
    gain_offset: Annotated[
        float | None,
        typer.Option(
            "--gain-offset",
            metavar="OFFSET",
            help="RMSNorm's gain offset stored in the metadata (Gemma's: 1).",
            show_default=False,
        ),
    ] = None,
    offset: Annotated[
        float,
        typer.Option(
            "--offset", metavar="MEAN", help="Mean of x: a large common offset tests numerics."
        ),
    ] = 0.0,
    std: Annotated[
        float, typer.Option("--std", metavar="STD", help="Standard deviation of x.")
    ] = 1.0,
    valid_dtype: Annotated[
        ValidDtype,
        typer.Option(
            "--valid-dtype",
            metavar="DTYPE",
            help="dtype of the mask: bool, int64 or uint8 (integers hold 0 and 1).",
        ),
    ] = ValidDtype.bool,
    fsync: Fsync = False,
    quiet: Quiet = False,
) -> None:
    """Write a random input file: x, valid, scale, bias (and grad_out with --grad).

    With --norm rms, an RMSNorm file: no bias, and metadata 'norm' saying rms. The same
    arguments always give the same file, byte for byte. On a terminal a progress bar
    shows the way for a big shape.

    **Examples**

    ```
    maskln generate batch.safetensors --shape 8,512,256 --poison --grad
    maskln generate offset.safetensors --shape 4,128,768 --offset 1e4 --std 0.1
    maskln generate masks.safetensors --shape 2,64,32 --valid-dtype int64
    maskln generate - --shape 2,64,32 | maskln normalize - out.safetensors
    maskln generate rms.safetensors --shape 4,128,4096 --norm rms --grad
    ```
    """
    from maskln_cli.cli.report import messages
    from maskln_cli.cli.report.progress import progress_bar
    from maskln_cli.files.output import write_tensors
    from maskln_cli.files.problem import check_eps
    from maskln_cli.files.tensorfile import torch_dtype
    from maskln_cli.jobs.generate import generate_inputs, parse_shape
    from maskln_cli.op.norms import NORMS

    parsed = parse_shape(shape)
    chosen = NORMS[norm.value]
    if gain_offset is not None and chosen.centered:
        raise MasklnError(f"--gain-offset {gain_offset!r}: only RMSNorm has one; give --norm rms")
    if gain_offset is not None and not math.isfinite(gain_offset):
        raise MasklnError(f"--gain-offset: must be a finite number, got {gain_offset}")
    eps = chosen.default_eps if eps is None else eps
    # A LayerNorm file names no norm (layer is every reader's default): the same bytes as
    # before --norm existed, sample_data's included.
    metadata = {
        **({} if chosen.centered else {"norm": chosen.name}),
        **({} if gain_offset is None else {"offset": repr(gain_offset)}),
        "eps": repr(check_eps(eps, "--eps", torch_dtype(dtype.value))),
        "maskln_version": installed_version(),
    }
    with progress_bar(f"generate {output}", enabled=not quiet) as progress:
        # Two phases on one bar: sampling x (and grad_out), then writing the file.
        sampled = 0

        def sampling(done: int, total: int) -> None:
            nonlocal sampled
            sampled = total
            progress(done, 2 * total)

        tensors = generate_inputs(
            parsed,
            dtype.value,
            seed,
            invalid=invalid,
            poison=poison,
            grad=grad,
            offset=offset,
            std=std,
            valid_dtype=valid_dtype.value,
            progress=sampling,
            norm=chosen.name,
        )
        write_tensors(
            output,
            tensors,
            metadata,
            lambda done, total: progress(sampled + done, sampled + total),
            fsync,
        )
    if not quiet and output != "-":
        valid = tensors["valid"]
        messages.note(
            f"wrote {output}: {', '.join(tensors)}; x {list(tensors['x'].shape)} {dtype.value},"
            f" {int(valid.sum()):,} of {valid.numel():,} positions valid"
        )
