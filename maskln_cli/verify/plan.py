"""What ``maskln verify`` checks, and how: the plan made before any row is measured.

From INPUT (the problem), RESULT and the options, a :class:`Plan` resolves which tensors are
checked (``--check``, or what INPUT's gradient allows), under which RESULT keys
(``--result-key``), in which dtype the kernel is judged, and with which error-budget precision;
it prepares a :class:`~maskln_cli.compare.comparison.Comparison` for each tensor RESULT holds,
and a failing outcome, with a hint, for each it does not. After the pass it notes RESULT's keys
that were not compared and gives the report's context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maskln_cli.compare.comparison import Comparison
from maskln_cli.compare.data import DEFAULT_TOLERANCES, TensorComparison
from maskln_cli.compare.files import missing
from maskln_cli.errors import MasklnError
from maskln_cli.files.problem import FLOATING, NormalizeOptions, Problem, check_eps
from maskln_cli.files.tensorfile import TensorFile, dtype_name
from maskln_cli.verify.options import ROW_TENSORS, TENSORS, VerifyOptions

if TYPE_CHECKING:
    import torch

    from maskln_cli.verify.budget import Precision

ALIASES = {
    "out": ("y", "output", "out", "result", "ln_out"),
    "grad_x": ("dx", "grad_input", "x_grad", "input_grad", "dinput"),
    "grad_scale": ("dgamma", "dweight", "dw", "grad_weight", "grad_gamma", "weight_grad"),
    "grad_bias": ("dbeta", "db", "dbias", "grad_beta", "bias_grad"),
}
"""Names kernels often give their results: used only to suggest ``--result-key``."""


@dataclass
class Checked:
    """One tensor to check: its RESULT key, and the running comparison (None when missing)."""

    name: str
    key: str
    comparison: Comparison | None = None
    outcome: TensorComparison | None = None
    judge: torch.dtype | None = None  # the dtype this tensor is judged in (None: not compared)


class Plan:
    """What is checked in RESULT against INPUT, under which keys, in which dtype, how judged."""

    def __init__(
        self,
        problem: Problem,
        result: TensorFile,
        options: NormalizeOptions,
        verify: VerifyOptions,
    ) -> None:
        from maskln_cli.verify.budget import DEFAULT_FACTOR, Precision

        self.problem = problem
        self.result = result
        self.options = options
        self.verify = verify
        self.mode = verify.mode
        self.factor = verify.factor if verify.factor is not None else DEFAULT_FACTOR
        self.notes = list(problem.notes)
        self.names = self._names()
        self.keys = self._keys(options)
        self.judge = self._judge_dtype()
        # eps as normalize would accept it for x, and usable in the dtype judged.
        for dtype in (problem.x.dtype, self.judge):
            check_eps(problem.eps, self._eps_where(), dtype)
        grad_dtype = problem.grad_out.dtype if problem.grad_out is not None else None
        self.checked = [self._prepare(name) for name in self.names]
        # Each tensor is judged in its own dtype (a float32 grad_scale beside a float16 out
        # by float32's budget), unless --dtype says one for all.
        self.precisions: dict[torch.dtype, Precision] = {
            dtype: Precision.of(dtype, problem.x.dtype, problem.param_dtype, grad_dtype)
            for dtype in dict.fromkeys([self.judge, *self.judges().values()])
        }
        self.precision: Precision = self.precisions[self.judge]
        self.valid_rows = int(problem.valid.sum())

    # --- set-up ---------------------------------------------------------------------------

    def _names(self) -> list[str]:
        has_grad_out = self.problem.grad_out is not None
        if self.verify.check is None:
            return ["out", *self.problem.gradient_keys] if has_grad_out else ["out"]
        names = list(self.verify.check)
        if not self.problem.norm.centered and "grad_bias" in names:
            raise MasklnError("--check grad_bias: RMSNorm has no bias")
        gradients = [n for n in names if n != "out"]
        if gradients and not has_grad_out:
            raise MasklnError(
                f"--check {','.join(gradients)}: {self.problem.source} holds no upstream"
                " gradient 'grad_out' (--grad-out FILE or --grad-out-key KEY gives one)"
            )
        return names

    def _keys(self, options: NormalizeOptions) -> dict[str, str]:
        keys = {name: name for name in TENSORS}
        if options.out_key != "out":  # the older spelling of --result-key out=KEY
            keys["out"] = options.out_key
        given = dict(self.verify.result_keys)
        if "out" in given and options.out_key not in ("out", given["out"]):
            raise MasklnError(
                f"--out-key {options.out_key!r} and --result-key out={given['out']} disagree"
            )
        keys.update(given)
        return keys

    def _judge_dtype(self) -> torch.dtype:
        import torch

        if self.verify.dtype != "auto":
            return getattr(torch, self.verify.dtype)
        x_dtype = self.problem.x.dtype
        # The first tensor of RESULT checked, of a dtype verify judges.
        keys = [self.keys[n] for n in self.names if self.keys[n] in self.result]
        stored = (self.result.info(key).dtype for key in keys)
        found = next((d for d in stored if d in FLOATING), None)
        if found is None:
            return x_dtype
        dtype = getattr(torch, found)
        if torch.finfo(dtype).eps < torch.finfo(x_dtype).eps:
            self.notes.append(
                f"RESULT is {found} while x is {dtype_name(x_dtype)}: judged as a {found}"
                f" kernel (--dtype {dtype_name(x_dtype)} judges it by"
                f" {dtype_name(x_dtype)}'s budget)"
            )
        return dtype

    def judges(self) -> dict[str, torch.dtype]:
        """The dtype each compared tensor is judged in."""
        return {c.name: c.judge for c in self.checked if c.judge is not None}

    def lower_precision(self) -> dict[str, str]:
        """RESULT's tensors judged in a coarser dtype than INPUT's x (by their own budget,
        which a kernel in that dtype deserves): name -> dtype. Empty under --dtype."""
        import torch

        if self.verify.dtype != "auto":
            return {}
        x_eps = torch.finfo(self.problem.x.dtype).eps
        return {
            name: dtype_name(dtype)
            for name, dtype in self.judges().items()
            if torch.finfo(dtype).eps > x_eps
        }

    def _yardstick_name(self) -> str:
        """PyTorch's function the yardstick runs: layer_norm, or rms_norm for RMSNorm."""
        return "layer_norm" if self.problem.norm.centered else "rms_norm"

    def _eps_where(self) -> str:
        source = self.problem.eps_source
        if source.startswith("metadata"):
            return f"{self.problem.source}: {source} ({self.problem.eps!r})"
        return source if source != "default" else "eps"

    def _prepare(self, name: str) -> Checked:
        problem = self.problem
        key = self.keys[name]
        shape = list(problem.shape) if name in ROW_TENSORS else [problem.channels]
        checked = Checked(name, key)
        if key not in self.result:
            checked.outcome = missing(name, "actual", shape, "float64")
            hint = self._missing_hint(name)
            checked.outcome.problems = [f"missing in RESULT: no key {key!r} ({hint})"]
            return checked
        info = self.result.info(key)
        if info.dtype not in FLOATING:  # an integer, bool or complex result is no layer norm
            checked.outcome = TensorComparison(
                name=name, passed=False,
                problems=[f"dtype {info.dtype}: not a floating-point result; values not compared"],
                shape=list(info.shape), expected_shape=shape, dtype=info.dtype,
                expected_dtype="float64", rtol=math.nan, atol=math.nan,
            )  # fmt: skip
            return checked
        rtol, atol = self._floor(info.dtype)
        checked.judge = self._own_judge(info.dtype, name)
        checked.comparison = Comparison(
            name, info.shape, info.dtype, shape, "float64", rtol, atol,
            rank_by_ratio=True, same_dtype=False,
        )  # fmt: skip
        return checked

    def _own_judge(self, stored: str, name: str) -> torch.dtype:
        """The dtype a tensor ``name`` stored as ``stored`` is judged in: --dtype's, else its
        own; a gradient of scale or bias, the coarser of its own and x's: PyTorch's own
        mixed-precision LayerNorm (half x, float32 weights) rounds them to x's dtype."""
        import torch

        if self.verify.dtype != "auto":
            return self.judge
        own, x_dtype = getattr(torch, stored), self.problem.x.dtype
        if name not in ROW_TENSORS and torch.finfo(x_dtype).eps > torch.finfo(own).eps:
            return x_dtype
        return own

    def _floor(self, dtype: str) -> tuple[float, float]:
        """The fixed tolerance (always enough to pass) for a RESULT tensor of ``dtype``."""
        rtol, atol = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float64"])
        return (
            rtol if self.verify.rtol is None else self.verify.rtol,
            atol if self.verify.atol is None else self.verify.atol,
        )

    def _missing_hint(self, name: str) -> str:
        held = self.result.keys()
        used = {self.keys[n] for n in self.names}
        unused = [k for k in held if k not in used]
        guesses = [k for k in unused if k.lower() in ALIASES[name]]
        shown = ", ".join(repr(k) for k in held[:6]) or "nothing"
        more = f" and {len(held) - 6} more" if len(held) > 6 else ""
        hint = f"it holds {shown}{more}; "
        if guesses:
            hint += f"--result-key {name}={guesses[0]} maps it"
        else:
            hint += f"--result-key {name}=KEY names it"
        others = [n for n in self.names if n != name]
        if others:
            hint += f", --check {','.join(others)} leaves it out"
        return hint

    # --- after the pass: notes and the context --------------------------------------------

    def unchecked(self) -> list[TensorComparison]:
        """Notes on RESULT's keys that were not compared (and, with --strict, failures)."""
        used = {c.key for c in self.checked}
        left = [k for k in self.result if k not in used]
        if not left:
            return []
        has_grad_out = self.problem.grad_out is not None
        reasons: dict[str, list[str]] = {}
        for key in left:
            name = next((n for n in TENSORS if self.keys[n] == key), None)
            if name is not None and name not in self.names:
                reason = (
                    f"--check {','.join(self.names)}"
                    if has_grad_out or name == "out"
                    else f"{self.problem.source} holds no 'grad_out'"
                )
            else:
                guess = next((n for n in TENSORS if key.lower() in ALIASES[n]), None)
                reason = (
                    f"--result-key {guess}={key} maps it" if guess else "not a name verify checks"
                )
            reasons.setdefault(reason, []).append(key)
        for reason, keys in reasons.items():
            shown = ", ".join(repr(k) for k in keys)
            self.notes.append(f"{self.result.name}: {shown} not compared ({reason})")
        if not self.verify.strict:
            return []
        failures = []
        for key in left:
            info = self.result.info(key)
            outcome = TensorComparison(
                name=key, passed=False, problems=["not compared (--strict fails what is not)"],
                shape=list(info.shape), expected_shape=None, dtype=info.dtype,
                expected_dtype=None, rtol=math.nan, atol=math.nan,
            )  # fmt: skip
            failures.append(outcome)
        return failures

    def context(self) -> dict[str, object]:
        problem = self.problem  # a default eps has its note from load_problem
        judged = dtype_name(self.judge)
        return {
            "reference": "maskln, float64",
            "eps": problem.eps,
            "eps_source": problem.eps_source,
            "rows": problem.rows,
            "valid_rows": self.valid_rows,
            "result_dtype": judged,
            "tolerance": self.mode,
            "factor": self.factor if self.mode == "budget" else None,
            "yardstick": f"torch.nn.functional.{self._yardstick_name()} in {judged}",
            "checked": list(self.names),
            "strict": self.verify.strict,
            **self._lower_precision_context(),
            # Rows left out by --plain-layer-norm are INPUT's invalid rows, not --valid's.
            **({"rows_left_out_by": self._left_out_by()} if self.verify.plain_layer_norm else {}),
        }

    def _left_out_by(self) -> str:
        plain = "--plain-layer-norm: INPUT's invalid rows"
        return f"--valid and {plain}" if self.verify.valid is not None else plain

    def _lower_precision_context(self) -> dict[str, object]:
        """``lower_precision`` (only when some tensor is judged in a coarser dtype than x's):
        x's dtype and each such tensor's, for the verdict line to say which budget applied."""
        lower = self.lower_precision()
        if not lower:
            return {}
        x_dtype = dtype_name(self.problem.x.dtype)
        return {"lower_precision": {"x_dtype": x_dtype, "tensors": lower}}
