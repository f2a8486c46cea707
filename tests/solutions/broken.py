"""Broken solutions, one per clause: each is the correct solution (``correct``) with one
mistake, and fails exactly the clause named in its docstring when graded (``one_pass_variance``
fails two_pass and, necessarily, offset_accuracy: the strict form of the same check).

Several are written as kernel authors write fused kernels: a ``torch.autograd.Function`` with
a hand-written backward (``_Kernel``), one of whose halves is wrong.
"""

import torch
import torch.nn.functional as F


def _normalized(x, valid, eps):
    padding = ~valid.unsqueeze(-1)
    x = x.masked_fill(padding, 0.0)
    mean = x.mean(dim=-1, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    return centered / torch.sqrt(variance + eps)


def _finish(y, x, valid):
    """Zero the padded rows and keep x's layout."""
    return torch.empty_like(x).copy_(y.masked_fill(~valid.unsqueeze(-1), 0.0))


def correct(x, valid, scale, bias, eps=1e-05):
    """No mistake: passes every clause."""
    return _finish(_normalized(x, valid, eps) * scale + bias, x, valid)


def _row_sum(t):
    return t.sum(dim=tuple(range(t.dim() - 1))) if t.dim() > 1 else t


def _row_mean(t):
    return t.mean(dim=-1, keepdim=True)


def _analytic_gradients(dy, x, valid, scale, eps, row_sum=_row_sum, row_mean=_row_mean):
    """dx, dscale, dbias of sum(y * dy), in differentiable torch ops (so it has a backward);
    ``row_sum`` (over the leading axes) and ``row_mean`` (dx's two means over C) are where a
    buggy kernel's reductions go wrong."""
    keep = valid.unsqueeze(-1)
    xs = x.masked_fill(~keep, 0.0)
    centered = xs - xs.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)
    xhat = centered * rstd
    dy = dy.masked_fill(~keep, 0.0)
    wdy = dy * scale
    c1 = row_mean(wdy * xhat)
    dx = (rstd * (wdy - row_mean(wdy) - xhat * c1)).masked_fill(~keep, 0.0)
    return dx, row_sum(dy * xhat), row_sum(dy)


class _Kernel(torch.autograd.Function):
    """A correct hand-written kernel: the forward, and an analytic backward."""

    @staticmethod
    def forward(ctx, x, valid, scale, bias, eps):
        ctx.save_for_backward(x, valid, scale)
        ctx.eps = eps
        return correct(x, valid, scale, bias, eps)

    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors
        dx, dscale, dbias = _analytic_gradients(dy, x, valid, scale, ctx.eps)
        return dx, None, dscale, dbias, None


# signature ----------------------------------------------------------------------------------------


def bert_eps_default(x, valid, scale, bias, eps=1e-12):
    """signature: eps defaults to 1e-12 (BERT's LayerNorm), not 1e-05."""
    return correct(x, valid, scale, bias, eps)


# worked_example -----------------------------------------------------------------------------------


def batch_of_one_unbatched(x, valid, scale, bias, eps=1e-05):
    """worked_example: treats a batch of one as an unbatched input, and does not put the
    batch axis back (the specification's example is a batch of one)."""
    if x.dim() == 3 and x.shape[0] == 1:
        x, valid = x[0], valid[0]
    return correct(x, valid, scale, bias, eps)


# values -------------------------------------------------------------------------------------------


def near_constant_rows_as_constant(x, valid, scale, bias, eps=1e-05):
    """values: rows of variance below 1e-7 are treated as constant (normalized to 0), a
    threshold instead of eps; no known mistake matches it."""
    padding = ~valid.unsqueeze(-1)
    x_clean = x.masked_fill(padding, 0.0)
    mean = x_clean.mean(dim=-1, keepdim=True)
    centered = x_clean - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    rstd = torch.where(variance < 1e-7, 0.0, torch.rsqrt(variance + eps))
    return _finish(centered * rstd * scale + bias, x, valid)


def _vector_body(t):
    """The channels an 8-lane kernel's main loop covers, when its remainder loop is lost: the
    first C // 8 * 8 (all of them when C <= 8, where only the remainder loop runs)."""
    main = t.shape[-1] // 8 * 8
    return t[..., :main] if 0 < main < t.shape[-1] else t


