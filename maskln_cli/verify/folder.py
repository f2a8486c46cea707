"""``maskln verify DUMPS/ [RESULTS/]``: every dump of a folder judged, a verdict per file.

A dump is one safetensors file per LayerNorm call (see ``maskln_cli.capture``): ``x``,
``valid``, ``scale``, ``bias``, the module's own ``out``, optionally ``grad_out`` and the
module's ``grad_x``, ``grad_scale`` and ``grad_bias``; metadata ``eps``, ``module`` (its path
in the model), ``call`` (its index) and ``dtype``. Alone, each dump's own tensors are judged
against the float64 reference with the dump's own eps (:func:`verify_file` with the dump as
INPUT and RESULT). With RESULTS, files are paired by name and RESULTS' files are judged (a
kernel's outputs for those inputs); a dump without a result, or a result without a dump, is a
failing row of the report, never skipped.

A model's own ``nn.LayerNorm`` normalizes the padding too. A dump judged alone whose metadata
says ``padding: normalized`` (or, without that key, whose ``out`` is not zero on every invalid
row) is judged as such (``--plain-layer-norm``: the valid rows only), and its row says so; one
that says ``zeroed`` (a ``MaskedLayerNorm``) must hold 0 there; a RESULTS file is judged as
the op's (padding exactly 0) unless ``--plain-layer-norm`` is given.

``shard=(K, N)`` keeps the K-th (from 1) of N contiguous, deterministic slices of the sorted
names (of both folders): run side by side (a Slurm array), the slices' JSON lines concatenate
into the whole report. Files are judged in parallel on :data:`FILE_WORKERS` threads; the
report keeps the sorted order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from maskln_cli.errors import MasklnError
from maskln_cli.files.problem import NormalizeOptions, Progress
from maskln_cli.files.slices import shard_of

if TYPE_CHECKING:
    from maskln_cli.compare.data import ComparisonReport
    from maskln_cli.verify.options import VerifyOptions

SUFFIX = ".safetensors"
FILE_WORKERS = 2
"""Files judged at once, on threads. Each file's blocks already run on every core (see
:mod:`maskln_cli.verify.measure`), but much of a file's time is not in them (reading, the
plan, the words): on 2 cores, 24 BERT-sized dumps with gradients took 0.60x the time with two
files at a time (benchmarks/verify_folder_workers.py), with the same figures, bit for bit."""
FOLDER_REFUSED = {
    "params": "--params",
    "module": "--module",
    "config": "--config",
    "grad_out": "--grad-out",
}
"""Options that name one file's parameters or gradient: each dump holds its own."""


@dataclass
class FileVerdict:
    """One file's row: what it is (from its metadata and header) and its verdict.

    ``status`` is ``checked`` (``report`` holds the comparison), ``missing`` (a dump without a
    result in RESULTS), ``extra`` (a result without a dump) or ``error`` (the file could not
    be judged: ``problem`` says why)."""

    file: str
    status: str
    passed: bool
    module: str | None = None
    call: str | None = None
    rows: int | None = None
    valid_rows: int | None = None
    dtype: str | None = None
    budget_ratios: dict[str, float | None] = field(default_factory=dict)
    plain_layer_norm: bool = False
    padding: str | None = None  # metadata: "normalized" (nn.LayerNorm) or "zeroed"
    problem: str | None = None
    report: ComparisonReport | None = None
    left_out: list[str] = field(default_factory=list)
    """Gradients a dump judged alone holds none of (though it holds grad_out): not checked."""

    def to_dict(self) -> dict[str, object]:
        document = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        document["report"] = self.report.to_dict() if self.report is not None else None
        return document


@dataclass
class FolderReport:
    """Every file's verdict, in sorted order (of this shard only, with ``shard``)."""

    dumps: str
    results: str | None
    files: list[FileVerdict]
    shard: tuple[int, int] | None = None
    total: int = 0  # names in the whole folder(s), every shard's
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.files)

    @property
    def errors(self) -> bool:
        return any(f.status == "error" for f in self.files)


def is_folder_verify(input_path: str, result_path: str | None) -> bool:
    """Whether ``verify INPUT [RESULT]`` is a folder's (INPUT a folder); errors for a mix."""
    folder = os.path.isdir(input_path)
    if folder and result_path is not None and not os.path.isdir(result_path):
        raise MasklnError(
            f"{result_path}: not a folder; INPUT {input_path} is a folder of dumps, so RESULT"
            " must be a folder of results (or left out: each dump's own out is judged)"
        )
    if not folder and result_path is None:
        raise MasklnError(
            f"RESULT is missing: give the kernel's result for {input_path} (only a folder of"
            " dumps is judged alone, against each dump's own out)"
        )
    if not folder and os.path.isdir(result_path):  # type: ignore[arg-type]
        raise MasklnError(
            f"{result_path}: a folder, while INPUT {input_path} is a file; give a folder of"
            " dumps as INPUT to judge a folder of results"
        )
    return folder


