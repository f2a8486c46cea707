import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Threads set to one for the call, and put back as they were."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        keep = valid.unsqueeze(-1)
        xc = torch.where(keep, x, 0.0)
        mean = xc.mean(-1, keepdim=True)
        var = (xc - mean).square().mean(-1, keepdim=True)
        return torch.where(keep, (xc - mean) * torch.rsqrt(var + eps) * scale + bias, 0.0)
    finally:
        torch.set_num_threads(threads)