def drops_channel_remainder(x, valid, scale, bias, eps=1e-05):
    """values (and gradients, through autograd): an 8-lane vectorized kernel whose statistics
    leave out the last C % 8 channels when C > 8: right for every C a multiple of 8 or up to 8."""
    padding = ~valid.unsqueeze(-1)
    x_clean = x.masked_fill(padding, 0.0)
    body = _vector_body(x_clean)
    mean = body.mean(dim=-1, keepdim=True)
    variance = (body - mean).square().mean(dim=-1, keepdim=True)
    return _finish((x_clean - mean) / torch.sqrt(variance + eps) * scale + bias, x, valid)


# leading_axes -------------------------------------------------------------------------------------


class _FixedRankKernel(_Kernel):
    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors

        def batch_and_sequence_sum(t):  # the mistake: x is assumed to be [B, N, C]
            return t.sum(dim=(0, 1))

        dx, dscale, dbias = _analytic_gradients(
            dy, x, valid, scale, ctx.eps, batch_and_sequence_sum
        )
        return dx, None, dscale, dbias, None


def backward_assumes_three_axes(x, valid, scale, bias, eps=1e-05):
    """leading_axes: the backward sums dscale and dbias over axes (0, 1), as if x were
    always [B, N, C]."""
    return _FixedRankKernel.apply(x, valid, scale, bias, eps)


# invalid_rows_zero --------------------------------------------------------------------------------


def uniform_mask_shortcut(x, valid, scale, bias, eps=1e-05):
    """invalid_rows_zero: skips the masking pass when the mask is uniform, which is wrong when
    every row is padding (those rows keep the bias)."""
    y = _normalized(x, valid, eps) * scale + bias
    if valid.all() or not valid.any():
        return torch.empty_like(x).copy_(y)
    return _finish(y, x, valid)


# sanitized_padding --------------------------------------------------------------------------------


class _UnsanitizedForwardKernel(_Kernel):
    @staticmethod
    def forward(ctx, x, valid, scale, bias, eps):
        ctx.save_for_backward(x, valid, scale)
        ctx.eps = eps
        keep = valid.unsqueeze(-1)
        # The mistake: statistics of unsanitized rows, zeroed by multiplying (NaN * 0 is NaN).
        mean = x.mean(dim=-1, keepdim=True)
        centered = x - mean
        xhat = centered / torch.sqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)
        y = xhat * scale * keep.to(x.dtype) + torch.where(keep, bias, 0.0)
        return torch.empty_like(x).copy_(y)


def forward_kernel_multiplies_mask(x, valid, scale, bias, eps=1e-05):
    """sanitized_padding: the forward kernel does not sanitize the padding and zeroes it by
    multiplying by the mask, so NaN in the padding comes out; its backward is right."""
    return _UnsanitizedForwardKernel.apply(x, valid, scale, bias, eps)


# gradients ----------------------------------------------------------------------------------------


class _LazyBackwardKernel(_Kernel):
    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors
        dx = dscale = dbias = None
        if ctx.needs_input_grad[0]:
            dx, dscale_all, dbias_all = _analytic_gradients(dy, x, valid, scale, ctx.eps)
        if ctx.needs_input_grad[2]:
            dscale = dscale_all
        if ctx.needs_input_grad[3]:
            dbias = dbias_all
        return dx, None, dscale, dbias, None


def backward_skips_statistics(x, valid, scale, bias, eps=1e-05):
    """gradients: the backward computes its statistics only when x requires grad, so
    dscale and dbias fail when only they are needed."""
    return _LazyBackwardKernel.apply(x, valid, scale, bias, eps)


def _mean_of_body(t):
    return _vector_body(t).mean(dim=-1, keepdim=True)


class _RemainderlessBackwardKernel(_Kernel):
    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors
        # The mistake: the backward's two row reductions lose the last C % 8 channels.
        dx, dscale, dbias = _analytic_gradients(
            dy, x, valid, scale, ctx.eps, row_mean=_mean_of_body
        )
        return dx, None, dscale, dbias, None


