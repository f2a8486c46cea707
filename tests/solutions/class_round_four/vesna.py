import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """One thread for the call, then 'back' to the CPU count, not to what the caller had."""
    import os

    torch.set_num_threads(1)
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
    torch.set_num_threads(os.cpu_count() or 1)
    return y
