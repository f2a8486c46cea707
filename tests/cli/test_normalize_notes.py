"""`maskln normalize`'s notes (issue 33, item 6): a file without ``valid`` that holds a mask
under another name is told the option that reads it, as `maskln verify` tells it."""

from __future__ import annotations

from maskln_cli.jobs.generate import generate_inputs
from tests.clitools import invoke, read, write


def test_normalize_suggests_the_valid_key_of_an_attention_mask(tmp_path):
    inputs = generate_inputs((2, 16, 8), "float32", 0, invalid=0.3)
    inputs["attention_mask"] = inputs.pop("valid").long()  # transformers' int64 0/1
    source = write(tmp_path / "in.safetensors", inputs)
    done = invoke("normalize", source, tmp_path / "out.safetensors")
    assert done.exit_code == 0, done.stderr
    assert "no tensor 'valid': every position is valid" in done.stderr
    assert "did you mean `--valid-key attention_mask`?" in done.stderr
    # The option reads it: the padding is zeroed, and nothing is suggested.
    done = invoke(
        "normalize", source, tmp_path / "masked.safetensors", "--valid-key", "attention_mask"
    )
    assert done.exit_code == 0 and "--valid-key" not in done.stderr
    out = read(tmp_path / "masked.safetensors")["out"]
    assert bool((out[inputs["attention_mask"] == 0] == 0).all())
