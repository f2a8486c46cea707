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
    INDEX_NAME,
    WEIGHTS_NAME,
    ConfigEps,
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
from maskln_cli.op.norms import LAYER, NORMS, Norm

if TYPE_CHECKING:
    import torch

DEFAULT_EPS = LAYER.default_eps
METADATA_EPS_KEYS = {"layer": ("eps", "layer_norm_eps"), "rms": ("eps", "rms_norm_eps")}
"""Metadata keys of INPUT that give each norm's eps, in the order they are looked up."""
METADATA_NORM_KEY = "norm"
"""The metadata key of INPUT that may name the norm (``layer`` or ``rms``)."""
DTYPE_CHOICES = ("auto", "float32", "float64")
CHUNK_BYTES = 8 * 2**20
"""Rows are processed in chunks of about this many bytes of x (at least two rows each, so
that chunked results are identical to one whole call: see core.row_blocks)."""

GRADIENT_KEYS = ("grad_x", "grad_scale", "grad_bias")
"""Every gradient a problem's output may hold; a norm's own are :func:`gradient_keys`."""


def gradient_keys(norm: Norm) -> tuple[str, ...]:
    """The gradients a norm has, as files name them (RMSNorm has no grad_bias).

    Example:
        >>> gradient_keys(NORMS["rms"])
        ('grad_x', 'grad_scale')
    """
    return tuple("grad_" + name.removeprefix("d") for name in norm.gradients)


Progress = Callable[[int, int], None]
"""Called with (work done, total work), in rows."""


@dataclass(frozen=True)
class NormalizeOptions:
    """Where to find each tensor and how to compute. ``None`` keys are optional defaults.

    A key given explicitly must exist; a default key that is absent falls back to a default
    (valid: every position; scale: ones; bias: zeros; grad_out: no gradients), with a note.
    ``module`` names a layer norm whose scale and bias are ``MODULE.weight``/``MODULE.bias``
    or ``MODULE.gamma``/``MODULE.beta``; ``params`` may be a checkpoint folder or index; eps is
    ``eps``, else ``config``'s (a config.json), else INPUT's metadata, else the norm's default.
    ``norm`` (``layer`` or ``rms``, a name of :data:`~maskln_cli.op.norms.NORMS`) is
    ``norm``, else the config's (``rms_norm_eps`` names RMSNorm), else INPUT's metadata
    ``norm``, else ``layer``; ``offset`` is RMSNorm's gain offset (Gemma's 1), else INPUT's
    metadata ``offset``, else 0.
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
    norm: str | None = None
    offset: float | None = None


@dataclass
class Problem:
    """Checked inputs, ready to compute: x and grad_out stay memory-mapped, as [rows, C]."""

    source: str
    shape: tuple[int, ...]
    x: torch.Tensor
    valid: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    """None for RMSNorm, which has no bias."""
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
    norm: Norm = LAYER
    """The norm computed (LayerNorm or RMSNorm)."""
    offset: float = 0.0
    """RMSNorm's gain is ``offset + scale`` (Gemma's offset is 1); 0 for LayerNorm."""
    norm_source: str = "default"
    """Where the norm came from: '--norm', 'PATH: rms_norm_eps', "metadata 'norm'", 'default'."""

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def channels(self) -> int:
        return self.x.shape[1]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def gradient_keys(self) -> tuple[str, ...]:
        """The gradients its output holds: grad_x, grad_scale (and grad_bias for LayerNorm)."""
        return gradient_keys(self.norm)

    def nonfinite_valid_rows(self) -> int:
        """How many valid rows hold NaN or inf in x: there the formula's statistics, and so
        the op's output (and grad_scale), are NaN. Read in chunks (x stays memory-mapped):
        only rows whose sum is not finite are looked at element by element."""
        count = 0
        step = max(1, self.chunk_rows)
        for start in range(0, self.rows, step):
            rows = self.x[start : start + step]
            suspects = ~rows.sum(-1).isfinite() & self.valid[start : start + step]
            if bool(suspects.any()):
                count += int((~rows[suspects].isfinite().all(-1)).sum())
        return count

    def parameters(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """scale (and bias, for LayerNorm), in ``dtype`` if given: the op's parameters."""
        found = (self.scale,) if self.bias is None else (self.scale, self.bias)
        return found if dtype is None else tuple(t.to(dtype) for t in found)

    def normalized(
        self, x: torch.Tensor, valid: torch.Tensor, *parameters: torch.Tensor
    ) -> torch.Tensor:
        """The op of this problem's norm on rows ``x`` (its parameters: :meth:`parameters`'s,
        or the same converted)."""
        from maskln_cli.op.api import masked_layer_normalization, masked_rms_normalization

        if self.norm.centered:
            return masked_layer_normalization(x, valid, *parameters, self.eps)
        return masked_rms_normalization(x, valid, *parameters, self.eps, offset=self.offset)


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
    norm, norm_source, config = _resolve_norm(options, data, notes)
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

    scale, bias, param_dtype = _parameters(params, options, norm, channels, dtype, notes)

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
    eps, eps_source = _resolve_eps(options, data, dtype, notes, norm, config)
    offset = _resolve_offset(options, data, norm)
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
        norm=norm,
        offset=offset,
        norm_source=norm_source,
    )


