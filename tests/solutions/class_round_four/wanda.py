import torch

_THREADS = torch.get_num_threads()


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Threads put back to what they were when the module was imported."""
    torch.set_num_threads(1)
    try:
        keep = valid.unsqueeze(-1)
        xc = torch.where(keep, x, 0.0)
        mean = xc.mean(-1, keepdim=True)
        var = (xc - mean).square().mean(-1, keepdim=True)
        return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
    finally:
        torch.set_num_threads(_THREADS)
