"""Causes in words for failures no formula explains: an exception torch raised inside the function
(a broadcasting or dtype error, ``.view`` on a strided tensor, ...), a second derivative that
cannot be taken or is wrong, a NaN gradient where the variance is zero. Each is a
:class:`~maskln_cli.op.mistakes.Diagnosis`, so that the root cause names it like any mistake.

Example:
    >>> found = explain_exception(
    ...     "RuntimeError: The size of tensor a (6) must match the size of tensor b (8) at"
    ...     " non-singleton dimension 2")
    >>> found.mistake
    'broadcasting_error'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from maskln_cli.op.mistakes import Diagnosis


@dataclass(frozen=True)
class Cause:
    """A cause recognized by the words of an error: ``pattern`` (a regular expression, searched
    case-insensitively) and the diagnosis it gives."""

    pattern: str
    mistake: str
    description: str
    fix: str

    def diagnosis(self) -> Diagnosis:
        return Diagnosis(self.mistake, self.description, self.fix, 0.0)


EXCEPTION_CAUSES = (
    Cause(
        r"once_differentiable",
        "backward_not_differentiable",
        "the backward is not differentiable: it is marked @once_differentiable, so no second"
        " derivative can flow through it",
        "drop @once_differentiable and write the backward in differentiable torch operations"
        " (or let autograd differentiate the forward)",
    ),
    Cause(
        r"must match the size of tensor|shape mismatch|cannot be broadcast|not broadcastable"
        r"|expanded size of the tensor",
        "broadcasting_error",
        "shapes that do not broadcast: valid [...] meets x [..., C] without valid[..., None]"
        " (torch lines shapes up from the right), or scale or bias broadcast on the wrong axis",
        "use valid[..., None] (valid.unsqueeze(-1)) against x, and scale and bias of shape [C]"
        " against x's last axis",
    ),
    Cause(
        r"expected scalar type|found dtype|dtypes? match|can't be cast to the desired output"
        r"|expected .* to have the same dtype|but got .*(Float|Double|Half)|same dtype"
        r"|(Float|Double|Half|BFloat16) did not match (Float|Double|Half|BFloat16)",
        "dtype_error",
        "tensors of different dtypes meet: one made without dtype=x.dtype (torch.zeros, ones,"
        " tensor and empty default to float32) or cast with .float() / .double()",
        "make every tensor in x's dtype: torch.zeros_like(x), x.new_zeros(...),"
        " torch.tensor(v, dtype=x.dtype)",
    ),
    Cause(
        r"view size is not compatible|use \.reshape\(\.\.\.\) instead",
        "view_on_strided",
        ".view on a tensor that is not contiguous (a transposed, sliced or expanded input, or"
        " upstream gradient): .view needs compatible strides",
        "use .reshape (it copies only when it must), or .contiguous() first",
    ),
    Cause(
        r"modified by an inplace operation|in-place operation",
        "inplace_breaks_autograd",
        "an in-place operation on a tensor autograd needs: one saved for the backward and"
        " modified afterwards (x.sub_(mean)), a leaf that requires grad, or the incoming"
        " gradient written into (grad_out.mul_(...))",
        "use out-of-place operations (y = x - mean, not x.sub_(mean)) on inputs, gradients"
        " and anything the backward needs",
    ),
    Cause(
        r"Expected all tensors to be on the same device",
        "device_error",
        "a tensor created on the CPU meets inputs on another device",
        "create tensors on x's device: torch.zeros_like(x), x.new_tensor(...), device=x.device",
    ),
    Cause(
        r"does not require grad and does not have a grad_fn|first-order gradients are not"
        r" differentiable",
        "detached_from_graph",
        "the result (or a gradient) has no graph back to the inputs: computed under"
        " torch.no_grad(), through .detach(), .item(), .numpy() or a new tensor",
        "compute the output from x, scale and bias with torch operations that autograd"
        " records; never detach or leave torch on the way",
    ),
    Cause(
        r"appears to not have been used in the graph|not have been used in the graph",
        "input_unused",
        "an input the result does not depend on: scale or bias left out of the formula, or"
        " used through a detached copy",
        "use every input in the output's formula: xhat * scale + bias",
    ),
    Cause(
        r"Dimension out of range|too many indices for tensor|not enough values to unpack"
        r"|tuple index out of range",
        "assumes_leading_axes",
        "the function assumes a number of leading axes (x [B, N, C]): x [C] with a 0-d valid,"
        " or more axes, reach an axis that does not exist (dim=-2, x.shape[1], B, N, C = x.shape)",
        "index from the end (-1 is the channels) and let valid[..., None] and x[..., :] carry"
        " any number of leading axes",
    ),
    Cause(
        r"Can't call numpy\(\) on Tensor that requires grad",
        "numpy_on_grad",
        ".numpy() on a tensor that requires grad: NumPy cannot carry the gradient",
        "stay in torch (or detach on purpose in a custom autograd.Function's forward)",
    ),
    Cause(
        r"Inference tensors cannot be saved for backward|inference tensor",
        "inference_tensor_saved",
        "a tensor made under torch.inference_mode() (cached between calls?) is used in a"
        " computation that needs grad",
        "cache nothing made under inference_mode; compute every call's tensors in that call",
    ),
)
"""Exceptions recognized by their message, first match first."""


def explain_exception(text: str | None) -> Diagnosis | None:
    """The cause of an exception's message (``RuntimeError: ...``), or None."""
    if not text:
        return None
    for cause in EXCEPTION_CAUSES:
        if re.search(cause.pattern, text, flags=re.IGNORECASE):
            return cause.diagnosis()
    return None


