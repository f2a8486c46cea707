"""Peak memory of ``maskln_cli.capture`` on a 12-layer model: forward and backward, and
forward only under ``torch.no_grad()``.

    .venv/bin/python benchmarks/capture_memory.py [--repeat N] [--batch B] [--length S]

Each run is a fresh process (``--child MODE PASS``) that builds a 12-layer BERT from its
config (hidden size 256, random weights, nothing downloaded), runs a padded batch once as a
warm-up, gives freed memory back to the OS, resets the peak (VmHWM), and runs it again,
measured: the peak resident memory beyond what it held before. Passes: ``train`` (forward and
backward under a loss over the valid positions; the autograd graph holds every layer norm's
input anyway) and ``inference`` (forward under no_grad: the model holds almost nothing).
Modes:

- ``plain``: the model alone, no capture: what the model itself holds;
- ``capture``: inside ``maskln_cli.capture(model, folder, valid=attention_mask)``;
- ``naive``: the hooks a user writes by hand (a forward hook keeping each layer norm's x
  and out, a full backward hook its gradients), saved with ``save_file`` after the backward.

The modes run interleaved, ``--repeat`` times (the machine is shared: medians of
interleaved runs). Printed: each mode's median extra peak, and capture's and naive's excess
over plain in units of one call's dump (train: x, out, grad_out and grad_x of one layer norm
call; inference: x and out). The claim: capture's excess is at most about one call, whatever
the number of calls; naive's grows with them where the model does not hold them anyway.
Linux only (/proc/self/status, malloc_trim).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from memory_probe import reset_peak, status_bytes  # beside this script

MODES = ("plain", "capture", "naive")
PASSES = ("train", "inference")


def child(mode: str, kind: str, batch: int, length: int) -> dict[str, int]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from safetensors.torch import save_file

    import maskln_cli

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=12,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=length,
    )
    model = transformers.BertModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 1000, (batch, length), generator=generator)
    lengths = torch.linspace(length // 4, length, batch).long()
    attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    weights = torch.randn(batch, length, 256, generator=generator)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]

    def step() -> None:
        if kind == "inference":
            with torch.no_grad():
                model(input_ids=input_ids, attention_mask=attention_mask)
            return
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        (hidden * weights * attention_mask[..., None]).sum().backward()
        model.zero_grad(set_to_none=True)

    def run(folder: Path) -> None:
        if mode == "plain":
            step()
        elif mode == "capture":
            with maskln_cli.capture(model, folder, valid=attention_mask):
                step()
        else:
            kept: list[dict[str, torch.Tensor]] = []

            def forward_hook(module, args, out):
                kept.append({"x": args[0].detach(), "out": out.detach()})

            def backward_hook(module, grad_input, grad_output):  # train only
                entry = next(e for e in reversed(kept) if "grad_x" not in e)
                entry["grad_x"], entry["grad_out"] = grad_input[0], grad_output[0]

            handles = [n.register_forward_hook(forward_hook) for n in norms]
            if kind == "train":
                handles += [n.register_full_backward_hook(backward_hook) for n in norms]
            step()
            for handle in handles:
                handle.remove()
            folder.mkdir()
            for index, entry in enumerate(kept):
                save_file({k: v.contiguous() for k, v in entry.items()}, folder / f"{index}.st")

    with tempfile.TemporaryDirectory() as scratch:
        run(Path(scratch) / "warm-up")
        shutil.rmtree(Path(scratch) / "warm-up", ignore_errors=True)
        reset_peak()
        before = status_bytes("VmRSS")
        run(Path(scratch) / "measured")
        peak = status_bytes("VmHWM")
        files = list((Path(scratch) / "measured").glob("*"))
    # x, out (and grad_out, grad_x in train) in float32
    call_bytes = (4 if kind == "train" else 2) * batch * length * 256 * 4
    return {"extra": peak - before, "call_bytes": call_bytes, "calls": len(files) or len(norms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PASS"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batch, args.length)))
        return
    results: dict[tuple[str, str], list[int]] = {}
    info: dict[str, dict[str, int]] = {}
    for repeat in range(args.repeat):
        for kind in PASSES:
            for mode in MODES:
                command = [sys.executable, __file__, "--child", mode, kind,
                           "--batch", str(args.batch), "--length", str(args.length)]  # fmt: skip
                output = subprocess.run(command, check=True, capture_output=True, text=True)
                measured = json.loads(output.stdout)
                results.setdefault((kind, mode), []).append(measured["extra"])
                info[kind] = measured
                print(f"run {repeat + 1} {kind:9} {mode:8} extra"
                      f" {measured['extra'] / 2**20:8.1f} MiB", file=sys.stderr)  # fmt: skip
    print(f"12-layer BERT (hidden 256), batch {args.batch} x {args.length} tokens,"
          f" {info['train']['calls']} layer norm calls; medians of {args.repeat} interleaved"
          " runs")  # fmt: skip
    for kind in PASSES:
        call = info[kind]["call_bytes"]
        plain = statistics.median(results[(kind, "plain")])
        print(f"{kind}: one call's dump {call / 2**20:.1f} MiB")
        for mode in MODES:
            extra = statistics.median(results[(kind, mode)])
            excess = (extra - plain) / call
            print(f"  {mode:8} extra peak {extra / 2**20:8.1f} MiB   over plain:"
                  f" {excess:6.2f} calls")  # fmt: skip


if __name__ == "__main__":
    main()
