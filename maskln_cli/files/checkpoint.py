"""Real checkpoints: eps from a model's config.json, sharded safetensors, layer norms by module.

A transformers model saved with ``save_pretrained`` is a folder holding ``config.json`` and
either ``model.safetensors`` or ``model.safetensors.index.json`` with its shards. This module
reads what maskln needs from such a folder:

- :func:`config_eps`: the norm and its eps from ``config.json`` (LayerNorm's ``layer_norm_eps``,
  ``layer_norm_epsilon`` or ``norm_eps``; RMSNorm's ``rms_norm_eps``);
- :func:`open_checkpoint`: a file, a folder or an index, opened as one set of tensors, each
  shard memory-mapped and opened only when one of its tensors is asked for;
- :func:`module_keys`: a layer norm's scale and bias keys from its module name, whichever of
  ``NAME.weight``/``NAME.bias`` or ``NAME.gamma``/``NAME.beta`` the checkpoint holds.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.files.keynames import closest_keys, missing_key_message
from maskln_cli.files.tensorfile import (
    STDIO,
    FileIdentity,
    TensorFile,
    TensorInfo,
    check_regular_file,
    file_identity,
    open_tensor_file,
)

if TYPE_CHECKING:
    import numpy
    import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_EPS_KEYS = ("layer_norm_eps", "layer_norm_epsilon", "norm_eps")
"""Where transformers configs keep a LayerNorm's eps, in the order they are looked up."""
RMS_EPS_KEYS = ("rms_norm_eps",)
"""RMSNorm's eps: not a LayerNorm's, so never taken for one."""
EPS_KEYS_BY_NORM = {"layer": CONFIG_EPS_KEYS, "rms": RMS_EPS_KEYS}
"""Each norm's eps keys (by :data:`maskln_cli.op.norms.NORMS` name), looked up in this order."""
JSON_LIMIT = 64 * 2**20
"""config.json and index files are small; a larger one is refused rather than read."""


# --- config.json ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigEps:
    """The eps a config.json gives, and where: ``source`` is ``'PATH: KEY'``; ``norm``: whose
    eps it is (``'layer'`` or ``'rms'``, by its key)."""

    value: float
    path: str
    key: str

    @property
    def norm(self) -> str:
        return next(norm for norm, keys in EPS_KEYS_BY_NORM.items() if self.key in keys)

    @property
    def source(self) -> str:
        return f"{self.path}: {self.key}"


def config_path(path: str) -> str:
    """``path`` itself, or ``path/config.json`` when ``path`` is a folder."""
    return os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path


def config_eps(path: str, norm: str | None = None) -> ConfigEps:
    """The norm's eps of a transformers-style ``config.json`` (or a folder holding one): of
    ``norm`` (``'layer'`` or ``'rms'``), or when None of whichever the config gives
    (LayerNorm's keys first); a config with only the other norm's eps is refused.

    Example:
        >>> import json, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with open(f"{folder}/config.json", "w") as file:
        ...         json.dump({"model_type": "bert", "layer_norm_eps": 1e-12}, file)
        ...     found = config_eps(folder)
        >>> found.value, found.key, found.norm
        (1e-12, 'layer_norm_eps', 'layer')
    """
    path = config_path(path)
    document = read_json(path)
    if not isinstance(document, dict):
        raise MasklnError(f"{path}: not a model config (a JSON object was expected)")
    wanted = EPS_KEYS_BY_NORM if norm is None else {norm: EPS_KEYS_BY_NORM[norm]}
    for keys in wanted.values():
        for key in keys:
            if key in document:
                value = document[key]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise MasklnError(f"{path}: {key!r} is {value!r}, not a number")
                return ConfigEps(float(value), path, key)
    looked_for = ", ".join(repr(k) for keys in wanted.values() for k in keys)
    for other, keys in EPS_KEYS_BY_NORM.items():
        found = [k for k in keys if k in document]
        if found and other != norm:
            raise MasklnError(
                f"{path}: holds {found[0]!r}, {_EPS_OWNER[other]}, and none of {looked_for}:"
                f" give --norm {other}, or --eps to use that value anyway"
            )
    nested = [f"{k!r}" for k, v in document.items() if isinstance(v, dict) and _eps_in(v)]
    if nested:
        raise MasklnError(
            f"{path}: no {looked_for} at the top level, only inside {', '.join(nested)};"
            " give the one you mean with --eps"
        )
    raise MasklnError(f"{path}: holds none of {looked_for}; give eps with --eps")


_EPS_OWNER = {"layer": "a LayerNorm eps", "rms": "an RMSNorm eps"}


def _eps_in(section: dict[str, object]) -> bool:
    return any(key in section for keys in EPS_KEYS_BY_NORM.values() for key in keys)


