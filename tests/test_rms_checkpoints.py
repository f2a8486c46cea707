"""maskln normalize on LLaMA-family checkpoints (issue 39): RMSNorm found from config.json.

Tiny LLaMA and Qwen2 models are built from configs with random weights (nothing is
downloaded), saved with ``save_pretrained``, and run on a padded batch with an int64 attention
mask; hooks capture one RMSNorm's input, output and gradients. ``maskln normalize`` then reads
the checkpoint folder with ``--config`` (whose ``rms_norm_eps`` gives the norm and eps, no
``--norm``) and ``--module``, and is compared on valid rows with a float64 plain-ops RMSNorm and
with the model's own module.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers

from tests.clitools import invoke, metadata, read, write
from tests.model_runs import LENGTHS, run_padded_batch

COMMON = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "vocab_size": 50,
    "rms_norm_eps": 1e-5,  # not RMSNorm's default 1e-6: the config's must be the one used
}
ARCHITECTURES = {"llama": ("LlamaConfig", "LlamaModel"), "qwen2": ("Qwen2Config", "Qwen2Model")}
MODULE = "layers.1.input_layernorm"


def capture(name, folder):
    config_class, model_class = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON))
    model.eval()
    with torch.no_grad():  # a weight far from ones, so that a scale mix-up shows
        model.get_submodule(MODULE).weight.normal_(1.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    module = model.get_submodule(MODULE)
    acts, own = run_padded_batch(model, module)
    return acts, {**own, "grad_scale": module.weight.grad}, module


def float64_rms(acts, weight, eps):
    """out, grad_x, grad_scale of the plain RMSNorm formula in float64 (valid rows' values)."""
    x = acts["x"].double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    out = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w
    valid = acts["attention_mask"].bool()[..., None]
    out = torch.where(valid, out, 0.0)
    grad_x, grad_scale = torch.autograd.grad(out, (x, w), acts["grad_out"].double())
    return {"out": out.detach(), "grad_x": grad_x, "grad_scale": grad_scale}


def assert_float32_close(ours, float64):
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), float64, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_normalize_finds_rmsnorm_in_the_config_and_matches_the_model(name, tmp_path):
    acts, own, module = capture(name, tmp_path / "model")
    source = write(tmp_path / "acts.safetensors", acts)
    output = tmp_path / "out.safetensors"
    result = invoke(
        "normalize", source, output, "--params", tmp_path / "model",
        "--config", tmp_path / "model", "--module", MODULE, "--valid-key", "attention_mask",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    written = metadata(output)
    assert (written["norm"], float(written["eps"])) == ("rms", 1e-5)
    ours = read(output)
    assert sorted(ours) == ["grad_scale", "grad_x", "out"]
    valid = acts["attention_mask"].bool()
    truth = float64_rms(acts, module.weight, 1e-5)
    for key in ("out", "grad_x"):
        # float32 results against the float64 formula at float32's default tolerance.
        assert_float32_close(ours[key][valid], truth[key][valid])
        torch.testing.assert_close(ours[key][valid], own[key][valid])
        assert bool((ours[key][~valid] == 0).all())  # padding: exactly 0
    # The model's grad_scale sums the padded rows too (it normalizes them): ours does not.
    assert_float32_close(ours["grad_scale"], truth["grad_scale"])


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_verify_passes_a_models_captured_rmsnorms_and_fails_a_wrong_one(name, tmp_path):
    """capture -> maskln verify DIR: each stock RMSNorm's dump (its padding normalized, so its
    valid rows are compared) passes; a dump whose out is 1 + weight's fails, naming that cause
    (RMSNorm's catalogue: the gain one more than due)."""
    from safetensors.torch import load_file, save_file

    import maskln_cli

    config_class, model_class = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**COMMON))
    model.eval()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 30, (len(LENGTHS), max(LENGTHS)), generator=generator)
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    folder = tmp_path / "dumps"
    with maskln_cli.capture(model, folder, valid=mask) as run:
        hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        (hidden * torch.randn(hidden.shape, generator=generator) * mask[..., None]).sum().backward()
    assert len(run.files) == 5  # two per layer and the final norm
    result = invoke("verify", folder, "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    verdicts = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(verdicts) == 5 and all(v["passed"] for v in verdicts)
    judged = {t["name"] for v in verdicts for t in v["report"]["tensors"]}
    assert judged == {"out", "grad_x", "grad_scale"}
    # A kernel that took Gemma's 1 + weight: wrong, and that is the cause named.
    dump = sorted(folder.iterdir())[-1]
    tensors = load_file(str(dump))
    valid = tensors["valid"]
    x = tensors["x"].double()
    wrong = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * (1 + tensors["scale"])
    save_file({"out": torch.where(valid[..., None], wrong, 0.0).float()}, str(tmp_path / "k.st"))
    failed = invoke("verify", dump, tmp_path / "k.st", "--check", "out", "--json")
    assert failed.exit_code == 1
    out = json.loads(failed.stdout)["tensors"][0]
    assert out["passed"] is False
    assert [d["mistake"] for d in out["diagnosis"]] == ["gain_plus_one"]
