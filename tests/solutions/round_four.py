"""Solutions of issue 38 (maskln grade, round four), written as students write them: wrong ones the
grader passed (global state a correct result hides; a second derivative wrong only at exact
ties), and wrong ones whose leading cause it named wrongly. Each is right but for its one
mistake."""

import itertools

import torch


def _keep(valid):
    return valid.unsqueeze(-1)


def _statistics(xc):
    mean = xc.mean(-1, keepdim=True)
    return mean, (xc - mean).square().mean(-1, keepdim=True)


def _correct(x, valid, scale, bias, eps):
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean, var = _statistics(xc)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


# --- false passes from global state (issue 38, item 2) -------------------------------------------


def grad_mode_left_on(x, valid, scale, bias, eps=1e-05):
    """Turns gradients on "so that the backward works" and leaves them on: a caller's
    torch.no_grad() block records graphs from then on."""
    torch.set_grad_enabled(True)
    return _correct(x, valid, scale, bias, eps)


def threads_left_at_one(x, valid, scale, bias, eps=1e-05):
    """One thread "for determinism", never set back: every later computation of the caller
    runs on one thread."""
    torch.set_num_threads(1)
    return _correct(x, valid, scale, bias, eps)


def abs_pow_variance(x, valid, scale, bias, eps=1e-05):
    """The variance as |x - mean| ** 2: right values and first derivatives, but the second
    derivative of |d| ** 2 is 2 * sign(d) ** 2, 0 where an element equals its row's mean."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).abs().pow(2).mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


# --- causes named wrongly (issue 38, item 4) -----------------------------------------------------


class _Float32ReciprocalBackward(torch.autograd.Function):
    """A hand-written backward, differentiable (written from the inputs), whose means multiply
    by 1 / C rounded to float32."""

    @staticmethod
    def forward(ctx, xc, scale, bias, eps):
        mean, var = _statistics(xc)
        ctx.save_for_backward(xc, scale)
        ctx.eps = eps
        return (xc - mean) * torch.rsqrt(var + eps) * scale + bias

    @staticmethod
    def backward(ctx, grad_out):
        xc, scale = ctx.saved_tensors
        inverse = torch.tensor(1.0 / xc.shape[-1], dtype=torch.float32)  # float32 1 / C
        mean = xc.sum(-1, keepdim=True) * inverse
        var = (xc - mean).square().sum(-1, keepdim=True) * inverse
        rstd = torch.rsqrt(var + ctx.eps)
        xhat = (xc - mean) * rstd
        gs = grad_out * scale
        mean_gs = gs.sum(-1, keepdim=True) * inverse
        mean_gx = (gs * xhat).sum(-1, keepdim=True) * inverse
        grad_x = rstd * (gs - mean_gs - xhat * mean_gx)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_scale = (rows * xhat.reshape(rows.shape)).sum(0)
        return grad_x, grad_scale, rows.sum(0), None


def float32_reciprocal_in_backward(x, valid, scale, bias, eps=1e-05):
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    return torch.where(keep, _Float32ReciprocalBackward.apply(xc, scale, bias, eps), 0.0)


def one_channel_returns_zeros(x, valid, scale, bias, eps=1e-05):
    """C = 1 taken as "nothing to normalize": zeros, where the output is bias."""
    if x.shape[-1] == 1:
        return torch.zeros_like(x)
    return _correct(x, valid, scale, bias, eps)


def clamped_variance(x, valid, scale, bias, eps=1e-05):
    """rsqrt(var.clamp(min=eps)): eps as a floor of the variance, not added to it."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean, var = _statistics(xc)
    return torch.where(keep, (xc - mean) * torch.rsqrt(var.clamp(min=eps)) * scale + bias, 0.0)


_BY_ID: dict[int, tuple] = {}


def statistics_cached_by_id(x, valid, scale, bias, eps=1e-05):
    """Without grad, mean and rstd cached by id(x) "to save recomputing them": a later tensor
    at the same address (Python reuses ids) gets another's statistics."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    if x.requires_grad or scale.requires_grad or bias.requires_grad:
        mean, var = _statistics(xc)
        rstd = torch.rsqrt(var + eps)
    else:
        if id(x) not in _BY_ID:
            mean, var = _statistics(xc)
            _BY_ID[id(x)] = (mean, torch.rsqrt(var + eps))
        mean, rstd = _BY_ID[id(x)]
    return torch.where(keep, (xc - mean) * rstd * scale + bias, 0.0)


def nanmean_padding(x, valid, scale, bias, eps=1e-05):
    """Padding marked NaN, then NaN-aware statistics: nanmean skips the NaN, but x's own NaN and
    inf in the padding go on, and NaN reaches the output where the mask is applied by
    multiplication."""
    keep = _keep(valid)
    marked = x.masked_fill(~keep, float("nan"))
    mean = marked.nanmean(-1, keepdim=True)
    var = (marked - mean).square().nanmean(-1, keepdim=True)
    y = (marked - mean) / torch.sqrt(var + eps) * scale + bias
    return y.nan_to_num(0.0) * keep


def variance_around_detached_mean(x, valid, scale, bias, eps=1e-05):
    """The variance around mean.detach() "since the mean's gradient cancels": it does at first
    order, not at the second."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean.detach()).square().mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


