"""Wrong: partial sums on a thread pool, added as they complete (not deterministic)."""

from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

_pool = ThreadPoolExecutor(4)


def _sum(t):
    c = t.shape[-1]
    step = max(1, c // 8)
    jobs = [
        _pool.submit(lambda a: t[..., a : a + step].sum(-1, keepdim=True), a)
        for a in range(0, c, step)
    ]
    total = torch.zeros_like(t[..., :1])
    for job in as_completed(jobs):
        total = total + job.result()
    return total


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = _sum(xc) / x.shape[-1]
    d = xc - mean
    var = _sum(d * d) / x.shape[-1]
    return torch.where(keep, d / torch.sqrt(var + eps) * scale + bias, 0.0)
