"""The peer of ``maskln verify IN RESULT`` with gradients: what a user would write by hand.

Load both files, compute the float64 truth with autograd (the one-liner on the padding zeroed,
its gradients for grad_out), compare each of RESULT's tensors with assert_close. Usage:
``python benchmarks/peer_verify_grad.py IN.safetensors RESULT.safetensors``; exit 1 naming
the tensors assert_close fails.
"""

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

EPS = 1e-5


def main(source: str, result: str) -> None:
    t, r = load_file(source), load_file(result)
    keep = t["valid"][..., None]
    x, scale, bias = (t[k].double().requires_grad_() for k in ("x", "scale", "bias"))
    rows = torch.where(keep, x, 0.0)
    out = torch.where(keep, F.layer_norm(rows, (x.shape[-1],), scale, bias, EPS), 0.0)
    grads = torch.autograd.grad(
        out, (x, scale, bias), torch.where(keep, t["grad_out"].double(), 0.0)
    )
    failed = []
    for name, truth in zip(
        ("out", "grad_x", "grad_scale", "grad_bias"), (out, *grads), strict=True
    ):
        try:  # float32 results against float64 truth: assert_close takes float32's tolerance
            torch.testing.assert_close(r[name], truth.detach().float())
        except AssertionError:
            failed.append(name)
    sys.exit(f"mismatch: {failed}" if failed else 0)


if __name__ == "__main__":
    main(*sys.argv[1:])
