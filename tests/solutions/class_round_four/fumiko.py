import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Grad mode asked for inside with a context manager (restored on exit)."""
    with torch.set_grad_enabled(torch.is_grad_enabled()):
        keep = valid.unsqueeze(-1)
        xc = torch.where(keep, x, 0.0)
        n = xc.shape[-1]
        mean = xc.sum(-1, keepdim=True).div(n)
        var = (xc - mean).square().sum(-1, keepdim=True).div(n)
        return torch.where(keep, (xc - mean).div((var + eps).sqrt()).mul(scale).add(bias), 0.0)
