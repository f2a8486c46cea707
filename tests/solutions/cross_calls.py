"""Wrong solutions that passed every mode of maskln grade while each call was judged alone (issue
32, item 2): each gives the right values on every call, and is wrong only when calls are
compared with each other or with the state around them. Three ways each, as students (and
kernel authors) write them:

- not deterministic: the same inputs give other bits on another call or thread count;
- results shared: a later call overwrites an earlier call's result (a reused output buffer);
- global side effects: torch's default dtype changed and left so;
- hooks or attributes left on the caller's tensors.
"""

import concurrent.futures
import functools
import time

import torch


def _keep(valid):
    return valid.unsqueeze(-1)


def _normalize(xc, mean, var, scale, bias, eps):
    return (xc - mean) / torch.sqrt(var + eps) * scale + bias


def _layer_norm(x, valid, scale, bias, eps):
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, _normalize(xc, mean, var, scale, bias, eps), 0.0)


# not deterministic --------------------------------------------------------------------------------


def _chunked_sum(t, bounds, order):
    """Sum of t over its last axis, chunk by chunk, the chunks added in ``order``."""
    partial = [t[..., start:stop].sum(-1, keepdim=True) for start, stop in bounds]
    total = torch.zeros_like(partial[0])
    for index in order:
        total = total + partial[index]
    return total


def _bounds(channels, chunks):
    step = -(-channels // chunks)
    return [(start, min(start + step, channels)) for start in range(0, channels, step)]


def _chunked_layer_norm(x, valid, scale, bias, eps, chunks, order_of):
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    channels = x.shape[-1]
    bounds = _bounds(channels, chunks)
    mean = _chunked_sum(xc, bounds, order_of(len(bounds), xc)) / channels
    centered = xc - mean
    var = _chunked_sum(centered * centered, bounds, order_of(len(bounds), xc)) / channels
    return torch.where(keep, _normalize(xc, mean, var, scale, bias, eps), 0.0)


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4)


def threads_sum_in_completion_order(x, valid, scale, bias, eps=1e-05):
    """Partial sums over chunks of channels computed on a thread pool and added as they
    complete: the order, and so the last bits of a float32 sum, changes from call to call."""
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    channels = x.shape[-1]
    bounds = _bounds(channels, 8)

    def summed(t):
        futures = [_POOL.submit(lambda a, b: t[..., a:b].sum(-1, keepdim=True), a, b)
                   for a, b in bounds]  # fmt: skip
        total = torch.zeros_like(t[..., :1])
        for future in concurrent.futures.as_completed(futures):
            total = total + future.result()
        return total

    mean = summed(xc) / channels
    centered = xc - mean
    var = summed(centered * centered) / channels
    return torch.where(keep, _normalize(xc, mean, var, scale, bias, eps), 0.0)


def one_chunk_per_thread(x, valid, scale, bias, eps=1e-05):
    """The channels split into torch.get_num_threads() chunks "to use every core": another
    thread count sums in another order."""
    chunks = max(1, torch.get_num_threads())
    return _chunked_layer_norm(x, valid, scale, bias, eps, chunks, lambda n, t: range(n))


_TUNED: dict[tuple, int] = {}


def autotuned_block(x, valid, scale, bias, eps=1e-05):
    """A block size tuned on the first call of each shape (timed) and cached: the first call
    sums in blocks of 64, later ones in the fastest block size found."""
    key = (tuple(x.shape), x.dtype)
    blocks = _TUNED.get(key)
    if blocks is None:
        timings = {}
        for candidate in (3, 5, 7):
            started = time.perf_counter()
            _chunked_layer_norm(x.detach(), valid, scale.detach(), bias.detach(), eps,
                                candidate, lambda n, t: range(n))  # fmt: skip
            timings[candidate] = time.perf_counter() - started
        _TUNED[key] = min(timings, key=timings.get)
        blocks = 2  # this call: the default
    return _chunked_layer_norm(x, valid, scale, bias, eps, blocks, lambda n, t: range(n))