def channels_from_size_one(x, valid, scale, bias, eps=1e-05):
    """C read as x.size(1), the size of the second axis, written for x [B, C]."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    channels = x.size(1) if x.dim() > 1 else x.size(0)
    mean = xc.sum(-1, keepdim=True) / channels
    var = (xc - mean).square().sum(-1, keepdim=True) / channels
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)


class _Backward(torch.autograd.Function):
    """The op with a hand-written backward; ``mask_grad_x`` and ``mask_grad_bias`` say whether
    it keeps the padding's upstream gradient out of grad_x and grad_bias."""

    mask_grad_x = True
    mask_grad_bias = True

    @staticmethod
    def forward(ctx, x, keep, scale, bias, eps):
        xc = torch.where(keep, x, 0.0)
        mean, var = _statistics(xc)
        rstd = torch.rsqrt(var + eps)
        xhat = (xc - mean) * rstd
        ctx.save_for_backward(xhat, rstd, scale, keep)
        return torch.where(keep, xhat * scale + bias, 0.0)

    @classmethod
    def _backward(cls, ctx, grad_out):
        xhat, rstd, scale, keep = ctx.saved_tensors
        g = torch.where(keep, grad_out, 0.0)
        gs = g * scale
        grad_x = rstd * (gs - gs.mean(-1, keepdim=True) - xhat * (gs * xhat).mean(-1, keepdim=True))
        if not cls.mask_grad_x:  # the padding's grad_out flows through unmasked
            gs = grad_out * scale
            grad_x = rstd * (gs - gs.mean(-1, keepdim=True)
                             - xhat * (gs * xhat).mean(-1, keepdim=True))  # fmt: skip
        rows = g.reshape(-1, g.shape[-1])
        grad_scale = (rows * xhat.reshape(rows.shape)).sum(0)
        summed = grad_out if not cls.mask_grad_bias else g
        grad_bias = summed.reshape(-1, g.shape[-1]).sum(0)
        return grad_x, None, grad_scale, grad_bias, None


class _PaddingInGradBias(_Backward):
    mask_grad_bias = False

    @staticmethod
    def backward(ctx, grad_out):
        return _PaddingInGradBias._backward(ctx, grad_out)


class _GradXNotMasked(_Backward):
    mask_grad_x = False

    @staticmethod
    def backward(ctx, grad_out):
        return _GradXNotMasked._backward(ctx, grad_out)


def backward_sums_padding_into_grad_bias(x, valid, scale, bias, eps=1e-05):
    """grad_bias summed over every row of the upstream gradient, the padding's too."""
    return _PaddingInGradBias.apply(x, _keep(valid), scale, bias, eps)


def backward_leaves_grad_x_in_padding(x, valid, scale, bias, eps=1e-05):
    """grad_x computed from the whole upstream gradient, the padding's rows not zeroed."""
    return _GradXNotMasked.apply(x, _keep(valid), scale, bias, eps)


def sqrt_eps_added_to_std(x, valid, scale, bias, eps=1e-05):
    """sqrt(eps) added to the standard deviation: a formula no catalogue holds."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean, var = _statistics(xc)
    y = (xc - mean) / (torch.sqrt(var) + eps**0.5) * scale + bias
    return torch.where(keep, y, 0.0)


# --- slow but correct, and a hang (issue 38, item 3) ---------------------------------------------


def python_row_loop(x, valid, scale, bias, eps=1e-05):
    """A beginner's loop over every position of the leading axes, each row written into the
    output in place: right, and some 2,000 times maskln's op's time on thousands of rows."""
    everywhere = torch.ones_like(x, dtype=torch.bool)
    zeros = x.masked_fill(everywhere, 0.0)
    out = torch.where(everywhere, 0.0, zeros * scale + bias)  # +0.0, x, scale and bias in the graph
    for index in itertools.product(*[range(n) for n in valid.shape]):
        if valid[index]:
            row = x[index]
            n = row.shape[0]
            mean = torch.sum(row) / n
            var = torch.sum((row - mean) * (row - mean)) / n
            out[index] = (row - mean) / torch.sqrt(var + eps) * scale + bias
    return out


def hangs_on_many_rows(x, valid, scale, bias, eps=1e-05):
    """Right on a few rows; never returns on a thousand or more."""
    if x[..., 0].numel() >= 1000:
        while True:
            pass
    return _correct(x, valid, scale, bias, eps)


# --- false passes found by the class of round four ------------------------------------------------


def deterministic_set_off_after(x, valid, scale, bias, eps=1e-05):
    """Deterministic algorithms on for the call, then off: a caller that had them on loses them."""
    torch.use_deterministic_algorithms(True)
    y = _correct(x, valid, scale, bias, eps)
    torch.use_deterministic_algorithms(False)
    return y


def anomaly_set_off_after(x, valid, scale, bias, eps=1e-05):
    """Anomaly detection on while computing, then off: a caller that had it on loses it."""
    torch.autograd.set_detect_anomaly(True)
    y = _correct(x, valid, scale, bias, eps)
    torch.autograd.set_detect_anomaly(False)
    return y


def affine_skipped_when_identity(x, valid, scale, bias, eps=1e-05):
    """The affine skipped when it is the identity, as a module initializes it: scale and bias get
    no gradient there."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean, var = _statistics(xc)
    y = (xc - mean) / torch.sqrt(var + eps)
    if not (bool((scale == 1).all()) and bool((bias == 0).all())):
        y = y * scale + bias
    return torch.where(keep, y, 0.0)


def one_channel_bias_detached(x, valid, scale, bias, eps=1e-05):
    """C = 1 short-cut: the output is bias, taken detached: right values, no gradient."""
    if x.shape[-1] == 1:
        return torch.where(_keep(valid), bias.detach().expand_as(x), 0.0)
    return _correct(x, valid, scale, bias, eps)