def _parameters(
    params: Tensors,
    options: NormalizeOptions,
    norm: Norm,
    channels: int,
    dtype: torch.dtype,
    notes: list[str],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype | None]:
    """``(scale, bias, param_dtype)``: bias None for RMSNorm, which refuses one named to it
    (a key, a module's bias) and leaves a default ``bias`` tensor unread, with a note."""
    import torch

    scale_key, bias_key = options.scale_key or "scale", options.bias_key or "bias"
    if not norm.centered and options.bias_key is not None:
        raise MasklnError(f"--bias-key {options.bias_key!r}: {norm.title} has no bias")
    if options.module is not None:
        scale_key, module_bias = _module_keys(params, options.module, options)
        scale = params.tensor(scale_key)
        if module_bias is not None and not norm.centered:
            raise MasklnError(
                f"{params.name}: module {options.module!r} has a bias {module_bias!r}:"
                f" {norm.title} has no bias (is it a LayerNorm? give --norm layer)"
            )
        bias = params.tensor(module_bias) if module_bias else None
        if module_bias is None and norm.centered:
            notes.append(f"{params.name}: module {options.module!r} has no bias: using zeros")
        bias_key = module_bias or bias_key
    else:
        _check_params_hold_some(params, options, norm)
        scale = _optional(params, options.scale_key, "scale", notes, "using ones")
        if norm.centered:
            bias = _optional(params, options.bias_key, "bias", notes, "using zeros")
        else:
            bias = None
            if "bias" in params:
                notes.append(f"{params.name}: tensor 'bias' not used: {norm.title} has no bias")
    stored = [t.dtype for t in (scale, bias) if t is not None and dtype_name(t.dtype) in FLOATING]
    param_dtype = min(stored, key=lambda d: torch.finfo(d).eps) if stored else None
    scale = torch.ones(channels) if scale is None else scale
    scale = _as_parameter(scale, params.name, scale_key, channels).to(dtype)
    if not norm.centered:
        return scale, None, param_dtype
    bias = torch.zeros(channels) if bias is None else bias
    return scale, _as_parameter(bias, params.name, bias_key, channels).to(dtype), param_dtype


def named_norm(metadata: dict[str, str], source: str) -> Norm | None:
    """The norm a file's metadata names (``norm``: ``layer`` or ``rms``), None when it names
    none; any other name is an error naming the file ``source``.

    Example:
        >>> named_norm({"norm": "rms"}, "f.safetensors").title
        'RMSNorm'
    """
    named = metadata.get(METADATA_NORM_KEY)
    if named is None:
        return None
    if named not in NORMS:
        raise MasklnError(
            f"{source}: metadata {METADATA_NORM_KEY!r} is {named!r}; expected one of"
            f" {', '.join(NORMS)}"
        )
    return NORMS[named]


@dataclass(frozen=True)
class FileNorm:
    """The norm a file or checkpoint is for, as ``maskln inspect`` says it: ``eps`` None when
    nothing gives it; ``source`` as :attr:`Problem.norm_source`."""

    name: str
    eps: float | None
    source: str


def file_norm(
    path: str, metadata: dict[str, str], source: str, norm: str | None = None
) -> FileNorm | None:
    """The norm ``path`` is for, by the rules of :func:`load_problem`: ``norm`` (--norm), else
    the checkpoint's config.json (``path`` a model folder, its index or its
    ``model.safetensors``), else the metadata's 'norm'; None when nothing names one. --norm
    against a config of the other norm is the same error as for normalize.

    Example:
        >>> file_norm("sample_data/worked_example.safetensors", {"norm": "rms"}, "f")
        FileNorm(name='rms', eps=None, source="metadata 'norm'")
    """
    named = named_norm(metadata, source)
    config = _checkpoint_config(path)
    found = None
    if config is not None:
        try:
            found = config_eps(config)
        except MasklnError:  # a config that gives no eps (or no JSON) names no norm
            found = None
        if found is not None and norm is not None and found.norm != norm:
            found = config_eps(config, norm)  # the other norm's too, else the error
    if norm is not None:
        chosen, where = NORMS[norm], "--norm"
    elif found is not None:
        return FileNorm(found.norm, found.value, found.source)
    elif named is not None:
        chosen, where = named, f"metadata {METADATA_NORM_KEY!r}"
    else:
        return None
    if found is not None:
        return FileNorm(chosen.name, found.value, found.source)
    eps = next(
        (parse_number(metadata[k]) for k in METADATA_EPS_KEYS[chosen.name] if k in metadata),
        None,
    )
    return FileNorm(chosen.name, eps, where)


