"""``maskln normalize``: stream a problem's outputs (and gradients) into a safetensors file."""

from __future__ import annotations

from dataclasses import dataclass

from maskln_cli.errors import MasklnError
from maskln_cli.files.masks import valid_key_hint
from maskln_cli.files.output import SafetensorsWriter, data_bytes, open_output, writing_chunks
from maskln_cli.files.problem import (
    GradientSums,
    NormalizeOptions,
    Problem,
    Progress,
    iter_gradients,
    iter_outputs,
    load_problem,
)
from maskln_cli.files.tensorfile import STDIO, output_name
from maskln_cli.version import installed_version


@dataclass(frozen=True)
class NormalizeResult:
    """What :func:`normalize_file` did, for the report."""

    input: str
    output: str
    shape: tuple[int, ...]
    dtype: str
    eps: float
    valid_rows: int
    rows: int
    keys: tuple[str, ...]
    notes: tuple[str, ...]
    eps_source: str = "default"
    norm: str = "layer"


def normalize_file(
    input_path: str,
    output_path: str,
    options: NormalizeOptions | None = None,
    progress: Progress | None = None,
    fsync: bool = False,
) -> NormalizeResult:
    """Normalize INPUT into OUTPUT (``-`` for stdin or stdout), written atomically (``fsync``:
    and flushed to disk before it replaces the old OUTPUT).

    OUTPUT holds ``out`` (``options.out_key``), and when the inputs hold an upstream gradient
    ``grad_out``, also ``grad_x``, ``grad_scale`` and (LayerNorm's only) ``grad_bias``: the
    gradients of ``sum(out * grad_out)``. Its metadata records ``norm``, ``eps``, ``dtype``
    and ``maskln_version`` (and RMSNorm's ``offset``).
    """
    options = options or NormalizeOptions()
    if options.out_key in ("", "__metadata__"):
        raise MasklnError(f"--out-key: {options.out_key!r} cannot name a tensor in safetensors")
    with load_problem(input_path, options) as problem:
        keys = [options.out_key]
        if problem.grad_out is not None:
            keys += problem.gradient_keys
        if len(set(keys)) != len(keys):
            raise MasklnError(f"--out-key: {options.out_key!r} clashes with a gradient's key")
        specs = {options.out_key: (problem.dtype_name, problem.shape)}
        if problem.grad_out is not None:
            specs["grad_x"] = (problem.dtype_name, problem.shape)
            for key in problem.gradient_keys[1:]:
                specs[key] = (problem.dtype_name, (problem.channels,))
        metadata = {
            "norm": problem.norm.name,
            **({} if problem.norm.centered else {"offset": repr(problem.offset)}),
            "eps": repr(problem.eps),
            "eps_source": problem.eps_source,
            "dtype": problem.dtype_name,
            "maskln_version": installed_version(),
        }
        passes = 2 if problem.grad_out is not None else 1
        total = problem.rows * passes
        # Files are refused as OUTPUT by identity (problem.read_files, naming their option);
        # a '-' among the sources is stdin, refused when it is redirected from OUTPUT.
        inputs = [s for s in (input_path, options.params, options.grad_out) if s == STDIO]
        size = data_bytes(specs)
        with open_output(output_path, size, inputs, fsync, problem.read_files) as stream:
            writer = SafetensorsWriter(stream, output_name(output_path), specs, metadata)
            with writing_chunks(writer) as output:  # on a thread of its own for files
                for _, stop, out in iter_outputs(problem):
                    output.write(options.out_key, out)
                    if progress:
                        progress(stop, total)
                if problem.grad_out is not None:
                    sums = GradientSums(problem)
                    for _, stop, grad_x in iter_gradients(problem, sums):
                        output.write("grad_x", grad_x)
                        if progress:
                            progress(problem.rows + stop, total)
                    output.write("grad_scale", sums.scale.to(problem.dtype))
                    if sums.bias is not None:
                        output.write("grad_bias", sums.bias.to(problem.dtype))
        return NormalizeResult(
            input=problem.source,
            output=output_name(output_path),
            shape=problem.shape,
            dtype=problem.dtype_name,
            eps=problem.eps,
            valid_rows=int(problem.valid.sum()),
            rows=problem.rows,
            keys=tuple(keys),
            notes=tuple(problem.notes)
            + _valid_key_hint(problem, options)
            + _nonfinite_x_note(problem),
            eps_source=problem.eps_source,
            norm=problem.norm.name,
        )


def _valid_key_hint(problem: Problem, options: NormalizeOptions) -> tuple[str, ...]:
    """Beside 'every position is valid': the option that reads a mask INPUT holds under
    another name (an ``attention_mask``), as ``maskln verify`` says it."""
    if options.valid_key is not None or problem.input_file is None:
        return ()
    if not any("every position is valid" in note for note in problem.notes):
        return ()
    hint = valid_key_hint(problem.input_file, tuple(problem.shape[:-1]))
    return (hint,) if hint is not None else ()


def _nonfinite_x_note(problem: Problem) -> tuple[str, ...]:
    """Valid rows whose x holds NaN or inf: their out is NaN (the formula's mean and variance
    are), written without a word before."""
    found = problem.nonfinite_valid_rows()
    if not found:
        return ()
    sums = (
        ", and grad_scale in every channel (it sums over them)"
        if problem.grad_out is not None
        else ""
    )
    return (
        f"{found:,} of {int(problem.valid.sum()):,} valid rows hold NaN or inf in x: their out"
        f" is NaN (their mean and variance are){sums}",
    )
