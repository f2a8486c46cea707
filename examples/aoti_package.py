"""A module using maskln's op, compiled ahead of time by AOTInductor and run from its package.

    python examples/aoti_package.py norm.pt2      # package, then load it in a fresh process

The package holds the graph's own code; maskln's op stays a call by name
(``maskln::masked_layer_norm``) that the loading process must have defined: ``import maskln_cli``
before ``aoti_load_package`` (in either order with ``import torch``).
"""

import subprocess
import sys

import torch

from maskln_cli import MaskedLayerNorm

LOAD = """
import sys
import maskln_cli  # defines maskln's ops: without it, "Could not find schema for maskln::..."
import torch

loaded = torch._inductor.aoti_load_package(sys.argv[1])
x, valid, want = torch.load(sys.argv[1] + ".io")
assert torch.equal(loaded(x, valid), want)
print("loaded in a fresh process: the same values as eager")
"""

if __name__ == "__main__":
    package = sys.argv[1]
    norm = MaskedLayerNorm(64).eval()
    x, valid = torch.randn(8, 16, 64), torch.rand(8, 16) > 0.3
    x[~valid] = float("nan")  # padding never reaches an output
    torch._inductor.aoti_compile_and_package(
        torch.export.export(norm, (x, valid)), package_path=package
    )
    with torch.no_grad():
        torch.save((x, valid, norm(x, valid)), package + ".io")
    subprocess.run([sys.executable, "-c", LOAD, package], check=True)
