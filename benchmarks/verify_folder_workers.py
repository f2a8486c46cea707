"""Is judging a folder's files on several threads faster than one after the other?

Writes DUMPS dumps (a BERT-base-sized LayerNorm call each: x [8, 128, 768] float32 with
grad_out and the module's gradients) and times ``verify_folder`` in-process with
``FILE_WORKERS`` 1 and 2, interleaved, REPS times; prints each ratio (2 workers / 1) and their
median, and checks that every file's report is the same whatever the workers.
Usage: ``.venv/bin/python benchmarks/verify_folder_workers.py [DUMPS] [REPS]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maskln_cli.verify import folder


def make(where: Path, count: int) -> None:
    g = torch.Generator().manual_seed(0)
    for call in range(count):
        x = torch.randn(8, 128, 768, generator=g).requires_grad_()
        valid = torch.rand(8, 128, generator=g) > 0.3
        scale = torch.ones(768, requires_grad=True)
        bias = torch.zeros(768, requires_grad=True)
        out = F.layer_norm(x, (768,), scale, bias, 1e-12)
        grad_out = torch.randn(8, 128, 768, generator=g)
        grads = torch.autograd.grad(out, (x, scale, bias), grad_out)
        tensors = dict(x=x, valid=valid, scale=scale, bias=bias, out=out, grad_out=grad_out)
        tensors.update(zip(("grad_x", "grad_scale", "grad_bias"), grads, strict=True))
        meta = {"eps": "1e-12", "module": f"layer.{call}.LayerNorm", "call": str(call)}
        tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
        save_file(tensors, str(where / f"{call:05d}.safetensors"), meta)


REPORTS: dict[int, list[dict[str, object]]] = {}


def timed(where: Path, workers: int) -> float:
    folder.FILE_WORKERS = workers
    started = time.perf_counter()
    report = folder.verify_folder(str(where), None)
    seconds = time.perf_counter() - started
    assert report.passed, [f.problem for f in report.files if not f.passed]
    # The same figures, bit for bit, whatever the number of workers.
    documents = [f.to_dict() for f in report.files]
    assert REPORTS.setdefault(workers, documents) == documents == REPORTS.get(1, documents)
    return seconds


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(scratch)
        make(where, count)
        timed(where, 1)  # warm-up
        ratios = []
        for _ in range(reps):
            one, two = timed(where, 1), timed(where, 2)
            ratios.append(two / one)
            print(f"1 worker {one:.2f} s, 2 workers {two:.2f} s: ratio {two / one:.2f}")
        print(f"median ratio (2 workers / 1): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
