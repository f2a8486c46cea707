"""Solutions of the fifth round's leftovers (issue 37): correct ones the grader must pass
whatever the machine's load, and hangs it must still stop."""

import time

import torch

_calls = [0]


def correct(x, valid, scale, bias, eps=1e-05):
    """tests/solutions/correct.py's solution."""
    padding = ~valid.unsqueeze(-1)
    x_clean = x.masked_fill(padding, 0.0)
    mean = x_clean.mean(dim=-1, keepdim=True)
    centered = x_clean - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)
    y = centered / torch.sqrt(variance + eps) * scale + bias
    return torch.empty_like(x).copy_(y.masked_fill(padding, 0.0))


def sleeps_in_second_order(x, valid, scale, bias, eps=1e-05):
    """Correct, but from its third call with a float64 x of 24 elements that requires grad
    (gradgradcheck's calls in second_order) it sleeps: a hang that uses no CPU."""
    if x.dtype == torch.float64 and x.numel() == 24 and x.requires_grad:
        _calls[0] += 1
        if _calls[0] >= 3:
            time.sleep(3600)
    return correct(x, valid, scale, bias, eps)


def spins_in_second_order(x, valid, scale, bias, eps=1e-05):
    """As :func:`sleeps_in_second_order`, but the hang is a busy loop (it uses a whole CPU)."""
    if x.dtype == torch.float64 and x.numel() == 24 and x.requires_grad:
        _calls[0] += 1
        if _calls[0] >= 3:
            while True:
                pass
    return correct(x, valid, scale, bias, eps)
