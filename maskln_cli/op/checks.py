"""The op's argument checks and dtype rules, shared by the public functions and the registered
ops, for both norms (RMSNorm's are LayerNorm's without the bias, with a finite offset).

A message always names the offending argument, so a user can act on it without a traceback.
The mask rule (:func:`as_valid_mask`) is here once, for the function, ``MaskedLayerNorm``,
the model tools and the files a command reads.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""Computed in float32 and returned in their own dtype."""
SUPPORTED_DTYPES = (torch.float32, torch.float64, *HALF_DTYPES)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the op computes in for x of ``dtype``: float32 for the half dtypes.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in HALF_DTYPES else dtype


def quiet_when_traced() -> None:
    """Under torch.jit.trace sizes are traced values: the checks compare the example's (as
    every Python condition on them is, in a trace) without a TracerWarning each."""
    if torch.jit.is_tracing():
        warnings.filterwarnings(
            "ignore", category=torch.jit.TracerWarning, module=r"maskln_cli\.op\."
        )


def check_inputs(x: object, valid: object, scale: object, bias: object, eps: object) -> float:
    """Raise TypeError or ValueError naming the offending argument; return eps as a float.

    Example:
        >>> check_inputs(torch.zeros(2, 3), torch.ones(2, dtype=torch.bool),
        ...              torch.ones(3), torch.zeros(3), 1e-5)
        1e-05
    """
    return _check(x, valid, (("scale", scale), ("bias", bias)), eps)


def check_rms_inputs(
    x: object, valid: object, scale: object, eps: object, offset: object
) -> tuple[float, float]:
    """RMSNorm's arguments: as :func:`check_inputs` checks LayerNorm's (no bias), and offset a
    finite number; return eps and offset as floats.

    Example:
        >>> check_rms_inputs(torch.zeros(2, 3), torch.ones(2, dtype=torch.bool),
        ...                  torch.ones(3), 1e-6, 1)
        (1e-06, 1.0)
    """
    eps = _check(x, valid, (("scale", scale),), eps)
    offset = as_number(offset, "offset")
    if not (offset > -math.inf and offset < math.inf):  # NaN fails both
        raise ValueError(f"offset must be a finite number, got {offset!r}")
    return eps, offset  # type: ignore[return-value]


def _check(x: object, valid: object, params: tuple[tuple[str, object], ...], eps: object) -> float:
    quiet_when_traced()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dtype = x.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"x must be a float32, float64, float16 or bfloat16 tensor, got {dtype_name(dtype)}"
        )
    for name, tensor in (("x", x), ("valid", valid), *params):
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {tensor.layout}")
    shape = x.shape
    if not shape:
        raise ValueError("x must have a channel axis (shape [..., C]), got a 0-d tensor")
    if not isinstance(valid, torch.Tensor):
        raise TypeError(f"valid must be a bool torch.Tensor, got {type(valid).__name__}")
    if valid.dtype != torch.bool:  # as_valid_mask converts masks of numbers first
        raise TypeError(f"valid must be a bool tensor, got {dtype_name(valid.dtype)}")
    if valid.shape != shape[:-1]:
        raise ValueError(
            f"valid must have x's leading shape {list(shape[:-1])}, got {list(valid.shape)}"
        )
    on_cpu = x.is_cpu  # CPU tensors share the one device: no device objects made
    if not (on_cpu and valid.is_cpu) and valid.device != x.device:
        raise ValueError(f"valid must be on x's device {x.device}, got {valid.device}")
    channels = shape[-1]
    for name, param in params:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(param).__name__}")
        if param.dtype != dtype and not (dtype in HALF_DTYPES and param.dtype == torch.float32):
            accepted = "x's dtype" + (" or float32" if dtype in HALF_DTYPES else "")
            raise TypeError(
                f"{name} must have {accepted} ({dtype_name(dtype)}), got {dtype_name(param.dtype)}"
            )
        if param.shape != (channels,):
            raise ValueError(
                f"{name} must have shape [{channels}] (x's channels), got {list(param.shape)}"
            )
        if not (on_cpu and param.is_cpu) and param.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {param.device}")
    eps = as_number(eps, "eps")
    # Comparisons only: under torch.compile with dynamic shapes, eps is a symbolic float.
    if not (eps > 0 and eps < math.inf):
        raise ValueError(f"eps must be a finite positive number, got {eps!r}")
    if dtype is not torch.float64 and eps_rounds_to_zero(eps, compute_dtype(dtype)):
        compute = dtype_name(compute_dtype(dtype))
        raise ValueError(f"eps {eps!r} rounds to 0 in {compute}, the compute dtype")
    return eps  # type: ignore[return-value]


