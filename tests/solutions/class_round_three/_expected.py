"""What the instructor expects of each submission of this class (issue 32): None for a correct
one; for a wrong one, the leading cause the instructor would give, as the grader names known
mistakes (any of a tuple is agreed with). Written with the solutions, before grading them; each
wrong one is established wrong by tests/grading/independent_checker.py, apart from the grader.

The folder is graded with its own rules, maskln-grade.toml: the specification's clauses plus
+0.0 in invalid rows and second derivatives, as the handout asks.
"""

EXPECTED: dict[str, tuple[str, ...] | None] = {
    # correct, in varied styles
    "abel.py": None,  # torch.where, mean, population variance
    "bea.py": None,  # masked_fill, var(unbiased=False)
    "cyrus.py": None,  # var_mean(correction=0), rsqrt, addcmul
    "dara.py": None,  # einsum
    "eliot.py": None,  # matmul with a column of 1/C
    "fatima.py": None,  # loops over the channels
    "gus.py": None,  # nan_to_num, masks by multiplication, + 0.0
    "hana.py": None,  # boolean indexing, index_put into zeros
    "ivan.py": None,  # Welford
    "jade.py": None,  # float64 inside, cast back
    "kofi.py": None,  # custom autograd.Function, differentiable backward
    "lena.py": None,  # 2-D rows, reshape back
    "milo.py": None,  # torch.func.vmap over rows
    "nadia.py": None,  # keepdim=False and unsqueeze, empty_like(x).copy_
    "omar.py": None,  # fixed blocks of 64 channels
    "pia.py": None,  # method calls
    "quinn.py": None,  # float64 normalization, affine in x's dtype
    "rosa.py": None,  # where(padding, 0, ...)
    "sami.py": None,  # contiguous().view
    "tomas.py": None,  # torch.sum, torch.square, tensors as zeros
    "uma.py": None,  # var_mean, sqrt(var + eps)
    "victor.py": None,  # a float mask compared with 0.5
    # wrong, one mistake each
    "alba.py": ("unbiased_variance",),
    "bruno.py": ("eps_outside_sqrt",),
    "carla.py": ("eps_missing",),
    "dmitri.py": ("sqrt_missing",),
    "esra.py": ("scale_missing",),
    "felix.py": ("bias_missing",),
    "greta.py": ("bias_before_scale",),
    "hugo.py": ("scale_bias_swapped",),
    "ines.py": ("wrong_axis",),
    "jonas.py": ("rms_norm",),
    "kira.py": ("padding_returns_bias",),
    "lucas.py": ("padding_not_masked",),
    "maya.py": ("nan_from_padding",),
    "nils.py": ("nan_from_padding",),
    "olga.py": ("negative_zero",),
    "pablo.py": ("one_pass_variance",),
    "quentin.py": ("stale_mask",),
    "ruth.py": ("mask_inverted",),
    "sven.py": ("eps_squared",),
    "tara.py": ("unbiased_rescaled",),
    "udo.py": ("statistics_over_valid_rows",),
    "vera.py": ("statistics_over_whole_tensor", "statistics_over_whole_tensor_padded"),
    "wim.py": ("output_uninitialized",),
    "xena.py": ("eps_float32",),
    "yusuf.py": ("broadcasting_error",),
    "zoe.py": ("dtype_error",),
    "adam.py": ("backward_not_differentiable",),
    "bianca.py": ("backward_from_saved_values",),
    "conrad.py": ("eps_floored",),
    "delia.py": ("zeros_taken_as_padding",),
    "emil.py": ("gradient_lost_at_zero_variance",),
    "freya.py": ("nan_at_zero_variance",),
    "gabor.py": ("view_on_strided", "upstream_read_as_contiguous"),
    "hedda.py": ("not_deterministic",),
    "igor.py": ("shared_result",),
    "jana.py": ("global_state_changed",),
    "karl.py": ("hooks_left",),
    "lotte.py": ("ready_made_normalization",),
    "mads.py": ("random_state_changed",),
    "nora.py": ("input_mutated",),
    "otto.py": ("computed_in_float32",),
    "petra.py": ("output_float32",),
    "rafael.py": ("assumes_leading_axes",),
    "selma.py": ("channel_remainder_lost",),
    "timo.py": ("statistics_detached",),
    "ugo.py": ("eps_default",),
}
