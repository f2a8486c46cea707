"""``swap_layer_norms``: a model's layer norms become maskln's masked norms, fed the mask of each
forward call: ``nn.LayerNorm`` becomes ``MaskedLayerNorm``; ``nn.RMSNorm`` and the RMSNorms of
LLaMA-family models (:data:`~maskln_cli.models.kinds.KINDS`) become ``MaskedRMSNorm``.

A transformers model calls its layer norms with the hidden states alone, so the mask reaches
them through the model: a forward pre-hook on the model takes it from the call's arguments
(by name or by position, as the model's ``forward`` binds them) into a :class:`ModelMask` that
the swapped layer norms read, and a forward hook (always called, errors included) takes it
away again. The hooks are bound methods of that ModelMask, so a deep copy of the model
(``copy.deepcopy``, ``torch.optim.swa_utils.AveragedModel``) copies it with the model and wires
the copy's hooks to the copy's layer norms: no closure keeps a copy reading the original's mask.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

import torch
from torch import nn

from maskln_cli.models.kinds import KINDS, Kind, lookalikes, summary
from maskln_cli.models.masks import fit_mask
from maskln_cli.models.select import Found, select_layer_norms
from maskln_cli.op.checks import as_valid_mask
from maskln_cli.op.module import MaskedLayerNorm, MaskedRMSNorm

__all__ = ["ModelMask", "SwappedLayerNorm", "SwappedRMSNorm", "swap_layer_norms"]

SWAPPED_KINDS = tuple(kind for kind in KINDS if not kind.masked)
"""The kinds the swap replaces: every kind but maskln's own masked norms."""
LAYER_NORM = next(kind for kind in KINDS if kind.match is nn.LayerNorm)
log = logging.getLogger(__name__)

POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class ModelMask:
    """The mask of the model's forward call in progress, which its swapped layer norms read;
    None between calls, so that a layer norm called on its own never reads an earlier batch's
    mask.

    ``argument`` names the forward's argument that carries the mask, and ``position`` is its
    index among the positional arguments (None when it can only be given by name).

    The hooks only hold the call's mask (no tensor operation): the first layer norm that reads
    it converts it by the one mask rule, once per call. So under torch.compile the hooks,
    which run as frames of their own, make no graph, and the conversion is traced into the
    model's graph: one graph for the whole forward.
    """

    def __init__(self, argument: str, position: int | None) -> None:
        self.argument = argument
        self.position = position
        self.given: torch.Tensor | None = None
        self.converted: torch.Tensor | None = None
        # The masks of the calls outside this one (a forward inside a forward of the model).
        self._outer: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []

    @property
    def mask(self) -> torch.Tensor | None:
        """The call's mask as a bool tensor (converted on first use), or None between calls."""
        if self.converted is None and self.given is not None:
            self.converted = as_valid_mask(self.given, self.argument)
        return self.converted

    def take(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's forward pre-hook: the call's mask."""
        self._outer.append((self.given, self.converted))  # first: drop() runs if this raises
        self.given = self.converted = None
        mask = kwargs.get(self.argument)
        if mask is None and self.position is not None and self.position < len(args):
            mask = args[self.position]
        if mask is None:
            raise TypeError(
                f"{type(model).__name__} was called without {self.argument}, which its layer"
                f" norms (swapped by maskln_cli.swap_layer_norms) need to zero the padding:"
                f" pass {self.argument}= (all ones when nothing is padded)"
            )
        if not isinstance(mask, torch.Tensor):
            as_valid_mask(mask, self.argument)  # its TypeError, naming the argument, now
        self.given = mask

    def drop(self, model: nn.Module, args: object, kwargs: object, output: object) -> None:
        """The model's forward hook, also called when the forward raised."""
        self.given, self.converted = self._outer.pop() if self._outer else (None, None)


class Swapped:
    """What a masked norm standing in for a model's own needs: called with the hidden states
    alone, it takes its mask from the model's forward call (see :func:`swap_layer_norms`);
    called with ``valid``, it uses that.

    ``path`` is its place in the model (for messages); ``model_mask`` the model's
    :class:`ModelMask`. Its parameters are the replaced module's own, under the same names.
    """

    path: str
    model_mask: ModelMask | None

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        if valid is None:
            valid = self.mask_for(x)
        return super().forward(x, valid)  # type: ignore[misc]

    def mask_for(self, x: torch.Tensor) -> torch.Tensor:
        """The bool mask of ``x``'s rows, from the model's forward call in progress."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            got = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"x must be a torch.Tensor of shape [..., C], got {got}")
        source = getattr(self, "model_mask", None)
        mask = None if source is None else source.mask
        if mask is None:
            argument = "its mask" if source is None else source.argument
            raise RuntimeError(
                f"layer norm {self.path!r} was called outside a forward call of the model"
                f" swap_layer_norms swapped it into, so it has no mask: call the model (its"
                f" forward hands {argument} to its layer norms), or pass valid= to this module"
            )
        return fit_mask(mask, x.shape[:-1], f"layer norm {self.path!r}")

    def placed(self, module: nn.Module, model_mask: ModelMask, path: str) -> None:
        """Take ``module``'s training mode and place in the model."""
        self.train(module.training)  # type: ignore[attr-defined]
        self.path = path
        self.model_mask = model_mask

    def extra_repr(self) -> str:
        source = getattr(self, "model_mask", None)
        return super().extra_repr() + (f", mask={source.argument}" if source else "")  # type: ignore[misc]


class SwappedLayerNorm(Swapped, MaskedLayerNorm):
    """A ``MaskedLayerNorm`` standing in for a model's ``nn.LayerNorm`` (see :class:`Swapped`).
    Its parameters are the ``nn.LayerNorm``'s own, under the same names."""

    @classmethod
    def replacing(
        cls, layer_norm: nn.LayerNorm, model_mask: ModelMask, path: str
    ) -> SwappedLayerNorm:
        """A SwappedLayerNorm with ``layer_norm``'s size, eps, training mode and parameters:
        the same Parameter objects, so an optimizer made before the swap still trains them."""
        _check_swappable(Found(path, layer_norm, LAYER_NORM))
        norm = cls(
            layer_norm.normalized_shape,
            eps=layer_norm.eps,
            elementwise_affine=layer_norm.elementwise_affine,
            bias=layer_norm.bias is not None,
            device="meta",  # no memory: the parameters are layer_norm's own
        )
        norm.weight = layer_norm.weight
        norm.bias = layer_norm.bias
        norm.placed(layer_norm, model_mask, path)
        return norm


class SwappedRMSNorm(Swapped, MaskedRMSNorm):
    """A ``MaskedRMSNorm`` standing in for a model's RMSNorm (``nn.RMSNorm``, ``LlamaRMSNorm``,
    ``GemmaRMSNorm``...: see :class:`Swapped`). Its weight is the replaced module's own, under
    the same name; its eps and offset are the module's kind's (Gemma's gain is ``1 + weight``).
    """

    @classmethod
    def replacing(
        cls, module: nn.Module, kind: Kind, model_mask: ModelMask, path: str
    ) -> SwappedRMSNorm:
        """A SwappedRMSNorm with ``module``'s size, eps, offset, training mode and weight (the
        same Parameter object)."""
        _check_swappable(Found(path, module, kind))
        weight = module.weight
        norm = cls(
            kind.shape_of(module),
            eps=getattr(module, kind.eps),  # None stays None: nn.RMSNorm's rule, per call
            elementwise_affine=weight is not None,
            offset=kind.offset_of(module),
            device="meta",  # no memory: the weight is the module's own
        )
        norm.weight = weight
        norm.placed(module, model_mask, path)
        return norm


def swap_layer_norms(
    model: nn.Module,
    *,
    mask_argument: str = "attention_mask",
    modules: str | list[str] | None = None,
) -> nn.Module:
    """Replace every layer norm of ``model`` by a masked norm that zeroes the padding, and return
    ``model`` (changed in place): each ``nn.LayerNorm`` by a ``MaskedLayerNorm``; each
    ``nn.RMSNorm``, and each RMSNorm of a LLaMA-family model (``LlamaRMSNorm``,
    ``Qwen2RMSNorm``, ``MistralRMSNorm``, ``GemmaRMSNorm`` with its offset of 1,
    ``T5LayerNorm``...: :data:`~maskln_cli.models.kinds.KINDS`) by a ``MaskedRMSNorm``.

    It logs what it swapped, by kind (at INFO, on the ``maskln_cli.models.swap`` logger), and
    warns when it swaps nothing (a model with no norm maskln knows), or leaves a module whose
    class name says it is a norm but whose formula maskln does not know (never silently).

    Each forward call of ``model`` hands its ``mask_argument`` (by name or by position, as
    ``model.forward`` binds it) to every swapped layer norm, by maskln's one mask rule: bool,
    or integers or floats holding only 0 and 1, 1 meaning valid. A call without it raises,
    as does a swapped layer norm called outside a forward of ``model``, or on rows the mask
    does not fit (see :func:`maskln_cli.models.masks.fit_mask`); nothing falls back to "every
    row valid". The model's ``state_dict`` is unchanged (the same parameters, under the same
    names), and the swap survives ``copy.deepcopy``, ``AveragedModel`` (EMA, SWA),
    ``torch.save`` and ``torch.compile`` (no graph break).

    Args:
        model: the model; its forward must take ``mask_argument`` (or ``**kwargs``).
        mask_argument: the forward's argument that carries the mask.
        modules: glob patterns of module paths (``"encoder.*"``): swap only those layer
            norms. Default: all of them.

    Raises:
        TypeError: ``model.forward`` takes no ``mask_argument``.
        ValueError: a layer norm that maskln's cannot stand in for (one normalizing several
            axes, or a subclass of torch's with its own forward): leave it out with
            ``modules``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> class Tagger(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = model
        ...     def forward(self, x, attention_mask):
        ...         return self.body(x)
        >>> tagger = swap_layer_norms(Tagger())
        >>> tagger.body[1]
        SwappedLayerNorm((4,), eps=1e-05, elementwise_affine=True, mask=attention_mask)
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> out = tagger(torch.randn(2, 3, 4), mask)
        >>> bool((out[mask == 0] == 0).all()), bool((out[mask == 1] != 0).all())
        (True, True)
        >>> tagger(torch.randn(2, 3, 4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: Tagger was called without attention_mask, which its layer norms ...
    """
    targets = select_layer_norms(model, modules, kinds=SWAPPED_KINDS)
    for found in targets:  # every refusal before any change
        _check_swappable(found)
    model_mask = _hooked_mask(model)
    if model_mask is None:
        model_mask = ModelMask(mask_argument, _mask_position(model, mask_argument))
    elif model_mask.argument != mask_argument:
        raise ValueError(
            f"model's layer norms were swapped with their mask from {model_mask.argument!r};"
            f" they cannot take it from {mask_argument!r} too"
        )
    swapped = {id(found.module): _replacement(found, model_mask) for found in targets}
    # Set by identity, in every parent: a layer norm shared by two blocks stays shared.
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in swapped:
                setattr(parent, name, swapped[id(child)])
    if _hooked_mask(model) is None:
        model.register_forward_pre_hook(model_mask.take, with_kwargs=True)
        model.register_forward_hook(model_mask.drop, with_kwargs=True, always_call=True)
    _say(model, targets, modules)
    return model


def _replacement(found: Found, model_mask: ModelMask) -> Swapped:
    if found.kind.norm.centered:
        return SwappedLayerNorm.replacing(found.module, model_mask, found.path)  # type: ignore[arg-type]
    return SwappedRMSNorm.replacing(found.module, found.kind, model_mask, found.path)


def _say(model: nn.Module, targets: list[Found], modules: str | list[str] | None) -> None:
    """Log what was swapped, by kind; warn when nothing was, or lookalikes were left."""
    name = type(model).__name__
    unknown = lookalikes(model) if modules is None else {}
    if unknown:
        shown = ", ".join(repr(path) for path in list(unknown)[:3])
        more = ", ..." if len(unknown) > 3 else ""
        warnings.warn(
            f"swap_layer_norms: {name} has modules that look like norms but whose formula maskln"
            f" does not know ({summary(unknown.values())}: {shown}{more}); they were not"
            " swapped, and the padding reaches them",
            stacklevel=3,
        )
    if targets:
        log.info("swap_layer_norms: %s: swapped %s", name, summary(f.kind.name for f in targets))
        return
    if modules is None and not any(isinstance(m, Swapped) for m in model.modules()):
        warnings.warn(
            f"swap_layer_norms: {name} has no layer norm maskln knows (nn.LayerNorm, nn.RMSNorm,"
            " or the RMSNorms of LLaMA-family models), so nothing was swapped",
            stacklevel=3,
        )


def _check_swappable(found: Found) -> None:
    path, module, kind = found
    base = kind.match
    what = "an nn.LayerNorm" if kind.norm.centered else "an nn.RMSNorm"
    masked = "MaskedLayerNorm" if kind.norm.centered else "MaskedRMSNorm"
    if not path:
        if not isinstance(base, type):
            raise ValueError(f"model is itself a {kind.name}: swap the model it is part of")
        converter = "from_layer_norm" if kind.norm.centered else "from_rms_norm"
        raise ValueError(f"model is itself {what}: {masked}.{converter} converts it")
    if isinstance(base, type) and type(module).forward is not base.forward:
        raise ValueError(
            f"layer norm {path!r} is a {type(module).__name__}, {what} with a forward of its"
            f" own, which {masked} cannot stand in for; leave it out with modules="
        )
    shape = kind.shape_of(module)
    if len(shape) != 1:
        raise ValueError(
            f"layer norm {path!r} normalizes {list(shape)}: {masked} normalizes the last axis"
            " only; leave it out with modules="
        )


def _hooked_mask(model: nn.Module) -> ModelMask | None:
    """The ModelMask whose hooks ``model`` already has (swapped before), if any."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, ModelMask):
            return owner
    return None


def _mask_position(model: nn.Module, argument: str) -> int | None:
    """The index of ``argument`` among ``model.forward``'s positional parameters, or None
    when it can be given by name only; a TypeError when the forward cannot take it."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: by name only
        return None
    named = next((p for p in parameters if p.name == argument), None)
    if named is None:
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return None
        raise TypeError(
            f"{type(model).__name__}.forward takes no argument {argument!r}: name the one that"
            " carries the mask with mask_argument="
        )
    if named.kind not in POSITIONAL:
        return None
    return [p for p in parameters if p.kind in POSITIONAL].index(named)
