"""Where the graded function is: ``path/to/solution.py[:NAME]`` or ``package.module:NAME``,
parsed, checked and imported (in the grader's child process), with a message a student can act on;
and a class's targets: folders of ``*.py`` expanded, sorted, and sliced into shards.

Parsing, expanding and sharding import nothing slow (the command line checks its arguments
before torch is imported); importing a target imports the clauses (torch) only then.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maskln_cli.errors import MasklnError

DEFAULT_FUNCTION_NAME = "masked_layer_normalization"

Fn = Callable[..., Any]


@dataclass(frozen=True)
class Target:
    """Where the function is: a file (``path``) or a module (``module``), and its name."""

    path: Path | None
    module: str | None
    name: str

    def __str__(self) -> str:
        where = str(self.path) if self.path is not None else self.module
        return f"{where}:{self.name}"


def parse_target(target: str) -> Target:
    """``solution.py``, ``solution.py:NAME`` or ``package.module:NAME``, checked.

    Example:
        >>> parse_target("maskln_cli:masked_layer_normalization")
        Target(path=None, module='maskln_cli', name='masked_layer_normalization')
    """
    from maskln_cli.grading.exercise import current

    location, _, name = target.rpartition(":") if ":" in target else (target, "", "")
    name = name or current().function_name  # the exercise's: masked_layer_normalization
    if not location:
        raise MasklnError(f"TARGET {target!r}: expected FILE.py[:NAME] or package.module:NAME")
    if not name.isidentifier():
        raise MasklnError(f"TARGET {target}: {name!r} is not a Python name")
    looks_like_file = location.endswith(".py") or "/" in location or Path(location).is_file()
    if looks_like_file:
        path = Path(location)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "no such file"
            raise MasklnError(f"TARGET {location}: {what}")
        return Target(path, None, name)
    if not all(part.isidentifier() for part in location.split(".")):
        raise MasklnError(f"TARGET {location}: neither a file nor a module name")
    return Target(None, location, name)


def is_maskln_target(target: str) -> bool:
    """Whether ``target`` is one of maskln's own functions: a module of the maskln_cli package
    (``maskln_cli:masked_layer_normalization``) or a file in it. A file elsewhere that imports
    maskln's op is not: it uses a ready-made implementation (``raw_ops`` fails it).

    Example:
        >>> is_maskln_target("maskln_cli:masked_layer_normalization")
        True
        >>> is_maskln_target("maskln_clipper.ops:f")
        False
    """
    parsed = parse_target(target)
    if parsed.module is not None:
        return parsed.module == "maskln_cli" or parsed.module.startswith("maskln_cli.")
    assert parsed.path is not None
    return parsed.path.resolve().parent == Path(__file__).resolve().parent


def load_target(target: str, shown: str | None = None) -> Fn:
    """Import the target and return its function. Raises MasklnError naming the target (as
    ``shown``: the submission's own path, when ``target`` is the grader's copy of it), with
    the exception's last line, when it cannot be imported, or is missing or not callable.

    Example:
        >>> load_target("maskln_cli:masked_layer_normalization").__name__
        'masked_layer_normalization'
    """
    from maskln_cli.grading.clauses import describe_exception

    parsed = parse_target(target)
    own = parsed.path if parsed.path is not None else parsed.module
    named = shown.rpartition(":")[0] if shown and ":" in shown else shown
    named = named or own  # where the messages say the function is
    try:
        if parsed.path is not None:
            module = _import_file(parsed.path)
        else:
            module = importlib.import_module(parsed.module or "")
    except MasklnError:
        raise
    except BaseException as error:  # SystemExit from a script's top level, too
        if isinstance(error, KeyboardInterrupt):
            raise
        where = named
        line = _failing_line(error, parsed.path)
        raise MasklnError(
            f"TARGET {where}{line}: cannot import: {describe_exception(error)}"
        ) from None
    try:
        fn = getattr(module, parsed.name)
    except AttributeError:
        close = difflib.get_close_matches(
            parsed.name, [name for name, value in vars(module).items() if callable(value)], 1
        )
        where = named
        hint = f"; did you mean {close[0]!r}? (TARGET {where}:{close[0]})" if close else ""
        raise MasklnError(f"TARGET {shown or target}: no {parsed.name!r} in it{hint}") from None
    if not callable(fn):
        raise MasklnError(
            f"TARGET {shown or target}: {parsed.name} is not callable (its type is"
            f" {type(fn).__name__})"
        )
    return fn


def _failing_line(error: BaseException, path: Path | None) -> str:
    """``:LINE`` of the target file where importing it failed (a SyntaxError's own line, else
    the traceback's last frame in the file), or ``""``.

    Example:
        >>> try:
        ...     compile("def f(:", "t.py", "exec")
        ... except SyntaxError as error:
        ...     _failing_line(error, Path("t.py"))
        ':1'
    """
    if path is None:
        return ""
    if isinstance(error, SyntaxError) and error.filename and error.lineno:
        same = Path(error.filename).resolve() == path.resolve()
        return f":{error.lineno}" if same else ""
    lines = [
        frame.lineno
        for frame in traceback.extract_tb(error.__traceback__)
        if frame.filename and Path(frame.filename).resolve() == path.resolve()
    ]
    return f":{lines[-1]}" if lines else ""


def private_copy(target: str, folder: str) -> str:
    """A file target copied, alone, into ``folder`` (made by the grader, private to one
    grade), read-only; the target naming the copy. The child imports the copy, from a folder
    nothing else is in: no neighbour's file, nothing planted beside the submission later.
    A module target is returned as it is."""
    import shutil

    parsed = parse_target(target)
    if parsed.path is None:
        return target
    copy = Path(folder) / parsed.path.name
    shutil.copyfile(parsed.path, copy)
    copy.chmod(0o444)
    Path(folder).chmod(0o555)
    return f"{copy}:{parsed.name}"


def _import_file(path: Path) -> Any:
    """Import a file as a module of its own name-space (``torch.py`` shadows nothing)."""
    name = f"_maskln_graded_{zlib.crc32(str(path.resolve()).encode()):08x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise MasklnError(f"TARGET {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        # It may import the files beside it, as a script does, but after Python's own modules
        # and the installed packages: no file there shadows one (inspect.py, safetensors.py).
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def expand_targets(arguments: Sequence[str]) -> list[str]:
    """The targets a class grade runs, sorted: each folder's ``*.py`` files (not those whose
    name starts with ``_`` or ``.``, not its subfolders), files and module targets as given;
    each checked (:func:`parse_target`), each once.

    Example:
        >>> expand_targets(["maskln_cli:masked_layer_normalization"])
        ['maskln_cli:masked_layer_normalization']
    """
    found: list[str] = []
    for argument in arguments:
        if os.path.isdir(argument):  # "pkg:NAME" is a module target, even beside a folder pkg
            files = sorted(
                entry.path
                for entry in os.scandir(argument)
                if entry.name.endswith(".py")
                and not entry.name.startswith(("_", "."))
                and entry.is_file()
            )
            if not files:
                raise MasklnError(f"TARGET {argument}: a folder with no .py file to grade")
            found += files
        else:
            parse_target(argument)
            found.append(argument)
    return sorted(dict.fromkeys(found))