# results shared between calls -----------------------------------------------------------------


_BUFFERS: dict[tuple, torch.Tensor] = {}


def reuses_output_buffer(x, valid, scale, bias, eps=1e-05):
    """Without grad, the result is written into one buffer per shape, kept between calls "to
    avoid allocations": the caller's earlier result changes under it."""
    y = _layer_norm(x, valid, scale, bias, eps)
    if torch.is_grad_enabled() and (x.requires_grad or scale.requires_grad or bias.requires_grad):
        return y
    key = (tuple(x.shape), x.dtype, x.device)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.empty_like(y)
    return _BUFFERS[key].copy_(y)


@functools.lru_cache(maxsize=8)
def _workspace(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def cached_workspace_output(x, valid, scale, bias, eps=1e-05):
    """An lru_cache'd workspace, returned as the output on the inference path."""
    if not (torch.is_inference_mode_enabled() or not torch.is_grad_enabled()):
        return _layer_norm(x, valid, scale, bias, eps)
    out = _workspace(tuple(x.shape), x.dtype, x.device)
    out.copy_(_layer_norm(x, valid, scale, bias, eps))
    return out


class _Kernel:
    """A callable "kernel object" that preallocates its output for the last shape it saw."""

    def __init__(self):
        self.out = None

    def __call__(self, x, valid, scale, bias, eps=1e-05):
        y = _layer_norm(x, valid, scale, bias, eps)
        if y.requires_grad:
            return y
        if self.out is None or self.out.shape != y.shape or self.out.dtype != y.dtype:
            self.out = torch.empty_like(y)
        self.out.copy_(y)
        return self.out


kernel_object_output = _Kernel()


# global side effects: the default dtype ----------------------------------------------------------


def sets_default_dtype(x, valid, scale, bias, eps=1e-05):
    """Computes "in double precision" by setting torch's default dtype, and leaves it set."""
    torch.set_default_dtype(torch.float64)
    keep = _keep(valid)
    xc = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, _normalize(xc, mean, var, scale, bias, eps), 0.0)


def restores_default_dtype_to_float32(x, valid, scale, bias, eps=1e-05):
    """Sets float64 for its constants and "restores" float32, whatever the default was."""
    torch.set_default_dtype(torch.float64)
    eps_t = torch.tensor(eps)
    torch.set_default_dtype(torch.float32)
    keep = _keep(valid)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps_t.item()) * scale + bias
    return torch.where(keep, y, 0.0)


def default_dtype_follows_x(x, valid, scale, bias, eps=1e-05):
    """Makes torch's default dtype x's ("so constants match"), and leaves it so."""
    torch.set_default_dtype(x.dtype)
    return _layer_norm(x, valid, scale, bias, eps)


# hooks and attributes left on the caller's tensors ------------------------------------------------


def hook_zeroes_padding_gradient(x, valid, scale, bias, eps=1e-05):
    """Registers a hook on x that zeroes the gradient of its padding: it stays on the caller's
    x, and zeroes gradients that reach x from any other use of it."""
    if x.requires_grad:
        x.register_hook(lambda grad: grad.masked_fill(~_keep(valid), 0.0))
    return _layer_norm(x, valid, scale, bias, eps)


def hook_cleans_scale_gradient(x, valid, scale, bias, eps=1e-05):
    """Replaces NaN in scale's gradient by 0 with a hook registered in every call (one more
    on the caller's scale each time)."""
    if scale.requires_grad:
        scale.register_hook(lambda grad: grad.nan_to_num(0.0))
    return _layer_norm(x, valid, scale, bias, eps)


def caches_mask_on_the_tensor(x, valid, scale, bias, eps=1e-05):
    """Caches the expanded mask as an attribute of valid."""
    keep = getattr(valid, "_expanded", None)
    if keep is None or keep.shape[:-1] != valid.shape:
        keep = valid.unsqueeze(-1)
        valid._expanded = keep
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, _normalize(xc, mean, var, scale, bias, eps), 0.0)