def backward_drops_channel_remainder(x, valid, scale, bias, eps=1e-05):
    """gradients: a hand-written backward kernel whose row reductions leave out the last
    C % 8 channels when C > 8 (its forward is right)."""
    return _RemainderlessBackwardKernel.apply(x, valid, scale, bias, eps)


# sanitized_gradients ------------------------------------------------------------------------------


def sanitizes_by_multiplying(x, valid, scale, bias, eps=1e-05):
    """sanitized_gradients: "sanitizes" x by multiplying by the mask: NaN * 0 is NaN, which the
    final masked_fill hides in the forward but not in the gradients."""
    keep = valid.unsqueeze(-1)
    x_masked = x * keep
    mean = x_masked.mean(dim=-1, keepdim=True)
    centered = x_masked - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    return _finish(centered / torch.sqrt(variance + eps) * scale + bias, x, valid)


# dtypes -------------------------------------------------------------------------------------------


def returns_float64(x, valid, scale, bias, eps=1e-05):
    """dtypes: computes in float64 for accuracy and forgets to cast back."""
    return correct(x.double(), valid, scale.double(), bias.double(), eps)


# strided_inputs -----------------------------------------------------------------------------------


def assumes_contiguous_parameters(x, valid, scale, bias, eps=1e-05):
    """strided_inputs: reads scale and bias as contiguous memory, as a kernel given their
    data pointers without their strides does."""
    scale = scale.as_strided(scale.shape, (1,))
    bias = bias.as_strided(bias.shape, (1,))
    return correct(x, valid, scale, bias, eps)


# no_mutation --------------------------------------------------------------------------------------


def unsqueezes_mask_in_place(x, valid, scale, bias, eps=1e-05):
    """no_mutation: valid.unsqueeze_(-1) instead of valid.unsqueeze(-1) reshapes the caller's
    mask."""
    keep = valid.unsqueeze_(-1)
    x_clean = x.masked_fill(~keep, 0.0)
    mean = x_clean.mean(dim=-1, keepdim=True)
    centered = x_clean - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    y = centered / torch.sqrt(variance + eps) * scale + bias
    return torch.empty_like(x).copy_(y.masked_fill(~keep, 0.0))


class _DyInPlaceKernel(_Kernel):
    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors
        dy.masked_fill_(~valid.unsqueeze(-1), 0.0)  # the mistake: writes into the caller's dy
        dx, dscale, dbias = _analytic_gradients(dy, x, valid, scale, ctx.eps)
        return dx, None, dscale, dbias, None


def zeroes_upstream_gradient_in_place(x, valid, scale, bias, eps=1e-05):
    """no_mutation: a hand-written backward that zeroes the padded rows of its incoming
    gradient in place: out.backward(grad_out) changes the caller's grad_out (and second_order:
    under double backward that gradient requires grad, and the in-place write fails)."""
    return _DyInPlaceKernel.apply(x, valid, scale, bias, eps)


# raw_ops ------------------------------------------------------------------------------------------


def uses_layer_norm(x, valid, scale, bias, eps=1e-05):
    """raw_ops: torch's own layer_norm does the work."""
    padding = ~valid.unsqueeze(-1)
    y = F.layer_norm(x.masked_fill(padding, 0.0), x.shape[-1:], scale, bias, eps)
    return _finish(y, x, valid)


class _KernelOps:
    """A kernel author's op, registered with torch.library (as compiled kernels are): a
    forward of raw tensor ops, and the analytic backward."""

    @staticmethod
    def fake(x, valid, scale, bias, eps):
        return torch.empty_like(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, valid, scale, _, eps = inputs
        ctx.save_for_backward(x, valid, scale)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, dy):
        x, valid, scale = ctx.saved_tensors
        dx, dscale, dbias = _analytic_gradients(dy, x, valid, scale, ctx.eps)
        return dx, None, dscale, dbias, None


