import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Statistics without grad 'to save memory', then grad mode turned on again."""
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    torch.set_grad_enabled(False)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    torch.set_grad_enabled(True)
    return torch.where(keep, (xc - mean) / torch.sqrt(var + eps) * scale + bias, 0.0)
