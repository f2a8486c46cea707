"""The ``maskln`` command line: a thin Typer layer over the library.

Each command parses its options, calls one library function and renders the result. torch is
imported only inside commands that compute, so ``maskln --help`` and ``--version`` are fast.
Exit codes: 0 success, 1 a comparison found a mismatch, 2 a usage, input or output error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import warnings
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from maskln_cli.errors import MasklnError
from maskln_cli.files.problem import NormalizeOptions
from maskln_cli.version import installed_version

if TYPE_CHECKING:
    from maskln_cli.compare.data import ComparisonReport

EXIT_MISMATCH = 1
EXIT_ERROR = 2


class _PlainArgument(TyperArgument):
    """An argument shown by its metavar alone: ``INPUT``, not ``{INPUT}`` and ``<str>``."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        return name if self.required else f"[{name}]"


class _PlainOption(TyperOption):
    """An option shown by its metavar (``FILE``, ``KEY``), a flag by its name alone: typer
    would add ``<bool>``, ``<str>``, ``<int range> [x>=1]`` and split long choice lists."""

    def display_type_rich(self, ctx: Any) -> str | None:
        if self.is_flag or self.count:
            return None
        return self.metavar or str(getattr(getattr(self, "type", None), "name", "value")).upper()

    def _get_number_range_help_str(self) -> str | None:
        return None  # each help text says its range in words


def _plain(params: list[Any]) -> list[Any]:
    for param in params:
        if type(param) is TyperArgument:
            param.__class__ = _PlainArgument
        elif type(param) is TyperOption:
            param.__class__ = _PlainOption
    return params


class PlainHelp(TyperCommand):
    """A command whose help shows metavars as written (see :class:`_PlainOption`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))


class OneLineErrors(TyperGroup):
    """Usage errors (a bad option value, a missing argument) as one line, like every error."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain(super().get_params(ctx))

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except typer.TyperException as failure:
            format_message = getattr(failure, "format_message", None)
            if format_message is None:
                raise
            # NoArgsIsHelpError has printed the help already; it needs no message.
            if type(failure).__name__ != "NoArgsIsHelpError":
                from maskln_cli.cli import report

                context = getattr(failure, "ctx", None)
                hint = f" (see '{context.command_path} --help')" if context else ""
                message = format_message().replace("Value error, ", "").rstrip(".")
                report.error(f"{message}{hint}")
            sys.exit(getattr(failure, "exit_code", EXIT_ERROR))
        except typer.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=OneLineErrors,
    name="maskln",
    help="Masked layer normalization over safetensors files: a reference result in one command.",
    epilog="Exit codes: 0 success, 1 mismatch (verify, diff) or failed clause (grade), 2 usage,"
    " input or output error,"
    " 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)


class ComputeDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    float64 = "float64"


class ValidDtype(str, Enum):
    bool = "bool"
    int64 = "int64"
    uint8 = "uint8"


class GenerateDtype(str, Enum):
    float32 = "float32"
    float64 = "float64"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so outputs are cleaned up as for Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


Command = TypeVar("Command", bound=Callable[..., Any])


def reports_errors(command: Command | None = None, *, writes: bool = True) -> Any:
    """Turn library errors into one line on stderr and exit code 2; Ctrl-C/SIGTERM into 130/143.

    ``writes``: the command writes an output file, which Ctrl-C discards (and says so).
    """
    if command is None:
        return functools.partial(reports_errors, writes=writes)
    discarded = "; the output being written was discarded" if writes else ""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from maskln_cli.cli import report

        try:
            with warnings.catch_warnings():
                # Library warnings are not for the command line's user: stderr carries one
                # line per error, and the conditions that warn are handled (or reported).
                warnings.simplefilter("ignore")
                return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):  # a command's own exit code
            raise
        except MasklnError as failure:
            message = str(failure)
        except KeyboardInterrupt:
            _report(report, f"interrupted{discarded}")
            raise typer.Exit(130) from None
        except Terminated:
            _report(report, f"terminated{discarded}")
            raise typer.Exit(143) from None
        except MemoryError:
            message = "out of memory; try a smaller --chunk-rows"
        except OSError as failure:  # files are wrapped by tensorfile: this is stdout or stderr
            message = f"cannot write output: {failure.strerror or failure}"
        except Exception as failure:  # a bug: still one line, and the way to see more
            if os.environ.get("MASKLN_DEBUG"):
                raise
            message = (
                f"internal error: {type(failure).__name__}: {failure} (please report it; set"
                " MASKLN_DEBUG=1 for a traceback)"
            )
        _report(report, message)
        _detach_broken_stdout()
        raise typer.Exit(EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


def _report(report: Any, message: str) -> None:
    with contextlib.suppress(OSError):  # stderr itself may be gone
        report.error(message)


def _detach_broken_stdout() -> None:
    """After a failed write to stdout, stop Python retrying the flush (and warning) at exit."""
    if sys.stdout is None:
        return
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"maskln {installed_version()}")
        from maskln_cli.op.backend import active_backend  # reads the kernel cache, not torch

        try:
            typer.echo(f"op backend: {active_backend()}")
        except MasklnError as error:
            typer.echo(f"op backend: unknown ({error})")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            help="Print the version and the op's backend (native or raw kernels), and exit.",
        ),
    ] = False,
) -> None:
    """Masked layer normalization over safetensors files: a reference result in one command.

    Valid rows of x [..., C] become (x - mean) / sqrt(var + eps) * scale + bias over the last
    axis; invalid rows become exactly 0, whatever they hold.
    """
    if hasattr(signal, "SIGTERM"):
        # ValueError: not the main thread (an embedding program); leave its handlers be.
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, _raise_terminated)


