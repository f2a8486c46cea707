"""The peer of ``maskln inspect CHECKPOINT`` in figure 8: what a user would write by hand.

Usage: ``python benchmarks/peer_inspect.py CHECKPOINT.safetensors``. Loads the whole file, then
prints min, max, mean and std of each floating tensor, computed by torch in the tensor's dtype.
"""

import sys

from safetensors.torch import load_file


def main(source: str) -> None:
    for name, tensor in load_file(source).items():
        if tensor.is_floating_point():
            stats = (tensor.min(), tensor.max(), tensor.mean(), tensor.std())
            print(name, *(f"{float(value):.4g}" for value in stats))


if __name__ == "__main__":
    main(*sys.argv[1:])