def _checkpoint_config(path: str) -> str | None:
    """The config.json of the model folder ``path`` is (or whose index or weights it is)."""
    if path == STDIO:
        return None
    if os.path.isdir(path):
        folder = path
    elif os.path.basename(path) in (WEIGHTS_NAME, INDEX_NAME):
        folder = os.path.dirname(path) or "."
    else:
        return None
    config = os.path.join(folder, CONFIG_NAME)
    return config if os.path.isfile(config) else None


def _resolve_norm(
    options: NormalizeOptions, data: TensorFile, notes: list[str]
) -> tuple[Norm, str, ConfigEps | None]:
    """``(norm, where it came from, --config's eps)``: --norm, else --config's (a config
    with ``rms_norm_eps`` is an RMSNorm model's), else INPUT's metadata 'norm', else LayerNorm.

    --norm against a --config of the other norm is an error (that config has no eps for it);
    against INPUT's metadata, --norm wins with a note, as --eps does over a config's eps.
    """
    if options.norm is not None and options.norm not in NORMS:
        raise MasklnError(f"--norm: must be one of {', '.join(NORMS)}, got {options.norm!r}")
    config = config_eps(options.config, options.norm) if options.config is not None else None
    found = named_norm(data.metadata, data.name)
    named = found.name if found is not None else None
    if options.norm is not None:
        name, source = options.norm, "--norm"
    elif config is not None:
        name, source = config.norm, config.source
    elif named is not None:
        return NORMS[named], f"metadata {METADATA_NORM_KEY!r}", None
    else:
        return LAYER, "default", None
    if named is not None and named != name:
        notes.append(
            f"{'--norm ' + name if source == '--norm' else source} overrides {data.name}'s"
            f" metadata {METADATA_NORM_KEY!r} ({named!r}): computing {NORMS[name].title}"
        )
    return NORMS[name], source, config


def _resolve_offset(options: NormalizeOptions, data: TensorFile, norm: Norm) -> float:
    """RMSNorm's gain offset: --gain-offset, else INPUT's metadata 'offset', else 0."""
    if options.offset is not None:
        where = "--gain-offset"
        value: float | None = options.offset
    elif "offset" in data.metadata and not norm.centered:
        where = f"{data.name}: metadata 'offset' ({data.metadata['offset']!r})"
        value = parse_number(data.metadata["offset"])
        if value is None:
            raise MasklnError(f"{where}: not a number such as 1 or 0.5")
    else:
        return 0.0
    if norm.centered and value != 0:
        raise MasklnError(
            f"--gain-offset {value!r}: only RMSNorm has a gain offset; give --norm rms"
        )
    if not math.isfinite(value):
        raise MasklnError(f"{where}: the offset must be a finite number")
    return value


def _module_keys(params: Tensors, module: str, options: NormalizeOptions) -> tuple[str, str | None]:
    """--module's scale and bias keys; naming the same tensors twice is refused."""
    for option, key in (("--scale-key", options.scale_key), ("--bias-key", options.bias_key)):
        if key is not None:
            raise MasklnError(f"--module and {option} both name a parameter; give one of them")
    return module_keys(params, module)


def _check_params_hold_some(params: Tensors, options: NormalizeOptions, norm: Norm) -> None:
    """A --params checkpoint with neither default key was meant to be read by name: say how.

    Keys the user named are left to fail on their own, with the closest names.
    """
    if not options.params or options.scale_key is not None or options.bias_key is not None:
        return
    if "scale" in params or "bias" in params:
        return
    norms = describe_norm_modules(params.keys())
    held = f" (it holds {norms})" if norms else ""
    if norm.centered:
        raise MasklnError(
            f"{params.name}: holds neither 'scale' nor 'bias'; name the layer norm with --module"
            f" NAME{held}, or its tensors with --scale-key and --bias-key"
        )
    raise MasklnError(
        f"{params.name}: holds no 'scale'; name the RMSNorm with --module NAME{held}, or its"
        " weight with --scale-key"
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
    options: NormalizeOptions,
    data: TensorFile,
    dtype: torch.dtype,
    notes: list[str],
    norm: Norm = LAYER,
    from_config: ConfigEps | None = None,
) -> tuple[float, str]:
    """``(eps, where it came from)``: --eps, else --config's, else INPUT's metadata 'eps' or
    the norm's own key ('layer_norm_eps', 'rms_norm_eps'), else the norm's default with a
    note; checked for ``dtype``."""
    if options.eps is not None:
        if from_config is not None and from_config.value != options.eps:
            notes.append(
                f"--eps {options.eps!r} overrides {from_config.source} {from_config.value!r}"
            )
        return check_eps(options.eps, "--eps", dtype), "--eps"
    if from_config is not None:
        return check_eps(from_config.value, from_config.source, dtype), from_config.source
    for key in METADATA_EPS_KEYS[norm.name]:
        if key in data.metadata:
            text = data.metadata[key]
            where = f"{data.name}: metadata {key!r} ({text!r})"
            value = parse_number(text)
            if value is None:
                raise MasklnError(f"{where}: not a number such as 1e-05 or 0.00001")
            return check_eps(value, where, dtype), f"metadata {key!r}"
    notes.append(
        f"no eps given (--eps, --config, or metadata 'eps' in {data.name}): using the default"
        f" {norm.default_eps!r}{'' if norm.centered else ' (RMSNorm)'}"
        f"{_config_hint(options.params, norm)}"
    )
    return norm.default_eps, "default"


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


