"""Check that ``maskln verify --json`` prints the same bytes before and after a change.

Speed work on verify (its budget, its blocked comparison) must not move a verdict or any
reported figure. This script writes a wide set of cases (passing kernels, failing kernels of
different kinds, non-finite values, -0.0, half and float64 results, offsets, tiny spreads,
long rows, single rows, all-invalid, fixed tolerances, gradients, --valid), then runs
``maskln verify --json`` on each with whatever ``maskln_cli`` the running Python imports:

    python benchmarks/verify_identity.py make DIR           # the cases (once)
    python benchmarks/verify_identity.py run DIR OUT        # one JSON file per case, in OUT
    PYTHONPATH=/tmp/verify-old python benchmarks/verify_identity.py run DIR OLD
    diff -r OLD OUT                                         # nothing: the same bytes

``run`` is in-process (Typer's CliRunner), so one torch import serves every case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

EPS = 1e-5


def _inputs(
    shape, seed=0, invalid=0.25, poison=True, grad=False, offset=0.0, std=1.0, dtype="float32"
):
    from maskln_cli.jobs.generate import generate_inputs

    return generate_inputs(
        shape, dtype, seed, invalid=invalid, poison=poison, grad=grad, offset=offset, std=std
    )


def _masked(y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid[..., None], y, torch.zeros((), dtype=y.dtype))


def _zeroed(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid[..., None], x, torch.zeros((), dtype=x.dtype))


def layer_norm(t, dtype=torch.float32, eps=EPS):
    x, valid = t["x"], t["valid"]
    out = F.layer_norm(
        _zeroed(x, valid).to(dtype), (x.shape[-1],), t["scale"].to(dtype), t["bias"].to(dtype), eps
    )
    return _masked(out, valid)


def truth(t, dtype=torch.float64):
    from maskln_cli.op.api import masked_layer_normalization

    x = t["x"].double()
    out = masked_layer_normalization(x, t["valid"], t["scale"].double(), t["bias"].double(), EPS)
    return out.to(dtype)


def two_pass(t, dtype=torch.float32, unbiased=False, eps=EPS, eps_outside=False):
    x, valid = t["x"], t["valid"]
    rows = _zeroed(x, valid).to(dtype)
    mean = rows.mean(-1, keepdim=True)
    var = rows.var(-1, keepdim=True, unbiased=unbiased)
    if eps_outside:
        scaled = (rows - mean) / (var.sqrt() + eps)
    else:
        scaled = (rows - mean) * torch.rsqrt(var + eps)
    return _masked(scaled * t["scale"].to(dtype) + t["bias"].to(dtype), valid)


def one_pass(t, dtype=torch.float32):
    x, valid = t["x"], t["valid"]
    rows = _zeroed(x, valid).to(dtype)
    mean = rows.mean(-1, keepdim=True)
    var = (rows * rows).mean(-1, keepdim=True) - mean * mean
    out = (rows - mean) / torch.sqrt(var.clamp_min(0) + EPS) * t["scale"] + t["bias"]
    return _masked(out, valid)


def cases() -> dict[str, tuple[dict, dict, list[str]]]:
    """name -> (inputs, result, extra arguments)."""
    made: dict[str, tuple[dict, dict, list[str]]] = {}
    base = _inputs((40, 256, 128))  # 10,240 rows: several chunks of several blocks
    ln = layer_norm(base)
    made["pass_layer_norm"] = (base, {"out": ln}, [])
    made["pass_layer_norm_strict"] = (base, {"out": ln}, ["--strict"])
    made["pass_maskln_f32"] = (base, {"out": truth(base, torch.float32)}, [])
    made["pass_two_pass"] = (base, {"out": two_pass(base)}, [])
    made["pass_float64"] = (base, {"out": truth(base)}, [])
    made["pass_float16"] = (base, {"out": layer_norm(base, torch.float16)}, [])
    made["pass_bfloat16"] = (base, {"out": layer_norm(base, torch.bfloat16)}, [])
    made["f16_truth_rounded"] = (base, {"out": truth(base, torch.float16)}, [])
    made["judge_float64"] = (base, {"out": ln}, ["--dtype", "float64"])
    made["judge_bfloat16"] = (base, {"out": ln}, ["--dtype", "bfloat16"])
    made["factor_1"] = (base, {"out": ln}, ["--factor", "1"])
    made["factor_1000"] = (base, {"out": one_pass(base)}, ["--factor", "1000"])
    made["fixed"] = (base, {"out": ln}, ["--tolerance", "fixed"])
    made["fixed_tight"] = (base, {"out": ln}, ["--rtol", "0", "--atol", "1e-7"])
    made["atol_0"] = (base, {"out": ln}, ["--atol", "0"])
    made["budget_atol_0_rtol_0"] = (
        base, {"out": ln}, ["--tolerance", "budget", "--atol", "0", "--rtol", "0"],
    )  # fmt: skip
    made["wrong_eps"] = (base, {"out": two_pass(base, eps=1e-3)}, [])
    made["eps_outside"] = (base, {"out": two_pass(base, eps_outside=True)}, [])
    made["unbiased"] = (base, {"out": two_pass(base, unbiased=True)}, [])
    made["one_pass"] = (base, {"out": one_pass(base)}, [])
    shifted = ln.clone()
    shifted[3, 10:200] = ln[3, 11:201]  # off by one row, in one sequence
    made["off_by_one_rows"] = (base, {"out": shifted}, [])
    rolled = torch.roll(ln, 1, dims=1)
    made["off_by_one_everywhere"] = (base, {"out": rolled}, [])
    nan_pad = torch.where(base["valid"][..., None], ln, torch.nan)
    made["nan_in_padding"] = (base, {"out": nan_pad}, [])
    nan_some = ln.clone()
    nan_some[~base["valid"]] = ln[~base["valid"]]
    nan_some[0, 0, 5] = torch.nan
    nan_some[7, 3, 1] = torch.inf
    made["nan_inf_in_valid"] = (base, {"out": nan_some}, [])
    nan_late = ln.clone()
    nan_late[35, 100, 3] = torch.nan  # in the third chunk only: the others stay blocked
    nan_late[20, 5, 9] += 1e-3
    made["nan_in_a_later_chunk"] = (base, {"out": nan_late}, [])
    negzero = torch.where(base["valid"][..., None], ln, -0.0)
    made["negative_zero_padding"] = (base, {"out": negzero}, [])
    made["negative_zero_padding_strict"] = (base, {"out": negzero}, ["--strict"])
    bias_pad = torch.where(base["valid"][..., None], ln, base["bias"])
    made["padding_returns_bias"] = (base, {"out": bias_pad}, [])
    local = ln.clone()
    local[5, 100, 7] += 1e-3  # one element beyond
    local[9, 7, :] *= 1 + 1e-4  # one row slightly off
    local[12, 3, 0] += 3e-5  # near the budget
    made["local_faults"] = (base, {"out": local}, [])
    nudged = ln + 2e-6 * torch.randn(ln.shape, generator=torch.Generator().manual_seed(3))
    made["noisy_near_budget"] = (base, {"out": _masked(nudged, base["valid"])}, [])
    made["zeros"] = (base, {"out": torch.zeros_like(ln)}, [])
    made["f32_result_extra_key"] = (base, {"out": ln, "y": ln.clone()}, [])

    offset = _inputs((16, 256, 128), seed=1, offset=1e4)
    made["offset_1e4_pass"] = (offset, {"out": layer_norm(offset)}, [])
    made["offset_1e4_one_pass"] = (offset, {"out": one_pass(offset)}, [])
    made["offset_1e4_bf16"] = (offset, {"out": layer_norm(offset, torch.bfloat16)}, [])
    made["offset_1e3_f16"] = (
        (o3 := _inputs((8, 256, 128), seed=2, offset=1e3)), {"out": layer_norm(o3, torch.float16)},
        [],
    )  # fmt: skip
    tiny = _inputs((16, 256, 128), seed=4, std=1e-4)
    made["tiny_std_pass"] = (tiny, {"out": layer_norm(tiny)}, [])
    made["tiny_std_wrong_eps"] = (tiny, {"out": two_pass(tiny, eps=1e-6)}, [])
    made["tiny_std_eps_outside"] = (tiny, {"out": two_pass(tiny, eps_outside=True)}, [])
    huge = _inputs((8, 128, 128), seed=5, std=1e30)
    made["huge_values"] = (huge, {"out": layer_norm(huge)}, [])
    made["huge_values_f16"] = (huge, {"out": layer_norm(huge, torch.float16)}, [])
    scaled = dict(base, scale=base["scale"] * 1e4, bias=base["bias"] * 0)
    made["scale_1e4_bias_0"] = (scaled, {"out": layer_norm(scaled)}, [])
    big_scale = dict(base, scale=base["scale"] * 3e4)
    made["scale_3e4_f16_overflow"] = (big_scale, {"out": layer_norm(big_scale, torch.float16)}, [])
    zero_scale = dict(base, scale=torch.zeros(128), bias=torch.zeros(128))
    made["scale_0_bias_0_atol_0"] = (
        zero_scale, {"out": layer_norm(zero_scale)}, ["--atol", "0", "--rtol", "0"],
    )  # fmt: skip
    made["scale_0_bias_0"] = (zero_scale, {"out": layer_norm(zero_scale) + 1e-30}, [])
    no_poison = _inputs((16, 256, 128), seed=6, poison=False, invalid=0.0)
    made["all_valid"] = (no_poison, {"out": layer_norm(no_poison)}, [])
    made["all_valid_wrong"] = (no_poison, {"out": two_pass(no_poison, unbiased=True)}, [])
    none_valid = _inputs((4, 64, 128), seed=7, invalid=1.0)
    made["all_invalid"] = (none_valid, {"out": layer_norm(none_valid)}, [])
    made["all_invalid_nonzero"] = (none_valid, {"out": torch.ones(4, 64, 128)}, [])
    long = _inputs((8, 65536), seed=8, invalid=0.25)
    made["long_rows_pass"] = (long, {"out": layer_norm(long)}, [])
    made["long_rows_wrong"] = (long, {"out": two_pass(long, unbiased=True)}, [])
    made["long_rows_f16"] = (long, {"out": layer_norm(long, torch.float16)}, [])
    one = _inputs((1, 128), seed=9, invalid=0.0)
    made["single_row"] = (one, {"out": layer_norm(one)}, [])
    made["single_row_wrong"] = (one, {"out": two_pass(one, unbiased=True)}, [])
    three = _inputs((3, 128), seed=10, invalid=0.0)
    made["three_rows"] = (three, {"out": layer_norm(three)}, [])
    odd = _inputs((1023, 77), seed=11)
    made["odd_shape"] = (odd, {"out": layer_norm(odd)}, [])
    made["odd_shape_f64"] = (odd, {"out": truth(odd) + 1e-12}, [])
    narrow = _inputs((5000, 2), seed=12)
    made["two_channels"] = (narrow, {"out": layer_norm(narrow)}, [])
    many = _inputs((70000, 4), seed=18)  # chunks of more rows than torch sums on one thread
    made["many_short_rows"] = (many, {"out": layer_norm(many)}, [])
    made["many_short_rows_wrong"] = (many, {"out": two_pass(many, eps=1e-3)}, [])
    made["chunk_rows_3"] = (odd, {"out": layer_norm(odd)}, ["--chunk-rows", "3"])
    half = _inputs((8, 256, 128), seed=13, dtype="float16")
    made["x_f16"] = (half, {"out": layer_norm(half, torch.float16)}, [])
    bf = _inputs((8, 256, 128), seed=14, dtype="bfloat16")
    made["x_bf16"] = (bf, {"out": layer_norm(bf, torch.bfloat16)}, [])
    made["x_bf16_result_f32"] = (bf, {"out": layer_norm(bf, torch.float32)}, [])
    x64 = _inputs((8, 256, 128), seed=15, dtype="float64")
    made["x_f64_result_f32"] = (x64, {"out": layer_norm(x64)}, [])
    made["x_f64_result_f64"] = (x64, {"out": layer_norm(x64, torch.float64)}, [])
    nan_x = _inputs((8, 256, 128), seed=16)
    nan_x["x"][2, 5, 3] = torch.nan  # a valid row holding NaN
    nan_x["valid"][2, 5] = True
    made["nan_in_valid_x"] = (nan_x, {"out": layer_norm(nan_x)}, [])

    grads = _inputs((8, 256, 64), seed=17, grad=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.kernels
    from tests import kernels

    made["grad_pass"] = (grads, kernels.run(kernels.torch_layer_norm, grads), [])
    made["grad_unbiased"] = (grads, kernels.run(kernels.unbiased, grads), [])
    made["grad_nan_leak"] = (grads, kernels.run(kernels.nan_leak, grads), [])
    made["grad_check_out"] = (grads, kernels.run(kernels.unbiased, grads), ["--check", "out"])
    made["grad_bf16"] = (grads, kernels.run(kernels.torch_layer_norm, grads, torch.bfloat16), [])
    made["valid_mask"] = (
        base,
        {"out": ln, "keep": base["valid"].clone()},
        ["--valid", "RESULT:keep"],
    )
    wrong = {"out": two_pass(base, eps=1e-3), "keep": base["valid"].clone()}
    made["valid_mask_wrong"] = (base, wrong, ["--valid", "RESULT:keep"])
    return made


def make(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, (inputs, result, args) in cases().items():
        source, target = directory / f"{name}.in.safetensors", directory / f"{name}.res.safetensors"
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(source), {"eps": "1e-05"})
        save_file({k: v.contiguous() for k, v in result.items()}, str(target))
        manifest[name] = [
            str(source),
            str(target),
            *(a.replace("RESULT", str(target)) for a in args),
        ]
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest)} cases in {directory}")


def run(directory: Path, out: Path) -> None:
    from typer.testing import CliRunner

    import maskln_cli
    from maskln_cli.cli.app import app

    print(f"maskln_cli from {Path(maskln_cli.__file__).parent}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((directory / "manifest.json").read_text())
    for name, args in manifest.items():
        result = CliRunner().invoke(app, ["verify", *args, "--json"])
        if result.exit_code not in (0, 1):
            text = f"exit {result.exit_code}\n{result.stdout}\n{result.stderr}"
        else:
            text = result.stdout
        (out / f"{name}.json").write_text(text)
        print(f"{name}: exit {result.exit_code}", file=sys.stderr)


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "make":
        make(Path(rest[0]))
    else:
        run(Path(rest[0]), Path(rest[1]))