# Options shared by normalize and verify.
XKey = Annotated[
    str,
    typer.Option("--x-key", metavar="KEY", help="Key of x, [..., C].", rich_help_panel="Keys"),
]
ValidKey = Annotated[
    str | None,
    typer.Option(
        "--valid-key",
        metavar="KEY",
        help="Key of the mask [...]: bool, or 0/1 numbers."
        " (default: valid; when absent, all positions are valid)",
        show_default=False,
        rich_help_panel="Keys",
    ),
]
ScaleKey = Annotated[
    str | None,
    typer.Option(
        "--scale-key",
        metavar="KEY",
        help="Key of scale [C]. (default: scale; when absent, ones)",
        show_default=False,
        rich_help_panel="Keys",
    ),
]
BiasKey = Annotated[
    str | None,
    typer.Option(
        "--bias-key",
        metavar="KEY",
        help="Key of bias [C]. (default: bias; when absent, zeros)",
        show_default=False,
        rich_help_panel="Keys",
    ),
]
GradOutKey = Annotated[
    str | None,
    typer.Option(
        "--grad-out-key",
        metavar="KEY",
        help="Key of the upstream gradient [..., C]."
        " (default: grad_out; when absent, no gradients)",
        show_default=False,
        rich_help_panel="Keys",
    ),
]
OutKey = Annotated[
    str,
    typer.Option("--out-key", metavar="KEY", help="Key of the result.", rich_help_panel="Keys"),
]
Params = Annotated[
    str | None,
    typer.Option(
        "--params",
        metavar="FILE",
        help="Read scale and bias from this checkpoint: a safetensors file, a model folder (with"
        " model.safetensors or model.safetensors.index.json) or a shard index; name them with"
        " --module, or --scale-key and --bias-key.",
    ),
]
Module = Annotated[
    str | None,
    typer.Option(
        "--module",
        metavar="NAME",
        help="The layer norm whose scale and bias to use: NAME.weight and NAME.bias, or"
        " NAME.gamma and NAME.beta, whichever --params (else INPUT) holds.",
        show_default=False,
        rich_help_panel="Keys",
    ),
]
Config = Annotated[
    str | None,
    typer.Option(
        "--config",
        metavar="FILE",
        help="Read eps from a transformers config.json (layer_norm_eps, layer_norm_epsilon or"
        " norm_eps); a folder means FOLDER/config.json.",
        show_default=False,
    ),
]
GradOutFile = Annotated[
    str | None,
    typer.Option(
        "--grad-out", metavar="FILE", help="Read the upstream gradient from this file instead."
    ),
]
Eps = Annotated[
    float | None,
    typer.Option(
        "--eps",
        metavar="EPS",
        help="Added to the variance. (default: --config's, else the input's metadata 'eps' or"
        " 'layer_norm_eps', else 1e-05)",
        show_default=False,
    ),
]
Dtype = Annotated[
    ComputeDtype,
    typer.Option(
        "--dtype",
        metavar="DTYPE",
        help="Compute and output dtype: auto (x's), float32 or float64. [default: auto]",
        show_default=False,
    ),
]
ChunkRows = Annotated[
    int | None,
    typer.Option(
        "--chunk-rows",
        min=1,
        metavar="ROWS",
        help="Positions per chunk, at least 1 (bounds memory). (default: a few MiB of x)",
        show_default=False,
    ),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors on stderr.")]
Fsync = Annotated[
    bool,
    typer.Option(
        "--fsync",
        help="Flush OUTPUT to disk before it replaces an old one, so that it survives a power"
        " loss or an OS crash too (a killed process never leaves a partial OUTPUT either way).",
    ),
]


@app.command(cls=PlainHelp, no_args_is_help=True)
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
    dtype: Dtype = ComputeDtype.auto,
    chunk_rows: ChunkRows = None,
    fsync: Fsync = False,
    quiet: Quiet = False,
) -> None:
    """Normalize x from INPUT and write the result to OUTPUT under 'out'.

    When the input holds an upstream gradient 'grad_out', OUTPUT also holds grad_x, grad_scale
    and grad_bias: the gradients of sum(out * grad_out), to check a kernel's backward pass.

    **Examples**

    ```
    maskln normalize sample_data/pair_features.safetensors out.safetensors
    maskln normalize - - < in.safetensors | maskln diff - expected.safetensors
    maskln normalize acts.safetensors out.safetensors --params checkpoint/ \\
        --module encoder.layer.0.output.LayerNorm --config checkpoint/
    maskln normalize dumps/*.safetensors --out-dir normalized/
    ```
    """
    from maskln_cli.cli import report
    from maskln_cli.jobs.normalize import normalize_file

    options = _normalize_options(locals())
    jobs = _normalize_jobs(paths, out_dir)
    failures = 0
    for input_path, output_path in jobs:
        try:
            with report.progress_bar(f"normalize {input_path}", enabled=not quiet) as progress:
                result = normalize_file(input_path, output_path, options, progress, fsync)
        except MasklnError as failure:
            if len(jobs) == 1:
                raise
            report.error(str(failure))
            failures += 1
            continue
        if not quiet:
            for message in result.notes:
                report.note(message)
            report.render_normalize_result(result)
    if failures:
        raise MasklnError(
            f"{failures} of {len(jobs)} inputs failed; their outputs were not written"
        )


