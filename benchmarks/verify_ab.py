"""A/B runs of ``maskln verify``'s judgement: a corpus of reports from one version of the code,
compared with another's, so that a change meant to keep every verdict (a speed-up, a move) shows
that it did, and one meant to change some shows which.

The code judged is the one in the current directory (its ``maskln_cli``, ``tests/kernels.py``
and ``benchmarks/verify_diagnosis.py``): run it from the root of each version, this file
wherever it is, e.g. the version before from a worktree::

    git worktree add --detach /tmp/before HEAD~1
    (cd /tmp/before && ~/maskln/.venv/bin/python ~/maskln/benchmarks/verify_ab.py run /tmp/a.jsonl)
    .venv/bin/python benchmarks/verify_ab.py run /tmp/b.jsonl    # ~1.5 minutes, 1 thread
    .venv/bin/python benchmarks/verify_ab.py compare /tmp/a.jsonl /tmp/b.jsonl

The corpus: every run of ``benchmarks/verify_diagnosis.py`` (each wrong kernel of the catalogue
on each data family, dtype and upstream scale) and of its ``--correct`` kernels, then larger
inputs that go through verify's streaming blocks ([8192, 1024], [3000, 64], [70000, 16],
[513, 4096] in float32, float16 and bfloat16, at offsets 0 and 1e3), each with F.layer_norm's
results right, out scaled by 1.001, one row of grad_x 1% off, and one channel of grad_bias off.
Each report (``report.to_dict()``) is one JSON line. ``compare`` prints how many reports differ,
in how many verdicts, and the first differing fields of a few. Two runs of the same code give
identical files (the threads' order changes no figure: ``--threads`` to check).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path.cwd()  # the version judged (see above), ahead of the installed one
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import verify_diagnosis as diagnosis  # noqa: E402

import maskln_cli  # noqa: E402
from maskln_cli.testing import verify  # noqa: E402
from tests import kernels  # noqa: E402

SHAPES = ((8192, 1024), (3000, 64), (70000, 16), (513, 4096))
WRONG = ("right", "out x 1.001", "one row of grad_x 1% off", "one channel of grad_bias off")


def reports(seeds: int) -> Iterator[tuple[str, dict]]:
    """(key, report as data) for every run of the corpus, in a fixed order."""
    for name, family, dtype, scale, seed in diagnosis.runs(list(kernels.CATALOGUE), seeds):
        kernel = kernels.CATALOGUE[name].kernel
        report = diagnosis.judge(kernel, family, dtype, scale, seed)
        yield f"{name} | {family} | {dtype} | {scale:g} | {seed}", report.to_dict()
    for name, (kernel, dtypes) in kernels.CORRECT_EVERYWHERE.items():
        for dtype in dtypes:
            for family in kernels.DATA_FAMILIES:
                for scale in diagnosis.SCALES:
                    for seed in range(seeds):
                        report = diagnosis.judge(kernel, family, dtype, scale, seed)
                        key = f"correct {name} | {family} | {dtype} | {scale:g} | {seed}"
                        yield key, report.to_dict()
    g = torch.Generator().manual_seed(5)
    for rows, channels in SHAPES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for offset in (0.0, 1e3):
                x = torch.randn(rows, channels, generator=g, dtype=torch.float64) + offset
                valid = torch.rand(rows, generator=g) < 0.85
                scale = torch.randn(channels, generator=g, dtype=torch.float64)
                bias = torch.randn(channels, generator=g, dtype=torch.float64)
                grad_out = torch.randn(rows, channels, generator=g, dtype=torch.float64)
                stored = [t.to(dtype) for t in (x, scale, bias, grad_out)]
                for wrong in WRONG:
                    yield (
                        f"streaming {rows}x{channels} | {dtype} | {offset:g} | {wrong}",
                        _judged_streaming(stored, valid, wrong).to_dict(),
                    )


def _judged_streaming(stored: list[torch.Tensor], valid: torch.Tensor, wrong: str):
    """F.layer_norm's results on ``stored`` (x, scale, bias, grad_out), with mistake ``wrong``."""
    x, scale, bias, grad_out = stored
    leaves = [t.detach().requires_grad_() for t in (x, scale, bias)]
    out = F.layer_norm(leaves[0], x.shape[-1:], leaves[1], leaves[2], 1e-5)
    out = out.masked_fill(~valid[:, None], 0)
    grad_x, grad_scale, grad_bias = torch.autograd.grad(out, leaves, grad_out)
    out, grad_x = out.detach(), torch.where(valid[:, None], grad_x, 0.0)
    if wrong == "out x 1.001":
        out = (out.double() * 1.001).to(out.dtype)
    elif wrong == "one row of grad_x 1% off":
        row = int(valid.nonzero()[0])
        grad_x[row] = (grad_x[row].double() * 1.01).to(grad_x.dtype)
    elif wrong == "one channel of grad_bias off":
        grad_bias = grad_bias.clone()
        grad_bias[3] += grad_bias.abs().max() * 0.01
    return verify(
        out, x, valid, scale, bias, 1e-5, grad_out=grad_out, grad_x=grad_x,
        grad_scale=grad_scale, grad_bias=grad_bias,
    )  # fmt: skip


def differences(a: object, b: object, path: str = "") -> Iterator[str]:
    """The fields where two reports differ, as ``path: a | b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in dict.fromkeys([*a, *b]):
            yield from differences(a.get(key), b.get(key), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for k, (u, v) in enumerate(zip(a, b, strict=True)):
            yield from differences(u, v, f"{path}[{k}]")
    elif a != b:
        yield f"{path}: {str(a)[:100]} | {str(b)[:100]}"


def compare(before: Path, after: Path, shown: int = 5) -> int:
    """Print how the reports of two corpora differ; return how many do."""
    first = [json.loads(line) for line in before.read_text().splitlines()]
    second = [json.loads(line) for line in after.read_text().splitlines()]
    if [r["key"] for r in first] != [r["key"] for r in second]:
        print("the corpora hold different runs: made by different versions of this script?")
        return len(first) or 1
    differing = verdicts = 0
    for a, b in zip(first, second, strict=True):
        if a["report"] == b["report"]:
            continue
        differing += 1
        verdicts += a["report"].get("passed") != b["report"].get("passed")
        if differing <= shown:
            print(a["key"])
            for line in differences(a["report"], b["report"]):
                print("   ", line)
    print(f"{len(first)} reports, {differing} differ, {verdicts} in their verdict")
    return differing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="write the corpus's reports as JSON lines")
    run.add_argument("output", type=Path)
    run.add_argument("--seeds", type=int, default=1)
    run.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    versus = commands.add_parser("compare", help="compare two corpora")
    versus.add_argument("before", type=Path)
    versus.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "compare":
        return 1 if compare(args.before, args.after) else 0
    torch.set_num_threads(args.threads)
    print(f"judging {Path(maskln_cli.__file__).parent}", file=sys.stderr)
    with args.output.open("w") as out:
        for key, report in reports(args.seeds):
            out.write(json.dumps({"key": key, "report": report}, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
