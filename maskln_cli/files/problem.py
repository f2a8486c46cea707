"""Normalizing safetensors files: resolve keys, parameters and options, then compute in chunks.

This is the library behind ``maskln normalize`` and ``maskln verify``: :func:`load_problem`
opens and checks the inputs, :func:`iter_outputs` computes the results chunk by chunk, and
:func:`normalize_file` streams them into an output file.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.files.checkpoint import (
    CONFIG_NAME,
    Tensors,
    config_eps,
    config_path,
    describe_norm_modules,
    module_keys,
    open_checkpoint,
)
from maskln_cli.files.masks import as_mask
from maskln_cli.files.resources import check_memory
from maskln_cli.files.tensorfile import (
    FLOATING,
    NUMERIC,
    STDIO,
    FileIdentity,
    TensorFile,
    dtype_name,
    file_identity,
    open_tensor_file,
)

if TYPE_CHECKING:
    import torch

DEFAULT_EPS = 1e-5
METADATA_EPS_KEYS = ("eps", "layer_norm_eps")
"""Metadata keys of INPUT that give eps, in the order they are looked up."""
DTYPE_CHOICES = ("auto", "float32", "float64")
CHUNK_BYTES = 8 * 2**20
"""Rows are processed in chunks of about this many bytes of x (at least two rows each, so
that chunked results are identical to one whole call: see core.row_blocks)."""

GRADIENT_KEYS = ("grad_x", "grad_scale", "grad_bias")

Progress = Callable[[int, int], None]
"""Called with (work done, total work), in rows."""


@dataclass(frozen=True)
class NormalizeOptions:
    """Where to find each tensor and how to compute. ``None`` keys are optional defaults.

    A key given explicitly must exist; a default key that is absent falls back to a default
    (valid: every position; scale: ones; bias: zeros; grad_out: no gradients), with a note.
    ``module`` names a layer norm whose scale and bias are ``MODULE.weight``/``MODULE.bias``
    or ``MODULE.gamma``/``MODULE.beta``; ``params`` may be a checkpoint folder or index; eps is
    ``eps``, else ``config``'s (a config.json), else INPUT's metadata, else 1e-5.
    """

    x_key: str = "x"
    valid_key: str | None = None
    scale_key: str | None = None
    bias_key: str | None = None
    grad_out_key: str | None = None
    out_key: str = "out"
    params: str | None = None
    grad_out: str | None = None
    eps: float | None = None
    dtype: str = "auto"
    chunk_rows: int | None = None
    module: str | None = None
    config: str | None = None


@dataclass
class Problem:
    """Checked inputs, ready to compute: x and grad_out stay memory-mapped, as [rows, C]."""

    source: str
    shape: tuple[int, ...]
    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    grad_out: torch.Tensor | None
    eps: float
    dtype: torch.dtype
    chunk_rows: int
    notes: list[str] = field(default_factory=list)
    eps_source: str = "default"
    """Where eps came from: '--eps', 'PATH: layer_norm_eps', "metadata 'eps'", 'default'."""
    param_dtype: torch.dtype | None = None
    """The finest dtype scale and bias were stored in (None: both are defaults)."""
    read_files: dict[FileIdentity, str] = field(default_factory=dict)
    """Every file read, INPUT and each option's, by identity: how messages name it. None of
    them may become an output."""
    input_file: TensorFile | None = field(default=None, repr=False)
    """INPUT, open while the problem is: what else it holds is read from here, never reopened
    (a file can change between two opens; stdin cannot be read twice)."""

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def channels(self) -> int:
        return self.x.shape[1]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@contextlib.contextmanager
def load_problem(path: str, options: NormalizeOptions) -> Iterator[Problem]:
    """Open INPUT (and the ``--params`` and ``--grad-out`` files) and check everything.

    Example:
        >>> with load_problem("sample_data/worked_example.safetensors", NormalizeOptions()) as p:
        ...     p.shape, p.eps, p.eps_source, p.dtype, p.param_dtype, p.valid.tolist()
        ((1, 2, 2), 3.0, "metadata 'eps'", torch.float64, torch.float64, [True, False])
    """
    sources = [s for s in (path, options.params, options.grad_out) if s is not None]
    if sources.count(STDIO) > 1:
        raise MasklnError("only one of INPUT, --params and --grad-out can be '-' (stdin)")
    with contextlib.ExitStack() as stack:
        data = stack.enter_context(open_tensor_file(path))
        params = stack.enter_context(open_checkpoint(options.params)) if options.params else data
        grads = (
            stack.enter_context(open_tensor_file(options.grad_out)) if options.grad_out else data
        )
        problem = _prepare(data, params, grads, options)
        problem.read_files = _read_files(data, params, grads, options)
        problem.input_file = data
        yield problem


def _read_files(
    data: TensorFile, params: Tensors, grads: TensorFile, options: NormalizeOptions
) -> dict[FileIdentity, str]:
    """What each file read is to the user, by identity; INPUT's name wins a tie."""
    found = {identity: f"the input {name}" for identity, name in data.read_files().items()}
    named = []
    if options.params:
        named.append(("--params", params.read_files()))
    if options.grad_out:
        named.append(("--grad-out", grads.read_files()))
    if options.config is not None:
        path = config_path(options.config)
        identity = file_identity(path)
        named.append(("--config", {} if identity is None else {identity: path}))
    for option, files in named:
        for identity, name in files.items():
            found.setdefault(identity, f"read through {option} ({name})")
    return found


