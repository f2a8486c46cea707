"""Write the files of the docs' walk-through of a sharded checkpoint (docs/guides/models.md).

    .venv/bin/python scripts/make_checkpoint_example.py [FOLDER]     # default: checkpoint-example

A tiny ESM protein model (hidden size 32, 2 layers) is built from its config with random
weights (nothing is downloaded) and saved as a transformers user saves one, sharded:

    FOLDER/esm-tiny/config.json, model.safetensors.index.json, model-0000N-of-0000M.safetensors

It then runs a padded batch of three sequences (lengths 9, 5 and 2) with an int64 attention mask
and a loss over the valid positions, and dumps what hooks saw at ``encoder.layer.1.LayerNorm``:

    FOLDER/acts.safetensors    x [3, 9, 32], attention_mask [3, 9] int64, grad_out [3, 9, 32]
    FOLDER/layer.safetensors   the LayerNorm's out, grad_x, grad_scale, grad_bias

The same arguments give the same files (a seeded model and batch).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from safetensors.torch import save_file
from transformers import EsmConfig, EsmModel
from transformers.utils import logging

MODULE = "encoder.layer.1.LayerNorm"
LENGTHS = (9, 5, 2)


def tiny_esm() -> EsmModel:
    torch.manual_seed(0)
    config = EsmConfig(
        vocab_size=33,
        pad_token_id=1,
        mask_token_id=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    model = EsmModel(config).eval()
    # A fresh LayerNorm is ones and zeros, which a kernel that ignores scale and bias passes:
    # trained-looking values make the walk-through check that they are read and applied.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
    return model


def dump_layer_norm(model: EsmModel) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The LayerNorm's input (with the mask and upstream gradient) and its results."""
    module = model.get_submodule(MODULE)
    seen: dict[str, torch.Tensor] = {}

    def forward_hook(_, inputs, output):
        seen["x"], seen["out"] = inputs[0].detach(), output.detach()

    def backward_hook(_, grad_input, grad_output):
        seen["grad_x"], seen["grad_out"] = grad_input[0], grad_output[0]

    hooks = [
        module.register_forward_hook(forward_hook),
        module.register_full_backward_hook(backward_hook),
    ]
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, 24, (len(LENGTHS), max(LENGTHS)), generator=generator)
    positions = torch.arange(max(LENGTHS))
    attention_mask = (positions[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    input_ids[attention_mask == 0] = model.config.pad_token_id
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    weights = torch.randn(hidden.shape, generator=generator)
    (hidden * weights * attention_mask[..., None]).sum().backward()  # valid positions only
    for hook in hooks:
        hook.remove()
    acts = {"x": seen["x"], "attention_mask": attention_mask, "grad_out": seen["grad_out"]}
    layer = {
        "out": seen["out"],
        "grad_x": seen["grad_x"],
        "grad_scale": module.weight.grad,
        "grad_bias": module.bias.grad,
    }
    return acts, layer


def main(folder: Path) -> None:
    logging.disable_progress_bar()
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_esm()
    model.save_pretrained(folder / "esm-tiny", safe_serialization=True, max_shard_size="20KB")
    acts, layer = dump_layer_norm(model)
    save_file({k: v.contiguous() for k, v in acts.items()}, str(folder / "acts.safetensors"))
    save_file({k: v.contiguous() for k, v in layer.items()}, str(folder / "layer.safetensors"))
    print(f"wrote {folder}/esm-tiny/, {folder}/acts.safetensors, {folder}/layer.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "checkpoint-example"))
