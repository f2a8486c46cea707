"""`python -m maskln_cli`: run the op on each sample in sample_data/ against its expected output."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from maskln_cli import masked_layer_normalization


def main(sample_dir: Path = Path("sample_data")) -> int:
    failed = False
    for path in sorted(sample_dir.glob("*.safetensors")):
        if path.stem.endswith("_expected"):
            continue
        with safe_open(path, framework="pt") as handle:
            eps = float((handle.metadata() or {}).get("eps", 1e-5))
        inputs = load_file(path)
        expected = load_file(path.with_name(f"{path.stem}_expected.safetensors"))["out"]
        out = masked_layer_normalization(
            inputs["x"], inputs["valid"], inputs["scale"], inputs["bias"], eps
        )
        error = (out.double() - expected.double()).abs().max().item()
        ok = torch.allclose(out, expected, rtol=1e-5, atol=1.3e-6)
        failed |= not ok
        print(
            f"{path}: shape {list(out.shape)} {out.dtype}, max |out - expected| = {error:.2e}"
            f" -> {'ok' if ok else 'MISMATCH'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