def _config_hint(params: str | None, norm: Norm) -> str:
    """When --params is a model folder (or a file in one) whose config.json gives an eps, say
    so, and which norm's when it is not ``norm`` (an RMSNorm model's, read as LayerNorm)."""
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
    if found.norm != norm.name:
        title = NORMS[found.norm].title
        return (
            f"; {config} gives {found.key} {found.value:g} ({title}): --config {config} reads"
            " the norm and its eps"
        )
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

    from maskln_cli.op.blocked import row_blocks

    parameters = problem.parameters()
    for start, stop in row_blocks(problem.rows, problem.chunk_rows):
        with torch.no_grad():  # not held across the yield: the caller's grad mode is its own
            x = problem.x[start:stop].to(problem.dtype)
            out = problem.normalized(x, problem.valid[start:stop], *parameters)
        yield start, stop, out


class GradientSums:
    """grad_scale and grad_bias (None for RMSNorm), accumulated in float64 over chunks of rows."""

    def __init__(self, problem: Problem) -> None:
        import torch

        self.scale = torch.zeros(problem.channels, dtype=torch.float64)
        self.bias = (
            None if problem.bias is None else torch.zeros(problem.channels, dtype=torch.float64)
        )


def overflows(stored: torch.Tensor, rounded: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether a valid row of ``stored`` holds a finite value that ``rounded`` (``stored`` in a
    narrower dtype) made inf.

    Example:
        >>> import torch
        >>> g = torch.tensor([[1e5, 1.0], [float("inf"), 1.0]])
        >>> overflows(g, g.half(), torch.tensor([True, True]))
        True
        >>> overflows(g, g.half(), torch.tensor([False, True]))  # padding may hold anything
        False
    """
    import torch

    if math.isfinite(float(rounded.sum(dtype=torch.float64))):
        return False  # one pass: a sum is finite only if every value is
    return bool((rounded.isinf() & stored.isfinite() & valid.unsqueeze(-1)).any())


def iter_gradients(problem: Problem, sums: GradientSums) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(start, stop, grad_x[start:stop])`` per chunk; grad_scale and grad_bias go to ``sums``.

    The gradients are those of ``sum(out * grad_out)``. float16 and bfloat16 are computed in
    float32 as the op does, and each chunk's sums reach ``sums`` before any rounding to the
    half dtype; grad_x is rounded to it, as one whole call would.
    """
    import torch

    from maskln_cli.op.blocked import row_blocks

    if problem.grad_out is None:
        raise ValueError("the problem has no grad_out")
    compute = torch.float32 if problem.dtype in (torch.float16, torch.bfloat16) else problem.dtype
    for start, stop in row_blocks(problem.rows, problem.chunk_rows):
        valid = problem.valid[start:stop]
        stored = problem.grad_out[start:stop]
        grad_out = stored.to(problem.dtype)
        # A finite upstream gradient beyond the dtype's range would reach the op as inf and
        # its rows' gradients as NaN; those chunks are computed in float64 instead, so their
        # gradients round to what they are (inf where they overflow, as the truth's would).
        chunk_compute = torch.float64 if overflows(stored, grad_out, valid) else compute
        with torch.enable_grad():
            x = problem.x[start:stop].to(problem.dtype).to(chunk_compute).requires_grad_()
            parameters = problem.parameters(chunk_compute)
            leaves = (x, *(p.detach().requires_grad_() for p in parameters))
            out = problem.normalized(x, valid, *leaves[1:])
            upstream = (stored if chunk_compute == torch.float64 else grad_out).to(chunk_compute)
            grad_x, grad_scale, *grad_bias = torch.autograd.grad(out, leaves, upstream)
        sums.scale += grad_scale.double()
        if sums.bias is not None:
            sums.bias += grad_bias[0].double()
        yield start, stop, grad_x.to(problem.dtype)