def read_json(path: str) -> object:
    """A small JSON file's contents; every failure names the file."""
    check_regular_file(path, f"without {CONFIG_NAME}")
    try:
        with open(path, "rb") as file:
            data = file.read(JSON_LIMIT + 1)
    except OSError as error:
        raise MasklnError(f"{path}: cannot read: {error.strerror or error}") from None
    if len(data) > JSON_LIMIT:
        raise MasklnError(f"{path}: larger than {JSON_LIMIT // 2**20} MiB; not a config or index")
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        raise MasklnError(f"{path}: not valid JSON: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        reason = f"{error.msg} at line {error.lineno} column {error.colno}"
        raise MasklnError(f"{path}: not valid JSON: {reason}") from None
    except RecursionError:
        raise MasklnError(f"{path}: not valid JSON: nested too deeply") from None


# --- sharded checkpoints -------------------------------------------------------------------------


class ShardedFile:
    """The tensors of a sharded checkpoint, read through its ``model.safetensors.index.json``.

    The index's ``weight_map`` says which shard holds each key; a shard is opened (memory-mapped)
    the first time one of its tensors is asked for, so a layer norm's two tensors open one or two
    shards of many. It offers what :class:`~maskln_cli.files.tensorfile.TensorFile` does, but
    ``stacked`` (diff's, on single files).
    """

    def __init__(self, index_path: str, stack: contextlib.ExitStack, torch_tensors: bool = True):
        document = read_json(index_path)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(shard, str) for shard in weight_map.values()
        ):
            raise MasklnError(
                f"{index_path}: not a safetensors index (no 'weight_map' of key to shard file)"
            )
        metadata = document.get("metadata")
        self.name = index_path
        self.torch_tensors = torch_tensors
        self.metadata: dict[str, str] = (
            {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
            if isinstance(metadata, dict)
            else {}
        )
        self._folder = os.path.dirname(index_path)
        self._map: dict[str, str] = weight_map
        self._stack = stack
        self._shards: dict[str, TensorFile] = {}
        self._identity = file_identity(index_path)

    def read_files(self) -> dict[FileIdentity, str]:
        """The files this reads: the index, and every shard it names (opened or not yet)."""
        found = {} if self._identity is None else {self._identity: self.name}
        for shard in sorted(set(self._map.values())):
            identity = file_identity(os.path.join(self._folder, shard))
            if identity is not None:
                found.setdefault(identity, f"{self.name}'s shard {shard}")
        return found

    def keys(self) -> list[str]:
        return list(self._map)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def info(self, key: str) -> TensorInfo:
        return self._shard_for(key).info(key)

    def data_size(self, key: str) -> int:
        return self._shard_for(key).data_size(key)

    def tensor(self, key: str) -> torch.Tensor:
        return self._shard_for(key).tensor(key)

    def read_data(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        return self._shard_for(key).read_data(key, start, stop)

    def mapped(self, key: str) -> numpy.ndarray:
        return self._shard_for(key).mapped(key)

    def _shard_for(self, key: str) -> TensorFile:
        if key not in self._map:
            raise MasklnError(missing_key_message(self.name, key, self.keys()))
        shard = self._map[key]
        if shard not in self._shards:
            self._shards[shard] = self._open(shard, key)
        opened = self._shards[shard]
        if key not in opened:
            raise MasklnError(
                f"{self.name}: names shard {shard!r} for tensor {key!r}, but {opened.name} holds"
                " no such tensor"
            )
        return opened

    def _open(self, shard: str, key: str) -> TensorFile:
        parts = PurePath(shard).parts
        if not shard or os.path.isabs(shard) or ".." in parts:
            raise MasklnError(
                f"{self.name}: shard {shard!r} (for tensor {key!r}) is not a file name in the"
                " index's folder; refused"
            )
        path = os.path.join(self._folder, shard)
        try:
            return self._stack.enter_context(open_tensor_file(path, self.torch_tensors))
        except MasklnError as error:
            raise MasklnError(f"{self.name}: shard {shard!r} for tensor {key!r}: {error}") from None


Tensors = TensorFile | ShardedFile
"""A set of tensors read by key: one safetensors file, or a sharded checkpoint."""


@contextlib.contextmanager
def open_checkpoint(path: str, torch_tensors: bool = True) -> Iterator[Tensors]:
    """Open ``path`` as a set of tensors: a safetensors file (or ``-``), a folder holding
    ``model.safetensors`` or ``model.safetensors.index.json``, or an index file itself.

    Example:
        >>> with open_checkpoint("sample_data/worked_example.safetensors") as tensors:
        ...     tensors.keys()
        ['bias', 'scale', 'x', 'valid']
    """
    with contextlib.ExitStack() as stack:
        if path != STDIO and os.path.isdir(path):
            path = _checkpoint_in_folder(path)
        if path != STDIO and path.endswith(".json"):
            yield ShardedFile(path, stack, torch_tensors)
        else:
            yield stack.enter_context(open_tensor_file(path, torch_tensors))


def _checkpoint_in_folder(folder: str) -> str:
    """The file that holds (or indexes) a checkpoint folder's tensors, as transformers loads
    them: ``model.safetensors`` first, else its index."""
    for name in (WEIGHTS_NAME, INDEX_NAME):
        candidate = os.path.join(folder, name)
        if os.path.isfile(candidate):
            return candidate
    try:
        others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    except OSError:
        others = []
    hint = f" (it holds {', '.join(others[:3])}: give one as the file)" if others else ""
    raise MasklnError(f"{folder}: a folder holding neither {WEIGHTS_NAME} nor {INDEX_NAME}{hint}")


# --- layer norms by module name ------------------------------------------------------------------

SCALE_SUFFIXES = ("weight", "gamma")
BIAS_SUFFIXES = ("bias", "beta")


def module_keys(tensors: Tensors, module: str) -> tuple[str, str | None]:
    """The keys of module ``module``'s scale and bias: ``NAME.weight`` or ``NAME.gamma``, and
    ``NAME.bias`` or ``NAME.beta`` (None when it has no bias), whichever ``tensors`` holds.

    Example:
        >>> import torch
        >>> from maskln_cli.files.output import write_tensors
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     write_tensors(f"{folder}/m.safetensors", {"ln.gamma": torch.ones(2),
        ...                                              "ln.beta": torch.zeros(2)})
        ...     with open_checkpoint(f"{folder}/m.safetensors") as tensors:
        ...         module_keys(tensors, "ln")
        ('ln.gamma', 'ln.beta')
    """
    scale = _one_of(tensors, module, SCALE_SUFFIXES)
    if scale is None:
        raise MasklnError(_no_module_message(tensors, module))
    return scale, _one_of(tensors, module, BIAS_SUFFIXES)


def _one_of(tensors: Tensors, module: str, suffixes: tuple[str, str]) -> str | None:
    present = [f"{module}.{suffix}" for suffix in suffixes if f"{module}.{suffix}" in tensors]
    if len(present) > 1:
        option = "--scale-key" if suffixes == SCALE_SUFFIXES else "--bias-key"
        raise MasklnError(
            f"{tensors.name}: holds both {present[0]!r} and {present[1]!r}; name the one you"
            f" mean with {option}"
        )
    return present[0] if present else None


def parameter_modules(keys: list[str]) -> list[str]:
    """Module names that have a scale-like parameter (``.weight`` or ``.gamma``), in key order.

    Example:
        >>> parameter_modules(["a.LayerNorm.gamma", "a.LayerNorm.beta", "a.dense.weight", "x"])
        ['a.LayerNorm', 'a.dense']
    """
    modules: dict[str, None] = {}
    for key in keys:
        module, _, suffix = key.rpartition(".")
        if module and suffix in SCALE_SUFFIXES:
            modules[module] = None
    return list(modules)


def norm_modules(keys: list[str]) -> list[str]:
    """Modules whose name says they are a normalization (``LayerNorm``, ``ln_f``, ``norm1``...).

    Example:
        >>> norm_modules(["emb.LayerNorm.weight", "emb.dense.weight", "ln_f.weight", "n1.gamma"])
        ['emb.LayerNorm', 'ln_f']
    """
    return [
        m
        for m in parameter_modules(keys)
        if "norm" in m.rsplit(".", 1)[-1].lower() or m.rsplit(".", 1)[-1].lower().startswith("ln")
    ]


def _no_module_message(tensors: Tensors, module: str) -> str:
    head = f"{tensors.name}: no {module + '.weight'!r} or {module + '.gamma'!r}"
    _, _, suffix = module.rpartition(".")
    if suffix in SCALE_SUFFIXES + BIAS_SUFFIXES and module not in parameter_modules(tensors.keys()):
        stem = module.rpartition(".")[0]
        return f"{head}; --module takes the module's name: {stem!r}, without '.{suffix}'"
    close = closest_keys(module, parameter_modules(tensors.keys()))
    if close:
        return f"{head}; closest modules: {', '.join(repr(m) for m in close)}"
    return f"{head}, nor any module of a close name (maskln inspect --keys {tensors.name})"


def describe_norm_modules(keys: list[str], limit: int = 3) -> str:
    """A short list of the layer norms among ``keys``, for a hint.

    Example:
        >>> describe_norm_modules(["a.LayerNorm.weight", "b.LayerNorm.weight", "c.ln.weight",
        ...                        "d.LayerNorm.weight"])
        "4 such as 'a.LayerNorm', 'b.LayerNorm', 'c.ln'"
    """
    found = norm_modules(keys)
    if not found:
        return ""
    shown = ", ".join(repr(m) for m in found[:limit])
    return f"{len(found)} such as {shown}" if len(found) > limit else shown