BACKWARD_FROM_SAVED = Cause(
    "",
    "backward_from_saved_values",
    "the backward's own derivative is wrong: it is written from values saved in the forward"
    " (mean, rstd, xhat) as constants, so a second derivative misses how they depend on x",
    "write the backward from the inputs in differentiable torch operations, or use no custom"
    " backward (autograd differentiates the forward twice)",
)
NAN_AT_ZERO_VARIANCE = Cause(
    "",
    "nan_at_zero_variance",
    "a derivative that is 0 / 0 where a row's variance is zero (C = 1, constant rows, the"
    " zeroed invalid rows): the"
    " square root or the norm of x - mean, sqrt(var) or ||x - mean||, whose slope at 0 is"
    " infinite, or a division by it",
    "use the variance itself, mean((x - mean)**2), and only sqrt(var + eps) or"
    " rsqrt(var + eps): never sqrt(var), a norm or std() of x - mean",
)


GRADIENT_LOST_AT_ZERO_VARIANCE = Cause(
    "",
    "gradient_lost_at_zero_variance",
    "the gradient w.r.t. x is 0 on rows of zero variance (constant rows), where it is"
    " (dy * scale - its mean) / sqrt(eps): a branch that returns a constant there"
    " (torch.where(var == 0, ...), a skipped row, rstd set to 0) has no gradient",
    "let (x - mean) / sqrt(var + eps) run on every row: eps already keeps it finite",
)
UPSTREAM_READ_AS_CONTIGUOUS = Cause(
    "",
    "upstream_read_as_contiguous",
    "the backward reads its incoming gradient as if it were contiguous (.view, as_strided,"
    " its raw memory): a transposed, sliced or expanded upstream gradient (as"
    " out.sum().backward() gives) is read in the wrong order",
    "read grad_out through its strides: .reshape, or .contiguous() first",
)
STATISTICS_DETACHED = (
    (
        "statistics_detached",
        "mean and variance cut from the graph (.detach(), .item(), or computed under"
        " torch.no_grad()): the gradient w.r.t. x misses how they depend on x",
        "keep mean and variance in the graph: compute them from x with torch operations",
        (True, True),
    ),
    (
        "variance_detached",
        "the variance cut from the graph (.detach(), .item(), or computed under"
        " torch.no_grad()): the gradient w.r.t. x misses how it depends on x",
        "keep the variance in the graph: compute it from x with torch operations",
        (False, True),
    ),
    (
        "mean_detached",
        "the mean cut from the graph (.detach(), .item(), or computed under torch.no_grad()):"
        " the gradient w.r.t. x misses how it depends on x",
        "keep the mean in the graph: compute it from x with torch operations",
        (True, False),
    ),
)
"""Gradient mistakes whose values are right: (name, description, fix, (mean detached,
variance detached))."""


