"""What the instructor expects of each RMSNorm submission (issue 39's grade item): None for a
correct one; for a wrong one, the clause its mistake fails first, the causes a report may name
for it (None: no cause, "where it differs" instead; a cause is named only when confirmed), and
the mistake in words. Written with the solutions, before grading them.

A formula mistake of RMSNorm's catalogue (:mod:`maskln_cli.op.rms_mistakes`) is named by its
name where the formula probe confirms it, as verify names it for a kernel making it; a mistake
the catalogue has no confirmable model of (a lower precision, a hand-written backward) gets no
cause.

The exercise: ``masked_rms_normalization(x, valid, scale, eps=1e-6)``, valid rows
``x / sqrt(mean(x**2) + eps) * scale`` over the last axis, invalid rows exactly +0.0 (no offset:
the gain is ``scale``), graded with ``maskln grade --op rms``.
"""

EXPECTED: dict[str, tuple[str, set[str | None], str] | None] = {
    # correct, in varied styles
    "ama.py": None,  # float64 accumulation, cast back
    "bruno.py": None,  # rsqrt of the mean square, masked_fill
    "chen.py": None,  # pow(2).mean, torch.where for the padding
    "dagny.py": None,  # a hand loop over the rows
    # wrong, one mistake each
    "emil.py": ("values", {"mean_subtracted"}, "the mean subtracted (a LayerNorm without bias)"),
    "farah.py": ("values", {None, "eps_outside_sqrt"}, "eps outside the sqrt"),
    "gus.py": ("values", {"gain_plus_one"}, "1 + scale instead of scale (Gemma's offset)"),
    "hana.py": ("values", {None}, "the mean square accumulated in float16"),
    "ivo.py": (
        "sanitized_padding",
        {None, "nan_from_padding"},
        "padding NaN multiplied into the output",
    ),
    "jana.py": (
        "sanitized_gradients",
        {None, "nan_from_padding"},
        "padding NaN reaching grad_x (masked after)",
    ),
    "kofi.py": ("raw_ops", {"ready_made_normalization"}, "F.rms_norm, a ready-made norm"),
    "lena.py": ("values", {"squares_over_c_minus_1"}, "the mean square over C - 1 (unbiased)"),
    "nils.py": ("values", {"mask_inverted"}, "the mask inverted: padding normalized, rows zeroed"),
    "olga.py": (
        "values",
        {None, "padding_not_masked", "nan_from_padding"},
        "the padding normalized and never zeroed",
    ),
    "pavel.py": ("values", {"gain_minus_one"}, "scale - 1 instead of scale"),
    "rosa.py": ("gradients", {None}, "a hand-written backward without grad_x's xhat term"),
    # wrong in a data family only
    "mika.py": ("gradients", {None}, "rows of zeros taken for padding: rstd 0, no gradient"),
}
