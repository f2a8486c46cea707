"""What each term of grad_x's error budget is for: correct backward passes measured against it.

Run from the repository root with the project's interpreter::

    .venv/bin/python benchmarks/verify_gradient_budget.py      # ~1 minute

On rows where float32 loses digits (x = offset + N(0, std), offsets 1e3 and 1e4, std 1 and 0.1;
C = 64 and 768; an upstream gradient of random signs, or of one sign), each correct kernel of
tests/kernels.py with a backward (autograd through torch's F.layer_norm, through a two-pass
formula, a sequential sum's loop, Welford's and Kahan's; hand-written backward with pairwise or
sequential sums, in the tutorial's form or torch's CPU form) is measured against the float64
truth, and its grad_x error divided by the model of :meth:`RowBudget.grad_x
<maskln_cli.verify.budget.RowBudget.grad_x>`, element by element: the greatest ratio is the
factor the kernel needs (verify's default allows 3). Then once more without each term of the
model (:func:`~maskln_cli.verify.budget.grad_x_terms`): a term that some correct kernel needs
shows as a factor above 1 without it. The missing-term mistakes are measured alike (their
factor must stay above 3, so that they fail).

Prints a Markdown table: for each data set, the worst correct kernel (and its factor), the
factor it would need without each term, PyTorch's own, and the mistakes'.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maskln_cli.op.blocked import backward_in_place, forward
from maskln_cli.verify.budget import Precision, RowBudget, floor, grad_x_terms, scaled_atol
from tests import kernels

CORRECT = {
    "F.layer_norm": kernels.torch_layer_norm,
    "two-pass": kernels.two_pass,
    "sequential": kernels.sequential,
    "Welford": kernels.welford,
    "Kahan": kernels.kahan,
    **kernels.BACKWARD_CORRECT,
}
MISTAKES = {
    "no xhat term": kernels.written("no_xhat_term"),
    "no mean term": kernels.written("no_mean_term"),
}
SHAPES = {64: (4, 32, 64), 768: (2, 16, 768)}


HALF_CORRECT = {"F.layer_norm": kernels.torch_layer_norm, **kernels.BACKWARD_CORRECT}
"""Correct kernels of a half dtype (computing in float32, storing in the half dtype)."""


def data(channels: int, offset: float, std: float, dy: str, dtype: str = "float32"):
    inputs = kernels.offset_batch(offset, 0, shape=SHAPES[channels], std=std, dtype=dtype)
    if dy == "one sign":
        inputs["grad_out"] = inputs["grad_out"].abs()
    return inputs


def factors(kernel: kernels.Kernel, inputs: kernels.Tensors) -> dict[str, float]:
    """The factor ``kernel``'s grad_x needs: with the whole model, and without each term, over
    the elements beyond what is always allowed (as verify's factor_needed)."""
    channels = inputs["x"].shape[-1]
    dtype = inputs["x"].dtype
    x = inputs["x"].reshape(-1, channels).double()
    valid = inputs["valid"].reshape(-1)
    scale, bias = inputs["scale"].double(), inputs["bias"].double()
    dy = inputs["grad_out"].reshape(-1, channels).double()
    _, mean, rstd = forward(x, valid, scale, bias, 1e-5)
    truth = backward_in_place(dy.clone(), x, valid, scale, mean, rstd, 1e-5)[0]
    grad_x = kernels.run(kernel, inputs)["grad_x"].reshape(-1, channels).double()
    rows = RowBudget(x, valid, scale, bias, 1e-5, Precision.of(dtype))
    always = floor(truth, dtype, 0.0, scaled_atol(1e-5, rows.grad_x_size(dy)))
    beyond = valid[:, None] & ((grad_x - truth).abs() > always)
    error = (grad_x - truth).abs()[beyond]
    terms = {k: v * rows.growth for k, v in grad_x_terms(rows, dy).items()}
    whole = sum(terms.values())
    found = {"model": float((error / whole[beyond]).max()) if error.numel() else 0.0}
    for name, term in terms.items():
        rest = (whole - term)[beyond]
        found[f"without {name}"] = float((error / rest).max()) if error.numel() else 0.0
    return found


def main() -> None:
    torch.set_num_threads(1)
    term_names = ["shift", "factor", "sums", "stored"]
    header = [
        "data", "worst correct kernel", "factor", *[f"w/o {t}" for t in term_names],
        "F.layer_norm", "no xhat term", "no mean term",
    ]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|---|---|" + "---:|" * (len(header) - 2))
    needs = {t: 0.0 for t in term_names}
    sets = [
        (channels, offset, std, dy, dtype)
        for channels in SHAPES
        for offset, std in ((0.0, 1.0), (1e3, 1.0), (1e4, 1.0), (1e4, 0.1))
        for dy in ("random", "one sign")
        for dtype in ("float32", "float16", "bfloat16")
        if dtype == "float32" or offset == 0.0
    ]
    for channels, offset, std, dy, dtype in sets:
        inputs = data(channels, offset, std, dy, dtype)
        correct = CORRECT if dtype == "float32" else HALF_CORRECT
        measured = {name: factors(k, inputs) for name, k in correct.items()}
        worst = max(measured, key=lambda n: measured[n]["model"])
        for figures in measured.values():
            for t in term_names:
                needs[t] = max(needs[t], figures[f"without {t}"])
        wrong = {name: factors(k, inputs)["model"] for name, k in MISTAKES.items()}
        cells = [
                    f"{dtype}, C = {channels}, {offset:g} + N(0, {std:g}), dy {dy}", worst,
                    f"{measured[worst]['model']:.2g}",
                    *[f"{measured[worst][f'without {t}']:.2g}" for t in term_names],
                    f"{measured['F.layer_norm']['model']:.2g}",
                    *[f"{wrong[n]:.3g}" for n in MISTAKES],
                ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print()
    print("the greatest factor any correct kernel needs without each term:")
    for t, value in needs.items():
        print(f"  {t}: {value:.3g}")


if __name__ == "__main__":
    main()