def _prepare(
    data: TensorFile, params: Tensors, grads: TensorFile, options: NormalizeOptions
) -> Problem:
    import torch

    if options.dtype not in DTYPE_CHOICES:
        raise MasklnError(
            f"--dtype: must be one of {', '.join(DTYPE_CHOICES)}, got {options.dtype!r}"
        )
    notes: list[str] = []
    x_info = data.info(options.x_key)
    where = f"{data.name}: tensor {options.x_key!r}"
    if x_info.dtype not in FLOATING:
        raise MasklnError(f"{where} has dtype {x_info.dtype}; x must be {', '.join(FLOATING)}")
    if not x_info.shape:
        raise MasklnError(f"{where} is 0-d; x needs a channel axis (shape [..., C])")
    channels = x_info.shape[-1]
    if channels == 0:
        raise MasklnError(f"{where} has shape {list(x_info.shape)}: zero channels")
    # scale, bias (defaults included) and the gradient sums are channel-sized: even with no
    # rows, a header can ask for 2**40 channels.
    check_memory(channels * 8 * 8, f"{where} of {channels:,} channels")
    leading = x_info.shape[:-1]
    dtype = getattr(torch, x_info.dtype if options.dtype == "auto" else options.dtype)
    x = data.tensor(options.x_key).reshape(-1, channels)

    valid = _optional(data, options.valid_key, "valid", notes, "every position is valid")
    if valid is None:
        valid = torch.ones(leading, dtype=torch.bool)
    valid = as_mask(valid, data.name, options.valid_key or "valid", leading)

    scale_key, bias_key = options.scale_key or "scale", options.bias_key or "bias"
    if options.module is not None:
        scale_key, module_bias = _module_keys(params, options.module, options)
        scale = params.tensor(scale_key)
        bias = params.tensor(module_bias) if module_bias else None
        if module_bias is None:
            notes.append(f"{params.name}: module {options.module!r} has no bias: using zeros")
        bias_key = module_bias or bias_key
    else:
        _check_params_hold_some(params, options)
        scale = _optional(params, options.scale_key, "scale", notes, "using ones")
        bias = _optional(params, options.bias_key, "bias", notes, "using zeros")
    stored = [t.dtype for t in (scale, bias) if t is not None and dtype_name(t.dtype) in FLOATING]
    param_dtype = min(stored, key=lambda d: torch.finfo(d).eps) if stored else None
    scale = torch.ones(channels) if scale is None else scale
    bias = torch.zeros(channels) if bias is None else bias
    scale = _as_parameter(scale, params.name, scale_key, channels).to(dtype)
    bias = _as_parameter(bias, params.name, bias_key, channels).to(dtype)

    grad_key = options.grad_out_key or ("grad_out" if options.grad_out else None)
    grad_out = _optional(grads, grad_key, "grad_out", None, "")
    if grad_out is not None:
        grad_name = f"{grads.name}: tensor {options.grad_out_key or 'grad_out'!r}"
        if tuple(grad_out.shape) != x_info.shape:
            raise MasklnError(
                f"{grad_name} has shape {list(grad_out.shape)}; expected x's shape"
                f" {list(x_info.shape)}"
            )
        if dtype_name(grad_out.dtype) not in FLOATING:
            raise MasklnError(f"{grad_name} has dtype {dtype_name(grad_out.dtype)}; expected float")
        grad_out = grad_out.reshape(-1, channels)

    rows_per_chunk = options.chunk_rows or max(2, CHUNK_BYTES // (channels * x.element_size()))
    # A chunk holds x converted, the output and a few temporaries: about 8 copies with
    # gradients, 4 without, of the compute dtype.
    copies = 8 if grad_out is not None else 4
    compute_itemsize = max(dtype.itemsize, 4)  # float16 and bfloat16 are computed in float32
    chunk_bytes = min(rows_per_chunk, x.shape[0]) * channels * compute_itemsize * copies
    check_memory(chunk_bytes, f"--chunk-rows {rows_per_chunk} ({channels} channels)")
    eps, eps_source = _resolve_eps(options, data, dtype, notes)
    return Problem(
        source=data.name,
        shape=x_info.shape,
        x=x,
        valid=valid.reshape(-1),
        scale=scale,
        bias=bias,
        grad_out=grad_out,
        eps=eps,
        dtype=dtype,
        chunk_rows=rows_per_chunk,
        notes=notes,
        eps_source=eps_source,
        param_dtype=param_dtype,
    )


def _module_keys(params: Tensors, module: str, options: NormalizeOptions) -> tuple[str, str | None]:
    """--module's scale and bias keys; naming the same tensors twice is refused."""
    for option, key in (("--scale-key", options.scale_key), ("--bias-key", options.bias_key)):
        if key is not None:
            raise MasklnError(f"--module and {option} both name a parameter; give one of them")
    return module_keys(params, module)


def _check_params_hold_some(params: Tensors, options: NormalizeOptions) -> None:
    """A --params checkpoint with neither default key was meant to be read by name: say how.

    Keys the user named are left to fail on their own, with the closest names.
    """
    if not options.params or options.scale_key is not None or options.bias_key is not None:
        return
    if "scale" in params or "bias" in params:
        return
    norms = describe_norm_modules(params.keys())
    held = f" (it holds {norms})" if norms else ""
    raise MasklnError(
        f"{params.name}: holds neither 'scale' nor 'bias'; name the layer norm with --module"
        f" NAME{held}, or its tensors with --scale-key and --bias-key"
    )


def _optional(
    file: TensorFile, key: str | None, default_key: str, notes: list[str] | None, fallback: str
) -> torch.Tensor | None:
    """The tensor under an explicit key (which must exist), or under the default key if present."""
    if key is not None:
        return file.tensor(key)
    if default_key in file:
        return file.tensor(default_key)
    if notes is not None:
        notes.append(f"{file.name}: no tensor {default_key!r}: {fallback}")
    return None


def _as_parameter(param: torch.Tensor, source: str, key: str, channels: int) -> torch.Tensor:
    where = f"{source}: tensor {key!r}"
    if tuple(param.shape) != (channels,):
        raise MasklnError(
            f"{where} has shape {list(param.shape)}; expected [{channels}] (x's channels)"
        )
    if dtype_name(param.dtype) not in NUMERIC:
        raise MasklnError(f"{where} has dtype {dtype_name(param.dtype)}; expected a float")
    return param


def _resolve_eps(
    options: NormalizeOptions, data: TensorFile, dtype: torch.dtype, notes: list[str]
) -> tuple[float, str]:
    """``(eps, where it came from)``: --eps, else --config's, else INPUT's metadata 'eps' or
    'layer_norm_eps', else 1e-5 with a note; checked for ``dtype``."""
    from_config = config_eps(options.config) if options.config is not None else None
    if options.eps is not None:
        if from_config is not None and from_config.value != options.eps:
            notes.append(
                f"--eps {options.eps!r} overrides {from_config.source} {from_config.value!r}"
            )
        return check_eps(options.eps, "--eps", dtype), "--eps"
    if from_config is not None:
        return check_eps(from_config.value, from_config.source, dtype), from_config.source
    for key in METADATA_EPS_KEYS:
        if key in data.metadata:
            text = data.metadata[key]
            where = f"{data.name}: metadata {key!r} ({text!r})"
            value = parse_number(text)
            if value is None:
                raise MasklnError(f"{where}: not a number such as 1e-05 or 0.00001")
            return check_eps(value, where, dtype), f"metadata {key!r}"
    notes.append(
        f"no eps given (--eps, --config, or metadata 'eps' in {data.name}): using the default"
        f" {DEFAULT_EPS!r}{_config_hint(options.params)}"
    )
    return DEFAULT_EPS, "default"


_NUMBER = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*", re.ASCII)
"""A number as people write one: ASCII digits, an optional point and exponent, spaces around.
(Python's float() also takes '1_0', Arabic-Indic digits, 'infinity' and 'nan'.)"""


def parse_number(text: str) -> float | None:
    """``text`` as a float if it is written as a plain decimal number, else None.

    Example:
        >>> parse_number(" 1E-5 "), parse_number("0.00001")
        (1e-05, 1e-05)
        >>> parse_number("1_0"), parse_number("\u0661"), parse_number("nan")
        (None, None, None)
    """
    return float(text) if _NUMBER.fullmatch(text) else None


def _config_hint(params: str | None) -> str:
    """When --params is a model folder (or a file in one) that has a config.json, say so."""
    if not params or params == STDIO:
        return ""
    folder = params if os.path.isdir(params) else os.path.dirname(params)
    config = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(config):
        return ""
    try:  # suggest only a config that gives an eps, and say which
        found = config_eps(config)
    except MasklnError:
        return ""
    return f"; {config} gives {found.key} {found.value:g}: --config {config} reads it"


def check_eps(eps: float, where: str, dtype: torch.dtype | None = None) -> float:
    """eps must be finite and positive, and not 0 in the compute dtype for ``dtype``;
    ``where`` names its source in the message."""
    if not (math.isfinite(eps) and eps > 0):
        raise MasklnError(f"{where}: eps must be a finite positive number")
    if dtype is not None:
        import torch

        from maskln_cli.op.checks import eps_rounds_to_zero

        compute = torch.float64 if dtype == torch.float64 else torch.float32
        if eps_rounds_to_zero(eps, compute):
            raise MasklnError(f"{where}: eps {eps!r} rounds to 0 in {dtype_name(compute)}")
    return eps


def iter_outputs(problem: Problem) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, out[start:stop])`` for each chunk of rows, computed without autograd."""
    import torch

    from maskln_cli.op.api import masked_layer_normalization
    from maskln_cli.op.blocked import row_blocks

    for start, stop in row_blocks(problem.rows, problem.chunk_rows):
        with torch.no_grad():  # not held across the yield: the caller's grad mode is its own
            x = problem.x[start:stop].to(problem.dtype)
            valid = problem.valid[start:stop]
            out = masked_layer_normalization(x, valid, problem.scale, problem.bias, problem.eps)
        yield start, stop, out


class GradientSums:
    """grad_scale and grad_bias, accumulated in float64 over chunks of rows."""

    def __init__(self, problem: Problem) -> None:
        import torch

        self.scale = torch.zeros(problem.channels, dtype=torch.float64)
        self.bias = torch.zeros(problem.channels, dtype=torch.float64)


def iter_gradients(problem: Problem, sums: GradientSums) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, grad_x[start:stop])`` per chunk; grad_scale and grad_bias go to ``sums``.

    The gradients are those of ``sum(out * grad_out)``. float16 and bfloat16 are computed in
    float32 as the op does, and each chunk's sums reach ``sums`` before any rounding to the
    half dtype; grad_x is rounded to it, as one whole call would.
    """
    import torch

    from maskln_cli.op.api import masked_layer_normalization
    from maskln_cli.op.blocked import row_blocks

    if problem.grad_out is None:
        raise ValueError("the problem has no grad_out")
    compute = torch.float32 if problem.dtype in (torch.float16, torch.bfloat16) else problem.dtype
    scale, bias = problem.scale.to(compute), problem.bias.to(compute)
    for start, stop in row_blocks(problem.rows, problem.chunk_rows):
        with torch.enable_grad():
            x = problem.x[start:stop].to(problem.dtype).to(compute).requires_grad_()
            leaves = (x, scale.detach().requires_grad_(), bias.detach().requires_grad_())
            out = masked_layer_normalization(x, problem.valid[start:stop], *leaves[1:], problem.eps)
            grad_out = problem.grad_out[start:stop].to(problem.dtype).to(compute)
            grad_x, grad_scale, grad_bias = torch.autograd.grad(out, leaves, grad_out)
        sums.scale += grad_scale.double()
        sums.bias += grad_bias.double()
        yield start, stop, grad_x.to(problem.dtype)