EPS_FLOORED = Cause(
    "",
    "eps_floored",
    "wrong only where eps is small (below 1e-5): eps raised to a floor (max(eps, 1e-5)), or"
    ' the variance, the denominator or rstd clamped "for stability"',
    "use eps as given, down to 1e-12: sqrt(var + eps) is already finite; clamp nothing",
)
ZEROS_AS_PADDING = Cause(
    "",
    "zeros_taken_as_padding",
    "wrong only on rows holding exact zeros: zeros taken for padding inside the row (the"
    " statistics over the nonzero entries, count_nonzero() or (x != 0).sum() as C)",
    "a zero in a valid row is a value: average over all C channels; only valid says which"
    " rows are padding",
)
ONE_CHANNEL_ONLY = Cause(
    "",
    "wrong_at_one_channel",
    "wrong only at C = 1: a division by C - 1 (an unbiased variance, or rescaling one), or a"
    " size-1 axis dropped (squeeze(), a reduction without keepdim)",
    "divide by C, and keep the channel axis: keepdim=True, never squeeze()",
)
PRIME_ONLY = Cause(
    "",
    "channel_remainder_lost",
    "wrong only when no vector width or block divides C (a prime C): the remainder of the"
    " channels (C % 8, C % block) lost, or read past the row",
    "handle the last partial block: loop to C, not to C - C % block",
)
CONSTANT_ONLY = Cause(
    "",
    "wrong_on_constant_rows",
    "wrong only on rows of zero variance (constant rows): a special case for them (var == 0"
    " guarded, the row returned as it is) gives the wrong value",
    "let (x - mean) / sqrt(var + eps) run on every row: it gives bias on a constant row",
)
TIES_ONLY = Cause(
    "",
    "wrong_at_ties",
    "wrong only at exact ties (an element equal to its row's mean, equal elements): |x - mean|,"
    " sign(x - mean), or a branch on x == mean, whose derivative there is 0 or undefined",
    "write the variance as ((x - mean)**2).mean(-1) and xhat as (x - mean) * rstd: smooth"
    " everywhere; no abs, sign or comparison of x with its mean",
)
FAMILY_CAUSES = {
    "exact zeros": ZEROS_AS_PADDING,
    "C = 1": ONE_CHANNEL_ONLY,
    "prime C": PRIME_ONLY,
    "constant rows": CONSTANT_ONLY,
    "strided upstream": UPSTREAM_READ_AS_CONTIGUOUS,
    "exact ties": TIES_ONLY,
}
"""The cause of a failure no formula explains, when every failing case is of one family
(the random cases, called first, passed): the family says what the function gets wrong."""


def family_cause(families: set[str], epsilons: set[float]) -> Diagnosis | None:
    """The cause of failures in ``families`` only (at ``epsilons``), or None.

    Example:
        >>> family_cause({"eps range"}, {1e-12, 1e-8}).mistake
        'eps_floored'
        >>> family_cause({"random rows", "exact zeros"}, {1e-5}) is None
        True
    """
    if len(families) != 1:
        return None
    (family,) = families
    if family == "eps range":
        return EPS_FLOORED.diagnosis() if max(epsilons) < 1e-5 else None
    cause = FAMILY_CAUSES.get(family)
    return cause.diagnosis() if cause is not None else None


def gradgradcheck_words(error: str | None) -> str:
    """gradgradcheck's message, without its tensors: ``Jacobian mismatch for output 0 with
    respect to input 0`` (not the numerical and analytical matrices that follow).

    Example:
        >>> gradgradcheck_words("GradcheckError: Jacobian mismatch for output 0 with respect"
        ...                     " to input 0, numerical:tensor(0.1) analytical:tensor(0.2)")
        'Jacobian mismatch for output 0 with respect to input 0 (the numerical and analytical second derivatives differ)'
    """  # noqa: E501
    text = re.sub(r"^[\w.]*GradcheckError: ", "", error or "no error came back")
    head = re.split(r",?\s*numerical:", text)[0].strip()
    if head != text.strip():
        head += " (the numerical and analytical second derivatives differ)"
    return head


def second_order_cause(error: str | None) -> Diagnosis:
    """Why gradgradcheck failed, in words: a backward marked once_differentiable, one without a
    graph, or (a Jacobian mismatch) one written from values saved in the forward."""
    found = explain_exception(error)
    if found is not None:
        return found
    if error and re.search(r"\bnan\b", error, flags=re.IGNORECASE):
        return NAN_AT_ZERO_VARIANCE.diagnosis()
    return BACKWARD_FROM_SAVED.diagnosis()
