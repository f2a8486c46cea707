"""The peer of ``maskln normalize IN OUT`` in figure 6: what a user would write by hand.

Usage: ``python benchmarks/peer_normalize.py IN.safetensors OUT.safetensors``.
"""

import sys

import torch.nn.functional as F
from safetensors.torch import load_file, save_file

EPS = 1e-5


def main(source: str, target: str) -> None:
    t = load_file(source)
    x, valid, scale, bias = t["x"], t["valid"], t["scale"], t["bias"]
    out = F.layer_norm(x, (x.shape[-1],), scale, bias, EPS).masked_fill(~valid[..., None], 0)
    save_file({"out": out}, target)


if __name__ == "__main__":
    main(*sys.argv[1:])