def _names(folder: str, what: str) -> tuple[list[str], dict[str, str]]:
    """The ``*.safetensors`` names of ``folder`` (hidden ones left out: editors' and writers',
    a partial file beside its output), and why those that are no regular file cannot be
    judged: each is a failing row, never skipped."""
    try:
        entries = os.listdir(folder)
    except OSError as error:
        raise MasklnError(f"{folder}: cannot list the {what} folder: {error.strerror}") from None
    names = sorted(n for n in entries if n.endswith(SUFFIX) and not n.startswith("."))
    special = {}
    for name in names:
        reason = _not_a_file(os.path.join(folder, name))
        if reason is not None:
            special[name] = reason
    return names, special


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _not_a_file(path: str) -> str | None:
    """Why ``path`` is no regular file to read (None: it is one, or a link to one), found
    without opening it: a FIFO would block its reader."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a dangling symbolic link (to {os.readlink(path)}), not a file"
        return "gone while the folder was read"
    except OSError as error:
        return f"cannot be read: {error.strerror}"
    if stat.S_ISREG(found.st_mode):
        return None
    kind = next((name for test, name in _KINDS if test(found.st_mode)), "not a regular file")
    return f"{kind}, not a file"


def verify_folder(
    dumps: str,
    results: str | None,
    options: NormalizeOptions | None = None,
    verify: VerifyOptions | None = None,
    shard: tuple[int, int] | None = None,
    progress: Progress | None = None,
) -> FolderReport:
    """Judge every dump of ``dumps`` (its own tensors), or every file of ``results`` paired
    with the dump of the same name; only the ``shard`` slice of the sorted names.
    """
    from maskln_cli.verify.options import VerifyOptions

    options = options or NormalizeOptions()
    verify = verify or VerifyOptions()
    for name, option in FOLDER_REFUSED.items():
        if getattr(options, name, None) is not None:
            raise MasklnError(
                f"{option}: not with a folder of dumps; each dump holds its own scale, bias,"
                " grad_out and eps (metadata)"
            )
    if verify.valid is not None:
        raise MasklnError("--valid: not with a folder of dumps; each dump holds its own valid")
    dump_names, dump_special = _names(dumps, "dumps")
    result_names, result_special = _names(results, "results") if results is not None else ([], {})
    every = sorted(set(dump_names) | set(result_names))
    if not every:
        where = dumps if results is None else f"{dumps} or {results}"
        raise MasklnError(f"{where}: no {SUFFIX} files to verify")
    chosen = shard_of(every, shard)
    report = FolderReport(dumps, results, [], shard, len(every))
    if shard is not None and not chosen:
        report.notes.append(
            f"--shard {shard[0]}/{shard[1]}: this slice of the {len(every):,} files is empty"
        )
    has_dump, has_result = set(dump_names), set(result_names)

    def judge(name: str) -> FileVerdict:
        special = [
            f"{os.path.join(folder, name)}: {special[name]}"
            for folder, special in ((dumps, dump_special), (results, result_special))
            if name in special
        ]
        if special:
            return FileVerdict(name, "error", False, problem="; ".join(special))
        if name not in has_dump:
            return FileVerdict(
                name, "extra", False, problem=f"a result without a dump: {dumps} has no {name}"
            )
        dump = os.path.join(dumps, name)
        if results is not None and name not in has_result:
            verdict = FileVerdict(
                name, "missing", False, problem=f"no result for this dump: {results} has no {name}"
            )
            with contextlib.suppress(MasklnError):  # its row says what it can of the dump
                _describe(verdict, dump, options)
            return verdict
        result = os.path.join(results, name) if results is not None else dump
        return _judge_file(name, dump, result, results is None, options, verify)

    if progress:
        progress(0, len(chosen))
    with concurrent.futures.ThreadPoolExecutor(FILE_WORKERS) as pool:
        for done, verdict in enumerate(pool.map(judge, chosen), start=1):
            report.files.append(verdict)
            if progress:
                progress(done, len(chosen))
    report.notes += _left_out_notes(report.files)
    return report


def _left_out_notes(files: list[FileVerdict]) -> list[str]:
    """Once for the folder: the gradients dumps held none of, and were not checked."""
    by_names: dict[tuple[str, ...], int] = {}
    for verdict in files:
        if verdict.left_out:
            key = tuple(verdict.left_out)
            by_names[key] = by_names.get(key, 0) + 1
    checked = sum(f.status == "checked" for f in files)
    notes = []
    for names, count in by_names.items():
        listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
        notes.append(
            f"{listed}: not checked in {count:,} of {checked:,} dumps, which hold grad_out but"
            f" no {'gradient' if len(names) == 1 else 'gradients'} {listed} (the capture"
            " records only what the backward pass reached: a parameter or input that did not"
            " require grad)"
        )
    return notes


def _judge_file(
    name: str,
    dump: str,
    result: str,
    own: bool,
    options: NormalizeOptions,
    verify: VerifyOptions,
) -> FileVerdict:
    """One dump judged (its own tensors when ``own``, else ``result``'s)."""
    from maskln_cli.verify.job import verify_file

    verdict = FileVerdict(name, "checked", False)
    try:
        _describe(verdict, dump, options)
        if own and not verify.plain_layer_norm and _plain(verdict, dump, options):
            verify = dataclasses.replace(verify, plain_layer_norm=True)
        if own and verify.check is None:
            verify = _what_it_holds(verdict, dump, options, verify)
        verdict.plain_layer_norm = verify.plain_layer_norm
        report = verify_file(dump, result, options, verify)
    except MasklnError as error:
        verdict.status, verdict.problem = "error", str(error)
        return verdict
    verdict.report = report
    verdict.passed = report.passed
    verdict.budget_ratios = {
        t.name: t.budget_ratio for t in report.tensors if t.name in TENSOR_ORDER
    }
    failed = [t for t in report.tensors if not t.passed]
    if failed and failed[0].problems:
        verdict.problem = f"{failed[0].name}: {failed[0].problems[0]}"
    return verdict


TENSOR_ORDER = ("out", "grad_x", "grad_scale", "grad_bias")


def _what_it_holds(
    verdict: FileVerdict, dump: str, options: NormalizeOptions, verify: VerifyOptions
) -> VerifyOptions:
    """A dump judged alone is checked for what it holds: with grad_out, the gradients it has
    (a parameter that did not require grad has none; those left out are said once, for the
    folder, not as a missing tensor per file)."""
    from maskln_cli.files.problem import gradient_keys, named_norm
    from maskln_cli.files.tensorfile import open_tensor_file
    from maskln_cli.op.norms import LAYER, NORMS

    with open_tensor_file(dump) as data:
        grad_out_key = options.grad_out_key or "grad_out"
        if grad_out_key not in data:
            return verify
        held = [name for name in TENSOR_ORDER if verify.result_keys.get(name, name) in data]
        norm = NORMS[options.norm] if options.norm else named_norm(data.metadata, dump) or LAYER
    # The norm's own gradients only: an RMSNorm has no grad_bias to leave out.
    verdict.left_out = [name for name in gradient_keys(norm) if name not in held]
    if not verdict.left_out:
        return verify
    return dataclasses.replace(verify, check=tuple(n for n in TENSOR_ORDER if n not in
                                                   verdict.left_out))  # fmt: skip


def _describe(verdict: FileVerdict, dump: str, options: NormalizeOptions) -> None:
    """The dump's module, call, dtype (metadata, else x's) and rows, from its header and
    valid."""
    import math

    from maskln_cli.files.tensorfile import open_tensor_file

    with open_tensor_file(dump) as data:
        metadata = data.metadata or {}
        verdict.module = metadata.get("module")
        verdict.call = metadata.get("call")
        verdict.padding = metadata.get("padding")
        x_key = options.x_key
        if x_key not in data:
            raise MasklnError(f"{dump}: no tensor {x_key!r} (a dump holds x, valid, scale, ...)")
        info = data.info(x_key)
        verdict.dtype = metadata.get("dtype") or info.dtype
        verdict.rows = math.prod(info.shape[:-1])
        valid_key = options.valid_key or "valid"
        if valid_key in data:
            verdict.valid_rows = int(data.tensor(valid_key).bool().sum())
        else:
            verdict.valid_rows = verdict.rows


def _plain(verdict: FileVerdict, dump: str, options: NormalizeOptions) -> bool:
    """Whether a dump's own out is a plain LayerNorm's: its metadata ``padding`` says
    ``normalized`` (an ``nn.LayerNorm``) or ``zeroed`` (a ``MaskedLayerNorm``, whose padding
    must then be 0); without it, whether out is non-zero on some invalid row."""
    padding = verdict.padding
    if padding in ("normalized", "zeroed"):
        return padding == "normalized"
    return _padding_not_zeroed(dump, options)


def _padding_not_zeroed(dump: str, options: NormalizeOptions) -> bool:
    """Whether the dump's out is non-zero on some invalid row: a plain LayerNorm's output."""
    from maskln_cli.files.tensorfile import open_tensor_file

    valid_key = options.valid_key or "valid"
    with open_tensor_file(dump) as data:
        if options.out_key not in data or valid_key not in data:
            return False
        valid = data.tensor(valid_key).bool()
        out = data.tensor(options.out_key)
        if tuple(out.shape[:-1]) != tuple(valid.shape):
            return False
        padding = out[~valid]
        return bool((padding != 0).any()) if padding.numel() else False
