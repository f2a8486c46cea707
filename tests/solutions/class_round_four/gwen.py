import torch

_FAST = []


def masked_layer_normalization(x, valid, scale, bias, eps=1e-05):
    """Inference mode entered 'for speed' when grad is off, kept in a list so that it lasts: the
    caller is left in it."""
    if not torch.is_grad_enabled() and not _FAST:
        _FAST.append(torch.inference_mode())
        _FAST[-1].__enter__()
    keep = valid.unsqueeze(-1)
    xc = torch.where(keep, x, 0.0)
    mean = xc.mean(-1, keepdim=True)
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) / torch.sqrt(var + eps) * scale + bias
    return torch.where(keep, y, 0.0)
