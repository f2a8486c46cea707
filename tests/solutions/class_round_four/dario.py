import torch


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Autocast turned off inside, with a context manager that restores it."""
    with torch.autocast("cpu", enabled=False):
        keep = valid[..., None]
        xc = x.masked_fill(~keep, 0)
        mean = xc.mean(dim=-1, keepdim=True)
        centered = xc - mean
        var = (centered * centered).mean(dim=-1, keepdim=True)
        out = torch.addcmul(bias, centered / torch.sqrt(var + eps), scale)
        return out.masked_fill(~keep, 0.0)
