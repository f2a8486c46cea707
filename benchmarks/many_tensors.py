"""``maskln inspect`` and ``maskln diff`` of a file of many tiny tensors, against a plain script.

Usage::

    .venv/bin/python benchmarks/many_tensors.py               # 10,000 keys, 7 repetitions
    .venv/bin/python benchmarks/many_tensors.py --keys 2000 --reps 3

With thousands of tiny tensors (biases, norms, scalars) the data is nothing and what is done per
tensor is everything. The file holds ``--keys`` tensors of 4 to 12 elements: float32 mostly,
every 10th int64 and every 10th bool; a second file holds the same values, the float ones
nudged within float32's default tolerance, so ``maskln diff`` passes (exit 0).

The peers are what a user would write by hand, here in ``peer-inspect`` and ``peer-diff`` mode
of this script (torch and safetensors only): ``load_file``, then per tensor min, max, mean and
std (a bool's count of true), or ``torch.testing.assert_close`` (``torch.equal`` for integers
and bool). Every command is a fresh process (torch's import is in both), output to /dev/null;
the two run interleaved, alternating which goes first, and each repetition gives one ratio,
ours / peer. The target is a median of at most 1.5. The machine's load average is printed
before and after: on a busy machine rerun before drawing conclusions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MASKLN = [sys.executable, "-m", "maskln_cli"]
PEER = [sys.executable, str(Path(__file__).resolve())]
TARGET = 1.5


def write_files(folder: Path, keys: int) -> tuple[Path, Path]:
    """Two files of ``keys`` tiny tensors; the second passes ``maskln diff`` against the first."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    first: dict[str, torch.Tensor] = {}
    second: dict[str, torch.Tensor] = {}
    for i in range(keys):
        shape = (4 + i % 9,) if i % 3 else (2, 2 + i % 5)
        name = f"layer.{i // 10}.part{i % 10}.weight"
        if i % 10 == 3:
            value = torch.randint(-(2**40), 2**40, shape, generator=generator)
            first[name] = second[name] = value
        elif i % 10 == 7:
            value = torch.rand(shape, generator=generator) > 0.5
            first[name] = second[name] = value
        else:
            value = torch.randn(shape, generator=generator)
            first[name] = value
            second[name] = value * (1 + 1e-7)  # within float32's rtol of 1.3e-6
    a, b = folder / "many_a.safetensors", folder / "many_b.safetensors"
    save_file(first, str(a))
    save_file(second, str(b))
    return a, b


def peer_inspect(source: str) -> None:
    import torch
    from safetensors.torch import load_file

    for name, tensor in load_file(source).items():
        if tensor.dtype.is_floating_point:
            stats = (tensor.min(), tensor.max(), tensor.mean(), tensor.std())
        elif tensor.dtype == torch.bool:
            stats = (tensor.sum(),)
        else:
            values = tensor.double()
            stats = (tensor.min(), tensor.max(), values.mean(), values.std())
        print(name, *(f"{float(value):.4g}" for value in stats))


def peer_diff(actual: str, expected: str) -> None:
    import torch
    from safetensors.torch import load_file

    a, e = load_file(actual), load_file(expected)
    failed = 0
    for name in [*a, *(k for k in e if k not in a)]:
        if name not in a or name not in e:
            print(name, "missing")
            failed += 1
            continue
        if a[name].dtype.is_floating_point:
            try:
                torch.testing.assert_close(a[name], e[name])
            except AssertionError as error:
                print(name, "FAIL", str(error).splitlines()[0])
                failed += 1
                continue
        elif a[name].shape != e[name].shape or not torch.equal(a[name], e[name]):
            print(name, "FAIL")
            failed += 1
            continue
        print(name, "ok")
    sys.exit(1 if failed else 0)


def wall_time(command: list[str]) -> float:
    """Seconds from start to exit of ``command`` (stdout to /dev/null); it must exit 0."""
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr.decode()}")
    return seconds


def measure(ours: list[str], peer: list[str], reps: int) -> tuple[list[float], list[float]]:
    """Wall times of ``reps`` runs of each, interleaved, alternating which goes first (after
    one unmeasured run of each, to warm the page cache)."""
    wall_time(ours), wall_time(peer)
    ours_times: list[float] = []
    peer_times: list[float] = []
    for rep in range(reps):
        if rep % 2 == 0:
            ours_times.append(wall_time(ours))
            peer_times.append(wall_time(peer))
        else:
            peer_times.append(wall_time(peer))
            ours_times.append(wall_time(ours))
    return ours_times, peer_times


def summary(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def load_average() -> str:
    with open("/proc/loadavg") as loadavg:
        return " ".join(loadavg.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000, help="tensors in the file")
    parser.add_argument("--reps", type=int, default=7, help="measured runs of each command")
    options = parser.parse_args()
    print(f"{options.keys:,} keys, {options.reps} repetitions, {os.cpu_count()} CPUs")
    print(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="maskln-many-") as folder:
        a, b = write_files(Path(folder), options.keys)
        cases = [
            ("inspect", [*MASKLN, "inspect", str(a)], [*PEER, "peer-inspect", str(a)]),
            ("diff", [*MASKLN, "diff", str(a), str(b)], [*PEER, "peer-diff", str(a), str(b)]),
        ]
        print(f"{'command':<8} {'ours / peer (min / median / max)':>34}  {'ours s':>6}"
              f"  {'peer s':>6}  target  met")  # fmt: skip
        for label, ours, peer in cases:
            ours_times, peer_times = measure(ours, peer, options.reps)
            ratios = [o / p for o, p in zip(ours_times, peer_times, strict=True)]
            met = "yes" if statistics.median(ratios) <= TARGET else "no"
            print(
                f"{label:<8} {summary(ratios):>34}  {statistics.median(ours_times):6.2f}"
                f"  {statistics.median(peer_times):6.2f}  <= {TARGET}  {met}"
            )
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["peer-inspect"]:
        peer_inspect(sys.argv[2])
    elif sys.argv[1:2] == ["peer-diff"]:
        peer_diff(*sys.argv[2:4])
    else:
        main()
