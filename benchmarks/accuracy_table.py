"""float32 error tables of the op on each backend, beside F.layer_norm's (docs-notes/op.md).

Run from the repository root: ``.venv/bin/python benchmarks/accuracy_table.py``. For each kind
of hard row of tests/op/test_accuracy.py and each row length, the largest error of y and dx in
float32 ulps of each element (floored at its row's RMS) against float64 torch on the same
float32-rounded inputs: maskln on the native kernels, on the raw-op kernels, and F.layer_norm.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from maskln_cli.op import backend
from tests.op.test_accuracy import KINDS, float32_errors, hard_rows

CHANNELS = (128, 4096, 65536)


def main() -> None:
    print("| kind | C | y native | y raw | y F.layer_norm | dx native | dx raw | dx F.layer_norm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    worst: dict[str, float] = {}
    for kind in KINDS:
        for channels in CHANNELS:
            rows = max(2, min(64, 2**20 // channels))
            x64 = hard_rows(kind, rows, channels, seed=channels)
            grad_out = torch.randn(x64.shape, generator=torch.Generator().manual_seed(4))
            cells: dict[str, float] = {}
            for name in ("native", "raw"):
                backend.set_backend(name)
                (y, peer_y), (dx, peer_dx) = float32_errors(x64, grad_out)
                cells[f"y {name}"], cells[f"dx {name}"] = y, dx
                cells["y peer"], cells["dx peer"] = peer_y, peer_dx
            for key, value in cells.items():
                worst[key] = max(worst.get(key, 0.0), value)
            order = ("y native", "y raw", "y peer", "dx native", "dx raw", "dx peer")
            print(f"| {kind} | {channels} | " + " | ".join(f"{cells[k]:.3g}" for k in order) + " |")
    order = ("y native", "y raw", "y peer", "dx native", "dx raw", "dx peer")
    print("| **worst** | | " + " | ".join(f"**{worst[k]:.3g}**" for k in order) + " |")
    backend.set_backend("native")
    print(f"\nnative backend: {backend.active_backend()}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
