"""A kernel of your own, standing in for the one you want to check: a correct two-pass masked
layer normalization in plain torch ops, and a script that writes its results for an input file.

    python examples/my_kernel.py INPUT RESULT

INPUT holds x, valid, scale, bias (and grad_out for the gradients) and eps in its metadata, as
``maskln generate`` writes them; RESULT gets out (and grad_x, grad_scale, grad_bias: the
gradients of sum(out * grad_out)), computed in x's dtype. Then ``maskln verify INPUT RESULT``
judges them. Replace ``masked_layer_normalization`` with a call to your kernel; ``maskln grade
examples/my_kernel.py`` grades the function itself.
"""

import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def masked_layer_normalization(
    x: torch.Tensor,
    valid: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-05,
) -> torch.Tensor:
    """Layer-normalize the valid rows of x over the last axis; invalid rows give exactly 0."""
    padding = ~valid.unsqueeze(-1)
    x = x.masked_fill(padding, 0.0)  # before any reduction: NaN in the padding must not spread
    mean = x.mean(dim=-1, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(dim=-1, keepdim=True)  # population variance
    y = centered / torch.sqrt(variance + eps) * scale + bias
    return y.masked_fill(padding, 0.0)  # after the bias


def main(input_path: str, result_path: str) -> None:
    tensors = load_file(input_path)
    with safe_open(input_path, framework="pt") as handle:
        eps = float((handle.metadata() or {}).get("eps", 1e-5))
    x, scale, bias = (tensors[k].requires_grad_() for k in ("x", "scale", "bias"))
    out = masked_layer_normalization(x, tensors["valid"].bool(), scale, bias, eps)
    result = {"out": out.detach()}
    if "grad_out" in tensors:
        grads = torch.autograd.grad(out, (x, scale, bias), tensors["grad_out"])
        result.update(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True))
    save_file(result, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
