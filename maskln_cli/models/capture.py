"""``capture``: record each call of every layer norm of a model run, one dump file per call: the
``nn.LayerNorm``, ``nn.RMSNorm``, LLaMA-family RMSNorm and maskln modules of
:data:`~maskln_cli.models.kinds.KINDS`.

    with maskln_cli.capture(model, "dumps", valid=attention_mask):
        loss = model(input_ids, attention_mask=attention_mask).last_hidden_state.sum()
        loss.backward()  # optional: the gradients go into the same files

Hooks on each of those modules write a call's forward dump as soon as
the call returns, and its gradients as soon as a backward pass has computed them: nothing is
held beyond the call being written (see :mod:`maskln_cli.models.dumps` for the files).

The gradients are the module's own, call by call: a forward pre-hook hands the module an alias
of its input (``x.view_as(x)``) and of its weight and bias, each with a gradient hook, so their
gradients are those flowing through this call alone (in a pre-LN block x also feeds the
residual path, and a module called twice sums both calls into ``.grad``); the module's output
gets a hook for ``grad_out``. The parameters are put back when the call returns, errors
included, and the hooks removed when the ``with`` block ends, exceptions included; under nested
captures each alias remembers the model's own parameter, which is what goes back.

A capture holds its folder from its start to its end (:meth:`DumpFolder.claim`): another
capture into it, in this process or another, is refused.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from maskln_cli.models.dumps import MAX_CALLS, DumpFolder
from maskln_cli.models.kinds import Kind, lookalikes, summary
from maskln_cli.models.masks import fit_mask
from maskln_cli.models.select import select_layer_norms
from maskln_cli.models.swap import Swapped
from maskln_cli.op.checks import as_valid_mask, dtype_name

__all__ = ["Capture", "capture"]

PARAMETERS = (("weight", "scale", "grad_scale"), ("bias", "bias", "grad_bias"))
"""A module's parameter, its name in a dump, and its gradient's."""
ORIGINAL = "_maskln_capture_original"
"""The attribute of a parameter's alias holding the parameter itself."""
INPUT_NAMES = ("input", "x", "hidden_states")
"""A layer norm's input by name: nn.LayerNorm's forward(input), MaskedLayerNorm's (x, valid),
transformers' RMSNorms' (hidden_states)."""
log = logging.getLogger(__name__)


def capture(
    model: nn.Module,
    out_dir: str | Path,
    valid: torch.Tensor | None = None,
    *,
    modules: str | Iterable[str] | None = None,
    backward: bool = True,
    max_calls: int | None = None,
) -> Capture:
    """Record each call of every layer norm of ``model`` run in the ``with`` block into a dump
    file of its own in ``out_dir``: each ``nn.LayerNorm``, ``nn.RMSNorm``, RMSNorm of a
    LLaMA-family model (``LlamaRMSNorm``, ``GemmaRMSNorm``...:
    :data:`~maskln_cli.models.kinds.KINDS`), ``MaskedLayerNorm`` and ``MaskedRMSNorm``.

    Args:
        model: any ``nn.Module`` (a transformers model, in eval or train mode, float32 or
            under autocast). A ``torch.compile``'d model runs eagerly inside the block
            (``torch.compiler.set_stance("force_eager")``; its compiled code calls no hooks),
            so its dumps are what its modules compute eagerly.
        out_dir: a new or empty folder (created if missing) that no other capture is writing
            into: dumps of two runs never mix.
        valid: the batch's mask, ``[batch, seq]`` as a transformers ``attention_mask`` (by the
            one mask rule: bool, or 0/1 of any integer or floating dtype, 1 = valid), for the
            calls of the model's own norms; it must fit each call's rows (see
            :func:`maskln_cli.models.masks.fit_mask`). Default: every row valid. A masked
            norm's dump holds the mask it was given. Set :attr:`Capture.valid` between
            batches.
        modules: glob patterns of module paths (fnmatch: ``*`` matches dots too, so
            ``"encoder.layer.11.*"`` is every layer norm of layer 11): record only those layer
            norms. Default: all of them.
        backward: record gradients when a backward pass runs in the block (True), or the
            forward pass only, with no alias or hook in the autograd graph (False).
        max_calls: record the first ``max_calls`` calls only. A capture records 100,000 calls
            at most (:data:`maskln_cli.models.dumps.MAX_CALLS`); past them a warning says how
            many were not recorded.

    Returns:
        A :class:`Capture`, the context manager; ``with capture(...) as run:`` gives it,
        ``run.found`` says which norms it records, by kind, and ``run.files`` lists the dumps
        written, in call order.

    Raises:
        ValueError: the model has no layer norm maskln knows (the message names the modules
            that look like norms but whose formula maskln does not know), or an argument is
            wrong (the message names it).
    """
    return Capture(model, out_dir, valid, modules, backward, max_calls)


