"""The contract of masked layer normalization as clauses: cases, runs and judges.

Each :class:`Clause` is a property from the specification (required) or one of maskln's own
stronger guarantees (strict). ``build(seed)`` makes its cases, deterministic from the seed;
``run(fn, cases, device)`` calls the function on them where the function lives (this process,
or the grader's child process) and returns what it computed as tensors and plain facts
(:class:`ClauseRun`); ``judge(cases, run)`` compares that with the float64 reference
(:mod:`maskln_cli.op.reference`) in the grading process and, on a failure, names the likely
mistake (:mod:`maskln_cli.op.mistakes`). :mod:`maskln_cli.grading` puts them together.

The shared machinery: :mod:`.cases` (inputs and their random data), :mod:`.calls` (calling
the function, and what the calls gave), :mod:`.judging` (verdicts against the reference),
:mod:`.clause` (what a clause is) and :mod:`.recorders` (what runs inside the function). The
clauses, by family: :mod:`.values`, :mod:`.sizes`, :mod:`.padding`, :mod:`.gradients`,
:mod:`.dtypes_layouts`, :mod:`.purity` and :mod:`.accuracy`; :data:`CLAUSES` puts them in the
order they run and are reported.

Cases are small (tens of rows), but for a few wide ones (:mod:`.sizes`), so that the whole
contract runs in seconds. :mod:`.half` holds the opt-in half-precision clauses; :mod:`.assumed`
what the judges compare with: the specification, or a known mistake assumed to see whether it
explains a failure.

It imports the op's reference and catalogue of mistakes, and nothing else of maskln but its own
modules.

Example:
    >>> from maskln_cli import masked_layer_normalization
    >>> run = CLAUSES["worked_example"].run(
    ...     masked_layer_normalization, CLAUSES["worked_example"].build(0), "cpu")
    >>> run.tensors["0.out"]
    tensor([[[-0.5000,  0.5000],
             [ 0.0000,  0.0000]]], dtype=torch.float64)
"""

from __future__ import annotations

import warnings

from maskln_cli.grading.clauses import (
    accuracy,
    crosscalls,
    dtypes_layouts,
    gradients,
    half,
    padding,
    purity,
    sizes,
    values,
)
from maskln_cli.grading.clauses.accuracy import OFFSET_FACTOR, TWO_PASS_FACTOR, layer_norm_error
from maskln_cli.grading.clauses.calls import CAUGHT, ClauseRun, Fn, Misbehaved, describe_exception
from maskln_cli.grading.clauses.cases import Case, dtype_name
from maskln_cli.grading.clauses.clause import Clause
from maskln_cli.grading.clauses.dtypes_layouts import same_device
from maskln_cli.grading.clauses.judging import Verdict, reference_gradients, relative_rms_error
from maskln_cli.grading.clauses.recorders import (
    GRADING_MASKLN,
    PythonRecorder,
    is_maskln_function,
    is_ready_made,
)
from maskln_cli.grading.clauses.state import preserved_state
from maskln_cli.op.mistakes import Diagnosis

# The names the rest of maskln imports from here; the others come from the module defining them.
__all__ = [
    "CLAUSES",
    "OFFSET_FACTOR",
    "TWO_PASS_FACTOR",
    "Case",
    "Clause",
    "ClauseRun",
    "Diagnosis",
    "Misbehaved",
    "PythonRecorder",
    "Verdict",
    "describe_exception",
    "dtype_name",
    "is_maskln_function",
    "is_ready_made",
    "layer_norm_error",
    "reference_gradients",
    "relative_rms_error",
    "run_clause",
    "same_device",
]

CLAUSES = {
    clause.name: clause
    for clause in (
        values.SIGNATURE,
        values.WORKED_EXAMPLE,
        values.VALUES,
        sizes.LARGE_SHAPES_CLAUSE,
        padding.LEADING_AXES,
        padding.INVALID_ROWS_ZERO,
        padding.SANITIZED_PADDING,
        gradients.GRADIENTS,
        padding.SANITIZED_GRADIENTS,
        dtypes_layouts.DTYPES,
        dtypes_layouts.STRIDED_INPUTS,
        purity.NO_MUTATION,
        purity.RAW_OPS,
        purity.NO_REINIT,
        crosscalls.DETERMINISTIC,
        crosscalls.NO_SHARED_RESULTS,
        crosscalls.NO_GLOBAL_EFFECTS,
        crosscalls.NO_HOOKS_LEFT,
        accuracy.TWO_PASS,
        padding.POSITIVE_ZERO,
        dtypes_layouts.OUTPUT_LAYOUT,
        gradients.SECOND_ORDER,
        gradients.GRAD_FLAGS,
        accuracy.OFFSET_ACCURACY,
        half.HALF_VALUES,
        half.HALF_GRADIENTS,
    )
}
"""Every clause, required first, then strict, then optional, in the order they run and are
reported."""


def run_clause(
    fn: Fn,
    name: str,
    seed: int,
    device: str,
    cases: list[Case] | None = None,
    maskln: bool | None = None,
) -> ClauseRun:
    """Run clause ``name`` on ``fn`` where ``fn`` lives (this process, or the child).

    ``maskln``: whether the function graded is maskln's own op, whose modules ``raw_ops`` then
    allows (by default, whether ``fn`` is defined in maskln_cli; the child decides by the
    target, so that a file that imports maskln's op is not taken for it)."""
    clause = CLAUSES[name]
    cases = clause.build(seed) if cases is None else cases
    token = GRADING_MASKLN.set(is_maskln_function(fn) if maskln is None else maskln)
    try:
        # torch's global state as it was after each clause, whatever the function did to it
        # (no_global_effects judges that): the clauses after it, and a process grading in
        # process, are not changed by it.
        with warnings.catch_warnings(), preserved_state():
            # The function's warnings are not verdicts (and under -W error would become
            # exceptions that fail a correct function).
            warnings.simplefilter("ignore")
            run = clause.run(fn, cases, device)
    except CAUGHT as error:  # outside any one call: the function broke the clause's machinery
        run = ClauseRun(failure=describe_exception(error))
    finally:
        GRADING_MASKLN.reset(token)
    run.device = device
    return run