def as_number(value: object, name: str) -> float:
    """``value`` (eps, offset) as a float, or a symbolic float as it is; a TypeError naming
    ``name`` for anything but a real number (a bool included). An int beyond float's range is
    inf (refused by the caller's finiteness check)."""
    if type(value) is float:  # the usual case, first: no abstract-class checks
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real | torch.SymFloat):
        what = "a finite positive number" if name == "eps" else "a finite number"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        try:
            return float(value)
        except OverflowError:  # an int beyond float's range
            return math.inf
    return value  # type: ignore[return-value]


def raise_contract_error(
    x: object, valid: object, scale: object, bias: object, eps: object, offset: object = 0.0
) -> None:
    """Raise :func:`check_inputs`' error for these inputs, or :func:`check_rms_inputs`' when
    bias is None (the native dispatcher ops call this when their own check of the same
    conditions fails); return when it finds none."""
    if bias is None:
        check_rms_inputs(x, valid, scale, eps, offset)
    else:
        check_inputs(x, valid, scale, bias, eps)


def check_backward_inputs(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: object,
    output_mask: list[bool],
) -> float:
    """The backward op's arguments: x, valid, scale and eps as :func:`check_inputs` checks
    them; dy of x's shape, mean and rstd one value per row, output_mask three bools."""
    eps = check_inputs(x, valid, scale, scale, eps)  # scale stands for bias: the same rules
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {list(x.shape)}, got {list(dy.shape)}")
    rows = valid.numel()
    for name, statistics in (("mean", mean), ("rstd", rstd)):
        if statistics.numel() != rows:
            raise ValueError(
                f"{name} must have one value per row ({rows}), got {statistics.numel()}"
            )
    if len(output_mask) != 3:
        raise ValueError(f"output_mask must have 3 entries, got {len(output_mask)}")
    return eps


def check_rms_backward_inputs(
    dy: torch.Tensor,
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    rstd: torch.Tensor,
    eps: object,
    offset: object,
    output_mask: list[bool],
) -> tuple[float, float]:
    """RMSNorm's backward op's arguments, as :func:`check_backward_inputs` (rstd alone, and
    output_mask two bools: dx, dscale)."""
    eps, offset = check_rms_inputs(x, valid, scale, eps, offset)
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {list(x.shape)}, got {list(dy.shape)}")
    if rstd.numel() != valid.numel():
        raise ValueError(f"rstd must have one value per row ({valid.numel()}), got {rstd.numel()}")
    if len(output_mask) != 2:
        raise ValueError(f"output_mask must have 2 entries, got {len(output_mask)}")
    return eps, offset


