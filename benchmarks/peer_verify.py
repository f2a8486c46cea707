"""The peer of ``maskln verify IN RESULT``: what a user would write by hand to check a kernel.

Usage: ``python benchmarks/peer_verify.py IN.safetensors RESULT.safetensors``; exit 1 on a
mismatch (assert_close raises).
"""

import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

EPS = 1e-5


def main(source: str, result: str) -> None:
    t = load_file(source)
    x, valid, scale, bias = t["x"], t["valid"], t["scale"], t["bias"]
    out = F.layer_norm(x, (x.shape[-1],), scale, bias, EPS).masked_fill(~valid[..., None], 0)
    torch.testing.assert_close(load_file(result)["out"], out)


if __name__ == "__main__":
    main(*sys.argv[1:])