def _normalize_options(arguments: dict[str, Any]) -> NormalizeOptions:
    """NormalizeOptions from a command's arguments (normalize and verify share their names)."""
    values = {f.name: arguments[f.name] for f in dataclasses.fields(NormalizeOptions)}
    return NormalizeOptions(**dict(values, dtype=values["dtype"].value))


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


@app.command(cls=PlainHelp, no_args_is_help=True)
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
) -> None:
    """Show each tensor of FILE (dtype, shape, size, statistics) and its metadata.

    Statistics are over finite values; NaN and inf are counted apart; masks (bool, or integers
    holding only 0 and 1) show their count of true. The file is read a chunk at a time, so
    large files do not need memory to match; on a terminal a progress bar shows the way.

    **Examples**

    ```
    maskln inspect sample_data/pair_features.safetensors
    maskln inspect --keys checkpoint/ --match '*LayerNorm*'
    maskln inspect --json dump.safetensors | jq '.tensors[] | {name, nan}'
    ```
    """
    from maskln_cli.cli import report
    from maskln_cli.jobs.inspect import summarize_file

    with report.progress_bar(f"inspect {path}", enabled=not keys_only) as progress:
        summary = summarize_file(path, patterns or (), progress, keys_only)
    with _quiet_when_stdout_closes(0):
        if json_output:
            report.print_json(summary.to_dict())
        else:
            report.render_file_summary(summary)