@dataclass
class _Call:
    """A layer norm call between its pre-hook and its forward hook."""

    index: int
    module: nn.Module
    x: torch.Tensor
    parameters: dict[str, nn.Parameter] = field(default_factory=dict)  # aliased, to put back
    gradients: set[str] = field(default_factory=set)  # those the backward pass will bring


class Capture:
    """The context manager :func:`capture` returns. ``found``: how many norms of each kind it
    records (``{"LlamaRMSNorm": 5}``). After (or during) the block:

    - ``files``: the dumps written, in call order;
    - ``calls``: how many calls were recorded, ``skipped`` how many were not (``max_calls``, or
      past the limit of 100,000 calls, which warns).
    """

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | Path,
        valid: torch.Tensor | None,
        modules: str | Iterable[str] | None,
        backward: bool,
        max_calls: int | None,
    ) -> None:
        self._targets = select_layer_norms(_uncompiled(model), modules)
        if not self._targets:
            raise ValueError(_none_found(model))
        self._kinds = {id(found.module): found.kind for found in self._targets}
        self.found = dict(Counter(found.kind.name for found in self._targets).most_common())
        log.info(
            "capture: %s: recording %s",
            type(model).__name__,
            summary(found.kind.name for found in self._targets),
        )
        if max_calls is not None and (
            isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1
        ):
            raise ValueError(f"max_calls must be a positive int or None, got {max_calls!r}")
        self.valid = valid
        self._folder = Path(out_dir)
        self._backward = backward
        self._limit = min(max_calls or MAX_CALLS, MAX_CALLS)
        self._past_limit = 0  # calls left out by MAX_CALLS, not by the max_calls asked for
        self._dumps = DumpFolder(self._folder)
        self._handles: list[RemovableHandle] = []
        self._open: dict[int, list[_Call | None]] = {}  # module id -> calls under way
        self._expected: dict[int, set[str]] = {}  # call -> gradients still to come
        self._pending: dict[str, torch.Tensor] = {}  # gradients of one call, not yet written
        self._pending_call: int | None = None
        self._lock = threading.RLock()  # backward hooks may run on autograd's threads
        self._entered = self._closed = False
        self._warned: set[str] = set()
        self._eager: Any = None  # the compiler stance in force inside the block
        self.calls = self.skipped = 0

    @property
    def valid(self) -> torch.Tensor | None:
        """The mask for the ``nn.LayerNorm`` calls of the next forward passes (bool)."""
        return self._valid

    @valid.setter
    def valid(self, mask: torch.Tensor | None) -> None:
        self._valid = None if mask is None else as_valid_mask(mask, "valid")

    @property
    def files(self) -> list[Path]:
        return [self._dumps.files[call] for call in sorted(self._dumps.files)]

    def __enter__(self) -> Capture:
        if self._entered:
            raise RuntimeError("a Capture records one with block; call capture() again")
        self._entered = True
        folder = self._folder
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"out_dir {str(folder)!r} is a file; give a folder")
        folder.mkdir(parents=True, exist_ok=True)
        # Claimed before it is found empty: of two captures starting together, one writes.
        self._dumps.claim()
        dumps = sorted(folder.glob("*.safetensors"))
        if dumps:
            self._dumps.release()
            raise ValueError(
                f"out_dir {str(folder)!r} already holds {len(dumps)} .safetensors files (first"
                f" {dumps[0].name!r}); capture into a new or empty folder, so that the dumps of"
                " two runs never mix"
            )
        # A torch.compile'd model would run its compiled code, which calls no hooks: nothing
        # would be recorded. Inside the block, compiled code runs eagerly instead.
        self._eager = torch.compiler.set_stance("force_eager")
        for path, module, _ in self._targets:
            self._handles += [
                module.register_forward_pre_hook(self._before, with_kwargs=True),
                module.register_forward_hook(
                    self._after_hook(path), with_kwargs=True, always_call=True
                ),
            ]
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        with self._lock:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for calls in self._open.values():  # an interruption the forward hook never saw
                for call in calls:
                    if call is not None:
                        _restore(call)
            self._open.clear()
            self._closed = True
            if self._eager is not None:
                self._eager.__exit__(None, None, None)  # the stance before the block
                self._eager = None
            try:
                if kind is None and self._pending_call is not None:
                    self._flush()
            finally:
                self._dumps.release()
        if kind is None and self._past_limit:
            self._warn_once(
                f"capture: {self._past_limit} layer norm calls past the limit of {MAX_CALLS:,}"
                " calls were not recorded (a dump's name numbers its call in five digits);"
                " record fewer with modules=, or capture the rest of the run into another folder"
            )
        if kind is None and self.calls == self.skipped == 0:
            self._warn_once(
                "capture: no layer norm of the model was called in the with block, so nothing"
                " was recorded: run the model you gave capture() inside the block"
            )

    # --- the forward pass ---------------------------------------------------------------------

    def _before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        calls = self._open.setdefault(id(module), [])
        if self.calls >= self._limit:
            self.skipped += 1
            if self.calls >= MAX_CALLS:
                self._past_limit += 1
            calls.append(None)
            return None
        if _in_backward():
            self._warn_once(
                "capture: layer norms ran inside a backward pass (gradient checkpointing"
                " recomputing a forward): those calls are not recorded, nor the gradients of"
                " the layers they recompute; capture with gradient checkpointing off"
            )
            calls.append(None)
            return None
        keyword = next((key for key in INPUT_NAMES if key in kwargs), None)
        x = args[0] if args else kwargs.get(keyword) if keyword else None
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"capture: expected a tensor as the layer norm's input, got {x!r}")
        call = _Call(self.calls, module, x)
        self.calls += 1
        calls.append(call)
        if not (self._backward and torch.is_grad_enabled()):
            return None
        for name, _, gradient in PARAMETERS:
            parameter = module._parameters.get(name)
            if parameter is not None and parameter.requires_grad:
                alias = parameter.view_as(parameter)
                alias.register_hook(self._gradient_hook(call.index, gradient))
                # Under another capture the module holds that capture's alias: what goes back
                # is the model's own parameter, whichever capture's hook runs last.
                original = getattr(parameter, ORIGINAL, parameter)
                setattr(alias, ORIGINAL, original)
                module._parameters[name] = alias  # put back by _restore  # type: ignore[assignment]
                call.parameters[name] = original
                call.gradients.add(gradient)
        if not x.requires_grad:
            return None
        alias = x.view_as(x)
        alias.register_hook(self._gradient_hook(call.index, "grad_x"))
        call.gradients.add("grad_x")
        if args:
            return (alias, *args[1:]), kwargs
        return args, {**kwargs, keyword: alias}

    def _after_hook(self, path: str):  # type: ignore[no-untyped-def]
        def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            call = self._open[id(module)].pop()
            if call is None:
                return
            _restore(call)
            if output is None:  # the forward raised
                return
            self._record(path, module, call, args, kwargs, output)

        return after

    def _record(
        self,
        path: str,
        module: nn.Module,
        call: _Call,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
    ) -> None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"capture: layer norm {path!r} returned {type(out).__name__}")
        x = call.x
        kind = self._kinds[id(module)]
        shape = kind.shape_of(module)
        if tuple(x.shape[-len(shape) :]) != shape or x.dim() < len(shape):
            raise ValueError(
                f"capture: layer norm {path!r} normalizes {list(shape)}, but its input has shape"
                f" {list(x.shape)}: maskln normalizes the last axes; leave it out with modules="
            )
        leading = tuple(x.shape[: x.dim() - len(shape)])
        valid, source = self._valid_of(path, module, kind, args, kwargs, x, leading)
        tensors, metadata = _dump(path, module, kind, call, out, valid, source)
        with self._lock:
            self._dumps.write(call.index, path, tensors, metadata)
            if call.gradients and out.requires_grad:
                call.gradients.add("grad_out")
                out.register_hook(self._gradient_hook(call.index, "grad_out"))
                self._expected[call.index] = call.gradients

    def _valid_of(
        self,
        path: str,
        module: nn.Module,
        kind: Kind,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        x: torch.Tensor,
        leading: tuple[int, ...],
    ) -> tuple[torch.Tensor, str]:
        """The call's mask of rows, and where it came from (metadata ``valid_source``)."""
        if kind.masked:
            given = args[1] if len(args) > 1 else kwargs.get("valid")
            if given is not None:
                return as_valid_mask(given, "valid"), "the module's valid argument"
            if isinstance(module, Swapped):
                return module.mask_for(x), "the model's mask (swap_layer_norms)"
        if self._valid is None:
            return torch.ones(leading, dtype=torch.bool, device=x.device), "none: every row"
        where = f"capture: layer norm {path!r}"
        mask = fit_mask(self._valid.to(x.device), leading, where)
        return mask, f"capture(valid=) {list(self._valid.shape)}"

    # --- the backward pass --------------------------------------------------------------------

    def _gradient_hook(self, call: int, key: str):  # type: ignore[no-untyped-def]
        def hook(gradient: torch.Tensor) -> None:
            self._receive(call, key, gradient)

        return hook

    def _receive(self, call: int, key: str, gradient: torch.Tensor) -> None:
        with self._lock:
            if self._closed:
                self._warn_once(
                    "capture: a backward pass ran after the with block ended; its gradients"
                    " were not recorded (run backward inside the block)"
                )
                return
            if self._pending_call not in (None, call):
                self._flush()  # another call's gradients: this one's are all here, or never
            self._pending_call = call
            gradient = gradient.detach().clone()  # autograd may reuse its buffer
            earlier = self._pending.get(key)
            self._pending[key] = gradient if earlier is None else earlier + gradient
            if self._expected.get(call, set()) <= self._pending.keys():
                self._flush()

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    def _flush(self) -> None:
        call, gradients = self._pending_call, self._pending
        self._pending_call, self._pending = None, {}
        if call is not None and gradients:
            self._dumps.add_gradients(call, gradients)