def eps_rounds_to_zero(eps: float, dtype: torch.dtype) -> bool:
    """True when eps, positive as a Python float, is 0 in ``dtype`` (then rows of constant
    values would divide by zero).

    Example:
        >>> eps_rounds_to_zero(1e-50, torch.float32), eps_rounds_to_zero(1e-50, torch.float64)
        (True, False)
    """
    # A comparison, so that it also runs under fake tensors and on a symbolic eps: 2**-150 is
    # half float32's smallest subnormal, and rounds (to even) to 0, as does anything below it.
    return dtype != torch.float64 and eps <= 2.0**-150


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_valid_mask(valid: object, name: str = "valid") -> torch.Tensor:
    """``valid`` as a bool mask, by maskln's one mask rule: a bool tensor is taken as it is; an
    integer or floating tensor only if it holds nothing but 0 and 1, where 1 means valid (a
    transformers ``attention_mask`` is int64 0/1). Anything else raises TypeError or ValueError
    naming ``name`` and the first offending value; a floating mask holding other values is most
    likely additive (0 where valid, -inf where masked), and the message says so.

    A bool mask costs nothing (no pass over it, nothing torch.compile would break on). Under
    torch.compile a mask of numbers is checked in the graph, by an assertion naming ``name``;
    under torch.func's transforms (``vmap`` over a batch of attention masks), the values beneath
    the transforms are checked, so the rule and its message are the same everywhere.

    Example:
        >>> as_valid_mask(torch.tensor([1, 0, 1])).tolist()
        [True, False, True]
        >>> as_valid_mask(torch.tensor([1, 2]), "mask")
        Traceback (most recent call last):
        ...
        ValueError: mask must hold only 0 and 1 (1 = valid), or be bool; found 2 at index [1]
    """
    if not isinstance(valid, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(valid).__name__}")
    if valid.dtype == torch.bool or valid.layout != torch.strided:
        return valid  # a sparse mask is refused by check_inputs, which names its layout
    values = _exact_values(valid)
    if values is None:
        raise TypeError(
            f"{name} must be bool, or an integer or floating tensor holding only 0 and 1"
            f" (1 = valid); got {dtype_name(valid.dtype)}"
        )
    rule = f"{name} must hold only 0 and 1 (1 = valid), or be bool"
    # Under torch.func the values are checked outside the transforms, on the tensor beneath
    # their wrappers (a branch on a batched tensor is refused by vmap); converted inside.
    checked = _beneath_transforms(values)
    if torch.compiler.is_compiling() or _symbolic(checked):
        # No data-dependent branch in a graph, nor on fake or meta tensors: assert in it.
        torch._assert_async(((checked == 0) | (checked == 1)).all(), rule)
        return values != 0
    _refuse_other_values(checked, valid.is_floating_point(), rule)
    return values != 0


def _refuse_other_values(values: torch.Tensor, floating: bool, rule: str) -> None:
    other = (values != 0) & (values != 1)  # NaN too
    if other.any():
        index = [int(i) for i in other.nonzero()[0]]
        message = f"{rule}; found {values[tuple(index)].item()!r} at index {index}"
        if floating:
            message += (
                ": a floating mask holding other values is most likely additive (0 where valid,"
                " -inf or a large negative number where masked); make it a 0/1 or bool mask"
                " first, e.g. mask == 0"
            )
        raise ValueError(message)


def _beneath_transforms(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor beneath torch.func's wrappers (vmap's batched tensors, grad's), whose
    values are all the values the transforms see; ``tensor`` itself outside them."""
    if not torch._C._are_functorch_transforms_active():
        return tensor
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(tensor):
        tensor = get_unwrapped(tensor)
    return tensor


def _symbolic(tensor: torch.Tensor) -> bool:
    """Fake, meta or other subclass tensors (tracing, export): no values to branch on."""
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type == "meta"


_SIGNED_OF_UNSIGNED = {
    torch.uint16: torch.int16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
}
_ORDINARY_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _exact_values(mask: torch.Tensor) -> torch.Tensor | None:
    """A mask's values in a dtype torch compares in on every torch version we support (0 and 1
    stay exactly 0 and 1), or None for dtypes with no such form (complex, float4, sub-byte
    integers, quantized).

    uint16 to uint64 are read as the signed integer of the same size (torch before 2.5 could
    not compare them), where 0 and 1 are the same bits and anything else stays neither. float8
    formats are converted to float32, exactly.

    Example:
        >>> _exact_values(torch.tensor([0, 1, 70000], dtype=torch.uint32)).tolist()
        [0, 1, 70000]
    """
    dtype = mask.dtype
    if dtype in _SIGNED_OF_UNSIGNED:
        return mask.view(_SIGNED_OF_UNSIGNED[dtype])
    if dtype.is_complex:
        return None
    if dtype.is_floating_point and dtype.itemsize == 1:
        try:
            return mask.float()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
    if dtype.is_floating_point or dtype in _ORDINARY_INTEGERS:
        return mask
    return None
