"""The "vs PyTorch" yardstick of a gradient when grad_out is finite but beyond the kernel's
dtype's range (issue 37's leftovers): it was run on grad_out cast to that dtype, inf, and its
figure was NaN. PyTorch is run on grad_out scaled by a power of two into range (a gradient
is linear in it: exact), and its gradients scaled back."""

from __future__ import annotations

import json
import math

import torch

from maskln_cli.jobs.generate import generate_inputs
from tests import kernels
from tests.clitools import invoke, write


def test_the_yardstick_of_a_float16_kernel_with_a_large_grad_out_is_a_number(tmp_path):
    inputs = generate_inputs((4, 32, 64), "float32", 2, invalid=0.25, grad=True)
    inputs["grad_out"] = inputs["grad_out"] * 1e6  # finite in float32, beyond float16's 65,504
    assert not bool(inputs["grad_out"].to(torch.float16).isfinite().all())
    result = kernels.run(kernels.two_pass, inputs)  # float32 gradients, stored as float16 below
    result = kernels.zero_padding(result, inputs["valid"])
    half = {k: v.to(torch.float16) for k, v in result.items() if k in ("out", "grad_x")}
    source = write(tmp_path / "in.safetensors", inputs, eps="1e-05")
    target = write(tmp_path / "result.safetensors", half)
    done = invoke("verify", source, target, "--json", "--check", "grad_x")
    document = json.loads(done.stdout)
    (grad_x,) = [t for t in document["tensors"] if t["name"] == "grad_x"]
    for key in ("yardstick_max_abs_diff", "yardstick_rel_l2"):  # was 0: PyTorch "exact"
        assert grad_x[key] is not None and math.isfinite(grad_x[key]), (key, grad_x[key])
        assert grad_x[key] > 0, (key, grad_x[key])
    # PyTorch's float16 grad_x errs about as a float16 result does: within some times of
    # RESULT's own (RESULT is the float32 gradient rounded to float16), both of float16's order.
    assert grad_x["rel_l2"] / 50 < grad_x["yardstick_rel_l2"] < 50 * grad_x["rel_l2"]
    assert 1e-5 < grad_x["yardstick_rel_l2"] < 1e-2
    report = invoke("verify", source, target, "--check", "grad_x").stdout
    assert "vs PyTorch" in report.split("grad_x", 1)[1], report
