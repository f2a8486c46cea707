"""Regenerate sample_data/ deterministically: `make sample-data`.

Writes each case as an input file (x, valid, scale, bias[, grad_out]; eps in the metadata) and an
expected file (out[, grad_x, grad_scale, grad_bias]) computed by the float64 reference in
maskln_cli.op.reference, not by the op under test. The worked example and the pair features are
built here; sequence_batch is written by `maskln generate`, as a user would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from maskln_cli.op.reference import reference_masked_layer_norm

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_data"


def worked_example() -> tuple[dict[str, torch.Tensor], float]:
    """The specification's worked example: one valid row, one masked row."""
    inputs = {
        "x": torch.tensor([[[1.0, 3.0], [99.0, -99.0]]], dtype=torch.float64),
        "valid": torch.tensor([[True, False]]),
        "scale": torch.tensor([2.0, -1.0], dtype=torch.float64),
        "bias": torch.tensor([0.5, 1.0], dtype=torch.float64),
    }
    return inputs, 3.0


def pair_features(seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    """A padded batch of pair features [2, 48, 48, 32] float32, like a protein-model pair stack.

    Sequence lengths are 48 and 35: pair (i, j) of sequence b is valid when both i and j are
    below its length. The padded rows hold garbage, NaN and inf included, as real dumps do.
    """
    generator = torch.Generator().manual_seed(seed)
    batch, length, channels = 2, 48, 32
    lengths = torch.tensor([48, 35])
    positions = torch.arange(length)
    in_sequence = positions[None, :] < lengths[:, None]
    valid = in_sequence[:, :, None] & in_sequence[:, None, :]
    x = 3.0 * torch.randn(batch, length, length, channels, generator=generator) + 0.5
    garbage = 1e4 * torch.randn(x.shape, generator=generator)
    garbage.view(-1)[::7] = float("nan")
    garbage.view(-1)[3::11] = float("inf")
    x = torch.where(valid[..., None], x, garbage)
    inputs = {
        "x": x,
        "valid": valid,
        "scale": 1.0 + 0.1 * torch.randn(channels, generator=generator),
        "bias": 0.1 * torch.randn(channels, generator=generator),
        "grad_out": torch.randn(x.shape, generator=generator),
    }
    return inputs, 1e-5


def expected_outputs(inputs: dict[str, torch.Tensor], eps: float) -> dict[str, torch.Tensor]:
    """The float64 reference's output, and its gradients when the inputs hold grad_out."""
    dtype = inputs["x"].dtype
    x = inputs["x"].double().requires_grad_()
    scale = inputs["scale"].double().requires_grad_()
    bias = inputs["bias"].double().requires_grad_()
    out = reference_masked_layer_norm(x, inputs["valid"], scale, bias, eps)
    expected = {"out": out.detach().to(dtype)}
    if "grad_out" in inputs:
        grads = torch.autograd.grad(out, (x, scale, bias), inputs["grad_out"].double())
        for name, grad in zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True):
            expected[name] = grad.to(dtype)
    return expected


GENERATED = {
    "sequence_batch": [
        "--shape",
        "4,64,128",
        "--invalid",
        "0.3",
        "--poison",
        "--grad",
        "--seed",
        "7",
    ],
}


def main(sample_dir: Path = SAMPLE_DIR) -> None:
    sample_dir.mkdir(exist_ok=True)
    for name, arguments in GENERATED.items():
        path = sample_dir / f"{name}.safetensors"
        command = [sys.executable, "-m", "maskln_cli", "generate", str(path), *arguments, "--quiet"]
        subprocess.run(command, check=True)
        with safe_open(path, framework="pt") as handle:
            eps = float(handle.metadata()["eps"])
        save_file(
            expected_outputs(load_file(path), eps),
            sample_dir / f"{name}_expected.safetensors",
            metadata={"eps": repr(eps)},
        )
        print(f"wrote {sample_dir / name}.safetensors (maskln generate) and its expected output")
    for name, (inputs, eps) in {
        "worked_example": worked_example(),
        "pair_features": pair_features(),
    }.items():
        metadata = {"eps": repr(eps)}
        save_file(inputs, sample_dir / f"{name}.safetensors", metadata=metadata)
        save_file(
            expected_outputs(inputs, eps),
            sample_dir / f"{name}_expected.safetensors",
            metadata=metadata,
        )
        print(f"wrote {sample_dir / name}.safetensors and its expected output")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else SAMPLE_DIR)
