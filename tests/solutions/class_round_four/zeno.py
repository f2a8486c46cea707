import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Without inputs requiring grad, grad mode turned off 'to save memory' and left so."""
    if not (x.requires_grad or scale.requires_grad or bias.requires_grad):
        torch.set_grad_enabled(False)
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
