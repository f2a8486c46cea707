"""What the instructor expects of each submission of this class (issue 38's done-when): None for a
correct one; for a wrong one, where its mistake lives (a data family, torch's global state, or
the formula or its backward everywhere) and the mistake in words. None of these mistakes is in
the earlier catalogues (tests/solutions/*.py, class_round_three/); 25 of the 34 live in a data
family or in global state. Written with the solutions, before grading them; each wrong one is
established wrong by tests/grading/independent_checker.py, apart from the grader.

The folder is graded with its own rules, maskln-grade.toml: the specification's clauses plus
+0.0 in invalid rows and second derivatives, as the handout asks.
"""

FAMILY, STATE, EVERYWHERE = "data family", "global state", "everywhere"

EXPECTED: dict[str, tuple[str, str] | None] = {
    # correct, in styles new to the catalogue
    "ada.py": None,  # a Python loop over the leading positions, rows written in place (slow)
    "basil.py": None,  # one thread for the call, put back as it was (try/finally)
    "celia.py": None,  # rows in chunks of 128, concatenated
    "dario.py": None,  # autocast off inside a with-block, addcmul
    "elif.py": None,  # var_mean(correction=0), rsqrt, zeros as 0-d tensors
    "fumiko.py": None,  # grad mode kept by a set_grad_enabled context, method chains
    "goran.py": None,  # the valid rows selected, their results masked_scatter-ed into zeros
    "hilde.py": None,  # centering as a product with the centering matrix
    # wrong in a data family
    "ingrid.py": (FAMILY, "C = 2 special-cased as sign(x - mean): eps forgotten"),
    "joaquin.py": (FAMILY, "a row of zeros taken as empty: zeros where the output is bias"),
    "kasia.py": (FAMILY, "C = 1 returns bias detached: no gradient"),
    "lars.py": (FAMILY, "rows stacked from a list: no rows, an error"),
    "mirela.py": (FAMILY, "one valid row: the sample variance"),
    "nuno.py": (FAMILY, "every row valid: a fast path without eps"),
    "orla.py": (FAMILY, "|d| as maximum(d, -d): second derivatives wrong at exact ties"),
    "piet.py": (FAMILY, "elements equal to the mean set to 0: their gradient cut"),
    "quirin.py": (FAMILY, "rows divided by their largest magnitude first: eps weighs more"),
    "rhea.py": (FAMILY, "eps at least the dtype's machine epsilon: a tiny eps in float32"),
    "stellan.py": (FAMILY, "nonzero().squeeze() indices: one valid row, no dim 1"),
    "tuula.py": (FAMILY, "the affine skipped when it is the identity: no grad_scale"),
    "ulrich.py": (FAMILY, "C = 1 not centered"),
    # wrong in torch's global state
    "vesna.py": (STATE, "threads set to 1, then to the CPU count"),
    "wanda.py": (STATE, "threads put back to the import-time count"),
    "xaver.py": (STATE, "grad mode off for the statistics, then forced on"),
    "yara.py": (STATE, "bfloat16 autocast entered and left on"),
    "zeno.py": (STATE, "grad mode turned off without inputs requiring grad, left so"),
    "anouk.py": (STATE, "float32 matmul precision lowered and left so"),
    "boris.py": (STATE, "denormals flushed and left so"),
    "chiara.py": (STATE, "warn-always turned on and left so"),
    "dmitrij.py": (STATE, "randperm of the channels: the caller's random stream moves"),
    "elke.py": (STATE, "deterministic algorithms set off after the call, whatever they were"),
    "fabian.py": (STATE, "anomaly mode set off after the call, whatever it was"),
    "gwen.py": (STATE, "inference mode entered under no_grad, kept and never left"),
    # wrong everywhere
    "henrik.py": (EVERYWHERE, "the mean divided by C - 1"),
    "ilse.py": (EVERYWHERE, "the square root taken twice"),
    "jarek.py": (EVERYWHERE, "returns (out, mean, rstd)"),
    "kaito.py": (EVERYWHERE, "eps added twice"),
    "leila.py": (EVERYWHERE, "scale used as 1 + scale"),
    "marek.py": (EVERYWHERE, "the variance around zero"),
    "nadja.py": (EVERYWHERE, "a hand-written backward without grad_scale and grad_bias"),
    "oskar.py": (EVERYWHERE, "a hand-written backward with the mean term's sign flipped"),
    "paula.py": (EVERYWHERE, "a hand-written backward using the output for xhat"),
}
