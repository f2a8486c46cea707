"""An instructor's rules for grading a class, in one place: which clauses count (a preset, or the
required clauses listed, and extra ones), the time limit, the jobs and the seed; written once
in ``maskln-grade.toml`` in the folder graded (the folder TARGET, else the current folder) or
under ``[tool.maskln.grade]`` in the nearest ``pyproject.toml`` from there up, or named on the
command line (``--rules``). Rules come from the instructor only: a rules file beside a
submission's own file, in a folder other than the one graded, is never read (and said so,
:attr:`Rules.ignored`). Every grade says which rule set graded it (:attr:`Rules.name`) and where
it comes from, with a hash of the file (:attr:`Rules.source_words`); a rules file cannot take a
preset's name for other rules. Reading rules imports nothing slow (no torch).

A rules file::

    # maskln-grade.toml, beside the submissions
    preset = "specification"            # or "strict"
    extra = ["positive_zero", "second_order"]
    timeout = 30                        # seconds per clause
    jobs = 2
    op = "rms"                          # the RMSNorm exercise (default "layer")

Keys: ``preset`` (:data:`PRESETS`), ``required`` (the clauses that count, instead of the
preset's), ``extra`` (clauses that count too: strict ones, ``half``), ``timeout``, ``jobs``,
``seed``, ``name`` (how the rule set is shown; by default, where it comes from and what it
counts), ``op`` (the exercise: ``layer``, masked LayerNorm, or ``rms``, masked RMSNorm:
:mod:`maskln_cli.grading.exercise`).

Example:
    >>> rules = parse_rules({"preset": "specification", "extra": ["second_order"]}, "x.toml")
    >>> rules.name
    'x.toml: specification + second_order'
    >>> rules.grading_options()
    {'strict': False, 'only': [], 'include': ['second_order'], 'op': 'layer'}
    >>> parse_rules({"op": "rms"}, "x.toml").name
    'x.toml: rms, specification'
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from maskln_cli.errors import MasklnError
from maskln_cli.grading.selection import CLAUSE_LEVELS, GROUPS, TIMEOUT_RANGE, select

RULES_FILE = "maskln-grade.toml"
PYPROJECT = "pyproject.toml"
PRESETS = {
    "specification": "values, shapes and gradients: the specification's required clauses",
    "strict": "the required clauses and maskln's strict guarantees but output_layout",
}
"""The rule sets a rules file (``preset``) or ``--rules`` can name."""
KEYS = ("preset", "required", "extra", "timeout", "jobs", "seed", "name", "op")
MAX_JOBS = 1024
MAX_SEED = 2**63 - 1
MAX_BYTES = 1 << 20
"""The largest rules file read (1 MiB)."""
MAX_NAME = 100


@dataclass(frozen=True)
class Rules:
    """Which clauses count, and how a class is graded. ``source``: the file the rules come
    from as shown (None: a preset named on the command line, or the default); ``path`` and
    ``digest``: that file's absolute path and the SHA-256 of its bytes; ``ignored``: rules
    files found beside submissions and not read."""

    preset: str = "specification"
    required: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    timeout: float | None = None
    jobs: int | None = None
    seed: int | None = None
    source: str | None = None
    title: str | None = None
    path: str | None = None
    digest: str | None = None
    ignored: tuple[str, ...] = ()
    op: str = "layer"

    @property
    def name(self) -> str:
        """How a report shows the rule set: ``maskln-grade.toml: specification +
        positive_zero, second_order``; ``strict``; ``only values, gradients``."""
        if self.title:
            return self.title
        counted = f"only {', '.join(self.required)}" if self.required else self.preset
        if self.extra:
            counted += f" + {', '.join(self.extra)}"
        if self.op != "layer":
            counted = f"{self.op}, {counted}"
        return f"{self.source}: {counted}" if self.source else counted

    @property
    def source_words(self) -> str:
        """Where the rules come from, for every report and gradebook row: the file and a hash
        of it (``/course/maskln-grade.toml, sha256 1a2b3c4d5e6f``), else ``built in``."""
        if self.path is None:
            return "built in"
        return f"{self.path}, sha256 {self.digest}"

    def grading_options(self) -> dict[str, Any]:
        """The grader's options for these rules: ``strict``, ``only``, ``include`` and
        ``op``."""
        if self.required:
            return {"strict": False, "only": [*self.required, *self.extra], "include": [],
                    "op": self.op}  # fmt: skip
        return {"strict": self.preset == "strict", "only": [], "include": list(self.extra),
                "op": self.op}  # fmt: skip

    def with_command_line(
        self,
        strict: bool = False,
        include: Sequence[str] = (),
        only: Sequence[str] = (),
        op: str | None = None,
    ) -> Rules:
        """These rules with the command line's ``--strict``, ``--with``, ``--only`` (which
        grades those clauses alone) and ``--op`` (the exercise)."""
        rules = self
        if op is not None and op != self.op:
            rules = replace(rules, op=op, title=None)
        if strict and not self.required:
            rules = replace(rules, preset="strict", title=None)
        if include:
            extra = tuple(dict.fromkeys([*rules.extra, *_names(include)]))
            rules = replace(rules, extra=extra, title=None)
        if only:
            rules = replace(rules, required=tuple(_names(only)), extra=(), title=None)
        return rules


def _names(values: Sequence[str]) -> list[str]:
    from maskln_cli.grading.selection import split_names

    return split_names(values)


def parse_rules(data: dict[str, Any], source: str) -> Rules:
    """Rules from a TOML table; a usage error naming ``source`` and the key for anything
    wrong."""
    unknown = [key for key in data if key not in KEYS]
    if unknown:
        raise MasklnError(f"{source}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    preset = data.get("preset", "specification")
    if preset not in PRESETS:
        raise MasklnError(f"{source}: preset {preset!r} is not one of {', '.join(PRESETS)}")
    required = _clause_list(data, "required", source)
    extra = _clause_list(data, "extra", source)
    op = data.get("op", "layer")
    if op not in ("layer", "rms"):
        raise MasklnError(f"{source}: op {str(op)[:40]!r} is not one of layer, rms")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise MasklnError(f"{source}: name must be a string")
    if name is not None and (not name.strip() or len(name) > MAX_NAME or not name.isprintable()):
        raise MasklnError(f"{source}: name must be one printable line of 1 to {MAX_NAME} characters"
                          )  # fmt: skip
    rules = Rules(
        preset=preset,
        required=tuple(required),
        extra=tuple(extra),
        timeout=_number(data, "timeout", source),
        jobs=_whole(data, "jobs", source, least=1),
        seed=_whole(data, "seed", source, least=0),
        source=source,
        title=name,
        op=op,
    )
    try:
        chosen = select(**rules.grading_options())
    except MasklnError as error:  # a clause that cannot be counted so, said with the file
        raise MasklnError(f"{source}: {error}") from None
    if name in PRESETS and chosen != select(**Rules(preset=name).grading_options()):
        raise MasklnError(
            f"{source}: name {name!r} is a preset's, and these rules count other clauses than"
            f" the preset {name!r}: give them a name of their own"
        )
    return rules


def _clause_list(data: dict[str, Any], key: str, source: str) -> list[str]:
    value = data.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise MasklnError(f"{source}: {key} must be a list of clause names")
    for name in value:
        if name not in CLAUSE_LEVELS and not (key == "extra" and name in GROUPS):
            raise MasklnError(
                f"{source}: {key}: no clause {name!r}; the clauses are {', '.join(CLAUSE_LEVELS)}"
            )
    return list(dict.fromkeys(value))


def _number(data: dict[str, Any], key: str, source: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MasklnError(f"{source}: {key} must be a number of seconds, got {value!r}"[:300])
    if not (value > 0 and math.isfinite(value)):
        raise MasklnError(f"{source}: {key} must be a positive number of seconds, got {value}")
    low, high = TIMEOUT_RANGE
    if not low <= value <= high:
        raise MasklnError(
            f"{source}: {key} must be between {low:g} and {high:,.0f} seconds, got {value:g}"
        )
    return float(value)


def _whole(data: dict[str, Any], key: str, source: str, least: int) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    most = MAX_JOBS if key == "jobs" else MAX_SEED
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise MasklnError(f"{source}: {key} must be a whole number of at least {least}")
    if value > most:
        raise MasklnError(f"{source}: {key} must be at most {most}, got {value}"[:300])
    return value


def _read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """A rules file's table and the SHA-256 of its bytes (12 hex digits); a usage error naming
    the file (and the key, where there is one) for anything that is not a small TOML file."""
    import hashlib

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise MasklnError(
                f"{path}: reading TOML needs Python 3.11, or the tomli package"
            ) from None
    if not path.is_file():
        raise MasklnError(f"{path}: not a regular file")
    try:
        with path.open("rb") as stream:
            data = stream.read(MAX_BYTES + 1)
    except OSError as error:
        raise MasklnError(f"{path}: cannot read it ({error.strerror or error})") from None
    if len(data) > MAX_BYTES:
        raise MasklnError(f"{path}: too large for a rules file (more than {MAX_BYTES >> 20} MiB)")
    digest = hashlib.sha256(data).hexdigest()[:12]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        before = data[: error.start].decode("utf-8", "replace")
        raise MasklnError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at line {line}"
            f"{_key_at(before, line)})"
        ) from None
    try:
        return tomllib.loads(text), digest
    except tomllib.TOMLDecodeError as error:
        raise MasklnError(f"{path}: not valid TOML ({error})") from None
    except RecursionError:
        line = _deepest_line(text)
        raise MasklnError(
            f"{path}: nested too deeply to read (line {line}{_key_at(text, line)})"
        ) from None


def _deepest_line(text: str) -> int:
    """The line where a TOML text's brackets nest deepest (strings skipped roughly: enough to
    point at the key)."""
    depth = deepest = 0
    line = found = 1
    quote = ""
    for character in text:
        if character == "\n":
            line += 1
        if quote:
            quote = "" if character == quote else quote
        elif character in "\"'":
            quote = character
        elif character in "[{":
            depth += 1
            if depth > deepest:
                deepest, found = depth, line
        elif character in "]}":
            depth -= 1
    return found


def _key_at(text: str, line: int) -> str:
    """``, key NAME``: the key whose value holds ``line`` of a TOML text (the last ``NAME =``
    at or before it), or ``""``."""
    import re

    head = "\n".join(text.split("\n")[:line])
    keys = re.findall(r"(?m)^\s*([A-Za-z0-9_.\-\"']+)\s*=", head)
    return f", key {keys[-1][:40]}" if keys else ""


def load_rules(path: str | os.PathLike[str]) -> Rules:
    """The rules of a file: a ``maskln-grade.toml``, or a ``pyproject.toml`` (its
    ``[tool.maskln.grade]`` table, which must be there)."""
    path = Path(path)
    if not path.exists():
        raise MasklnError(f"--rules {path}: no such file, nor a preset ({', '.join(PRESETS)})")
    data, digest = _read_toml(path)
    origin = {"path": str(path.resolve()), "digest": digest}
    if path.name == PYPROJECT:
        table = _grade_table(data)
        if table is None:
            raise MasklnError(f"{path}: no [tool.maskln.grade] table")
        return replace(parse_rules(table, f"{shown(path)} [tool.maskln.grade]"), **origin)
    return replace(parse_rules(data, shown(path)), **origin)


def _grade_table(data: dict[str, Any]) -> dict[str, Any] | None:
    table: Any = data
    for key in ("tool", "maskln", "grade"):
        table = table.get(key) if isinstance(table, dict) else None
    return table if isinstance(table, dict) else None


def shown(path: str | os.PathLike[str]) -> str:
    """``path`` as a report shows it: relative to the current folder when it is below it."""
    relative = os.path.relpath(path)
    return relative if not relative.startswith(os.pardir) else str(path)


def graded_folder(targets: Sequence[str]) -> Path | None:
    """The folder a grade is about: a folder TARGET itself, else the folder holding the file
    TARGETs (their common one); None for module targets alone."""
    folders = []
    for target in targets:
        location = target.rpartition(":")[0] if ":" in target and not os.path.exists(target) \
            else target  # fmt: skip
        if os.path.isdir(location):
            folders.append(os.path.abspath(location))
        elif location.endswith(".py") or os.path.isfile(location):
            folders.append(os.path.dirname(os.path.abspath(location)))
    if not folders:
        return None
    return Path(os.path.commonpath(folders))


def rules_folder(targets: Sequence[str]) -> Path:
    """The folder whose rules grade ``targets``: the folder TARGET, when one is given (a
    class's folder, the instructor's), else the current folder (where the instructor grades
    from). Never a file TARGET's own folder: that one is the submission's."""
    folders = {os.path.abspath(t) for t in targets if os.path.isdir(t)}
    if len(folders) == 1:
        return Path(folders.pop())
    return Path(os.getcwd())


def find_rules(targets: Sequence[str]) -> Rules | None:
    """The rules of the folder graded (:func:`rules_folder`): its ``maskln-grade.toml``, else
    the ``[tool.maskln.grade]`` of the nearest ``pyproject.toml`` from it upward (the first
    found decides: one without the table means no rules). A rules file beside a file TARGET
    elsewhere is not read: :attr:`Rules.ignored` names it."""
    folder = rules_folder(targets)
    found = _found_rules(folder)
    ignored = _beside_submissions(targets, folder)
    if ignored:
        found = replace(found or Rules(), ignored=tuple(ignored))
    return found


def _found_rules(folder: Path) -> Rules | None:
    beside = folder / RULES_FILE
    if beside.exists():
        return load_rules(beside)
    for parent in (folder, *folder.parents):
        pyproject = parent / PYPROJECT
        if pyproject.is_file():
            data, digest = _read_toml(pyproject)
            table = _grade_table(data)
            if table is None:
                return None
            rules = parse_rules(table, f"{shown(pyproject)} [tool.maskln.grade]")
            return replace(rules, path=str(pyproject.resolve()), digest=digest)
    return None


def _beside_submissions(targets: Sequence[str], folder: Path) -> list[str]:
    """Rules files beside file TARGETs, in folders other than ``folder``."""
    found = []
    for target in targets:
        location = target
        if ":" in target and not os.path.exists(target):
            location = target.rpartition(":")[0]
        if not os.path.isfile(location):
            continue
        beside = Path(os.path.abspath(location)).parent
        if beside != folder and (beside / RULES_FILE).exists():
            found.append(shown(beside / RULES_FILE))
    return sorted(set(found))


def ignored_words(path: str) -> str:
    """What a grade says of a rules file it did not read."""
    return (
        f"{path}: beside a submission, not read as rules (rules come from the folder graded,"
        " the current folder, the nearest pyproject.toml, or --rules)"
    )


def resolve_rules(option: str | None, targets: Sequence[str]) -> Rules:
    """The rules a grade uses: ``--rules`` (a preset's name or a file), else the rules of the
    folder graded (:func:`find_rules`), else the specification's."""
    if option is not None:
        if option in PRESETS and not os.path.exists(option):
            return Rules(preset=option)
        return load_rules(option)
    return find_rules(targets) or Rules()