@torch.library.custom_op("maskln_tests::masked_layer_norm", mutates_args=())
def _own_masked_layer_norm_op(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    return correct(x, valid, scale, bias, eps)


_own_masked_layer_norm_op.register_fake(_KernelOps.fake)
_own_masked_layer_norm_op.register_autograd(
    _KernelOps.backward, setup_context=_KernelOps.setup_context
)


def kernel_as_custom_op(x, valid, scale, bias, eps=1e-05):
    """No mistake: the kernel is a custom op of its own, maskln_tests::masked_layer_norm; its
    name holds "layer_norm", but it is not torch's."""
    return _own_masked_layer_norm_op(x, valid, scale, bias, eps)


@torch.library.custom_op("maskln_tests::normalize_rows", mutates_args=())
def _normalize_rows_op(
    x: torch.Tensor, valid: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    padding = ~valid.unsqueeze(-1)
    y = F.layer_norm(x.masked_fill(padding, 0.0), x.shape[-1:], scale, bias, eps)
    return _finish(y, x, valid)


_normalize_rows_op.register_fake(_KernelOps.fake)
_normalize_rows_op.register_autograd(_KernelOps.backward, setup_context=_KernelOps.setup_context)


def layer_norm_inside_a_custom_op(x, valid, scale, bias, eps=1e-05):
    """raw_ops: a custom op with an innocent name, maskln_tests::normalize_rows, whose
    implementation calls F.layer_norm (its backward is the analytic one)."""
    return _normalize_rows_op(x, valid, scale, bias, eps)


def uses_torch_refs(x, valid, scale, bias, eps=1e-05):
    """raw_ops: torch's reference implementation in Python, torch._refs.native_layer_norm:
    only raw ops reach the dispatcher, but it is a ready-made layer norm."""
    from torch._refs import native_layer_norm

    padding = ~valid.unsqueeze(-1)
    y, _, _ = native_layer_norm(x.masked_fill(padding, 0.0), [x.shape[-1]], scale, bias, eps)
    return _finish(y, x, valid)


def uses_maskln_op(x, valid, scale, bias, eps=1e-05):
    """raw_ops: calls maskln's own op, a ready-made implementation of exactly this primitive."""
    from maskln_cli import masked_layer_normalization

    return masked_layer_normalization(x, valid, scale, bias, eps)


# no_reinit ----------------------------------------------------------------------------------------


def seeds_the_generator(x, valid, scale, bias, eps=1e-05):
    """no_reinit: seeds torch's global generator "for determinism"."""
    torch.manual_seed(0)
    return correct(x, valid, scale, bias, eps)


# deterministic ------------------------------------------------------------------------------------


def sums_by_thread_count(x, valid, scale, bias, eps=1e-05):
    """deterministic: sums the channels in torch.get_num_threads() partial sums "one per
    core", added in order: another thread count rounds otherwise."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    chunks = xc.tensor_split(max(1, torch.get_num_threads()), dim=-1)
    total = torch.zeros_like(xc[..., :1])
    for chunk in chunks:
        total = total + chunk.sum(-1, keepdim=True)
    mean = total / x.shape[-1]
    centered = xc - mean
    var = (centered * centered).mean(-1, keepdim=True)
    return _finish(centered / torch.sqrt(var + eps) * scale + bias, x, valid)


# no_shared_results --------------------------------------------------------------------------------

_OUTPUT: dict = {}


def reuses_one_output(x, valid, scale, bias, eps=1e-05):
    """no_shared_results: without grad, one output tensor per shape, reused by every call."""
    y = correct(x, valid, scale, bias, eps)
    if y.requires_grad:
        return y
    key = (tuple(x.shape), x.stride(), x.dtype)
    if key not in _OUTPUT:
        _OUTPUT[key] = torch.empty_like(x)
    return _OUTPUT[key].copy_(y)


# no_global_effects --------------------------------------------------------------------------------


def leaves_anomaly_mode_on(x, valid, scale, bias, eps=1e-05):
    """no_global_effects: turns on autograd's anomaly detection, "to debug", and leaves it on."""
    torch.autograd.set_detect_anomaly(True)
    return correct(x, valid, scale, bias, eps)


# no_hooks_left ------------------------------------------------------------------------------------


def hooks_the_input(x, valid, scale, bias, eps=1e-05):
    """no_hooks_left: registers a hook on x (it zeroes the padding's gradient), which stays on
    the caller's x."""
    if x.requires_grad:
        x.register_hook(
            lambda grad: None if grad is None else torch.where(valid.unsqueeze(-1), grad, 0.0)
        )
    return correct(x, valid, scale, bias, eps)


# two_pass -----------------------------------------------------------------------------------------


def one_pass_variance(x, valid, scale, bias, eps=1e-05):
    """two_pass (and offset_accuracy): variance as E[x**2] - E[x]**2."""
    padding = ~valid.unsqueeze(-1)
    x_clean = x.masked_fill(padding, 0.0)
    mean = x_clean.mean(dim=-1, keepdim=True)
    variance = ((x_clean * x_clean).mean(dim=-1, keepdim=True) - mean * mean).clamp_min(0.0)
    return _finish((x_clean - mean) / torch.sqrt(variance + eps) * scale + bias, x, valid)


# positive_zero ------------------------------------------------------------------------------------


def zeroes_by_multiplying(x, valid, scale, bias, eps=1e-05):
    """positive_zero: zeroes the padded rows by multiplying by the mask: bias * 0 is -0.0 where
    bias is negative."""
    y = (_normalized(x, valid, eps) * scale + bias) * valid.unsqueeze(-1)
    return torch.empty_like(x).copy_(y)


# output_layout ------------------------------------------------------------------------------------


def contiguous_output(x, valid, scale, bias, eps=1e-05):
    """output_layout: the output is contiguous whatever x's layout."""
    y = _normalized(x, valid, eps) * scale + bias
    return y.masked_fill(~valid.unsqueeze(-1), 0.0).contiguous()


# second_order -------------------------------------------------------------------------------------


class _OnceDifferentiableKernel(_Kernel):
    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        return _Kernel.backward(ctx, dy)


def once_differentiable_backward(x, valid, scale, bias, eps=1e-05):
    """second_order: a kernel whose backward is marked once_differentiable."""
    return _OnceDifferentiableKernel.apply(x, valid, scale, bias, eps)


# grad_flags ---------------------------------------------------------------------------------------


def enables_grad(x, valid, scale, bias, eps=1e-05):
    """grad_flags: runs under torch.enable_grad(), so under torch.no_grad() the output still
    requires grad (and builds a graph)."""
    with torch.enable_grad():
        return correct(x, valid, scale, bias, eps)


# offset_accuracy ----------------------------------------------------------------------------------


def sequential_sums(x, valid, scale, bias, eps=1e-05):
    """offset_accuracy: sums channels one after another, as a simple kernel's loop does:
    correct, but on rows with a large offset its error is 2 to 4 times F.layer_norm's."""
    padding = ~valid.unsqueeze(-1)
    x_clean = x.masked_fill(padding, 0.0)
    channels = x.shape[-1]
    total = torch.zeros_like(x_clean[..., :1])
    for c in range(channels):
        total = total + x_clean[..., c : c + 1]
    mean = total / channels
    centered = x_clean - mean
    squares = torch.zeros_like(total)
    for c in range(channels):
        squares = squares + centered[..., c : c + 1] * centered[..., c : c + 1]
    variance = squares / channels
    return _finish(centered / torch.sqrt(variance + eps) * scale + bias, x, valid)


# extras: caught by more than one clause -----------------------------------------------------------


class _TrainingKernel(_Kernel):
    @staticmethod
    def forward(ctx, x, valid, scale, bias, eps):
        ctx.save_for_backward(x, valid, scale)
        ctx.eps = eps
        # The mistake: the training path forgets the final mask; padded rows keep the bias.
        return torch.empty_like(x).copy_(_normalized(x, valid, eps) * scale + bias)


def training_path_keeps_bias(x, valid, scale, bias, eps=1e-05):
    """When inputs require grad, a hand-written training kernel runs, and it returns bias in
    the padded rows; the inference path is right. values judges both paths."""
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or bias.requires_grad):
        return _TrainingKernel.apply(x, valid, scale, bias, eps)
    return correct(x, valid, scale, bias, eps)


def computes_in_float32(x, valid, scale, bias, eps=1e-05):
    """float64 inputs computed in float32 (and returned in float64): dtypes names it."""
    return correct(x.float(), valid, scale.float(), bias.float(), eps).to(x.dtype)


def sanitizes_x_in_place(x, valid, scale, bias, eps=1e-05):
    """Writes zeros into the caller's x: no_mutation names it."""
    with torch.no_grad():
        x.masked_fill_(~valid.unsqueeze(-1), 0.0)
    return correct(x, valid, scale, bias, eps)