@app.command(cls=PlainHelp, no_args_is_help=True)
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
    eps: Annotated[
        float, typer.Option("--eps", metavar="EPS", help="eps stored in the metadata.")
    ] = 1e-5,
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

    The same arguments always give the same file, byte for byte. On a terminal a progress bar
    shows the way for a big shape.

    **Examples**

    ```
    maskln generate batch.safetensors --shape 8,512,256 --poison --grad
    maskln generate offset.safetensors --shape 4,128,768 --offset 1e4 --std 0.1
    maskln generate masks.safetensors --shape 2,64,32 --valid-dtype int64
    maskln generate - --shape 2,64,32 | maskln normalize - out.safetensors
    ```
    """
    from maskln_cli.cli import report
    from maskln_cli.files.output import write_tensors
    from maskln_cli.files.problem import check_eps
    from maskln_cli.files.tensorfile import torch_dtype
    from maskln_cli.jobs.generate import generate_inputs, parse_shape

    parsed = parse_shape(shape)
    metadata = {
        "eps": repr(check_eps(eps, "--eps", torch_dtype(dtype.value))),
        "maskln_version": installed_version(),
    }
    with report.progress_bar(f"generate {output}", enabled=not quiet) as progress:
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
        report.note(
            f"wrote {output}: {', '.join(tensors)}; x {list(tensors['x'].shape)} {dtype.value},"
            f" {int(valid.sum()):,} of {valid.numel():,} positions valid"
        )


Rtol = Annotated[
    float | None,
    typer.Option(
        "--rtol",
        metavar="RTOL",
        help="Relative tolerance. (default: by dtype, as torch.testing.assert_close)",
        show_default=False,
        rich_help_panel="Tolerance",
    ),
]
Atol = Annotated[
    float | None,
    typer.Option(
        "--atol",
        metavar="ATOL",
        help="Absolute tolerance. (default: by dtype, as torch.testing.assert_close)",
        show_default=False,
        rich_help_panel="Tolerance",
    ),
]
JsonOutput = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of the report.")
]
QuietReport = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print only the PASS/FAIL verdict line.")
]
ValidRows = Annotated[
    str | None,
    typer.Option(
        "--valid",
        metavar="FILE[:KEY]",
        help="Compare only the rows this mask marks valid (KEY defaults to 'valid'; bool or"
        " 0/1), in tensors of shape [*mask, C]; say how many rows were left out.",
        show_default=False,
    ),
]


class JudgeDtype(str, Enum):
    auto = "auto"
    float64 = "float64"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class ToleranceMode(str, Enum):
    budget = "budget"
    fixed = "fixed"


@app.command(cls=PlainHelp, no_args_is_help=True)
@reports_errors(writes=False)
def verify(
    input_path: Annotated[
        str, typer.Argument(metavar="INPUT", help="The input file; '-' reads stdin.")
    ],
    result_path: Annotated[
        str,
        typer.Argument(metavar="RESULT", help="The kernel's result to judge; '-' reads stdin."),
    ],
    x_key: XKey = "x",
    valid_key: ValidKey = None,
    scale_key: ScaleKey = None,
    bias_key: BiasKey = None,
    grad_out_key: GradOutKey = None,
    out_key: Annotated[
        str,
        typer.Option(
            "--out-key",
            metavar="KEY",
            help="RESULT's key of out (as --result-key out=KEY).",
            rich_help_panel="Keys",
        ),
    ] = "out",
    result_keys: Annotated[
        list[str] | None,
        typer.Option(
            "--result-key",
            metavar="NAME=KEY",
            help="RESULT's KEY holds NAME (out, grad_x, grad_scale or grad_bias), e.g."
            " grad_x=dx. Repeatable.",
            show_default=False,
            rich_help_panel="Keys",
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
    dtype: Annotated[
        JudgeDtype,
        typer.Option(
            "--dtype",
            metavar="DTYPE",
            help="The dtype the kernel computed in, whose error budget applies: auto (RESULT's"
            " dtype), float64, float32, float16 or bfloat16.",
            show_default=False,
            rich_help_panel="Tolerance",
        ),
    ] = JudgeDtype.auto,
    tolerance: Annotated[
        ToleranceMode | None,
        typer.Option(
            "--tolerance",
            metavar="MODE",
            help="budget: within --factor times the rounding of a correct kernel in its dtype,"
            " calibrated against PyTorch's F.layer_norm; fixed: within --rtol and --atol."
            " (default: budget, fixed when --rtol or --atol is given)",
            show_default=False,
            rich_help_panel="Tolerance",
        ),
    ] = None,
    factor: Annotated[
        float | None,
        typer.Option(
            "--factor",
            metavar="F",
            help="How many times the modelled rounding a kernel may err. (default: 3)",
            show_default=False,
            rich_help_panel="Tolerance",
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
    chunk_rows: ChunkRows = None,
    valid_rows: ValidRows = None,
    json_output: JsonOutput = False,
    quiet: QuietReport = False,
) -> None:
    """Judge RESULT, a kernel's output, against maskln's float64 result for INPUT.

    RESULT's out (and grad_x, grad_scale and grad_bias when INPUT holds grad_out) must each be
    as close to the float64 truth as a correct kernel in RESULT's dtype can be: within --factor
    times a model of that dtype's rounding, checked against PyTorch's own F.layer_norm on the
    same data. A tensor of RESULT that is missing fails; out and grad_x must be exactly 0 at
    every invalid position. A failing tensor is described and diagnosed. Exit code 0 when all
    pass, 1 on any failure, 2 on an error.

    **Examples**

    ```
    maskln verify inputs.safetensors kernel_out.safetensors
    maskln verify in.safetensors kernel.safetensors --result-key grad_x=dx \\
        --check out,grad_x
    maskln verify in.safetensors kernel.safetensors --rtol 1e-4 --atol 1e-5
    maskln verify in.safetensors kernel.safetensors --json | jq .passed
    maskln verify acts.safetensors layer_dump.safetensors --params checkpoint/ \\
        --module encoder.layer.0.output.LayerNorm --config checkpoint/ \\
        --valid-key attention_mask --valid acts.safetensors:attention_mask
    ```
    """
    from maskln_cli.cli import report
    from maskln_cli.verify.job import VerifyOptions, parse_check, parse_result_keys, verify_file

    options = _normalize_options({**locals(), "dtype": ComputeDtype.auto})
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
    )
    with report.progress_bar(f"verify {input_path}") as progress:
        result = verify_file(input_path, result_path, options, judged, progress)
    _finish_comparison(result, json_output, quiet)


@app.command(cls=PlainHelp, no_args_is_help=True)
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

    result = diff_files(actual_path, expected_path, keys or (), rtol, atol, valid_rows)
    _finish_comparison(result, json_output, quiet)


@app.command(cls=PlainHelp, no_args_is_help=True)
@reports_errors
def grade(
    target: Annotated[
        str,
        typer.Argument(
            metavar="TARGET",
            help="path/to/solution.py (its masked_layer_normalization), path/to/solution.py:NAME,"
            " or package.module:NAME.",
            show_default=False,
        ),
    ],
    strict: Annotated[
        bool,
        typer.Option("--strict", help="Strict clauses (maskln's own guarantees) count too."),
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option(
            "--only",
            metavar="CLAUSE",
            help="Grade only this clause (repeatable); each one named counts.",
            show_default=False,
        ),
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", metavar="SEED", help="Seed of the cases (deterministic).")
    ] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", help="Time limit of each clause.")
    ] = 60.0,
    device: Annotated[
        str,
        typer.Option(
            "--device", metavar="DEVICE", help="Device the cases are built on (cpu, cuda, ...)."
        ),
    ] = "cpu",
    json_output: JsonOutput = False,
    quiet: QuietReport = False,
) -> None:
    """Grade an implementation of masked_layer_normalization against the whole contract.

    Each clause of the specification (required) and of maskln's own guarantees (strict) is
    checked on deterministic cases against maskln's float64 reference; a failure shows its
    first counterexample and the known mistake it matches. The function runs in a child
    process: a crash, a hang or too much memory fails a clause, not the grader.
    Exit code 0 when every required clause passes (and strict ones with --strict), 1 when one
    fails, 2 when TARGET cannot be found, imported or called.

    **Examples**

    ```
    maskln grade solution.py
    maskln grade solution.py:my_layer_norm --strict
    maskln grade my_kernels.ops:masked_ln --device cuda --only gradients
    maskln grade solution.py --json | jq '.clauses[] | select(.passed | not)'
    ```
    """
    from maskln_cli.cli import report
    from maskln_cli.grading.runner import grade_target

    result = grade_target(
        target,
        strict=strict,
        only=only or (),
        seed=seed,
        timeout=timeout,
        device=device,
        contain_processes=True,  # this process does nothing else: detached processes come back
    )
    if json_output:
        report.print_json(result.to_dict())
    else:
        report.render_grade(result, quiet=quiet)
    if not result.passed:
        raise typer.Exit(EXIT_MISMATCH)


def _finish_comparison(result: ComparisonReport, json_output: bool, quiet: bool) -> None:
    from maskln_cli.cli import report

    code = 0 if result.passed else EXIT_MISMATCH
    with _quiet_when_stdout_closes(code):
        if json_output:
            report.print_json(result.to_dict())
        else:
            report.render_comparison(result, quiet=quiet)
    if code:
        raise typer.Exit(code)


@contextlib.contextmanager
def _quiet_when_stdout_closes(code: int) -> Any:
    """A report's reader closed the pipe (``| head``): stop writing, say nothing, and exit with
    the command's own code (the verdict's), as git and grep do."""
    from maskln_cli.errors import StdoutClosed

    try:
        yield
    except StdoutClosed:
        _detach_broken_stdout()
        raise typer.Exit(code) from None


def main() -> None:
    """The console script: ``maskln``."""
    from maskln_cli.files import shrinking

    shrinking.install_handler()  # an input truncated while mapped: one line, exit 2
    app(prog_name="maskln")
