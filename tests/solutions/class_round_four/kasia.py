import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """C = 1 shortcut: the output is bias, taken detached."""
    keep = valid.unsqueeze(-1)
    if x.shape[-1] == 1:
        return torch.where(keep, bias.detach().expand_as(x), 0.0)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
