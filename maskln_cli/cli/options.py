"""The options more than one command takes, each defined once as an ``Annotated`` alias.

normalize and verify read the same problem (keys, scale and bias, eps), verify and diff compare
the same way (tolerance, ``--valid``), and the reports share ``--json`` and ``--quiet``. A
command's own options stay in its module.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Annotated, Any

import typer

from maskln_cli.files.problem import NormalizeOptions


class NormChoice(str, Enum):
    """--norm's choices: the names of :data:`maskln_cli.op.norms.NORMS`."""

    layer = "layer"
    rms = "rms"


class ComputeDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    float64 = "float64"


def key_option(flag: str, help: str, metavar: str = "KEY", show_default: bool = False) -> Any:
    """An option saying where a tensor is (a key, a module), listed under Keys. Its help says
    the default in words, unless ``show_default``: then typer shows it."""
    return typer.Option(
        flag, metavar=metavar, help=help, show_default=show_default, rich_help_panel="Keys"
    )


def tolerance_option(flag: str, metavar: str, help: str) -> Any:
    """An option saying how close is close enough, listed under Tolerance; its help says the
    default in words."""
    return typer.Option(
        flag, metavar=metavar, help=help, show_default=False, rich_help_panel="Tolerance"
    )


# The problem normalize and verify read: where x, the mask, scale, bias and grad_out are, eps.
XKey = Annotated[str, key_option("--x-key", "Key of x, [..., C].", show_default=True)]
ValidKey = Annotated[
    str | None,
    key_option(
        "--valid-key",
        "Key of the mask [...]: bool, or 0/1 numbers."
        " (default: valid; when absent, all positions are valid)",
    ),
]
ScaleKey = Annotated[
    str | None, key_option("--scale-key", "Key of scale [C]. (default: scale; when absent, ones)")
]
BiasKey = Annotated[
    str | None, key_option("--bias-key", "Key of bias [C]. (default: bias; when absent, zeros)")
]
GradOutKey = Annotated[
    str | None,
    key_option(
        "--grad-out-key",
        "Key of the upstream gradient [..., C]. (default: grad_out; when absent, no gradients)",
    ),
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
    key_option(
        "--module",
        "The layer norm whose scale and bias to use: NAME.weight and NAME.bias, or"
        " NAME.gamma and NAME.beta, whichever --params (else INPUT) holds.",
        metavar="NAME",
    ),
]
Config = Annotated[
    str | None,
    typer.Option(
        "--config",
        metavar="FILE",
        help="Read the norm and eps from a transformers config.json (rms_norm_eps: RMSNorm;"
        " layer_norm_eps, layer_norm_epsilon or norm_eps: LayerNorm); a folder means"
        " FOLDER/config.json.",
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
        help="Added to the variance (RMSNorm: to mean(x**2)). (default: --config's, else the"
        " input's metadata 'eps', 'layer_norm_eps' or 'rms_norm_eps', else 1e-05 for LayerNorm,"
        " 1e-06 for RMSNorm)",
        show_default=False,
    ),
]
NormName = Annotated[
    NormChoice | None,
    typer.Option(
        "--norm",
        metavar="NORM",
        help="The norm: layer (LayerNorm) or rms (RMSNorm: no centering, no bias). (default:"
        " --config's, rms when it holds rms_norm_eps; else the input's metadata 'norm'; else"
        " layer)",
        show_default=False,
    ),
]
Offset = Annotated[
    float | None,
    typer.Option(
        "--gain-offset",
        metavar="OFFSET",
        help="RMSNorm's gain is OFFSET + scale (Gemma's: 1). (default: the input's metadata"
        " 'offset', else 0)",
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

# normalize and generate, which write a file.
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors on stderr.")]
Fsync = Annotated[
    bool,
    typer.Option(
        "--fsync",
        help="Flush OUTPUT to disk before it replaces an old one, so that it survives a power"
        " loss or an OS crash too (a killed process never leaves a partial OUTPUT either way).",
    ),
]

# verify and diff, which compare (and grade, whose report takes --json and -q too).
Rtol = Annotated[
    float | None,
    tolerance_option(
        "--rtol", "RTOL", "Relative tolerance. (default: by dtype, as torch.testing.assert_close)"
    ),
]
Atol = Annotated[
    float | None,
    tolerance_option(
        "--atol", "ATOL", "Absolute tolerance. (default: by dtype, as torch.testing.assert_close)"
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


def normalize_options(arguments: dict[str, Any]) -> NormalizeOptions:
    """NormalizeOptions from a command's arguments (normalize and verify share their names)."""
    values = {f.name: arguments[f.name] for f in dataclasses.fields(NormalizeOptions)}
    norm = values["norm"].value if values["norm"] is not None else None
    return NormalizeOptions(**dict(values, dtype=values["dtype"].value, norm=norm))