def _dump(
    path: str,
    module: nn.Module,
    kind: Kind,
    call: _Call,
    out: torch.Tensor,
    valid: torch.Tensor,
    source: str,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A call's dump: its tensors (an RMSNorm's without bias) and metadata (an RMSNorm's with
    its ``norm`` and ``offset``: the gain is offset + scale)."""
    x = call.x
    shape = kind.shape_of(module)
    leading = tuple(x.shape[: x.dim() - len(shape)])
    channels = math.prod(shape)
    tensors = {
        "x": x.reshape(*leading, channels),
        "valid": valid,
        "scale": _parameter(module, call, "weight", x, shape, 1.0).reshape(channels),
        "out": out.reshape(*leading, channels),
    }
    if kind.norm.centered:
        tensors["bias"] = _parameter(module, call, "bias", x, shape, 0.0).reshape(channels)
    metadata = {
        "eps": repr(kind.eps_of(module, x.dtype)),
        "module": path,
        "call": str(call.index),
        "dtype": dtype_name(x.dtype),
        "module_type": f"{type(module).__module__}.{type(module).__qualname__}",
        "padding": "zeroed" if kind.masked else "normalized",
        "valid_source": source,
        "training": str(module.training).lower(),
        "autocast": _autocast(x.device.type),
        **_versions(),
    }
    if not kind.norm.centered:
        weighted = module._parameters.get("weight") is not None  # no weight: a gain of 1
        metadata["norm"] = kind.norm.name
        metadata["offset"] = repr(kind.offset_of(module) if weighted else 0.0)
    if len(shape) > 1:
        metadata["normalized_shape"] = str(list(shape))
    return tensors, metadata


def _parameter(
    module: nn.Module,
    call: _Call,
    name: str,
    x: torch.Tensor,
    shape: tuple[int, ...],
    fill: float,
) -> torch.Tensor:
    parameter = call.parameters.get(name, module._parameters.get(name))
    if parameter is None:  # no affine (or no bias): what the module multiplies or adds
        return torch.full(shape, fill, dtype=x.dtype)
    return parameter


def _none_found(model: nn.Module) -> str:
    """Why a model has nothing to capture, naming its lookalikes."""
    text = (
        f"{type(model).__name__} has no layer norm maskln knows (nn.LayerNorm, nn.RMSNorm, the"
        " RMSNorms of LLaMA-family models, MaskedLayerNorm, MaskedRMSNorm)"
    )
    unknown = lookalikes(model)
    if unknown:
        shown = ", ".join(repr(path) for path in list(unknown)[:3])
        more = ", ..." if len(unknown) > 3 else ""
        text += (
            f"; it has modules that look like norms but whose formula maskln does not know"
            f" ({summary(unknown.values())}: {shown}{more})"
        )
    return text


def _uncompiled(model: nn.Module) -> nn.Module:
    """A ``torch.compile``'d model's own module, whose paths are the model's (without
    ``_orig_mod.``, as in its checkpoint)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def _restore(call: _Call) -> None:
    """Put a call's parameters back in place of their aliases."""
    for name, parameter in call.parameters.items():
        call.module._parameters[name] = parameter
    call.parameters.clear()


def _in_backward() -> bool:
    """A layer norm running inside a backward pass is gradient checkpointing recomputing a
    forward: already recorded in its first run, and not what its first run computed."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _autocast(device: str) -> str:
    """Metadata ``autocast``: the dtype autocast computes in on ``device``, or ``off``."""
    if device in ("cpu", "cuda", "xpu") and torch.is_autocast_enabled(device):
        return dtype_name(torch.get_autocast_dtype(device))
    return "off"


def _versions() -> dict[str, str]:
    from maskln_cli.version import installed_version

    return {"maskln_version": installed_version(), "torch_version": torch.__version__}
