"""The peer of ``maskln diff ACTUAL EXPECTED`` in figure 10: what a user would write by hand.

Usage: ``python benchmarks/peer_diff.py ACTUAL.safetensors EXPECTED.safetensors``. Loads both
files whole, checks they hold the same keys, then ``torch.testing.assert_close`` (its default
tolerances by dtype, as ``maskln diff``'s) key by key; exit 1 on a mismatch (an exception).
"""

import sys

import torch
from safetensors.torch import load_file


def main(actual: str, expected: str) -> None:
    a, b = load_file(actual), load_file(expected)
    assert a.keys() == b.keys(), f"keys differ: {sorted(a.keys() ^ b.keys())}"
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=lambda m, key=key: f"{key}: {m}")


if __name__ == "__main__":
    main(*sys.argv[1:])
